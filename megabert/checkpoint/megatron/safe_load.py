"""Loading Megatron's pickles without letting them choose what runs (checkpoint/safe_pickle).

A Megatron-LM `model_optim_rng.pt` (and a `torch_dist` directory's `common.pt`) pickles more
than tensors: `args` is an `argparse.Namespace` whose fields hold megatron enums
(`AttnBackend`, `ModelType`, ...), `rng_state` holds numpy's generator state, and some
versions pickle their own classes into a `torch_dist` directory's `.metadata`. None of
these may be imported or called on load: a checkpoint a user downloaded would choose code.

So a Megatron file may name torch.save's tensor globals (safe_pickle.TENSORS) and, as inert
ForeignObject stubs, what megatron-core itself lists as the non-tensor content of its files
(`megatron/core/safe_globals.py`: Namespace, SimpleNamespace, PosixPath, BytesIO, numpy's
array reconstruction) and megatron's own classes by plain name; anything else refuses the
file. `.metadata` resolves DCP's metadata dataclasses, each by its exact name. Nothing is
imported from what a file names (megatron need not be installed). `foreign_to_plain` turns
what was read into dicts and plain values (a Namespace -> its fields, an enum -> its value).
"""
from __future__ import annotations

import argparse
import enum
import functools
import os
from typing import Any

from megabert.checkpoint.safe_pickle import TENSORS, VALUES, Allowed, ForeignObject, load, loads, wrong_type
from megabert.errors import CheckpointError, RefusedFileError

KIND = "checkpoint"  # the rank-file layout is megabert's too: _format reads its rank-0 file first

_INERT = {("argparse", "Namespace"), ("types", "SimpleNamespace"), ("io", "BytesIO"), ("_io", "BytesIO"),
          ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
          ("pathlib", "PureWindowsPath"), ("numpy", "ndarray"), ("numpy", "dtype"),
          ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
          ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
          # 2019-2020 Megatron-LM kept its fp16 package at the top level; its optimizer state
          # pickled the loss scaler object (Megatron's loader aliases the module to read them).
          ("fp16.loss_scaler", "LossScaler"), ("fp16.loss_scaler", "DynamicLossScaler")}


def _megatron_inert(module: str, name: str) -> bool:
    """Recorded, never run: megatron-core's listed non-tensor content, numpy's dtype classes
    (`numpy.dtypes.UInt32DType`) and megatron's own classes (its enums in `args`)."""
    return ((module, name) in _INERT or module == "megatron" or module.startswith("megatron.")
            or (module == "numpy.dtypes" and name.endswith("DType")))


MEGATRON = Allowed(KIND, TENSORS, _megatron_inert)


def safe_torch_load(path: str, *, mmap: bool = True) -> Any:
    """A Megatron `.pt` file (zip or pre-1.6 format) read through MEGATRON: RefusedFileError
    for anything else it names, CheckpointError when it is no torch.save file."""
    return load(path, MEGATRON, mmap=mmap)


def load_dict(path: str, *, mmap: bool = True) -> dict:
    """safe_torch_load of a file that must hold a dict (a rank file, `common.pt`)."""
    payload = safe_torch_load(path, mmap=mmap)
    if not isinstance(payload, dict):
        raise wrong_type(path, payload, "the dict Megatron saves", KIND)
    return payload


def plain_args(payload: dict, path: str) -> dict:
    """The `args` entry of a rank file or `common.pt` as a plain dict ({} when absent)."""
    args = payload.get("args")
    if args is None:
        return {}
    try:
        plain = foreign_to_plain(args)
    except RecursionError:  # nested deeper than any Namespace Megatron writes
        plain = None
    if not isinstance(plain, dict) or not all(isinstance(k, str) for k in plain):
        raise wrong_type(path, args, "args (the argparse.Namespace Megatron saves)", KIND)
    for name, value in plain.items():
        kinds = _ARG_TYPES.get(name)
        if value is not None and kinds is not None and (not isinstance(value, kinds) or (
                isinstance(value, bool) and bool not in kinds)):
            raise wrong_type(path, value, f"args.{name} ({' or '.join(k.__name__ for k in kinds)})", KIND)
    return plain


# The types Megatron gives the args megabert reads (None: unset); a file with others is malformed.
_INT = (int,)
_NUMBER = (int, float)
_ARG_TYPES: dict[str, tuple] = {
    **{n: _INT for n in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                         "max_position_embeddings", "vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by",
                         "tensor_model_parallel_size", "pipeline_model_parallel_size", "seq_length",
                         "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                         "consumed_train_samples",
                         "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")},
    **{n: _NUMBER for n in ("layernorm_epsilon", "hidden_dropout", "attention_dropout", "init_method_std",
                            "adam_beta1", "adam_beta2", "adam_eps", "weight_decay")},
    **{n: (str,) for n in ("normalization", "position_embedding_type", "optimizer")},
    **{n: (bool,) for n in ("swiglu", "group_query_attention", "add_bias_linear", "openai_gelu",
                            "untie_embeddings_and_output_weights", "apply_residual_connection_post_layernorm",
                            "decoupled_weight_decay")},
}


