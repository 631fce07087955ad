"""GLUE: the nine tasks' TSV layouts (and CSV / JSON-lines files; each task's columns, labels
and metrics are a tasks.GlueTaskSpec), sentence-pair features, the classification model
(BertForSequenceClassification), the official metrics, the submission files, and GlueTask,
what the fine-tuning driver (megabert.training.finetune) runs for finetune_glue.py."""
from megabert.tasks.glue.model import BertForSequenceClassification, SequenceClassifierOutput

__all__ = ["BertForSequenceClassification", "SequenceClassifierOutput"]
