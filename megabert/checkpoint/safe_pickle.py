"""Reading pickled files from outside without letting them choose what runs.

A pickle names the globals it wants by (module, qualified name) and calls what it gets back.
Every pickle megabert reads from outside (a Megatron rank file, a `torch_dist` `.metadata`
or `common.pt` or `.distcp` item, a Hugging Face `pytorch_model.bin`, megabert's own
checkpoints) goes through `Restricted`'s `find_class`, which looks the pair up in an
explicit table of exact pairs and never imports or walks anything the file names:

- `resolved`: the objects megabert imported itself (tensor rebuild helpers, dtypes,
  `torch.Size`, `OrderedDict`, DCP's metadata dataclasses, ...): a name is found only as
  written, so `("torch.distributed.checkpoint.filesystem", "operator.methodcaller")` (a dotted
  name, allowed from pickle protocol 4) or a class a module merely imports finds nothing;
- `inert`: names a genuine file of that kind holds but megabert does not need to run (Megatron's
  enums, numpy's RNG state arrays): each becomes a `ForeignObject` stub that only records its
  arguments and state, without importing anything;
- anything else: the file is refused with one line naming the global (RefusedFileError).

torch.load does the rest (storages, zip and pre-1.6 legacy formats, mmap) through its public
`pickle_module` argument with this unpickler in place of pickle's: torch's own weights-only
unpickler is not used, so neither its table (which differs by torch version) nor its advice to
retry with `weights_only=False` reaches a user holding a hostile file.
"""
from __future__ import annotations

import collections
import io
import pickle
import types
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Mapping, Union

import torch

from megabert.errors import CheckpointError, RefusedFileError


class ForeignObject:
    """Stands in for a class a checkpoint names but megabert does not run: it keeps the
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


def stub(qualified_name: str) -> type:
    return type(qualified_name.rsplit(".", 1)[-1], (ForeignObject,), {"qualified_name": qualified_name})


# ---------------------------------------------------------------- what a tensor file may name

class _Refused(Exception):
    """Raised inside the unpickler; load() turns it into a RefusedFileError naming the file."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


def _hooks_free(hooks: Any, what: str) -> None:
    if hooks:  # torch.save writes an empty OrderedDict; a hook would run on backward
        raise _Refused(f"backward hooks on a tensor ({what})")


def _tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
    _hooks_free(backward_hooks, "torch._utils._rebuild_tensor_v2")
    return torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
                                           collections.OrderedDict(), metadata)


def _tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    _hooks_free(backward_hooks, "torch._utils._rebuild_tensor_v3")
    return torch._utils._rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad,
                                           collections.OrderedDict(), dtype, metadata)


def _parameter(data, requires_grad, backward_hooks):
    _hooks_free(backward_hooks, "torch._utils._rebuild_parameter")
    return torch.nn.Parameter(_as_tensor(data), requires_grad)


def _parameter_with_state(data, requires_grad, backward_hooks, state):
    _hooks_free(backward_hooks, "torch._utils._rebuild_parameter_with_state")
    return _with_state(torch.nn.Parameter(_as_tensor(data), requires_grad), state)


def _from_type_v2(func, new_type, args, state):
    """torch._tensor._rebuild_from_type_v2 (a tensor that had a __dict__, or a subclass), for
    the rebuild helpers and tensor types of this table only."""
    if func not in _REBUILD_FUNCS or new_type not in (torch.Tensor, torch.nn.Parameter):
        # Whatever the file names: a callable or type, or any other object a pickle can hold.
        raise _Refused(f"torch._tensor._rebuild_from_type_v2 of {getattr(func, '__qualname__', type(func).__name__)}"
                       f" -> {getattr(new_type, '__qualname__', type(new_type).__name__)}")
    t = func(*args)
    if type(t) is not new_type:
        t = t.as_subclass(new_type)
    return _with_state(t, state)


def _as_tensor(data):
    if not isinstance(data, torch.Tensor):
        raise _Refused(f"a {type(data).__name__} where a parameter's tensor belongs")
    return data


