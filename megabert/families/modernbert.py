"""ModernBERT (Warner et al. 2024, "Smarter, Better, Faster, Longer") as transformers'
`modernbert`: no positions or token types (RoPE, a base per layer type), pre-LN with a final
norm and none before layer 0's attention, a GeGLU MLP, global attention every n-th layer and
a sliding window in the others, no biases by default, a tied decoder, MLM only.

Both config.json spellings are read: transformers 5's (`layer_types`, `rope_parameters`) and
the one on the Hub since ModernBERT's release (`global_attn_every_n_layers`,
`global_rope_theta`, `local_rope_theta`). An export writes both, consistent, so transformers
4.48+ and 5 read it alike.
"""
from __future__ import annotations

from fractions import Fraction

from megabert.config import MODERNBERT_ACTIVATIONS, ModelConfig
from megabert.errors import CheckpointError
from megabert.families.family import Family, Recipe, hf_architectures
from megabert.families.spec import (AttentionSpec, ClassifierSpec, EmbeddingSpec, EncoderSpec, InitSpec, MLMHeadSpec,
                                 MLPSpec, ModuleNames, NormSpec)

NAMES = ModuleNames(attention="attn", qkv="Wqkv", attn_out="Wo", mlp_in="Wi", mlp_out="Wo", attn_norm="attn_norm",
                    mlp_norm="mlp_norm", final_norm="final_norm", embedding_norm="norm", head_norm="norm")
_LAYER = {"qkv": ("attn.Wqkv",), "attn_out": ("attn.Wo",), "attn_norm": ("attn_norm",), "mlp_in": ("mlp.Wi",),
          "mlp_out": ("mlp.Wo",), "mlp_norm": ("mlp_norm",)}
_GLOBAL = {"word_embeddings": ("model.embeddings.tok_embeddings",), "embedding_norm": ("model.embeddings.norm",),
           "final_norm": ("model.final_norm",), "head_dense": ("head.dense",), "head_norm": ("head.norm",),
           "decoder_bias": ("decoder",), "classifier_dense": ("head.dense",), "classifier_norm": ("head.norm",)}


def spec(cfg: ModelConfig) -> EncoderSpec:
    layer_types = tuple("full_attention" if cfg.is_global_layer(i) else "sliding_attention"
                        for i in range(cfg.num_layers))
    rope = {"full_attention": cfg.global_rope_theta, "sliding_attention": cfg.local_rope_theta}
    return EncoderSpec(
        family="modernbert", hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        norm=NormSpec(kind="layernorm", eps=cfg.layernorm_epsilon, bias=cfg.norm_bias),
        pre_norm=True, first_layer_attn_norm=False,
        embeddings=EmbeddingSpec(max_positions=0, type_vocab_size=0, norm=True, dropout=cfg.embedding_dropout),
        attention=AttentionSpec(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_attention_heads,
                                head_dim=cfg.head_dim, qkv_bias=cfg.attention_bias, out_bias=cfg.attention_bias,
                                dropout=cfg.attention_dropout, layer_types=layer_types,
                                rope_theta={t: rope[t] for t in set(layer_types)},
                                half_window={"sliding_attention": cfg.local_attention // 2}
                                if "sliding_attention" in layer_types else {}),
        mlp=MLPSpec(ffn_size=cfg.ffn_hidden_size, kind="glu", activation=cfg.hidden_activation, in_bias=cfg.mlp_bias,
                    out_bias=cfg.mlp_bias, dropout=cfg.mlp_dropout),
        # transformers' out_drop after the attention's Wo; nothing after the MLP's.
        residual_dropout=(cfg.attention_dropout, 0.0),
        mlm_head=MLMHeadSpec(transform=True, activation=cfg.classifier_activation, dense_bias=cfg.classifier_bias,
                             norm=True, tied=True, decoder_bias=cfg.decoder_bias),
        classifier=ClassifierSpec(pooling=cfg.classifier_pooling, prediction_head=True,
                                  dense_bias=cfg.classifier_bias, activation=cfg.classifier_activation,
                                  dropout=cfg.classifier_dropout),
        init=InitSpec(std=cfg.init_method_std, truncate_at=cfg.initializer_cutoff_factor, scaled_out=True),
        names=NAMES, hf_layer_prefix="model.layers.{i}.", hf_layer_names=_LAYER, hf_names=_GLOBAL)


_SPECIAL_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id")
# transformers' ModernBertConfig defaults, for the keys an older config.json may lack.
_DEFAULTS = dict(global_rope_theta=160000.0, local_rope_theta=10000.0, global_attn_every_n_layers=3,
                 local_attention=128, norm_eps=1e-5, norm_bias=False, attention_bias=False, mlp_bias=False,
                 decoder_bias=True, classifier_bias=False, hidden_activation="gelu", classifier_activation="gelu",
                 initializer_cutoff_factor=2.0, initializer_range=0.02, attention_dropout=0.0,
                 embedding_dropout=0.0, mlp_dropout=0.0, classifier_pooling="cls", max_position_embeddings=8192)


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


def config_from_hf(hf: dict) -> dict:
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
    for act in ("hidden_activation", "classifier_activation"):
        if fields[act] not in MODERNBERT_ACTIVATIONS:
            raise CheckpointError(f"config.json has {act} {fields[act]!r}; megabert's ModernBERT takes "
                                  f"{', '.join(MODERNBERT_ACTIVATIONS)}")
    return fields


def hf_config(cfg: ModelConfig, architecture: str = "ModernBertForMaskedLM") -> dict:
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


FAMILY = Family(
    name="modernbert", model_type="modernbert", spec=spec, config_from_hf=config_from_hf, hf_config=hf_config,
    recipe=Recipe(mask_prob=0.3, binary_head=False, tokenizer="tokenizer.json"),
    # Where ModernBERT's recipe differs from BERT's defaults (transformers' ModernBertConfig): no
    # dropout, LayerNorm eps 1e-5, 8192 positions, pre-norm, MLM only; ModernBERT-base's GeGLU is
    # 1.5 x hidden wide (1152 for 768).
    scratch_defaults={"layernorm_epsilon": 1e-5, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                      "max_position_embeddings": 8192, "layernorm_position": "pre", "bert_binary_head": False},
    ffn_per_hidden=Fraction(3, 2),
    task_classes={"pretraining": "ModernBertForMaskedLM", "masked_lm": "EncoderForMaskedLM",
                  "sequence_classification": "ModernBertForSequenceClassification",
                  "token_classification": "ModernBertForTokenClassification",
                  "question_answering": "ModernBertForQuestionAnswering",
                  "embeddings": "ModernBertForSentenceEmbedding"},
    hf_base_prefix="model.",
    architectures=hf_architectures("ModernBert", "sequence_classification", "token_classification",
                                   "question_answering"),
)
