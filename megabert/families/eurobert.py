"""EuroBERT (Boizard et al. 2025) as transformers' `eurobert`: Llama's block made bidirectional.
No positions or token types (RoPE), RMSNorm pre-norm with a final norm, grouped-query
attention, a SwiGLU MLP (act(gate_proj x) * up_proj x), no head transform, a decoder of its
own by default (`lm_head`, with a bias only when mlp_bias is set)."""
from __future__ import annotations

from megabert.config import ModelConfig
from megabert.errors import CheckpointError
from megabert.families.blocks import FULL, llama_block, llama_fields, llama_hf_config
from megabert.families.family import Family, Recipe, encoder_task_classes, hf_architectures
from megabert.families.rope_config import checked_activation, rope_theta
from megabert.families.spec import ClassifierSpec, EncoderSpec, MLMHeadSpec

LAYER_NAMES = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "q": ("self_attn.q_proj",), "kv": ("self_attn.k_proj", "self_attn.v_proj"),
               "attn_out": ("self_attn.o_proj",), "attn_norm": ("input_layernorm",),
               # Our gated up-projection is [input; gate] with act(input): transformers' gate_proj is
               # the activated half.
               "mlp_in": ("mlp.gate_proj", "mlp.up_proj"), "mlp_out": ("mlp.down_proj",),
               "mlp_norm": ("post_attention_layernorm",)}
_GLOBAL = {"word_embeddings": ("model.embed_tokens",), "final_norm": ("model.norm",),
           "decoder": ("lm_head",), "decoder_bias": ("lm_head",), "classifier_dense": ("dense",)}
# transformers' classifier_pooling -> ours (its "bos" is the first token, our "cls").
_POOLINGS = {"bos": "cls", "mean": "mean", "late": "late"}
_SPECIAL_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "mask_token_id")


def spec(cfg: ModelConfig) -> EncoderSpec:
    return EncoderSpec(
        family="eurobert", **llama_block(cfg, (FULL,) * cfg.num_layers, {FULL: cfg.global_rope_theta}, {}),
        mlm_head=MLMHeadSpec(transform=False, tied=not cfg.untie_embeddings_and_output_weights,
                             decoder_bias=cfg.mlp_bias),
        # dense -> exact GELU (transformers' nn.GELU, whatever hidden_act is) -> classifier.
        classifier=ClassifierSpec(pooling=cfg.classifier_pooling, prediction_head=True, head_norm=False,
                                  activation="gelu"),
        hf_layer_prefix="model.layers.{i}.", hf_layer_names=LAYER_NAMES, hf_names=_GLOBAL)


def config_from_hf(hf: dict) -> dict:
    special = {k: hf[k] for k in _SPECIAL_IDS if isinstance(hf.get(k), int)}
    pooling = hf.get("classifier_pooling", "late")
    if pooling not in _POOLINGS:
        raise CheckpointError(f"config.json has classifier_pooling {pooling!r}; EuroBERT's are "
                              f"{', '.join(_POOLINGS)}")
    return dict(llama_fields(hf, positions=8192, eps=1e-5), global_rope_theta=rope_theta(hf, 10000.0, "EuroBERT"),
                hidden_activation=checked_activation(hf, "silu", "EuroBERT"), classifier_pooling=_POOLINGS[pooling],
                special_token_ids=special or None)


def hf_config(cfg: ModelConfig, architecture: str = "EuroBertForMaskedLM") -> dict:
    return {
        **llama_hf_config(cfg, "eurobert", architecture),
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.global_rope_theta},
        "classifier_pooling": {v: k for k, v in _POOLINGS.items()}[cfg.classifier_pooling],
        **(cfg.special_token_ids or {}),
    }


FAMILY = Family(
    name="eurobert", model_type="eurobert", spec=spec, config_from_hf=config_from_hf, hf_config=hf_config,
    recipe=Recipe(mask_prob=0.5, binary_head=False, tokenizer="tokenizer.json"),
    scratch_defaults={"layernorm_epsilon": 1e-5, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                      "max_position_embeddings": 8192, "layernorm_position": "pre", "bert_binary_head": False,
                      "hidden_activation": "silu", "global_rope_theta": 250000.0,
                      "untie_embeddings_and_output_weights": True, "classifier_pooling": "late"},
    task_classes=encoder_task_classes(sequence_classification="EncoderForSequenceClassification"),
    hf_base_prefix="model.",
    architectures=hf_architectures("EuroBert", "sequence_classification", "token_classification"),
)
