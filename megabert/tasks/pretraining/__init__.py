"""BERT pre-training (masked LM + SOP/NSP): samples built from Megatron's indexed dataset,
the BertForPreTraining model, its loss and evaluation counts, and the assembly that
pretrain_bert.py runs."""
from megabert.tasks.pretraining.model import BertForPreTraining, BertPreTrainingOutput

__all__ = ["BertForPreTraining", "BertPreTrainingOutput"]
