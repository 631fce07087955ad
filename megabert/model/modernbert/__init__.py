"""ModernBERT (Warner et al. 2024, "Smarter, Better, Faster, Longer"), a model family of
megabert's one model tree: RoPE, GeGLU, pre-norm with a final norm, no biases, global
attention every n-th layer and a sliding window in the others, MLM only."""
from megabert.model.modernbert.classification import ModernBertForSequenceClassification
from megabert.model.modernbert.model import MaskedLMOutput, ModernBertForMaskedLM

__all__ = ["ModernBertForMaskedLM", "ModernBertForSequenceClassification", "MaskedLMOutput"]
