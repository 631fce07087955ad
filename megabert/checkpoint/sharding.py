"""Which slice of each full tensor a (tp, pp) rank holds, by parameter name.

The rules mirror the layers' tags (`partition_dim`, `partition_stride`; a test checks
they agree), so checkpoints can be split and merged without building a model:
conversion and resharding run in one process on any machine.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from megabert.tensor_parallel.layers import shard, unshard

_TP_RULES = [  # (regex, partition dim, stride)
    (re.compile(r"\.word_embeddings\.weight$"), 0, 1),
    (re.compile(r"\.attention\.qkv\.(weight|bias)$"), 0, 3),
    (re.compile(r"\.attention\.dense\.weight$"), 1, 1),
    (re.compile(r"\.mlp\.dense_h_to_4h\.(weight|bias)$"), 0, 1),
    (re.compile(r"\.mlp\.dense_4h_to_h\.weight$"), 1, 1),
    (re.compile(r"^lm_head\.bias$"), 0, 1),
]
_LAYER = re.compile(r"\.encoder\.layers\.(\d+)\.")
WORD_EMBEDDINGS = "bert.embeddings.word_embeddings.weight"


def partition_spec(name: str) -> Optional[tuple[int, int]]:
    """(dim, stride) for a tensor-parallel parameter, None for a replicated one."""
    for rx, dim, stride in _TP_RULES:
        if rx.search(name):
            return dim, stride
    return None


def stage_of(name: str, num_layers: int, pp_size: int, layers_per_virtual_stage: Optional[int] = None) -> list[int]:
    """The pipeline stages that hold `name` (the tied word embeddings: first and last).
    Interleaved layouts deal chunks of `layers_per_virtual_stage` layers round-robin."""
    m = _LAYER.search(name)
    if m:
        per_chunk = layers_per_virtual_stage or num_layers // pp_size
        return [(int(m.group(1)) // per_chunk) % pp_size]
    if name == WORD_EMBEDDINGS:
        return sorted({0, pp_size - 1})
    if name.startswith("bert.embeddings."):
        return [0]
    return [pp_size - 1]  # pooler, final LayerNorm, heads


def shard_state(full: dict, *, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1,
                num_layers: int, layers_per_virtual_stage: Optional[int] = None) -> dict:
    """The local state dict of rank (tp_rank, pp_rank) from a full state dict."""
    out = {}
    for name, t in full.items():
        if pp_rank not in stage_of(name, num_layers, pp_size, layers_per_virtual_stage):
            continue
        spec = partition_spec(name)
        out[name] = shard(t, spec[0], tp_rank, tp_size, spec[1]) if spec else t.clone()
    return out


def unshard_states(local: list[list[dict]]) -> dict:
    """local[pp_rank][tp_rank] -> the full state dict."""
    full: dict[str, torch.Tensor] = {}
    for stage in local:
        for name in stage[0]:
            if name in full:
                continue  # the tied word embeddings come from the first stage
            spec = partition_spec(name)
            parts = [shard_dict[name] for shard_dict in stage]
            full[name] = unshard(parts, spec[0], spec[1]) if spec else parts[0].clone()
    return full


VOCAB_ROWS = (WORD_EMBEDDINGS, "lm_head.bias")


def repad_vocab(full: dict, vocab_size: int, padded_vocab_size: int) -> dict:
    """Tensors padded for one TP size, re-padded for another (padding rows are zeros).
    `full` maps names to tensors, or to dicts of tensors (optimizer moments)."""
    def repad(t):
        if not torch.is_tensor(t) or t.dim() == 0 or t.size(0) == padded_vocab_size:
            return t
        t = t[:vocab_size]
        return torch.cat([t, t.new_zeros((padded_vocab_size - vocab_size,) + tuple(t.shape[1:]))])

    out = dict(full)
    for name in VOCAB_ROWS:
        if name in out:
            out[name] = {k: repad(v) for k, v in out[name].items()} if isinstance(out[name], dict) \
                else repad(out[name])
    return out
