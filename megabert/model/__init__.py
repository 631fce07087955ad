"""The encoder of every family, built from an EncoderSpec (megabert.families.spec) that a family
of the registry (megabert.families) maps its config onto: one encoder for every TP/PP
layout. The task models (pre-training, SQuAD, ...) live in their task packages under
megabert.tasks; the masked LM and the classifiers every family shares live here."""
from megabert.model.bert import BertModel, BertPreTrainedModel, attention_mask_to_bool
from megabert.model.classifier import ModernBertForSequenceClassification
from megabert.model.masked_lm import AutoModelForMaskedLM, EncoderForMaskedLM, MaskedLMOutput, ModernBertForMaskedLM
from megabert.model.outputs import ModelOutput

__all__ = ["AutoModelForMaskedLM", "BertModel", "BertPreTrainedModel", "EncoderForMaskedLM", "MaskedLMOutput",
           "ModelOutput",
           "ModernBertForMaskedLM", "ModernBertForSequenceClassification", "attention_mask_to_bool"]
