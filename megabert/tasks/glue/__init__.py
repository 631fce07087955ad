"""GLUE: the nine tasks' TSV layouts (and CSV / JSON-lines files), sentence-pair features,
the classification model (BertForSequenceClassification), the official metrics, the
submission files, and the glue that finetune_glue.py runs."""
from megabert.tasks.glue.model import BertForSequenceClassification, SequenceClassifierOutput

__all__ = ["BertForSequenceClassification", "SequenceClassifierOutput"]
