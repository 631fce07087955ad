"""BERT built from tensor-parallel layers: one encoder for every TP/PP layout. The task
models (pre-training, SQuAD, ...) live in their task packages under megabert.tasks."""
from megabert.model.bert import BertModel, BertPreTrainedModel, attention_mask_to_bool
from megabert.model.modernbert import ModernBertForMaskedLM, ModernBertForSequenceClassification
from megabert.model.outputs import ModelOutput

__all__ = ["BertModel", "BertPreTrainedModel", "ModelOutput", "ModernBertForMaskedLM",
           "ModernBertForSequenceClassification", "attention_mask_to_bool"]
