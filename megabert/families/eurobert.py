"""EuroBERT (Boizard et al. 2025) as transformers' `eurobert`: Llama's block made bidirectional.
No positions or token types (RoPE), RMSNorm pre-norm with a final norm, grouped-query
attention, a SwiGLU MLP (act(gate_proj x) * up_proj x), no head transform, a decoder of its
own by default (`lm_head`, with a bias only when mlp_bias is set)."""
from __future__ import annotations

from megabert.config import ModelConfig
from megabert.errors import CheckpointError
from megabert.families.family import Family, Recipe
from megabert.families.spec import (AttentionSpec, ClassifierSpec, EmbeddingSpec, EncoderSpec, InitSpec, MLMHeadSpec,
                                    MLPSpec, NormSpec)

LAYER_NAMES = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "q": ("self_attn.q_proj",), "kv": ("self_attn.k_proj", "self_attn.v_proj"),
               "attn_out": ("self_attn.o_proj",),
          "attn_norm": ("input_layernorm",),
          # Our gated up-projection is [input; gate] with act(input): transformers' gate_proj is
          # the activated half.
          "mlp_in": ("mlp.gate_proj", "mlp.up_proj"), "mlp_out": ("mlp.down_proj",),
          "mlp_norm": ("post_attention_layernorm",)}
_GLOBAL = {"word_embeddings": ("model.embed_tokens",), "final_norm": ("model.norm",),
           "decoder": ("lm_head",), "decoder_bias": ("lm_head",), "classifier_dense": ("dense",)}
# transformers' classifier_pooling -> ours (its "bos" is the first token, our "cls").
_POOLINGS = {"bos": "cls", "mean": "mean", "late": "late"}
_SPECIAL_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "mask_token_id")
_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


def spec(cfg: ModelConfig) -> EncoderSpec:
    return EncoderSpec(
        family="eurobert", hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        norm=NormSpec(kind="rmsnorm", eps=cfg.layernorm_epsilon, bias=False), pre_norm=True,
        embeddings=EmbeddingSpec(max_positions=0, type_vocab_size=0, norm=False, dropout=0.0),
        attention=AttentionSpec(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_kv_heads,
                                head_dim=cfg.head_dim, qkv_bias=cfg.attention_bias, out_bias=cfg.attention_bias,
                                dropout=cfg.attention_dropout, layer_types=("full_attention",) * cfg.num_layers,
                                rope_theta={"full_attention": cfg.global_rope_theta}),
        mlp=MLPSpec(ffn_size=cfg.ffn_hidden_size, kind="glu", activation=cfg.hidden_activation, in_bias=cfg.mlp_bias,
                    out_bias=cfg.mlp_bias),
        mlm_head=MLMHeadSpec(transform=False, tied=not cfg.untie_embeddings_and_output_weights,
                             decoder_bias=cfg.mlp_bias),
        # dense -> exact GELU (transformers' nn.GELU, whatever hidden_act is) -> classifier.
        classifier=ClassifierSpec(pooling=cfg.classifier_pooling, prediction_head=True, head_norm=False,
                                  activation="gelu"),
        init=InitSpec(std=cfg.init_method_std),
        hf_layer_prefix="model.layers.{i}.", hf_layer_names=LAYER_NAMES, hf_names=_GLOBAL)


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    kind = params.get("rope_type", "default")
    if kind != "default" or hf.get("rope_scaling"):
        raise CheckpointError(f"config.json asks for rope_type {kind if kind != 'default' else hf['rope_scaling']}; "
                              f"megabert's EuroBERT implements the default RoPE only")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_from_hf(hf: dict) -> dict:
    heads = hf["num_attention_heads"]
    act = hf.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise CheckpointError(f"config.json has hidden_act {act!r}; megabert's EuroBERT takes "
                              f"{', '.join(_ACTIVATIONS)}")
    head_dim = hf.get("head_dim")
    special = {k: hf[k] for k in _SPECIAL_IDS if isinstance(hf.get(k), int)}
    pooling = hf.get("classifier_pooling", "late")
    if pooling not in _POOLINGS:
        raise CheckpointError(f"config.json has classifier_pooling {pooling!r}; EuroBERT's are "
                              f"{', '.join(_POOLINGS)}")
    return dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 8192),
        num_query_groups=hf.get("num_key_value_heads") or None,
        kv_channels=head_dim if head_dim not in (None, hf["hidden_size"] // heads) else None,
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-5), init_method_std=hf.get("initializer_range", 0.02),
        attention_dropout=hf.get("attention_dropout", 0.0), hidden_dropout=0.0, layernorm_position="pre",
        bert_binary_head=False, global_rope_theta=_rope_theta(hf), attention_bias=hf.get("attention_bias", False),
        mlp_bias=hf.get("mlp_bias", False), hidden_activation=act,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        classifier_pooling=_POOLINGS[pooling], special_token_ids=special or None)


def hf_config(cfg: ModelConfig, architecture: str = "EuroBertForMaskedLM") -> dict:
    return {
        "architectures": [architecture], "model_type": "eurobert", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_activation,
        "max_position_embeddings": cfg.max_position_embeddings, "initializer_range": cfg.init_method_std,
        "rms_norm_eps": cfg.layernorm_epsilon, "attention_bias": cfg.attention_bias,
        "attention_dropout": cfg.attention_dropout, "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.global_rope_theta},
        "classifier_pooling": {v: k for k, v in _POOLINGS.items()}[cfg.classifier_pooling],
        "torch_dtype": "float32", **(cfg.special_token_ids or {}),
    }


FAMILY = Family(
    name="eurobert", model_type="eurobert", spec=spec, config_from_hf=config_from_hf, hf_config=hf_config,
    recipe=Recipe(mask_prob=0.5, binary_head=False, tokenizer="tokenizer.json"),
    scratch_defaults={"layernorm_epsilon": 1e-5, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                      "max_position_embeddings": 8192, "layernorm_position": "pre", "bert_binary_head": False,
                      "hidden_activation": "silu", "global_rope_theta": 250000.0,
                      "untie_embeddings_and_output_weights": True, "classifier_pooling": "late"},
    # transformers has no EuroBertForQuestionAnswering: ours fine-tunes but does not export.
    task_classes={"pretraining": "EncoderForMaskedLM", "masked_lm": "EncoderForMaskedLM",
                  "sequence_classification": "EncoderForSequenceClassification",
                  "token_classification": "BertForTokenClassification",
                  "question_answering": "BertForQuestionAnswering", "embeddings": "BertForSentenceEmbedding"},
    hf_base_prefix="model.",
    architectures={"pretraining": "EuroBertForMaskedLM", "masked_lm": "EuroBertForMaskedLM",
                   "embeddings": "EuroBertModel", "sequence_classification": "EuroBertForSequenceClassification",
                   "token_classification": "EuroBertForTokenClassification"},
)