def _with_state(t: torch.Tensor, state: Any) -> torch.Tensor:
    """Attributes Megatron sets on its parameters (`tensor_model_parallel`, ...): plain names
    and values only; never a dunder (which would reach the tensor's type)."""
    if isinstance(state, tuple):  # (dict state, slots state)
        state = {k: v for part in state if part for k, v in part.items()}
    if not state:
        return t
    if not isinstance(state, dict) or any(not isinstance(k, str) or k.startswith("_") for k in state):
        raise _Refused("attributes on a tensor that no checkpoint sets")
    for k, v in state.items():
        setattr(t, k, v)
    return t


_REBUILD_FUNCS = {torch._utils._rebuild_tensor, _tensor_v2, _tensor_v3, _parameter, _parameter_with_state}

DTYPE_NAMES = ("float32", "float", "float64", "double", "float16", "half", "bfloat16", "complex64", "complex128",
               "cfloat", "cdouble", "int64", "long", "int32", "int", "int16", "short", "int8", "uint8", "bool",
               "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")

#: Builtin constructors of plain values (protocol 2 pickles a set as `set([...])`, bytes as
#: `_codecs.encode(str, "latin1")`).
PLAIN: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict, ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice, ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray, ("_codecs", "encode"): lambda s, enc="utf-8": _encode(s, enc),
}


def _encode(s: Any, encoding: str) -> bytes:
    if not isinstance(s, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8", "ascii"):
        raise _Refused("_codecs.encode of something other than text")
    return s.encode(encoding)


#: Plain values beside tensors: sizes, devices, dtypes, layouts, memory formats.
VALUES: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size, ("torch", "device"): torch.device,
    ("torch.serialization", "_get_layout"): lambda name: _layout(name),
    # The dtypes this torch has (a newer torch's names may be missing from an older one).
    **{("torch", n): getattr(torch, n) for n in DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)},
    **{("torch", n): getattr(torch, n) for n in ("contiguous_format", "channels_last", "preserve_format")},
    **PLAIN,
}

#: torch.save's own globals for tensors and Parameters (storages are resolved by torch.load
#: itself, by name, to inert StorageType descriptors), and VALUES.
TENSORS: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v2"): _tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _parameter_with_state,
    ("torch._tensor", "_rebuild_from_type_v2"): _from_type_v2,
    ("torch", "Tensor"): torch.Tensor, ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    **VALUES,
}


def _layout(name: Any) -> torch.layout:
    layouts = {"torch.strided": torch.strided, "torch.sparse_coo": torch.sparse_coo}
    if name not in layouts:
        raise _Refused(f"torch.serialization._get_layout({str(name)[:40]!r})")
    return layouts[name]


@dataclass(frozen=True)
class Allowed:
    """What a file of one kind may name: `resolved` exact (module, name) pairs -> objects,
    `inert(module, name)` -> whether that name becomes a ForeignObject stub. `kind` is what the
    refusal says no file of this kind holds ("a Megatron-LM checkpoint")."""

    kind: str
    resolved: Mapping[tuple[str, str], Any]
    inert: Callable[[str, str], bool] = field(default=lambda module, name: False)


def _printable(module: Any, name: Any) -> str:
    """The global as the refusal shows it: escaped to one printable line and kept short (the
    file chose these strings)."""
    text = f"{module}.{name}" if isinstance(module, str) and isinstance(name, str) else f"{module!r}, {name!r}"
    text = text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= 120 else text[:117] + "..."


def _identifier(name: str) -> bool:
    return all(part.isidentifier() for part in name.split("."))


def unpickler_class(allowed: Allowed) -> type:
    """A pickle.Unpickler whose find_class resolves `allowed` only (see the module docstring)."""
    stubs: dict[tuple[str, str], type] = {}

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            key = (module, name)
            if type(module) is not str or type(name) is not str:
                raise _Refused(_printable(module, name))
            if key in allowed.resolved:
                return allowed.resolved[key]
            # A stub resolves nothing, but its name must still be a plain one: a dotted qualified
            # name is exactly how a pickle walks attributes.
            if _identifier(module) and name.isidentifier() and allowed.inert(module, name):
                if key not in stubs:
                    stubs[key] = stub(f"{module}.{name}")
                return stubs[key]
            raise _Refused(_printable(module, name))

    return Restricted


