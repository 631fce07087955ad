"""Megatron-LM BERT checkpoints (and those of its forks, which keep its formats), read and written without megatron.

A Megatron `--save` directory (the root with `latest_checkpointed_iteration.txt`, or one
`iter_NNNNNNN/` / `release/` directory) in either format:
- `torch`: `mp_rank_TT[_PPP]/model_optim_rng.pt` per rank (torch's zip or pre-1.6 format), legacy (`language_model.*`,
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
from dataclasses import dataclass
from typing import Optional

import torch

from megabert.checkpoint.layout import TRACKER, read_tracker, tag_dir_name
from megabert.checkpoint.megatron import adam_state, arch, dist_format, names, qkv, torch_format
from megabert.checkpoint.megatron.safe_load import safe_torch_load
from megabert.checkpoint.safe_pickle import wrong_type
from megabert.config import ModelConfig
from megabert.errors import CheckpointError, RefusedFileError

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
    except RefusedFileError:
        raise  # what it names is refused here as it would be by megabert's own reader
    except CheckpointError:
        return None  # a damaged file: megabert's own reader reports it
    if not isinstance(payload, dict):  # neither Megatron's rank file nor megabert's
        raise wrong_type(files[(0, 0)], payload, "the dict a rank file holds", "checkpoint")
    if "model_config" in payload:  # megabert's own rank file
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


@dataclass(frozen=True)
class Share:
    """What one reading rank takes: its TP rank of `tp_size`, its padded vocab, and the
    megabert names its pipeline stage holds. Only the rank files (torch) or the keys and
    layer slices (torch_dist) that hold part of it are read."""

    tp_rank: int
    tp_size: int
    padded_vocab_size: int
    names: frozenset


@dataclass
class MegatronTensors:
    """read_tensors' result in megabert names, full tensors: `weights` (fp32 master copies
    where an fp16/bf16 run saved them); with `optimizer`, `moments` {name: {"step",
    "exp_avg", "exp_avg_sq"}} or None and `note` saying why."""

    weights: dict[str, torch.Tensor]
    moments: Optional[dict[str, dict[str, torch.Tensor]]] = None
    note: Optional[str] = None


def read_state(path: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The full megabert-named state dict of the Megatron checkpoint at `path` for `cfg`
    (read_config's): QKV in megabert's order, vocab rows cut to cfg.vocab_size."""
    return read_tensors(path, cfg).weights


def read_tensors(path: str, cfg: ModelConfig, *, optimizer: bool = False, share: Optional[Share] = None
                 ) -> MegatronTensors:
    """The weights (and with `optimizer`, the Adam state: adam_state) of the Megatron
    checkpoint at `path` for `cfg`, in megabert names, QKV in megabert's order (moments
    permuted as their parameter), vocab rows cut to cfg.vocab_size. With `share`, only what
    that rank takes is read (the rest of each tensor it touches is zeros)."""
    d = iteration_dir(path)
    heads = cfg.num_attention_heads
    wanted = None if share is None else _canonical_names(share.names)
    if checkpoint_format(path) == "torch_dist":
        read = dist_format.read_full(d, optimizer=optimizer, wanted=None if wanted is None else wanted.__contains__)
    else:
        header = read_header(path)
        args = header["args"]
        needs = None if share is None else torch_format.rank_needs(
            d, args, wanted, tp_rank=share.tp_rank, tp_size=share.tp_size, padded_vocab_size=share.padded_vocab_size,
            vocab_size=cfg.vocab_size, saved_padded_vocab=header["shapes"]["embedding.word_embeddings.weight"][0])
        read = torch_format.read_full(d, heads, args=args, optimizer=optimizer, needs=needs)
    weights = _to_megabert({**read.weights, **read.masters}, cfg, path, report=True)
    tokentype = "embedding.tokentype_embeddings.weight"
    if "bert.embeddings.tokentype_embeddings.weight" not in weights and (wanted is None or tokentype in wanted):
        # Megatron builds no token-type embeddings without a binary head: zeros add nothing.
        weights["bert.embeddings.tokentype_embeddings.weight"] = torch.zeros(cfg.type_vocab_size, cfg.hidden_size)
    out = MegatronTensors(weights, note=read.note)
    if read.moments is not None:
        per_kind = {kind: _to_megabert(read.moments[kind], cfg, path) for kind in adam_state.MOMENTS}
        step = torch.tensor(float(read.step), dtype=torch.float32)
        out.moments = {name: {"step": step.clone(), **{kind: per_kind[kind][name] for kind in adam_state.MOMENTS}}
                       for name in per_kind["exp_avg"]}
    return out


def _canonical_names(megabert_names) -> set[str]:
    """The canonical tensors behind these megabert names. The word embeddings of a stage
    without the other embeddings (the last) come from the copy Megatron keeps beside its
    output layer where it has one (PP > 1), else from the first stage."""
    out = {c for n in megabert_names if (c := names.canonical_from_megabert(n)) is not None}
    if "embedding.word_embeddings.weight" in out and "embedding.position_embeddings.weight" not in out:
        out.add("output_layer.weight")
    return out


def _to_megabert(full: dict[str, torch.Tensor], cfg: ModelConfig, path: str, report: bool = False
                 ) -> dict[str, torch.Tensor]:
    """Canonical full tensors (weights, or one kind of moment: permuted alike) -> megabert's."""
    full = dict(full)
    copy = full.pop("output_layer.weight", None)  # the last stage's copy of the tied word embeddings
    if "embedding.word_embeddings.weight" not in full and copy is not None:
        full["embedding.word_embeddings.weight"] = copy
    out: dict[str, torch.Tensor] = {}
    unused = []
    for name, t in full.items():
        target = names.megabert_name(name)
        if target is None:
            unused.append(name)
            continue
        if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            t = qkv.v2_to_megabert(t, cfg.num_attention_heads)
        if name in ("embedding.word_embeddings.weight", "output_layer.bias"):
            t = t[: cfg.vocab_size]
        out[target] = t.contiguous()
    if unused and report:
        logger.info("%s: not used by megabert: %s", path, ", ".join(sorted(unused)))
    return out
