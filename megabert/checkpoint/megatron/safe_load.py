"""Loading Megatron's pickles without letting them choose what runs.

A Megatron-LM `model_optim_rng.pt` (and a `torch_dist` directory's `common.pt`) pickles more
than tensors: `args` is an `argparse.Namespace` whose fields hold megatron enums
(`AttnBackend`, `ModelType`, ...), `rng_state` holds numpy's generator state, and some
versions pickle their own classes into a `torch_dist` directory's `.metadata`. None of
these may be imported or called on load: a checkpoint a user downloaded would choose code.

So every global a file names that torch's weights-only unpickler does not already allow
becomes an inert `ForeignObject` subclass registered under that exact name: constructing or
restoring one only records its arguments and state. Nothing is imported (megatron need not
be installed) and `torch.load` keeps `weights_only=True`. `foreign_to_plain` turns what
was read into dicts and plain values (an `argparse.Namespace` -> its fields, an enum ->
its value).
"""
from __future__ import annotations

import argparse
import enum
import io
import pickle
from typing import Any

import torch

from megabert.errors import CheckpointError


class ForeignObject:
    """Stands in for a class a checkpoint names but megabert does not trust: it keeps the
    constructor arguments (`args`) and the restored state (`state`), and does nothing."""

    qualified_name = "?"

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.qualified_name} {self.args or ''}{self.state if self.state is not None else ''}>"


def _stub(qualified_name: str) -> type:
    return type(qualified_name.rsplit(".", 1)[-1], (ForeignObject,), {"qualified_name": qualified_name})


def safe_torch_load(path: str, *, mmap: bool = True) -> Any:
    """torch.load(weights_only=True) of `path`, each global torch does not allow replaced by
    a ForeignObject stub of that name (see the module docstring)."""
    try:
        foreign = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (ValueError, RuntimeError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"{path} is not a file torch.save wrote ({e}); is the checkpoint complete?") from e
    stubs = [(_stub(name), name) for name in foreign]
    with torch.serialization.safe_globals(stubs):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


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

_DCP_MODULES = ("torch.distributed.checkpoint.",)
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)
_PLAIN = {("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"), ("builtins", "frozenset"),
          ("builtins", "slice"), ("builtins", "complex"), ("builtins", "bytearray"),
          ("torch.serialization", "_get_layout")}  # "torch.strided" -> torch.strided, nothing else


class _MetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint's FileSystemReader reads `.metadata` with a bare
    `pickle.load`; this reads it with an allow-list instead: DCP's own metadata dataclasses,
    torch.Size and dtypes, a few builtins; any other class (megatron-core 0.15 pickled its
    MCoreMetadata there) becomes a ForeignObject stub."""

    def find_class(self, module: str, name: str):
        if (module, name) in _PLAIN:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return getattr(torch, name)
        if module.startswith(_DCP_MODULES):
            found = super().find_class(module, name)
            if isinstance(found, type):  # classes only: nothing callable with effects
                return found
        return _stub(f"{module}.{name}")


def load_dcp_metadata(path: str):
    with open(path, "rb") as f:
        return _MetadataUnpickler(io.BytesIO(f.read())).load()
