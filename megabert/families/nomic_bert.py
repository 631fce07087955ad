"""NomicBERT (Nussbaum et al. 2024, nomic-embed) as transformers' `nomic_bert`: BERT's post-LN
layout with RoPE (base 1000 by default), token types and an embedding LayerNorm, no biases in
the layers, a SwiGLU MLP, and BERT's MLM head whose activation is `hidden_act`, tied, with a
decoder bias.

On disk: `Wqkv` [q; k; v], `fc11` the up projection and `fc12` the gate (the activated half),
`norm1` / `norm2`, `emb_ln`. `tie_word_embeddings` is transformers' class attribute: config.json
does not carry it and no decoder weight is saved."""
from __future__ import annotations

from megabert.config import ModelConfig
from megabert.families.blocks import bert_layout_rope
from megabert.families.family import Family, Recipe, encoder_task_classes, hf_architectures
from megabert.families.rope_config import bert_layout_fields, bert_layout_hf_config
from megabert.families.spec import EncoderSpec, MLPSpec

_LAYER = {"qkv": ("attn.Wqkv",), "attn_out": ("attn.out_proj",), "attn_norm": ("norm1",),
          # ours is [input; gate] with act(input): fc12, the activated half, first
          "mlp_in": ("mlp.fc12", "mlp.fc11"), "mlp_out": ("mlp.fc2",), "mlp_norm": ("norm2",)}
_GLOBAL = {"word_embeddings": ("nomic_bert.embeddings.word_embeddings",),
           "token_type_embeddings": ("nomic_bert.embeddings.token_type_embeddings",),
           "embedding_norm": ("nomic_bert.emb_ln",), "head_dense": ("cls.predictions.transform.dense",),
           "head_norm": ("cls.predictions.transform.layer_norm",), "decoder_bias": ("cls.predictions",),
           "pooler": ("nomic_bert.pooler.dense",)}


def spec(cfg: ModelConfig) -> EncoderSpec:
    mlp = MLPSpec(ffn_size=cfg.ffn_hidden_size, kind="glu", activation=cfg.hidden_activation, in_bias=False,
                  out_bias=False)
    return EncoderSpec(family="nomic_bert",
                       **bert_layout_rope(cfg, biases=False, mlp=mlp, head_activation=cfg.hidden_activation),
                       hf_layer_prefix="nomic_bert.encoder.layers.{i}.", hf_layer_names=_LAYER, hf_names=_GLOBAL)


def config_from_hf(hf: dict) -> dict:
    return bert_layout_fields(hf, "NomicBERT", theta=1000.0, act="silu", type_vocab_size=2, positions=2048,
                              hidden_dropout=0.0)


def hf_config(cfg: ModelConfig, architecture: str = "NomicBertForMaskedLM") -> dict:
    return {**bert_layout_hf_config(cfg, "nomic_bert", architecture)}


FAMILY = Family(
    name="nomic_bert", model_type="nomic_bert", spec=spec, config_from_hf=config_from_hf, hf_config=hf_config,
    recipe=Recipe(mask_prob=0.3, binary_head=False, tokenizer="wordpiece"),
    scratch_defaults={"global_rope_theta": 1000.0, "hidden_activation": "silu", "hidden_dropout": 0.0,
                      "attention_dropout": 0.0, "max_position_embeddings": 2048, "bert_binary_head": False},
    task_classes=encoder_task_classes(),
    hf_base_prefix="nomic_bert.",
    architectures=hf_architectures("NomicBert", "sequence_classification", "token_classification"),
)
