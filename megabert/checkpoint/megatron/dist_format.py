"""megatron-core's `torch_dist` format, read with torch.distributed.checkpoint alone.

    ITER/.metadata  ITER/__R_I.distcp  ITER/common.pt  ITER/metadata.json

The `.distcp` files hold each tensor at its global shape; the transformer layers are stacked
(`encoder.layers.self_attention.linear_qkv.weight` is [L, 3h, h], QKV rows in version-2.0
order over all heads) and the per-layer LayerNorms sit under their fused names whatever
spec saved them. torch's FileSystemReader reads `.metadata` with a bare `pickle.load`, so it
is read here with safe_load's allow-list instead, and each tensor item of a `.distcp` file
(a torch.save blob) through safe_pickle rather than torch's weights-only unpickler;
`common.pt` (args, iteration) through safe_load too. megatron is never imported.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Callable, Optional

import torch

from megabert.checkpoint.megatron import adam_state, names
from megabert.checkpoint.megatron.torch_format import FullRead
from megabert.checkpoint.megatron.safe_load import (DIST_KIND, foreign_to_plain, load_dcp_metadata, load_dict, number,
    plain_args)
from megabert.checkpoint.safe_pickle import TENSORS, Allowed, describe, load_bytes, wrong_type
from megabert.errors import CheckpointError, MegabertError

_ITEM = Allowed(DIST_KIND, TENSORS)  # a .distcp tensor item: torch.save of one tensor

METADATA = ".metadata"


def is_dist_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA)) and (
        os.path.isfile(os.path.join(path, "common.pt")) or os.path.isfile(os.path.join(path, "metadata.json")))


# NOTE: torch.distributed.checkpoint is imported where a torch_dist directory is read, not at
# module import: it pulls in DTensor and sympy, 1.2 s added to every process that imports
# megabert (every rank of every run), most of which never meet a torch_dist directory.
def _safe_reader(iter_dir: str):
    """torch's FileSystemReader whose `.metadata` goes through megabert's allow-listed unpickler
    and whose tensor items are read with safe_pickle (torch's own read_data torch.loads each
    with its weights-only unpickler, whose refusals advise `weights_only=False`)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = load_dcp_metadata(os.path.join(self.path, METADATA))
            if getattr(metadata, "storage_meta", None) is None:  # torch's Metadata: missing in older files
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan, planner):
            for req in plan.items:
                info = self.storage_data[req.storage_index]  # checked by load_dcp_metadata
                path = os.path.join(iter_dir, info.relative_path)
                what = f"{path} (item '{req.storage_index.fqn}')"
                # transform_descriptors: torch's _StorageInfo has it from 2.6 on
                if req.type == LoadItemType.BYTE_IO or getattr(info, "transform_descriptors", None):
                    raise CheckpointError(f"{what}: a byte or transformed item, which megabert never reads")
                with open(path, "rb") as f:
                    f.seek(info.offset)
                    blob = f.read(info.length)
                tensor = load_bytes(blob, _ITEM, name=what)
                if not isinstance(tensor, torch.Tensor):
                    raise wrong_type(what, tensor, "a tensor", DIST_KIND)
                for dim, (offset, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                    tensor = tensor.narrow(dim, offset, length)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise CheckpointError(f"{what} holds a {tuple(tensor.shape)} slice where its metadata says "
                                          f"{tuple(target.shape)}: damaged")
                target.copy_(tensor)
                planner.commit_tensor(req, target)
            fut: Future = Future()
            fut.set_result(None)
            return fut

    return SafeReader(iter_dir)


def read_header(iter_dir: str) -> dict:
    backend = "torch_dist"
    if os.path.isfile(os.path.join(iter_dir, "metadata.json")):
        with open(os.path.join(iter_dir, "metadata.json")) as f:
            backend = json.load(f).get("sharded_backend", backend)
    if backend != "torch_dist":
        raise CheckpointError(f"{iter_dir} is a megatron-core '{backend}' checkpoint; megabert reads 'torch_dist' "
                              f"and 'torch': convert it with Megatron's tools/checkpoint first")
    common_path = os.path.join(iter_dir, "common.pt")
    common = load_dict(common_path, mmap=False) if os.path.isfile(common_path) else {}
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = load_dcp_metadata(os.path.join(iter_dir, METADATA))
    shapes = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
              if isinstance(v, TensorStorageMetadata)}
    return {"args": plain_args(common, common_path), "shapes": shapes,
            "checkpoint_version": float(number(common, "checkpoint_version", 3.0, common_path)),
            "iteration": int(number(common, "iteration", 0, common_path))}


