"""Token classification (named entities): CoNLL and JSON-lines sentences, sub-word features
with windows for long sentences, the model (BertForTokenClassification), seqeval's
entity-level metrics, predictions in CoNLL form, and NerTask, what the fine-tuning driver
(megabert.training.finetune) runs for finetune_ner.py."""
from megabert.tasks.ner.model import BertForTokenClassification, TokenClassifierOutput

__all__ = ["BertForTokenClassification", "TokenClassifierOutput"]
