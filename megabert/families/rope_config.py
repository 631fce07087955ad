"""config.json fields the RoPE families read alike: the RoPE base (transformers 5's
`rope_parameters`, or an older top-level `rope_theta`), a checked activation name, and the
BERT-layout keys GTE and NomicBERT share."""
from __future__ import annotations

from megabert.config import MODERNBERT_ACTIVATIONS, ModelConfig
from megabert.errors import CheckpointError


def rope_theta(hf: dict, default: float, family: str, layer_type: str = "") -> float:
    """The RoPE base of config.json (of `layer_type`'s entry when rope_parameters is keyed by
    layer type), `default` where it says none; any other rope_type than the default is refused."""
    params = hf.get("rope_parameters") or {}
    if layer_type and layer_type in params:
        params = params[layer_type] or {}
    kind = params.get("rope_type", "default")
    if kind != "default" or hf.get("rope_scaling"):
        raise CheckpointError(f"config.json asks for rope_type {kind if kind != 'default' else hf['rope_scaling']}; "
                              f"megabert's {family} implements the default RoPE only")
    return float(params.get("rope_theta", hf.get("rope_theta", default)))


def checked_activation(hf: dict, default: str, family: str, key: str = "hidden_act") -> str:
    act = hf.get(key, default)
    if act not in MODERNBERT_ACTIVATIONS:
        raise CheckpointError(f"config.json has {key} {act!r}; megabert's {family} takes "
                              f"{', '.join(MODERNBERT_ACTIVATIONS)}")
    return act


def bert_layout_fields(hf: dict, family: str, *, theta: float, act: str, type_vocab_size: int, positions: int,
                       hidden_dropout: float) -> dict:
    """ModelConfig fields of a BERT-layout RoPE config.json (GTE, NomicBERT); the arguments are
    the family's defaults for the keys a config may leave out."""
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    return dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", positions),
        type_vocab_size=hf.get("type_vocab_size", type_vocab_size),
        kv_channels=head_dim if head_dim not in (None, hf["hidden_size"] // heads) else None,
        hidden_dropout=hf.get("hidden_dropout_prob", hidden_dropout),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.0),
        layernorm_epsilon=hf.get("layer_norm_eps", 1e-12),
        init_method_std=hf.get("initializer_range", 0.02), global_rope_theta=rope_theta(hf, theta, family),
        hidden_activation=checked_activation(hf, act, family), bert_binary_head=False)


def bert_layout_hf_config(cfg: ModelConfig, model_type: str, architecture: str) -> dict:
    """config.json of a BERT-layout RoPE family (GTE, NomicBERT)."""
    return {
        "architectures": [architecture], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_activation,
        "max_position_embeddings": cfg.max_position_embeddings, "type_vocab_size": cfg.type_vocab_size,
        "hidden_dropout_prob": cfg.hidden_dropout, "attention_probs_dropout_prob": cfg.attention_dropout,
        "layer_norm_eps": cfg.layernorm_epsilon, "initializer_range": cfg.init_method_std,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.global_rope_theta}, "torch_dtype": "float32",
    }
