"""GTE (Li et al. 2023; gte-multilingual, gte-en-v1.5) as transformers' `gte`: BERT's post-LN
layout with RoPE instead of learned positions, an embedding LayerNorm, token type row 0 always
added (type_vocab_size 1), a gated MLP (act(gate) * up, exact GELU by default; biases only on the
down projection and q/k/v/o), and BERT's MLM head with an exact GELU, tied, with a decoder bias.

On disk (what transformers writes and the Hub holds): a fused `qkv_proj` [q; k; v] and a fused
`up_gate_proj` [up; gate], up first (MLPSpec.gate_first); Hub checkpoints carry the prefix
`new.` where transformers writes `gte.` (both are read)."""
from __future__ import annotations

from megabert.config import ModelConfig
from megabert.families.blocks import bert_layout_rope
from megabert.families.family import Family, Recipe, encoder_task_classes, hf_architectures
from megabert.families.rope_config import bert_layout_fields, bert_layout_hf_config
from megabert.families.spec import EncoderSpec, MLPSpec

_LAYER = {"qkv": ("attention.qkv_proj",), "attn_out": ("attention.o_proj",), "attn_norm": ("attn_ln",),
          "mlp_in": ("mlp.up_gate_proj",), "mlp_out": ("mlp.down_proj",), "mlp_norm": ("mlp_ln",)}
_GLOBAL = {"word_embeddings": ("gte.embeddings.word_embeddings",),
           "token_type_embeddings": ("gte.embeddings.token_type_embeddings",),
           "embedding_norm": ("gte.embeddings.LayerNorm",), "head_dense": ("lm_head.dense",),
           "head_norm": ("lm_head.norm",), "decoder_bias": ("lm_head.decoder",), "pooler": ("gte.pooler.dense",)}


def spec(cfg: ModelConfig) -> EncoderSpec:
    mlp = MLPSpec(ffn_size=cfg.ffn_hidden_size, kind="glu", activation=cfg.hidden_activation, in_bias=False,
                  out_bias=True, dropout=cfg.hidden_dropout, gate_first=True)
    return EncoderSpec(family="gte", **bert_layout_rope(cfg, biases=True, mlp=mlp, head_activation="gelu"),
                       hf_layer_prefix="gte.encoder.layer.{i}.", hf_layer_names=_LAYER, hf_names=_GLOBAL)


def config_from_hf(hf: dict) -> dict:
    return bert_layout_fields(hf, "GTE", theta=160000.0, act="gelu", type_vocab_size=1, positions=8192,
                              hidden_dropout=0.1)


def hf_config(cfg: ModelConfig, architecture: str = "GteForMaskedLM") -> dict:
    return {**bert_layout_hf_config(cfg, "gte", architecture), "tie_word_embeddings": True}


FAMILY = Family(
    name="gte", model_type="gte", spec=spec, config_from_hf=config_from_hf, hf_config=hf_config,
    recipe=Recipe(mask_prob=0.3, binary_head=False, tokenizer="tokenizer.json"),
    scratch_defaults={"type_vocab_size": 1, "global_rope_theta": 160000.0, "max_position_embeddings": 8192,
                      "bert_binary_head": False, "attention_dropout": 0.0},
    task_classes=encoder_task_classes(),
    hf_base_prefix="gte.", hf_prefix_aliases={"new.": "gte."},
    architectures=hf_architectures("Gte", "sequence_classification", "token_classification"),
)
