"""The parts of an EncoderSpec that several families build alike, as transformers' modular files
share them: BERT's post-LN layout with RoPE and a gated MLP (GTE, NomicBERT), and EuroBERT's
block, a bidirectional Llama (EuroBERT, UltraBERT). Each returns EncoderSpec keyword arguments
that a family's `spec` completes."""
from __future__ import annotations

from megabert.config import ModelConfig
from megabert.families.spec import (AttentionSpec, ClassifierSpec, EmbeddingSpec, InitSpec, MLMHeadSpec, MLPSpec,
                                    NormSpec)

FULL = "full_attention"


def bert_layout_rope(cfg: ModelConfig, *, biases: bool, mlp: MLPSpec, head_activation: str) -> dict:
    """Post-LN LayerNorms, RoPE on every (full) layer, token types and an embedding norm, the
    hidden dropout on the embeddings and both residuals, BERT's tied MLM head and pooler.
    `biases`: on q/k/v and the attention's output; `mlp`: the family's gated MLP."""
    return dict(
        hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        norm=NormSpec(kind="layernorm", eps=cfg.layernorm_epsilon, bias=True), pre_norm=False,
        embeddings=EmbeddingSpec(max_positions=0, type_vocab_size=cfg.type_vocab_size, norm=True,
                                 dropout=cfg.hidden_dropout),
        attention=AttentionSpec(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_attention_heads,
                                head_dim=cfg.head_dim, qkv_bias=biases, out_bias=biases, dropout=cfg.attention_dropout,
                                layer_types=(FULL,) * cfg.num_layers, rope_theta={FULL: cfg.global_rope_theta}),
        mlp=mlp, residual_dropout=(cfg.hidden_dropout, cfg.hidden_dropout),
        mlm_head=MLMHeadSpec(transform=True, activation=head_activation, dense_bias=True, norm=True, tied=True,
                             decoder_bias=True),
        classifier=ClassifierSpec(pooling="pooler"), init=InitSpec(std=cfg.init_method_std))


def llama_block(cfg: ModelConfig, layer_types: tuple[str, ...], rope_theta: dict, half_window: dict) -> dict:
    """RMSNorm pre-norm with a final norm, no positions or token types, grouped-query attention
    (biases as attention_bias) with RoPE per layer type, a SwiGLU-style MLP (biases as mlp_bias)."""
    return dict(
        hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        norm=NormSpec(kind="rmsnorm", eps=cfg.layernorm_epsilon, bias=False), pre_norm=True,
        embeddings=EmbeddingSpec(max_positions=0, type_vocab_size=0, norm=False, dropout=0.0),
        attention=AttentionSpec(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_kv_heads,
                                head_dim=cfg.head_dim, qkv_bias=cfg.attention_bias, out_bias=cfg.attention_bias,
                                dropout=cfg.attention_dropout, layer_types=layer_types, rope_theta=rope_theta,
                                half_window=half_window),
        mlp=MLPSpec(ffn_size=cfg.ffn_hidden_size, kind="glu", activation=cfg.hidden_activation, in_bias=cfg.mlp_bias,
                    out_bias=cfg.mlp_bias),
        init=InitSpec(std=cfg.init_method_std))


def llama_fields(hf: dict, *, positions: int, eps: float) -> dict:
    """ModelConfig fields of EuroBERT's block from config.json (a family adds its own); the
    arguments are the family's defaults for keys a config may leave out."""
    heads, head_dim = hf["num_attention_heads"], hf.get("head_dim")
    return dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", positions),
        num_query_groups=hf.get("num_key_value_heads") or None,
        kv_channels=head_dim if head_dim not in (None, hf["hidden_size"] // heads) else None,
        layernorm_epsilon=hf.get("rms_norm_eps", eps), init_method_std=hf.get("initializer_range", 0.02),
        attention_dropout=hf.get("attention_dropout", 0.0), hidden_dropout=0.0, layernorm_position="pre",
        bert_binary_head=False, attention_bias=hf.get("attention_bias", False), mlp_bias=hf.get("mlp_bias", False),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False))


def llama_hf_config(cfg: ModelConfig, model_type: str, architecture: str) -> dict:
    """config.json keys of EuroBERT's block (a family adds its own)."""
    return {
        "architectures": [architecture], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_activation,
        "max_position_embeddings": cfg.max_position_embeddings, "initializer_range": cfg.init_method_std,
        "rms_norm_eps": cfg.layernorm_epsilon, "attention_bias": cfg.attention_bias,
        "attention_dropout": cfg.attention_dropout, "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights, "torch_dtype": "float32",
    }
