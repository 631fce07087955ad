"""transformers' ModernBertConfig <-> megabert's ModelConfig (model_family "modernbert").

Both config.json spellings are read: transformers 5's (`layer_types`, `rope_parameters`)
and the one on the Hub since ModernBERT's release (`global_attn_every_n_layers`,
`global_rope_theta`, `local_rope_theta`). An export writes both, consistent, so transformers
4.48+ and 5 read it alike. The tensors need no conversion beyond names: each ModernBERT
parameter's Hugging Face name is in its ParamSpec (megabert.model.modernbert).
"""
from __future__ import annotations

from megabert.config import MODERNBERT_ACTIVATIONS, ModelConfig
from megabert.errors import CheckpointError

_SPECIAL_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id")
# transformers' ModernBertConfig defaults, for the keys an older config.json may lack.
_DEFAULTS = dict(global_rope_theta=160000.0, local_rope_theta=10000.0, global_attn_every_n_layers=3,
                 local_attention=128, norm_eps=1e-5, norm_bias=False, attention_bias=False, mlp_bias=False,
                 decoder_bias=True, classifier_bias=False, hidden_activation="gelu", classifier_activation="gelu",
                 initializer_cutoff_factor=2.0, initializer_range=0.02, attention_dropout=0.0,
                 embedding_dropout=0.0, mlp_dropout=0.0, classifier_pooling="cls", max_position_embeddings=8192)


def is_modernbert_config(hf: dict) -> bool:
    return hf.get("model_type") == "modernbert"


def _every_n(hf: dict) -> int:
    """global_attn_every_n_layers from `layer_types` (layer i global when i % n == 0), or as given."""
    layer_types = hf.get("layer_types")
    if not layer_types:
        return int(hf.get("global_attn_every_n_layers", _DEFAULTS["global_attn_every_n_layers"]))
    n = next((i for i, t in enumerate(layer_types) if i > 0 and t == "full_attention"), len(layer_types))
    expected = ["full_attention" if i % n == 0 else "sliding_attention" for i in range(len(layer_types))]
    if layer_types != expected:
        raise CheckpointError(f"config.json's layer_types {layer_types} is not a global layer every n layers from "
                              f"layer 0, the pattern megabert's ModernBERT builds")
    return n


def _rope_theta(hf: dict, layer_type: str, old_key: str) -> float:
    params = (hf.get("rope_parameters") or {}).get(layer_type) or {}
    if params.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise CheckpointError(f"config.json asks for rope_type {params.get('rope_type') or hf.get('rope_scaling')}; "
                              f"megabert's ModernBERT implements the default RoPE only")
    return float(params.get("rope_theta", hf.get(old_key, _DEFAULTS[old_key])))


def model_config_from_hf(hf: dict, **overrides) -> ModelConfig:
    if not hf.get("tie_word_embeddings", True):
        raise CheckpointError("config.json has tie_word_embeddings false; megabert's ModernBERT ties the decoder to "
                              "the word embeddings, as ModernBERT does")
    if hf.get("head_dim") not in (None, hf["hidden_size"] // hf["num_attention_heads"]):
        raise CheckpointError(f"config.json has head_dim {hf['head_dim']}; megabert takes hidden_size / "
                              f"num_attention_heads")
    get = lambda key: hf.get(key, _DEFAULTS[key])  # noqa: E731
    special = {k: hf[k] for k in _SPECIAL_IDS if hf.get(k) is not None}
    fields = dict(
        model_family="modernbert", num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"], ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], max_position_embeddings=get("max_position_embeddings"),
        layernorm_epsilon=get("norm_eps"), init_method_std=get("initializer_range"),
        attention_dropout=get("attention_dropout"), embedding_dropout=get("embedding_dropout"),
        mlp_dropout=get("mlp_dropout"), hidden_dropout=0.0, layernorm_position="pre", bert_binary_head=False,
        global_rope_theta=_rope_theta(hf, "full_attention", "global_rope_theta"),
        local_rope_theta=_rope_theta(hf, "sliding_attention", "local_rope_theta"),
        global_attn_every_n_layers=_every_n(hf), local_attention=get("local_attention"),
        norm_bias=get("norm_bias"), attention_bias=get("attention_bias"), mlp_bias=get("mlp_bias"),
        decoder_bias=get("decoder_bias"), classifier_bias=get("classifier_bias"),
        hidden_activation=get("hidden_activation"), classifier_activation=get("classifier_activation"),
        initializer_cutoff_factor=get("initializer_cutoff_factor") or 3.0,  # transformers: None means 3
        classifier_pooling=get("classifier_pooling"), classifier_dropout=hf.get("classifier_dropout") or 0.0,
        special_token_ids=special or None)
    if {"ModernBertForSequenceClassification", "ModernBertForTokenClassification"} & set(hf.get("architectures") or []):
        id2label = hf.get("id2label")  # transformers derives num_labels from id2label
        fields.update(num_labels=len(id2label) if id2label else hf.get("num_labels", 2), id2label=id2label)
    for act in ("hidden_activation", "classifier_activation"):
        if fields[act] not in MODERNBERT_ACTIVATIONS:
            raise CheckpointError(f"config.json has {act} {fields[act]!r}; megabert's ModernBERT takes "
                                  f"{', '.join(MODERNBERT_ACTIVATIONS)}")
    fields.update(overrides)
    return ModelConfig(**fields)


def hf_config_from_model(cfg: ModelConfig, architecture: str = "ModernBertForMaskedLM") -> dict:
    n = cfg.global_attn_every_n_layers
    layer_types = ["full_attention" if cfg.is_global_layer(i) else "sliding_attention" for i in range(cfg.num_layers)]
    special = cfg.special_token_ids or {}
    return {
        "architectures": [architecture], "model_type": "modernbert",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "hidden_activation": cfg.hidden_activation, "max_position_embeddings": cfg.max_position_embeddings,
        "initializer_range": cfg.init_method_std, "initializer_cutoff_factor": cfg.initializer_cutoff_factor,
        "norm_eps": cfg.layernorm_epsilon, "norm_bias": cfg.norm_bias, "attention_bias": cfg.attention_bias,
        "attention_dropout": cfg.attention_dropout, "embedding_dropout": cfg.embedding_dropout,
        "mlp_bias": cfg.mlp_bias, "mlp_dropout": cfg.mlp_dropout, "decoder_bias": cfg.decoder_bias,
        "classifier_pooling": cfg.classifier_pooling, "classifier_bias": cfg.classifier_bias,
        "classifier_activation": cfg.classifier_activation, "classifier_dropout": cfg.classifier_dropout,
        "local_attention": cfg.local_attention, "layer_types": layer_types,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": cfg.global_rope_theta},
                            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_theta}},
        # The same facts as transformers 4.x spells them.
        "global_attn_every_n_layers": n, "global_rope_theta": cfg.global_rope_theta,
        "local_rope_theta": cfg.local_rope_theta,
        "tie_word_embeddings": True, "sparse_prediction": False, "torch_dtype": "float32",
        **{k: v for k, v in special.items() if k in _SPECIAL_IDS},
    }
