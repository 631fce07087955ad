"""Model presets: plain functions, so a user can read and copy them (`--preset NAME` on the
command line; `megabert.bert_large()` in Python). Each returns a ModelConfig; keyword
arguments override any field."""
from __future__ import annotations

from megabert.config import ModelConfig
from megabert.families import scratch_config


def bert_tiny(**overrides) -> ModelConfig:
    """2 layers, hidden 128: for CPU demos and tests (about 4M parameters with a 30k vocab)."""
    return ModelConfig(**{"num_layers": 2, "hidden_size": 128, "num_attention_heads": 2, **overrides})


def bert_base(**overrides) -> ModelConfig:
    """BERT-base: 12 layers, hidden 768, 12 heads (110M parameters)."""
    return ModelConfig(**{"num_layers": 12, "hidden_size": 768, "num_attention_heads": 12, **overrides})


def bert_large(**overrides) -> ModelConfig:
    """BERT-large: 24 layers, hidden 1024, 16 heads (340M parameters)."""
    return ModelConfig(**{"num_layers": 24, "hidden_size": 1024, "num_attention_heads": 16, **overrides})


def modernbert_tiny(**overrides) -> ModelConfig:
    """4 layers, hidden 256, 4 heads (the issue's CPU benchmark shape), ModernBERT's vocab."""
    return scratch_config(**{"model_family": "modernbert", "num_layers": 4, "hidden_size": 256,
                             "num_attention_heads": 4, "vocab_size": 50368, **overrides})


def modernbert_base(**overrides) -> ModelConfig:
    """ModernBERT-base (answerdotai/ModernBERT-base): 22 layers, hidden 768, 12 heads, GeGLU 1152 (149M parameters)."""
    return scratch_config(**{"model_family": "modernbert", "num_layers": 22, "hidden_size": 768,
                             "num_attention_heads": 12, "ffn_hidden_size": 1152, "vocab_size": 50368, **overrides})


def modernbert_large(**overrides) -> ModelConfig:
    """ModernBERT-large (answerdotai/ModernBERT-large): 28 layers, hidden 1024, 16 heads, GeGLU 2624 (395M parameters)."""
    return scratch_config(**{"model_family": "modernbert", "num_layers": 28, "hidden_size": 1024,
                             "num_attention_heads": 16, "ffn_hidden_size": 2624, "vocab_size": 50368, **overrides})


PRESETS = {"bert-tiny": bert_tiny, "bert-base": bert_base, "bert-large": bert_large,
           "modernbert-tiny": modernbert_tiny, "modernbert-base": modernbert_base,
           "modernbert-large": modernbert_large}
