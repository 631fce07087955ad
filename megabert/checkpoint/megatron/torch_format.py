"""Megatron-LM's `--ckpt-format torch`: one `model_optim_rng.pt` per (TP, PP) rank.

    ITER/mp_rank_TT/model_optim_rng.pt          (PP = 1)
    ITER/mp_rank_TT_PPP/model_optim_rng.pt      (PP > 1; layer numbers restart in each stage)

Each file: `model` (megatron-core names, flat; legacy: nested dicts under `language_model`),
`args`, `checkpoint_version`, `iteration`, `rng_state`, `optimizer`, ... read with
safe_load (nothing foreign is imported or called). The rank files are merged here into one
full canonical state dict (names.py), the QKV of each TP shard put in version-2.0 order first.
"""
from __future__ import annotations

import os
import re

import torch

from megabert.checkpoint.megatron import names, qkv
from megabert.checkpoint.megatron.safe_load import foreign_to_plain, safe_torch_load
from megabert.errors import CheckpointError

FILENAME = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


def rank_files(iter_dir: str) -> dict[tuple[int, int], str]:
    """{(tp_rank, pp_rank): path} of the rank files in an iteration directory."""
    files = {}
    for entry in os.listdir(iter_dir):
        m = _RANK_DIR.match(entry)
        path = os.path.join(iter_dir, entry, FILENAME)
        if m and os.path.isfile(path):
            files[(int(m.group(1)), int(m.group(2) or 0))] = path
    return files


def grid_size(files: dict) -> tuple[int, int]:
    tp, pp = max(t for t, _ in files) + 1, max(p for _, p in files) + 1
    if len(files) != tp * pp:
        raise CheckpointError(f"{os.path.dirname(os.path.dirname(next(iter(files.values()))))} has {len(files)} rank "
                              f"files for a {tp} x {pp} (TP x PP) grid: some mp_rank_* directories are missing")
    return tp, pp


def flatten(tree: dict, prefix: str = "") -> dict:
    """Legacy Megatron nests its state dict (`{'language_model': {'embedding': {...}}}`); the
    flat dotted names are what its modules would have."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def read_header(path: str) -> dict:
    """Everything of one rank file but its tensors: args (plain dict), checkpoint_version,
    iteration. Memory-mapped: the weights are not read."""
    payload = safe_torch_load(path, mmap=True)
    if "model" not in payload:
        if any(k.startswith("model0") for k in payload):
            raise CheckpointError(f"{path} holds interleaved-pipeline model chunks (model0, model1, ...); save it "
                                  f"without --num-layers-per-virtual-pipeline-stage, or convert it with Megatron's "
                                  f"tools/checkpoint first")
        raise CheckpointError(f"{path} has no 'model' entry: not a Megatron-LM checkpoint")
    return {"args": foreign_to_plain(payload.get("args")) or {},
            "checkpoint_version": float(payload.get("checkpoint_version", 0)),
            "iteration": int(payload.get("iteration", 0) or 0), "model_keys": list(flatten(payload["model"]))}


def read_full(iter_dir: str, num_attention_heads: int) -> dict[str, torch.Tensor]:
    """All rank files of `iter_dir` -> the full canonical state dict (vocab rows as saved)."""
    files = rank_files(iter_dir)
    tp_size, pp_size = grid_size(files)
    if num_attention_heads % tp_size:
        raise CheckpointError(f"{iter_dir} was saved at TP {tp_size}, which does not divide its "
                              f"{num_attention_heads} attention heads: check --num-attention-heads")
    full: dict[str, torch.Tensor] = {}
    offset = 0
    for pp in range(pp_size):
        shards = []
        version = 0.0
        for tp in range(tp_size):
            payload = safe_torch_load(files[(tp, pp)], mmap=True)
            version = float(payload.get("checkpoint_version", 0))
            shards.append(flatten(payload["model"]))
        legacy = names.is_legacy(shards[0])
        stage: dict[str, torch.Tensor] = {}
        for key in shards[0]:
            name = names.canonical_name(key, offset)
            if name is None or not torch.is_tensor(shards[0][key]):
                continue
            parts = [s[key] for s in shards]
            if legacy and name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
                parts = [qkv.to_v2(p, version, num_attention_heads // tp_size) for p in parts]
            dim = names.tp_split_dim(name)
            stage[name] = torch.cat(parts, dim=dim) if dim is not None and tp_size > 1 else parts[0].clone()
        offset += len({k.split(".")[2] for k in stage if k.startswith("encoder.layers.")})
        for name, t in stage.items():
            full.setdefault(name, t)  # the first stage's word embeddings win over the last's copy
    return full


def full_shapes(iter_dir: str) -> dict[str, tuple]:
    """Canonical name -> full shape, from the TP-rank-0 file of each stage (memory-mapped:
    no tensor is read)."""
    files = rank_files(iter_dir)
    tp_size, pp_size = grid_size(files)
    shapes: dict[str, tuple] = {}
    offset = 0
    for pp in range(pp_size):
        model = flatten(safe_torch_load(files[(0, pp)], mmap=True)["model"])
        stage = {}
        for key, t in model.items():
            name = names.canonical_name(key, offset)
            if name is None or not torch.is_tensor(t):
                continue
            shape = list(t.shape)
            dim = names.tp_split_dim(name)
            if dim is not None:
                shape[dim] *= tp_size
            stage[name] = tuple(shape)
        offset += len({k.split(".")[2] for k in stage if k.startswith("encoder.layers.")})
        for name, shape in stage.items():
            shapes.setdefault(name, shape)
    return shapes
