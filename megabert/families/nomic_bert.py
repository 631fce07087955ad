"""NomicBERT (Nussbaum et al. 2024, nomic-embed) as transformers' `nomic_bert`: BERT's post-LN
layout with RoPE (base 1000 by default), token types and an embedding LayerNorm, no biases in
the layers, a SwiGLU MLP, and BERT's MLM head whose activation is `hidden_act`, tied, with a
decoder bias.

On disk: `Wqkv` [q; k; v], `fc11` the up projection and `fc12` the gate (the activated half),
`norm1` / `norm2`, `emb_ln`. `tie_word_embeddings` is transformers' class attribute: config.json
does not carry it and no decoder weight is saved."""
from __future__ import annotations

from megabert.config import ModelConfig
from megabert.families.family import Family, Recipe
from megabert.families.rope_config import checked_activation, rope_theta
from megabert.families.spec import (AttentionSpec, ClassifierSpec, EmbeddingSpec, EncoderSpec, InitSpec, MLMHeadSpec,
                                    MLPSpec, NormSpec)

_LAYER = {"qkv": ("attn.Wqkv",), "attn_out": ("attn.out_proj",), "attn_norm": ("norm1",),
          # ours is [input; gate] with act(input): fc12, the activated half, first
          "mlp_in": ("mlp.fc12", "mlp.fc11"), "mlp_out": ("mlp.fc2",), "mlp_norm": ("norm2",)}
_GLOBAL = {"word_embeddings": ("nomic_bert.embeddings.word_embeddings",),
           "token_type_embeddings": ("nomic_bert.embeddings.token_type_embeddings",),
           "embedding_norm": ("nomic_bert.emb_ln",), "head_dense": ("cls.predictions.transform.dense",),
           "head_norm": ("cls.predictions.transform.layer_norm",), "decoder_bias": ("cls.predictions",),
           "pooler": ("nomic_bert.pooler.dense",)}


def spec(cfg: ModelConfig) -> EncoderSpec:
    return EncoderSpec(
        family="nomic_bert", hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
        norm=NormSpec(kind="layernorm", eps=cfg.layernorm_epsilon, bias=True), pre_norm=False,
        embeddings=EmbeddingSpec(max_positions=0, type_vocab_size=cfg.type_vocab_size, norm=True,
                                 dropout=cfg.hidden_dropout),
        attention=AttentionSpec(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_attention_heads,
                                head_dim=cfg.head_dim, qkv_bias=False, out_bias=False, dropout=cfg.attention_dropout,
                                layer_types=("full_attention",) * cfg.num_layers,
                                rope_theta={"full_attention": cfg.global_rope_theta}),
        mlp=MLPSpec(ffn_size=cfg.ffn_hidden_size, kind="glu", activation=cfg.hidden_activation, in_bias=False,
                    out_bias=False),
        residual_dropout=(cfg.hidden_dropout, cfg.hidden_dropout),
        mlm_head=MLMHeadSpec(transform=True, activation=cfg.hidden_activation, dense_bias=True, norm=True, tied=True,
                             decoder_bias=True),
        classifier=ClassifierSpec(pooling="pooler"),
        init=InitSpec(std=cfg.init_method_std),
        hf_layer_prefix="nomic_bert.encoder.layers.{i}.", hf_layer_names=_LAYER, hf_names=_GLOBAL)


def config_from_hf(hf: dict) -> dict:
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    return dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=heads,
        ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048), type_vocab_size=hf.get("type_vocab_size", 2),
        kv_channels=head_dim if head_dim not in (None, hf["hidden_size"] // heads) else None,
        hidden_dropout=hf.get("hidden_dropout_prob", 0.0), attention_dropout=hf.get("attention_probs_dropout_prob", 0.0),
        layernorm_epsilon=hf.get("layer_norm_eps", 1e-12), init_method_std=hf.get("initializer_range", 0.02),
        global_rope_theta=rope_theta(hf, 1000.0, "NomicBERT"), hidden_activation=checked_activation(hf, "silu", "NomicBERT"),
        bert_binary_head=False)


def hf_config(cfg: ModelConfig, architecture: str = "NomicBertForMaskedLM") -> dict:
    return {
        "architectures": [architecture], "model_type": "nomic_bert", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "head_dim": cfg.head_dim, "hidden_act": cfg.hidden_activation,
        "max_position_embeddings": cfg.max_position_embeddings, "type_vocab_size": cfg.type_vocab_size,
        "hidden_dropout_prob": cfg.hidden_dropout, "attention_probs_dropout_prob": cfg.attention_dropout,
        "layer_norm_eps": cfg.layernorm_epsilon, "initializer_range": cfg.init_method_std,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.global_rope_theta}, "torch_dtype": "float32",
    }


FAMILY = Family(
    name="nomic_bert", model_type="nomic_bert", spec=spec, config_from_hf=config_from_hf, hf_config=hf_config,
    recipe=Recipe(mask_prob=0.3, binary_head=False, tokenizer="wordpiece"),
    scratch_defaults={"global_rope_theta": 1000.0, "hidden_activation": "silu", "hidden_dropout": 0.0,
                      "attention_dropout": 0.0, "max_position_embeddings": 2048, "bert_binary_head": False},
    task_classes={"pretraining": "EncoderForMaskedLM", "sequence_classification": "BertForSequenceClassification",
                  "token_classification": "BertForTokenClassification", "embeddings": "BertForSentenceEmbedding"},
    hf_base_prefix="nomic_bert.",
    architectures={"pretraining": "NomicBertForMaskedLM", "masked_lm": "NomicBertForMaskedLM",
                   "embeddings": "NomicBertModel", "sequence_classification": "NomicBertForSequenceClassification",
                   "token_classification": "NomicBertForTokenClassification"},
)