def number(payload: dict, key: str, default: float, path: str) -> float:
    """`checkpoint_version` / `iteration` of a rank file: a number, else the one-line refusal."""
    value = payload.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise wrong_type(path, value, f"'{key}' (a number)", KIND)
    return value


def foreign_to_plain(value: Any) -> Any:
    """What safe_torch_load read, with stubs turned into plain values: an object with a
    dict state (argparse.Namespace, a dataclass) -> that dict; an enum (one constructor
    argument) -> the argument; anything else -> its repr."""
    # Classes something else in this process allow-listed (megatron-core registers argparse.Namespace
    # and its enums with torch when imported) come back as themselves: made plain the same way.
    if isinstance(value, argparse.Namespace):
        return {k: foreign_to_plain(v) for k, v in vars(value).items()}
    if isinstance(value, enum.Enum):
        return foreign_to_plain(value.value)
    if isinstance(value, ForeignObject):
        if isinstance(value.state, dict):
            return {k: foreign_to_plain(v) for k, v in value.state.items()}
        if len(value.args) == 1 and value.state is None:
            return foreign_to_plain(value.args[0])
        return repr(value)
    if isinstance(value, dict):
        return {k: foreign_to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(foreign_to_plain(v) for v in value)
    return value


# ---------------------------------------------------------------- torch.distributed.checkpoint metadata

DIST_KIND = "torch_dist checkpoint"
_DCP_NAMES = {
    "torch.distributed.checkpoint.metadata": ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.distributed.checkpoint.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
}


@functools.lru_cache(maxsize=1)
def dcp_allowed() -> Allowed:
    """DCP's metadata dataclasses by their exact names (imported here, by megabert: DCP is
    imported only where a torch_dist directory is read), plain values, Megatron's stubs."""
    import importlib

    resolved = dict(VALUES)
    for module_name, names in _DCP_NAMES.items():
        module = importlib.import_module(module_name)
        resolved.update({(module_name, n): getattr(module, n) for n in names if hasattr(module, n)})
    return Allowed(DIST_KIND, resolved, _megatron_inert)


def load_dcp_metadata(path: str):
    """A `.metadata` file, checked: torch's FileSystemReader would `pickle.load` it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    metadata = loads(data, dcp_allowed(), name=path, what="torch.distributed.checkpoint metadata")
    return _checked_metadata(metadata, path)


def _checked_metadata(metadata: Any, path: str):
    """The Metadata, each entry the type DCP's reader relies on (a wrong one would surface as
    an AttributeError deep inside it); storage files inside the checkpoint's directory."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
        MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata)
    import torch

    if (isinstance(metadata, ForeignObject) and isinstance(metadata.state, dict)
            and "state_dict_metadata" in metadata.state):
        # megatron-core 0.15 pickled a subclass of DCP's Metadata (MCoreMetadata): its fields are DCP's.
        state = metadata.state
        metadata = Metadata(state_dict_metadata=state["state_dict_metadata"],
                            planner_data=state.get("planner_data"), storage_data=state.get("storage_data"))
    if not isinstance(metadata, Metadata):
        raise wrong_type(path, metadata, "torch.distributed.checkpoint's Metadata", DIST_KIND)
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        raise wrong_type(path, metadata.storage_meta, "its storage_meta", DIST_KIND)

    def bad(what: Any, where: str):
        return wrong_type(path, what, where, DIST_KIND)

    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise bad(entries, "its state_dict_metadata (a dict)")
    for key, md in entries.items():
        if not isinstance(key, str):
            raise bad(key, "a state dict key (a str)")
        if isinstance(md, BytesStorageMetadata):
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise bad(md, f"the metadata of '{key}'")
        if (not isinstance(md.size, torch.Size) or not isinstance(md.properties, TensorProperties)
                or not isinstance(md.properties.dtype, torch.dtype)):
            raise bad(md.properties if isinstance(md.size, torch.Size) else md.size, f"the size or dtype of '{key}'")
        if not isinstance(md.chunks, list) or not all(
                isinstance(c, ChunkStorageMetadata) and isinstance(c.offsets, torch.Size)
                and isinstance(c.sizes, torch.Size) for c in md.chunks):
            raise bad(md.chunks, f"the chunks of '{key}'")
    storage = metadata.storage_data
    if storage is not None:
        if not isinstance(storage, dict):
            raise bad(storage, "its storage_data (a dict)")
        for index, info in storage.items():
            if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
                raise bad(info if isinstance(index, MetadataIndex) else index, "a storage entry")
            rel = info.relative_path
            if not isinstance(rel, str) or os.path.isabs(rel) or os.sep in rel or "/" in rel or rel in ("", ".", ".."):
                raise RefusedFileError(f"{path}: refused: it points at {str(rel)[:80]!r}, a file outside its "
                                       f"directory, which no {DIST_KIND} does (nothing in it was run)")
            if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (info.offset, info.length)):
                raise bad(info.offset, f"the offset and length of an item in {rel}")
    return metadata

