"""Megatron-LM's `--ckpt-format torch`: one `model_optim_rng.pt` per (TP, PP) rank.

    ITER/mp_rank_TT/model_optim_rng.pt          (PP = 1)
    ITER/mp_rank_TT_PPP/model_optim_rng.pt      (PP > 1; layer numbers restart in each stage)

Each file: `model` (megatron-core names, flat; legacy: nested dicts under `language_model`),
`args`, `checkpoint_version`, `iteration`, `rng_state`, `optimizer`, ... in torch's zip or
pre-1.6 legacy format, read with safe_load (nothing foreign is imported or called). The rank
files are merged here into one full canonical state dict (names.py), the QKV of each TP shard
put in version-2.0 order first.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megabert.checkpoint.megatron import adam_state, names, qkv
from megabert.checkpoint.megatron.safe_load import KIND, load_dict, number, plain_args
from megabert.checkpoint.safe_pickle import wrong_type
from megabert.errors import CheckpointError

FILENAME = "model_optim_rng.pt"
DISTRIB_OPTIM = "distrib_optim.pt"  # the distributed optimizer's state, beside FILENAME
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
    payload = checked_rank_file(path)
    return {"args": plain_args(payload, path),
            "checkpoint_version": float(number(payload, "checkpoint_version", 0, path)),
            "iteration": int(number(payload, "iteration", 0, path)), "model_keys": list(flatten(payload["model"]))}


def _load(path: str) -> dict:
    """The one place a rank file is opened for its tensors (memory-mapped where it is a zip
    file: the tensors this rank does not take are never read from disk)."""
    return checked_rank_file(path)


def checked_rank_file(path: str) -> dict:
    """A rank file (torch's pre-1.6 format is read whole, a zip file mapped) checked to be what
    Megatron saves: a dict whose `model` is a dict of tensors by name."""
    payload = load_dict(path, mmap=True)
    if "model" not in payload:
        if any(k.startswith("model0") for k in payload if isinstance(k, str)):
            raise CheckpointError(f"{path} holds interleaved-pipeline model chunks (model0, model1, ...); save it "
                                  f"without --num-layers-per-virtual-pipeline-stage, or convert it with Megatron's "
                                  f"tools/checkpoint first")
        raise CheckpointError(f"{path} has no 'model' entry: not a Megatron-LM checkpoint")
    try:
        _check_model(payload["model"], path)
    except RecursionError:  # nested deeper than any state dict
        raise wrong_type(path, payload["model"], "the model's state dict", KIND) from None
    return payload


def _check_model(tree, path: str) -> None:
    if not isinstance(tree, dict):
        raise wrong_type(path, tree, "the model's state dict (a dict)", KIND)
    for k, v in tree.items():
        if not isinstance(k, str):
            raise wrong_type(path, k, "a state dict key (a str)", KIND)
        if isinstance(v, dict):
            _check_model(v, path)
        elif v is not None and not isinstance(v, (torch.Tensor, bytes)) and not k.endswith("_extra_state"):
            raise wrong_type(path, v, f"tensor '{k}'", KIND)


@dataclass
class FullRead:
    """What read_full gathers, in canonical names, full tensors (vocab rows as saved):
    weights; with `optimizer`, the Adam moments ({"exp_avg": {...}, "exp_avg_sq": {...}}),
    fp32 master weights of an fp16/bf16 run, the step count, or `note` saying why not."""

    weights: dict[str, torch.Tensor]
    moments: Optional[dict[str, dict[str, torch.Tensor]]] = None
    masters: dict[str, torch.Tensor] = field(default_factory=dict)
    step: Optional[float] = None
    note: Optional[str] = None


_UNEVEN_ARGS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")


def stage_layer_counts(files: dict, args: dict) -> list[int]:
    """Layers per saved pipeline stage: Megatron's even split from `args` when they say so
    (no rank file opened), else counted from the TP-rank-0 file of each stage (pickle only)."""
    _, pp_size = grid_size(files)
    num_layers = args.get("num_layers")
    if (num_layers and args.get("pipeline_model_parallel_size") == pp_size and num_layers % pp_size == 0
            and not any(args.get(a) for a in _UNEVEN_ARGS)):
        return [num_layers // pp_size] * pp_size
    counts = []
    for pp in range(pp_size):
        keys = flatten(checked_rank_file(files[(0, pp)])["model"])
        counts.append(len({m.group(1) for k in keys if (m := _LAYER.match(names.canonical_name(k) or ""))}))
    return counts


_LAYER = re.compile(r"^encoder\.layers\.(\d+)\.")


def rank_needs(iter_dir: str, args: dict, wanted: set[str], *, tp_rank: int, tp_size: int, padded_vocab_size: int,
               vocab_size: int, saved_padded_vocab: int) -> Callable[[int, int], bool]:
    """needs(tp, pp) of read_full for a rank of `tp_size` taking the canonical tensors `wanted`
    (vocab padded to `padded_vocab_size` for it; `saved_padded_vocab` rows as saved): the saved
    stages holding them, and the saved TP ranks whose slices overlap this rank's. Megatron and
    megabert both split a tensor into equal contiguous parts (QKV: whole heads, in either row
    order), so the overlap is that of the fractions [r / tp, (r + 1) / tp); vocab rows are
    padded differently at each TP size, so theirs is that of the real rows each holds."""
    files = rank_files(iter_dir)
    saved_tp, saved_pp = grid_size(files)
    counts = stage_layer_counts(files, args)
    starts = [sum(counts[:p]) for p in range(saved_pp)]
    stages = set()
    for name in wanted:
        m = _LAYER.match(name)
        if m:
            stages |= {p for p in range(saved_pp) if starts[p] <= int(m.group(1)) < starts[p] + counts[p]}
        elif name == "output_layer.weight" and saved_pp > 1:
            stages.add(saved_pp - 1)
        elif name.startswith("embedding."):
            if name != "embedding.word_embeddings.weight" or "output_layer.weight" not in wanted or saved_pp == 1:
                stages.add(0)
        elif name != "output_layer.weight":
            stages.add(saved_pp - 1)  # final LayerNorm, pooler, LM and binary heads
    tps = {s for s in range(saved_tp)
           if s * tp_size < (tp_rank + 1) * saved_tp and tp_rank * saved_tp < (s + 1) * tp_size}
    if wanted & {"embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias"}:
        saved_rows = saved_padded_vocab // saved_tp
        lo, hi = tp_rank * padded_vocab_size // tp_size, min((tp_rank + 1) * padded_vocab_size // tp_size, vocab_size)
        tps |= {s for s in range(saved_tp) if s * saved_rows < hi and lo < (s + 1) * saved_rows}
    return lambda tp, pp: pp in stages and tp in tps


def _merge(shards: dict[int, dict], tp_size: int, offset: int, version: float, heads_per_shard: int,
           legacy: bool) -> dict[str, torch.Tensor]:
    """One stage's TP shards {tp: {local key: tensor}} -> canonical full tensors. A TP rank
    missing from `shards` (not read: the reading rank takes nothing of it) is zeros."""
    ref = shards[min(shards)]
    out: dict[str, torch.Tensor] = {}
    for key, t in ref.items():
        name = names.canonical_name(key, offset)
        if name is None or not torch.is_tensor(t):
            continue
        dim = names.tp_split_dim(name)
        if dim is None:
            out[name] = t.clone()
            continue
        parts = [shards[tp][key] if tp in shards else torch.zeros_like(t) for tp in range(tp_size)]
        if legacy and name.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            parts = [qkv.to_v2(p, version, heads_per_shard) for p in parts]
        out[name] = torch.cat(parts, dim=dim) if tp_size > 1 else parts[0].clone()
    return out


def read_full(iter_dir: str, num_attention_heads: int, *, args: Optional[dict] = None, optimizer: bool = False,
              needs: Optional[Callable[[int, int], bool]] = None) -> FullRead:
    """The rank files of `iter_dir` -> full canonical tensors. `needs(tp, pp)`: whether the
    reading rank takes anything of saved rank (tp, pp)'s file; only those files are opened
    (default: all). `optimizer`: the Adam state too (adam_state.rank_moments)."""
    files = rank_files(iter_dir)
    tp_size, pp_size = grid_size(files)
    if num_attention_heads % tp_size:
        raise CheckpointError(f"{iter_dir} was saved at TP {tp_size}, which does not divide its "
                              f"{num_attention_heads} attention heads: check --num-attention-heads")
    counts = stage_layer_counts(files, args or {})
    read = FullRead(weights={}, moments={k: {} for k in adam_state.MOMENTS} if optimizer else None)
    steps: set = set()
    offset = 0
    for pp in range(pp_size):
        tps = [tp for tp in range(tp_size) if needs is None or needs(tp, pp)]
        if not tps:
            offset += counts[pp]
            continue
        payloads = {tp: _load(files[(tp, pp)]) for tp in tps}
        models = {tp: flatten(p["model"]) for tp, p in payloads.items()}
        version = float(payloads[tps[0]].get("checkpoint_version", 0))
        legacy = names.is_legacy(models[tps[0]])
        merge = lambda shards: _merge(shards, tp_size, offset, version, num_attention_heads // tp_size, legacy)  # noqa
        for name, t in merge(models).items():
            read.weights.setdefault(name, t)  # the first stage's word embeddings win over the last's copy
        if read.moments is not None and read.note is None:
            ranks = {tp: adam_state.rank_moments(payloads[tp], models[tp]) for tp in tps}
            refused = next(((tp, r.note) for tp, r in ranks.items() if r.note), None)
            if refused is not None:
                path = files[(refused[0], pp)]
                if os.path.isfile(os.path.join(os.path.dirname(path), DISTRIB_OPTIM)):
                    read.note = (f"{path}: its optimizer state was saved by Megatron's distributed optimizer "
                                 f"({DISTRIB_OPTIM}, laid out by its gradient buckets), which megabert does not read")
                else:
                    read.note = f"{path}: {refused[1]}"
            else:
                for kind in adam_state.MOMENTS:
                    for name, t in merge({tp: {k: m[kind] for k, m in r.moments.items()}
                                          for tp, r in ranks.items()}).items():
                        read.moments[kind].setdefault(name, t)
                if all(r.masters for r in ranks.values()):
                    for name, t in merge({tp: r.masters for tp, r in ranks.items()}).items():
                        read.masters.setdefault(name, t)
                steps |= {r.step for r in ranks.values()}
        offset += counts[pp]
    if read.moments is not None and read.note is None:
        if len(steps) != 1:
            read.note = f"its rank files were stepped different numbers of times ({sorted(steps)})"
        else:
            read.step = steps.pop()
    if read.note is not None:
        read.moments, read.masters = None, {}
    return read


def full_shapes(iter_dir: str) -> dict[str, tuple]:
    """Canonical name -> full shape, from the TP-rank-0 file of each stage (memory-mapped:
    no tensor is read)."""
    files = rank_files(iter_dir)
    tp_size, pp_size = grid_size(files)
    shapes: dict[str, tuple] = {}
    offset = 0
    for pp in range(pp_size):
        model = flatten(checked_rank_file(files[(0, pp)])["model"])
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
