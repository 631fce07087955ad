"""UltraBERT as transformers' `ultrabert`: EuroBERT's block (RMSNorm pre-norm with a final norm,
grouped-query attention, SwiGLU, RoPE) with sliding and full layers (`layer_types`; by default
every third layer full), a RoPE base per layer type, and an MLM head of its own width: linear
(h -> prediction_head_size) -> tanh-GELU -> linear (-> h) -> tanh-GELU -> decoder, no biases, no
norm, untied by default.

NOTE: `sliding_window` is an inclusive radius (|i - j| <= sliding_window), our half window;
ModernBERT's `local_attention` is the window's whole width, so ModelConfig.local_attention holds
2 x sliding_window. On disk: the prefix `ultrabert.`, the decoder as `cls.weight`."""
from __future__ import annotations

from megabert.config import ModelConfig
from megabert.errors import CheckpointError
from megabert.families.blocks import FULL, llama_block, llama_fields, llama_hf_config
from megabert.families.eurobert import LAYER_NAMES as EUROBERT_LAYER
from megabert.families.family import Family, Recipe, encoder_task_classes, hf_architectures
from megabert.families.rope_config import checked_activation, rope_theta
from megabert.families.spec import ClassifierSpec, EncoderSpec, MLMHeadSpec

# EuroBERT's block, named as EuroBERT names it under the layer prefix.
_LAYER = EUROBERT_LAYER
_GLOBAL = {"word_embeddings": ("ultrabert.embed_tokens",), "final_norm": ("ultrabert.norm",),
           "head_dense": ("head.linear1",), "head_dense2": ("head.linear2",), "decoder": ("cls",)}
SLIDING = "sliding_attention"


def layer_types(cfg: ModelConfig) -> tuple[str, ...]:
    """config.json's, else transformers' default: every third layer full."""
    return tuple(cfg.layer_types) if cfg.layer_types else tuple(
        SLIDING if (i + 1) % 3 else FULL for i in range(cfg.num_layers))


def spec(cfg: ModelConfig) -> EncoderSpec:
    types = layer_types(cfg)
    theta = {FULL: cfg.global_rope_theta, SLIDING: cfg.local_rope_theta}
    return EncoderSpec(
        family="ultrabert",
        **llama_block(cfg, types, {t: theta[t] for t in set(types)},
                      {SLIDING: cfg.local_attention // 2} if SLIDING in types else {}),
        mlm_head=MLMHeadSpec(transform=True, width=cfg.prediction_head_size or cfg.hidden_size,
                             activation="gelu_pytorch_tanh", dense_bias=False, norm=False,
                             tied=not cfg.untie_embeddings_and_output_weights, decoder_bias=False),
        classifier=ClassifierSpec(pooling=cfg.classifier_pooling, prediction_head=False,
                                  dropout=cfg.classifier_dropout),
        hf_layer_prefix="ultrabert.layers.{i}.", hf_layer_names=_LAYER, hf_names=_GLOBAL)


def config_from_hf(hf: dict) -> dict:
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is not None and (not isinstance(types, list) or len(types) != n or set(types) - {FULL, SLIDING}):
        raise CheckpointError(f"config.json's layer_types {types} is not one of {FULL!r} / {SLIDING!r} per layer "
                              f"({n} layers)")
    window = hf.get("sliding_window", 128)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise CheckpointError(f"config.json's sliding_window {window!r} is not a positive number of tokens")
    return dict(
        llama_fields(hf, positions=32768, eps=1e-6), layer_types=types, local_attention=2 * window,
        global_rope_theta=rope_theta(hf, 2_560_000.0, "UltraBERT", FULL),
        local_rope_theta=rope_theta(hf, 10_000.0, "UltraBERT", SLIDING),
        hidden_activation=checked_activation(hf, "silu", "UltraBERT"),
        prediction_head_size=hf.get("prediction_head_size", 768),
        classifier_pooling=hf.get("classifier_pooling", "cls"), classifier_dropout=hf.get("classifier_dropout") or 0.0)


def hf_config(cfg: ModelConfig, architecture: str = "UltrabertForMaskedLM") -> dict:
    types = list(layer_types(cfg))
    return {
        **llama_hf_config(cfg, "ultrabert", architecture), "layer_types": types,
        "sliding_window": cfg.local_attention // 2, "prediction_head_size": cfg.prediction_head_size or cfg.hidden_size,
        "rope_parameters": {t: {"rope_type": "default", "rope_theta": cfg.global_rope_theta if t == FULL
                                else cfg.local_rope_theta} for t in sorted(set(types))},
        "classifier_pooling": cfg.classifier_pooling, "classifier_dropout": cfg.classifier_dropout,
        "use_cache": False,
    }


FAMILY = Family(
    name="ultrabert", model_type="ultrabert", spec=spec, config_from_hf=config_from_hf, hf_config=hf_config,
    recipe=Recipe(mask_prob=0.3, binary_head=False, tokenizer="tokenizer.json"),
    scratch_defaults={"layernorm_epsilon": 1e-6, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                      "max_position_embeddings": 32768, "layernorm_position": "pre", "bert_binary_head": False,
                      "hidden_activation": "silu", "global_rope_theta": 2_560_000.0, "local_rope_theta": 10_000.0,
                      "local_attention": 256, "untie_embeddings_and_output_weights": True},
    task_classes=encoder_task_classes(sequence_classification="EncoderForSequenceClassification"),
    hf_base_prefix="ultrabert.",
    architectures=hf_architectures("Ultrabert", "sequence_classification", "token_classification",
                                   "question_answering"),
)
