"""Megatron-LM's BERT tensor names, all eras, mapped to one canonical set and to megabert's.

Canonical names are megatron-core's `torch`-format names with global layer numbers and local
layer-spec LayerNorm names (`embedding.word_embeddings.weight`,
`encoder.layers.3.self_attention.linear_qkv.weight`, `encoder.layers.3.pre_mlp_layernorm.bias`,
`output_layer.bias`, ...). Readers turn what they find into these; the writer starts from them.

Legacy Megatron (megatron/legacy/model, `model.language_model.*`) named its tensors in three
eras: A (to 2020) `transformer` / `attention` / `*_layernorm`; B (2021-01, commit 4b50683)
`encoder` / `self_attention`; C (2023-09, commit 4dc0715) `*_norm`. megatron-core's
Transformer Engine spec and every `torch_dist` checkpoint fuse the two per-layer LayerNorms
into the following linear (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_bias`).
"""
from __future__ import annotations

import re
from typing import Optional

# legacy (era A/B/C) per-layer suffix -> canonical per-layer suffix
_LEGACY_LAYER = [
    (r"input_(?:layernorm|norm)\.", "input_layernorm."),
    (r"(?:attention|self_attention)\.query_key_value\.", "self_attention.linear_qkv."),
    (r"(?:attention|self_attention)\.dense\.", "self_attention.linear_proj."),
    (r"post_attention_(?:layernorm|norm)\.", "pre_mlp_layernorm."),
    (r"mlp\.dense_h_to_4h\.", "mlp.linear_fc1."),
    (r"mlp\.dense_4h_to_h\.", "mlp.linear_fc2."),
]
# megatron-core's fused (TE) LayerNorm names -> the local spec's
_FUSED_LAYER = [
    (r"self_attention\.linear_qkv\.layer_norm_(weight|bias)$", r"input_layernorm.\1"),
    (r"mlp\.linear_fc1\.layer_norm_(weight|bias)$", r"pre_mlp_layernorm.\1"),
]
_LEGACY_TOP = [
    (r"language_model\.embedding\.(word|position|tokentype)_embeddings\.weight$", r"embedding.\1_embeddings.weight"),
    (r"language_model\.(?:transformer|encoder)\.final_(?:layernorm|norm)\.(weight|bias)$",
     r"encoder.final_layernorm.\1"),
    (r"language_model\.pooler\.dense\.(weight|bias)$", r"pooler.dense.\1"),
    (r"lm_head\.(?:layernorm|norm)\.(weight|bias)$", r"lm_head.layer_norm.\1"),
    (r"lm_head\.bias$", "output_layer.bias"),
    (r"word_embeddings_for_head\.weight$", "output_layer.weight"),
]
_LEGACY_LAYER_KEY = re.compile(r"^language_model\.(?:transformer|encoder)\.layers\.(\d+)\.(.*)$")
_MCORE_LAYER_KEY = re.compile(r"^(?:decoder|encoder)\.layers\.(\d+)\.(.*)$")

# canonical -> megabert, per layer and top level
_TO_MEGABERT_LAYER = {
    "input_layernorm": "attention_layernorm", "pre_mlp_layernorm": "mlp_layernorm",
    "self_attention.linear_qkv": "attention.qkv", "self_attention.linear_proj": "attention.dense",
    "mlp.linear_fc1": "mlp.dense_h_to_4h", "mlp.linear_fc2": "mlp.dense_4h_to_h",
}
_TO_MEGABERT_TOP = {
    "embedding.word_embeddings.weight": "bert.embeddings.word_embeddings.weight",
    "embedding.position_embeddings.weight": "bert.embeddings.position_embeddings.weight",
    "embedding.tokentype_embeddings.weight": "bert.embeddings.tokentype_embeddings.weight",
    "encoder.final_layernorm.weight": "bert.encoder.final_layernorm.weight",
    "encoder.final_layernorm.bias": "bert.encoder.final_layernorm.bias",
    "pooler.dense.weight": "bert.pooler.dense.weight", "pooler.dense.bias": "bert.pooler.dense.bias",
    "lm_head.dense.weight": "lm_head.dense.weight", "lm_head.dense.bias": "lm_head.dense.bias",
    "lm_head.layer_norm.weight": "lm_head.layernorm.weight", "lm_head.layer_norm.bias": "lm_head.layernorm.bias",
    "output_layer.bias": "lm_head.bias",
    "binary_head.weight": "binary_head.weight", "binary_head.bias": "binary_head.bias",
}

# How a canonical tensor splits over TP ranks (Megatron's column / row / vocab parallel
# layers): the dim, or None for replicated.
def tp_split_dim(name: str) -> Optional[int]:
    if name in ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias"):
        return 0
    if re.search(r"(linear_qkv|linear_fc1)\.(weight|bias)$", name):
        return 0
    if re.search(r"(linear_proj|linear_fc2)\.weight$", name):
        return 1
    return None


def is_legacy(keys) -> bool:
    return any(k.startswith("language_model.") for k in keys)


def canonical_name(key: str, layer_offset: int = 0) -> Optional[str]:
    """A Megatron state-dict key (legacy of any era, or megatron-core, with this pipeline
    stage's local layer number) -> its canonical name with the global layer number; None
    for entries that hold no weights (`_extra_state`, rotary buffers)."""
    if key.endswith("_extra_state") or "rotary_pos_emb" in key:
        return None
    m = _LEGACY_LAYER_KEY.match(key) or _MCORE_LAYER_KEY.match(key)
    if m:
        rest = m.group(2)
        for pattern, repl in _LEGACY_LAYER + _FUSED_LAYER:
            rest = re.sub("^" + pattern, repl, rest)
        return f"encoder.layers.{int(m.group(1)) + layer_offset}.{rest}"
    for pattern, repl in _LEGACY_TOP:
        if re.match(pattern, key):
            return re.sub(pattern, repl, key)
    if key.startswith("decoder.final_layernorm."):
        return "encoder." + key[len("decoder."):]
    return key


def megabert_name(canonical: str) -> Optional[str]:
    """Canonical -> megabert parameter name; None for the last stage's copy of the tied
    word embeddings (`output_layer.weight`), which megabert keeps as the same tensor."""
    if canonical == "output_layer.weight":
        return None
    m = re.match(r"^encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$", canonical)
    if m and m.group(2) in _TO_MEGABERT_LAYER:
        return f"bert.encoder.layers.{m.group(1)}.{_TO_MEGABERT_LAYER[m.group(2)]}.{m.group(3)}"
    return _TO_MEGABERT_TOP.get(canonical)


def canonical_from_megabert(name: str) -> Optional[str]:
    """megabert parameter name -> canonical (the inverse of megabert_name)."""
    m = re.match(r"^bert\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
    if m:
        inverse = {v: k for k, v in _TO_MEGABERT_LAYER.items()}
        return f"encoder.layers.{m.group(1)}.{inverse[m.group(2)]}.{m.group(3)}" if m.group(2) in inverse else None
    return {v: k for k, v in _TO_MEGABERT_TOP.items()}.get(name)

