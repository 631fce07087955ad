"""megabert: BERT pre-training and SQuAD / GLUE fine-tuning with tensor, pipeline and ZeRO
data parallelism, from one CPU to many GPU nodes."""
from __future__ import annotations

__version__ = "0.1.0"

from megabert.config import DataConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from megabert.presets import bert_base, bert_large, bert_tiny, modernbert_base, modernbert_large, modernbert_tiny
from megabert.errors import ConfigError, MegabertError
from megabert.parallel import ParallelState, destroy_parallel, get_parallel_state, init_parallel

__all__ = [
    "__version__", "ModelConfig", "ParallelConfig", "DataConfig", "OptimConfig", "TrainConfig",
    "bert_tiny", "bert_base", "bert_large", "modernbert_tiny", "modernbert_base", "modernbert_large",
    "ConfigError", "MegabertError", "ParallelState",
    "init_parallel", "get_parallel_state", "destroy_parallel",
    "BertForPreTraining", "BertForQuestionAnswering", "BertForSequenceClassification", "BertModel",
    "ModernBertForMaskedLM", "ModernBertForSequenceClassification", "BertForTokenClassification",
    "ModernBertForQuestionAnswering", "ModernBertForTokenClassification", "AutoModelForMaskedLM", "EncoderForMaskedLM",
]


def __getattr__(name: str):
    # The model pulls in more of torch; import it when first asked for.
    if name == "BertModel":
        from megabert.model import BertModel

        return BertModel
    if name == "BertForPreTraining":
        from megabert.tasks.pretraining import BertForPreTraining

        return BertForPreTraining
    if name in ("BertForQuestionAnswering", "ModernBertForQuestionAnswering"):
        import megabert.tasks.squad

        return getattr(megabert.tasks.squad, name)
    if name == "BertForSequenceClassification":
        from megabert.tasks.glue import BertForSequenceClassification

        return BertForSequenceClassification
    if name in ("ModernBertForMaskedLM", "ModernBertForSequenceClassification", "AutoModelForMaskedLM",
                "EncoderForMaskedLM"):
        import megabert.model

        return getattr(megabert.model, name)
    if name in ("BertForTokenClassification", "ModernBertForTokenClassification"):
        import megabert.tasks.ner

        return getattr(megabert.tasks.ner, name)
    raise AttributeError(f"module 'megabert' has no attribute {name!r}")