def _requests(metadata, optimizer: bool, wanted: Optional[Callable[[str], bool]]) -> dict[str, tuple]:
    """{stored key: (offsets, sizes)} of what the reading rank takes: its tensors (and their
    Adam moments), each stacked layer tensor [L, ...] cut to the layers it holds."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    requests = {}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue  # byte items (megatron-core's `_extra_state` objects) are never asked for
        model_key = key
        if key.startswith(adam_state.DIST_PREFIX):
            kind, _, model_key = key[len(adam_state.DIST_PREFIX):].partition(".")
            if not optimizer or kind not in (*adam_state.MOMENTS, "fp32_param"):
                continue
        size = tuple(md.size)
        if _stacked(model_key):
            rest = model_key.split(".", 2)[2]
            layers = [i for i in range(size[0]) if _take(names.canonical_name(f"encoder.layers.{i}.{rest}"), wanted)]
            if layers:
                requests[key] = ((layers[0],) + (0,) * (len(size) - 1), (layers[-1] + 1 - layers[0],) + size[1:])
        elif _take(names.canonical_name(model_key), wanted):
            requests[key] = ((0,) * len(size), size)
    return requests


def _stacked(key: str) -> bool:
    return key.startswith(("encoder.layers.", "decoder.layers.")) and not key.split(".")[2].isdigit()


def _take(canonical: Optional[str], wanted: Optional[Callable[[str], bool]]) -> bool:
    return canonical is not None and (wanted is None or wanted(canonical))


def _load(iter_dir: str, metadata, requests: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """The one place tensors are read from a torch_dist directory: each requested slice,
    through torch.distributed.checkpoint (a planner asking for those slices only)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class SlicePlanner(DefaultLoadPlanner):
        def create_local_plan(self) -> LoadPlan:
            items = []
            for key, (offsets, sizes) in requests.items():
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
            return LoadPlan(items)

        def lookup_tensor(self, index):
            return self.state_dict[index.fqn]  # the slice's own tensor: read items address it from its offsets

    out = {key: torch.empty(sizes, dtype=metadata.state_dict_metadata[key].properties.dtype)
           for key, (_, sizes) in requests.items()}
    # no_dist: each process reads on its own, inside a distributed run or outside one (torch
    # warns about that choice when no process group exists; it is the intended one).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(out, storage_reader=_safe_reader(iter_dir), planner=SlicePlanner(), no_dist=True)
        except CheckpointException as e:  # DCP wraps what its steps raise with their tracebacks
            raise _unwrapped(e, iter_dir) from None
    return out


def _unwrapped(e, iter_dir: str) -> BaseException:
    """A CheckpointException's first MegabertError (SafeReader's one line), else one line of its own."""
    causes = [exc for exc, _ in e.failures.values()]
    return next((c for c in causes if isinstance(c, MegabertError)),
                CheckpointError(f"cannot read {iter_dir}: {describe(causes[0]) if causes else 'DCP load failed'}"))


def read_full(iter_dir: str, *, optimizer: bool = False, wanted: Optional[Callable[[str], bool]] = None
              ) -> FullRead:
    """The canonical tensors (vocab rows as saved) of a torch_dist directory that `wanted`
    (canonical name -> bool; default: all) selects, read as slices: a stacked layer tensor
    only for the wanted layers. `optimizer`: their Adam moments and step too."""
    metadata = load_dcp_metadata(os.path.join(iter_dir, METADATA))
    stored = _load(iter_dir, metadata, _requests(metadata, optimizer, wanted))
    per_kind: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in stored.items():
        kind, model_key = "weights", key
        if key.startswith(adam_state.DIST_PREFIX):
            kind, _, model_key = key[len(adam_state.DIST_PREFIX):].partition(".")
        target = per_kind.setdefault(kind, {})
        if _stacked(model_key):
            rest = model_key.split(".", 2)[2]
            lo = _first_layer(model_key, wanted)
            for i in range(t.size(0)):  # stacked [L, ...]
                target[names.canonical_name(f"encoder.layers.{lo + i}.{rest}")] = t[i].clone()
        else:
            target[names.canonical_name(model_key)] = t
    read = FullRead(weights=per_kind.pop("weights", {}))
    if optimizer:
        read.note = _moments_note(read.weights, per_kind)
        if read.note is None:
            read.moments = {k: per_kind[k] for k in adam_state.MOMENTS}
            read.masters = per_kind.get("fp32_param", {})
            common_path = os.path.join(iter_dir, "common.pt")
            common = load_dict(common_path, mmap=False) if os.path.isfile(common_path) else {}
            try:
                read.step = adam_state.dist_step(foreign_to_plain(common))
            except (AttributeError, TypeError, ValueError):  # not the dicts and number Megatron saves there
                raise wrong_type(common_path, common.get("optimizer"), "the optimizer state Megatron saves",
                                 DIST_KIND) from None
            if read.step is None:
                read.moments, read.masters = None, {}
                read.note = f"{common_path} keeps no optimizer step (optimizer.state.common_step)"
    return read


def _first_layer(model_key: str, wanted: Optional[Callable[[str], bool]]) -> int:
    """The first layer of a stacked tensor that _requests asked for (its slice starts there)."""
    rest = model_key.split(".", 2)[2]
    i = 0
    while not _take(names.canonical_name(f"encoder.layers.{i}.{rest}"), wanted):
        i += 1
    return i


def _moments_note(weights: dict, per_kind: dict) -> Optional[str]:
    if not any(k in per_kind for k in adam_state.MOMENTS):
        return ("it holds no optimizer state under optimizer.state.* (saved with --no-save-optim, or by Megatron's "
                "distributed optimizer, whose sharded layout megabert does not read)")
    for name in weights:
        if names.megabert_name(name) is not None and any(name not in per_kind.get(k, {}) for k in adam_state.MOMENTS):
            return f"its optimizer state has no Adam moments for {name}"
    return None
