"""Megatron-LM BERT checkpoints (and those of its forks, which keep its formats), read and written without megatron.

A Megatron `--save` directory (the root with `latest_checkpointed_iteration.txt`, or one
`iter_NNNNNNN/` / `release/` directory) in either format:
- `torch`: `mp_rank_TT[_PPP]/model_optim_rng.pt` per rank, legacy (`language_model.*`,
  naming eras A/B/C, QKV `checkpoint_version` 0 / 1.0 / 2.0 / 3.0) or megatron-core names;
- `torch_dist`: `.metadata` + `*.distcp` + `common.pt`, read with torch.distributed.checkpoint.

Reading gives (ModelConfig, megabert-named full state dict with the vocab padding cut),
which megabert.checkpoint.reader pads and shards for the reading model like a Hugging Face
directory's weights. Nothing foreign is unpickled (safe_load). Writing: writer.py.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import torch

from megabert.checkpoint.layout import TRACKER, read_tracker, tag_dir_name
from megabert.checkpoint.megatron import arch, dist_format, names, qkv, torch_format
from megabert.checkpoint.megatron.safe_load import safe_torch_load
from megabert.config import ModelConfig
from megabert.errors import CheckpointError

logger = logging.getLogger(__name__)


def iteration_dir(path: str) -> Optional[str]:
    """The root (with the tracker file) or an iteration directory itself -> the iteration
    directory; None when `path` is neither."""
    if not os.path.isdir(path):
        return None
    if os.path.isfile(os.path.join(path, TRACKER)):
        d = os.path.join(path, tag_dir_name(read_tracker(path)))
        return d if os.path.isdir(d) else None
    return path


def checkpoint_format(path: str) -> Optional[str]:
    """"torch_dist", "torch" (a Megatron rank file: no megabert `model_config`) or None."""
    d = iteration_dir(path)
    if d is None:
        return None
    return _format(os.path.realpath(d), os.path.getmtime(d))


@functools.lru_cache(maxsize=32)
def _format(iter_dir: str, mtime: float) -> Optional[str]:
    if dist_format.is_dist_dir(iter_dir):
        return "torch_dist"
    files = torch_format.rank_files(iter_dir)
    if not files or (0, 0) not in files:
        return None
    try:
        payload = safe_torch_load(files[(0, 0)], mmap=True)
    except CheckpointError:
        return None  # a damaged file: megabert's own reader reports it
    if not isinstance(payload, dict) or "model_config" in payload:  # megabert's own rank file
        return None
    # "model0", "model1", ...: interleaved-pipeline chunks, which read_header refuses by name.
    return "torch" if "model" in payload or "model0" in payload else None


def is_megatron_dir(path: str) -> bool:
    return checkpoint_format(path) is not None


def read_header(path: str) -> dict:
    """{"format", "args" (a plain dict), "checkpoint_version", "iteration", "shapes" (canonical
    name -> full shape)} without reading a tensor."""
    fmt = checkpoint_format(path)
    if fmt is None:
        raise CheckpointError(f"{path} is not a Megatron-LM checkpoint directory")
    d = iteration_dir(path)
    if fmt == "torch_dist":
        header = dist_format.read_header(d)
        stacked = header.pop("shapes")
        header["shapes"] = _unstacked_shapes(stacked)
    else:
        files = torch_format.rank_files(d)
        header = torch_format.read_header(files[(0, 0)])
        header.pop("model_keys")
        header["shapes"] = torch_format.full_shapes(d)
    return {**header, "format": fmt}


def _unstacked_shapes(stacked: dict[str, tuple]) -> dict[str, tuple]:
    shapes = {}
    for key, shape in stacked.items():
        if key.startswith("encoder.layers.") and not key.split(".")[2].isdigit():
            rest = key.split(".", 2)[2]
            for i in range(shape[0]):
                shapes[names.canonical_name(f"encoder.layers.{i}.{rest}")] = tuple(shape[1:])
        elif names.canonical_name(key) is not None:
            shapes[names.canonical_name(key)] = tuple(shape)
    return shapes


def read_config(path: str, overrides: Optional[dict] = None) -> ModelConfig:
    """The ModelConfig of the checkpoint at `path` (arch.model_config): `overrides` are
    ModelConfig fields (flags; `vocab_size` from the tokenizer cuts the vocab padding)."""
    overrides = dict(overrides or {})
    header = read_header(path)
    cfg = arch.model_config(path, header["args"], header["shapes"], overrides)
    note = arch.vocab_note(cfg, header["shapes"]["embedding.word_embeddings.weight"][0], header["args"],
                           overrides.get("vocab_size"))
    if note:
        logger.warning("%s: %s", path, note)
    return cfg


def read_state(path: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The full megabert-named state dict of the Megatron checkpoint at `path` for `cfg`
    (read_config's): QKV in megabert's order, vocab rows cut to cfg.vocab_size."""
    d = iteration_dir(path)
    heads = cfg.num_attention_heads
    full = dist_format.read_full(d) if checkpoint_format(path) == "torch_dist" else torch_format.read_full(d, heads)
    out: dict[str, torch.Tensor] = {}
    unused = []
    for name, t in full.items():
        target = names.megabert_name(name)
        if target is None:
            if name != "output_layer.weight":
                unused.append(name)
            continue
        if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            t = qkv.v2_to_megabert(t, heads)
        if name in ("embedding.word_embeddings.weight", "output_layer.bias"):
            t = t[: cfg.vocab_size]
        out[target] = t.contiguous()
    if "bert.embeddings.tokentype_embeddings.weight" not in out:
        # Megatron builds no token-type embeddings without a binary head: zeros add nothing.
        out["bert.embeddings.tokentype_embeddings.weight"] = torch.zeros(cfg.type_vocab_size, cfg.hidden_size)
    if unused:
        logger.info("%s: not used by megabert: %s", path, ", ".join(sorted(unused)))
    return out