def _pickle_module(allowed: Allowed) -> types.ModuleType:
    """The `pickle_module` torch.load takes: its Unpickler and load (torch's legacy format reads
    a header of plain pickles with load) both restricted."""
    module = types.ModuleType("megabert_restricted_pickle")
    module.Unpickler = unpickler_class(allowed)
    module.load = lambda f, **kwargs: module.Unpickler(f, **kwargs).load()
    return module


class _Stream:
    """A file object without fileno(): torch's legacy reader then reads through read/readinto and
    never tries its pre-0.4 tar format, which extracts members into a temporary directory."""

    def __init__(self, f: BinaryIO):
        self._f = f

    def read(self, n: int = -1) -> bytes:
        return self._f.read(n)

    def readinto(self, b) -> int:
        return self._f.readinto(b)

    def readline(self, n: int = -1) -> bytes:
        return self._f.readline(n)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def seekable(self) -> bool:
        return True


def describe(e: BaseException) -> str:
    """An error's own first line for a one-line message, kept short, and never torch's advice
    about `weights_only` (which, for a file that may be hostile, must not reach the user)."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if "weights_only" in text or "weights-only" in text:
        text = type(e).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def type_name(value: Any) -> str:
    """What a value is, for a refusal: a stub by the name the file gave it."""
    if isinstance(value, ForeignObject):
        return value.qualified_name
    return f"{type(value).__module__}.{type(value).__qualname__}"


def wrong_type(name: str, value: Any, expected: str, kind: str) -> RefusedFileError:
    """A file whose content is not of the type a file of its kind holds there."""
    return RefusedFileError(f"{name}: refused: it holds a {type_name(value)} where {expected} belongs, which no "
                            f"{kind} holds (damaged, or not such a file)")


def refusal(name: str, what: str, kind: str) -> RefusedFileError:
    return RefusedFileError(f"{name}: refused: it names {what}, which no {kind} holds (nothing in it was run; "
                            f"get the file again from its source)")


def _is_zip(f: BinaryIO) -> bool:
    """torch's own test (a zip local-file header first), so torch.load takes the same branch."""
    pos = f.tell()
    magic = f.read(4)
    f.seek(pos)
    return magic == b"PK\x03\x04"


def load(source: Union[str, BinaryIO], allowed: Allowed, *, mmap: bool = True, name: str | None = None) -> Any:
    """torch.load of `source` (a path or a seekable binary file; `name` says which in errors)
    through `allowed`, on the CPU: zip files memory-mapped when `mmap` and a path, the pre-1.6
    legacy format read whole. RefusedFileError when it names anything else; CheckpointError
    when it is not a file torch.save wrote."""
    name = name or (source if isinstance(source, str) else "<stream>")
    module = _pickle_module(allowed)
    try:
        if isinstance(source, str):
            with open(source, "rb") as f:
                if _is_zip(f):
                    return torch.load(source, map_location="cpu", pickle_module=module, weights_only=False, mmap=mmap)
                return torch.load(_Stream(f), map_location="cpu", pickle_module=module, weights_only=False)
        return torch.load(source if _is_zip(source) else _Stream(source), map_location="cpu", pickle_module=module,
                          weights_only=False)
    except _Refused as e:
        raise refusal(name, e.what, allowed.kind) from None
    except MemoryError:
        raise CheckpointError(f"{name} asks for more memory than there is: damaged, or not a file torch.save "
                              f"wrote") from None
    except (OSError, EOFError) as e:
        raise CheckpointError(f"cannot read {name}: {describe(e)}; is the file complete?") from None
    except Exception as e:  # anything a malformed pickle makes torch or pickle raise: one line
        raise CheckpointError(f"{name} is not a file torch.save wrote, or is damaged ({describe(e)})") from None


def loads(data: bytes, allowed: Allowed, *, name: str, what: str) -> Any:
    """A plain pickle (no tensors: DCP's `.metadata`) through `allowed`; `what` it should be, for
    the line a malformed one ends in."""
    try:
        return unpickler_class(allowed)(io.BytesIO(data)).load()
    except _Refused as e:
        raise refusal(name, e.what, allowed.kind) from None
    except Exception as e:  # a malformed pickle: one line
        raise CheckpointError(f"{name} is not {what}, or is damaged ({describe(e)})") from None


def load_bytes(blob: bytes, allowed: Allowed, *, name: str) -> Any:
    return load(io.BytesIO(blob), allowed, mmap=False, name=name)
