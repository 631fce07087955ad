"""BERT (Devlin et al. 2019) as transformers' `bert` and Megatron-LM build it: learned positions
and token types, post-LN (pre-LN as an option, Megatron's), a GELU MLP, biases everywhere,
tied MLM decoder, the pooler and a sentence-pair head."""
from __future__ import annotations

from megabert.config import ModelConfig
from megabert.errors import CheckpointError
from megabert.families.family import Family, Recipe, encoder_task_classes, hf_architectures
from megabert.families.spec import (AttentionSpec, ClassifierSpec, EmbeddingSpec, EncoderSpec, InitSpec, MLMHeadSpec,
                                 MLPSpec, ModuleNames, NormSpec)

_LAYER = {"qkv": ("attention.self.query", "attention.self.key", "attention.self.value"),
          "attn_out": ("attention.output.dense",), "attn_norm": ("attention.output.LayerNorm",),
          "mlp_in": ("intermediate.dense",), "mlp_out": ("output.dense",), "mlp_norm": ("output.LayerNorm",)}
_GLOBAL = {"word_embeddings": ("bert.embeddings.word_embeddings",),
           "position_embeddings": ("bert.embeddings.position_embeddings",),
           "token_type_embeddings": ("bert.embeddings.token_type_embeddings",),
           "embedding_norm": ("bert.embeddings.LayerNorm",),
           "head_dense": ("cls.predictions.transform.dense",), "head_norm": ("cls.predictions.transform.LayerNorm",),
           "decoder_bias": ("cls.predictions",), "pooler": ("bert.pooler.dense",)}


def spec(cfg: ModelConfig) -> EncoderSpec:
    return EncoderSpec(
        family="bert", hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        norm=NormSpec(kind="layernorm", eps=cfg.layernorm_epsilon, bias=True),
        pre_norm=cfg.layernorm_position == "pre",
        embeddings=EmbeddingSpec(max_positions=cfg.max_position_embeddings, type_vocab_size=cfg.type_vocab_size,
                                 norm=cfg.embedding_layernorm, dropout=cfg.hidden_dropout),
        attention=AttentionSpec(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_attention_heads,
                                head_dim=cfg.head_dim, dropout=cfg.attention_dropout,
                                layer_types=("full_attention",) * cfg.num_layers),
        mlp=MLPSpec(ffn_size=cfg.ffn_hidden_size, kind="plain", activation="gelu"),
        residual_dropout=(cfg.hidden_dropout, cfg.hidden_dropout),
        mlm_head=MLMHeadSpec(),
        classifier=ClassifierSpec(pooling="pooler"),
        init=InitSpec(std=cfg.init_method_std),
        names=ModuleNames(),
        hf_layer_prefix="bert.encoder.layer.{i}.", hf_layer_names=_LAYER, hf_names=_GLOBAL)


def config_from_hf(hf: dict) -> dict:
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        raise CheckpointError(f"config.json has hidden_act {act!r}; megabert's BERT uses exact GELU ('gelu')")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError("only absolute position embeddings are supported "
                              f"(config.json says {hf['position_embedding_type']!r})")
    fields = dict(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                  num_attention_heads=hf["num_attention_heads"], ffn_hidden_size=hf["intermediate_size"],
                  vocab_size=hf["vocab_size"], max_position_embeddings=hf["max_position_embeddings"],
                  type_vocab_size=hf.get("type_vocab_size", 2),
                  hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
                  attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
                  layernorm_epsilon=hf.get("layer_norm_eps", 1e-12),
                  init_method_std=hf.get("initializer_range", 0.02))
    return fields


def hf_config(cfg: ModelConfig, architecture: str) -> dict:
    if cfg.layernorm_position != "post":
        raise CheckpointError("transformers' BERT is post-LayerNorm; a pre-LN model cannot be exported to it")
    return {
        "architectures": [architecture], "model_type": "bert", "hidden_act": "gelu",
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.ffn_hidden_size,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
        "type_vocab_size": cfg.type_vocab_size, "hidden_dropout_prob": cfg.hidden_dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout, "layer_norm_eps": cfg.layernorm_epsilon,
        "initializer_range": cfg.init_method_std, "position_embedding_type": "absolute",
        "pad_token_id": 0, "torch_dtype": "float32",
    }


FAMILY = Family(
    name="bert", model_type="bert", spec=spec, config_from_hf=config_from_hf, hf_config=hf_config,
    recipe=Recipe(mask_prob=0.15, binary_head=True, tokenizer="wordpiece"),
    task_classes=encoder_task_classes(pretraining="BertForPreTraining"),
    hf_base_prefix="bert.", architecture_from_checkpoint=False, packed_mlm_slots=True,
    architectures=hf_architectures("Bert", "sequence_classification", "token_classification", "question_answering",
                                   pretraining="BertForPreTraining"),
)
