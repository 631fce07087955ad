"""Token classification (named entities): CoNLL and JSON-lines sentences, sub-word features
with windows for long sentences, the models (BertForTokenClassification,
ModernBertForTokenClassification), seqeval's entity-level metrics, predictions in CoNLL form,
and NerTask, what the fine-tuning driver (megabert.training.finetune) runs for finetune_ner.py."""
from megabert.tasks.ner.model import BertForTokenClassification, ModernBertForTokenClassification, TokenClassifierOutput

__all__ = ["BertForTokenClassification", "ModernBertForTokenClassification", "TokenClassifierOutput"]
