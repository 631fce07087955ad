"""megatron-core's `torch_dist` format, read with torch.distributed.checkpoint alone.

    ITER/.metadata  ITER/__R_I.distcp  ITER/common.pt  ITER/metadata.json

The `.distcp` files hold each tensor at its global shape; the transformer layers are stacked
(`encoder.layers.self_attention.linear_qkv.weight` is [L, 3h, h], QKV rows in version-2.0
order over all heads) and the per-layer LayerNorms sit under their fused names whatever
spec saved them. torch's FileSystemReader reads `.metadata` with a bare `pickle.load`, so it
is read here with safe_load's allow-list instead; `common.pt` (args, iteration) through
safe_load too. megatron is never imported.
"""
from __future__ import annotations

import json
import os
import warnings

import torch

from megabert.checkpoint.megatron import names
from megabert.checkpoint.megatron.safe_load import foreign_to_plain, load_dcp_metadata, safe_torch_load
from megabert.errors import CheckpointError

METADATA = ".metadata"


def is_dist_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA)) and (
        os.path.isfile(os.path.join(path, "common.pt")) or os.path.isfile(os.path.join(path, "metadata.json")))


# NOTE: torch.distributed.checkpoint is imported where a torch_dist directory is read, not at
# module import: it pulls in DTensor and sympy, 1.2 s added to every process that imports
# megabert (every rank of every run), most of which never meet a torch_dist directory.
def _safe_reader(iter_dir: str):
    """torch's FileSystemReader whose `.metadata` goes through megabert's allow-listed unpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = load_dcp_metadata(os.path.join(self.path, METADATA))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

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
    common = foreign_to_plain(safe_torch_load(common_path, mmap=False)) if os.path.isfile(common_path) else {}
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = load_dcp_metadata(os.path.join(iter_dir, METADATA))
    shapes = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items()
              if isinstance(v, TensorStorageMetadata)}
    return {"args": common.get("args") or {}, "checkpoint_version": float(common.get("checkpoint_version", 3.0)),
            "iteration": int(common.get("iteration", 0) or 0), "shapes": shapes}


def read_full(iter_dir: str) -> dict[str, torch.Tensor]:
    """The full canonical state dict (vocab rows as saved) of a torch_dist directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = load_dcp_metadata(os.path.join(iter_dir, METADATA))
    stored = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
              for k, v in metadata.state_dict_metadata.items()
              if isinstance(v, TensorStorageMetadata) and names.canonical_name(k) is not None}
    # Tensors only: DCP's default planner would torch.load(weights_only=False) a byte item
    # (megatron-core's `_extra_state` objects), so none is ever asked for.
    # no_dist: each process reads on its own, inside a distributed run or outside one (torch
    # warns about that choice when no process group exists; it is the intended one).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(stored, storage_reader=_safe_reader(iter_dir), no_dist=True)
    full: dict[str, torch.Tensor] = {}
    for key, t in stored.items():
        if key.startswith(("encoder.layers.", "decoder.layers.")) and not key.split(".")[2].isdigit():
            rest = key.split(".", 2)[2]
            for i in range(t.size(0)):  # stacked [L, ...]
                full[names.canonical_name(f"encoder.layers.{i}.{rest}")] = t[i].clone()
        else:
            full[names.canonical_name(key)] = t
    return full
