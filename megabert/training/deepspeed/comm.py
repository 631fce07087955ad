"""DeepSpeed's collectives, counted in megabert's communication ledger as `zero`.

ZeRO's traffic never passes through megabert's door (megabert.parallel.comm): DeepSpeed
calls `deepspeed.comm`, whose module functions forward every op to one backend object,
`deepspeed.comm.comm.cdb` (a TorchBackend over our process groups). Wrapping that object
counts every op DeepSpeed issues (ZeRO's reduce-scatters, per-partition reduces and
all-gathers, its all-reduces, the norm) in the active ledger, with the same per-op
factors as megabert's own (megabert.parallel.comm.sent_bytes), then forwards the call.

Why not DeepSpeed's comms logger (`comms_logger` in the config): it synchronises the
device after every op to time it (not cheap, not on by default), and records op and
message size but not the group. The wrapper reads sizes only.

NOTE: `cdb` is a private module global of deepspeed.comm; checked on the versions
megabert.training.deepspeed.version knows (0.19). On another version nothing is wrapped
and DeepSpeed's traffic is simply not counted (one warning, from the version guard).
"""
from __future__ import annotations

from typing import Callable

import torch

from megabert.parallel import comm


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# TorchBackend method -> (ledger op, the bytes of the buffer that op's factor applies to).
# Positional and keyword arguments are both accepted: deepspeed.comm passes either.
_SIZES: dict[str, tuple[str, Callable[[tuple, dict], int]]] = {}


def _arg(args: tuple, kwargs: dict, i: int, name: str):
    return args[i] if len(args) > i else kwargs[name]


def _counted(method: str, op: str, size: Callable[[tuple, dict], int]) -> None:
    _SIZES[method] = (op, size)


_counted("all_reduce", "all_reduce", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")))
_counted("inference_all_reduce", "all_reduce", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")))
_counted("all_reduce_coalesced", "all_reduce", lambda a, k: sum(_nbytes(t) for t in _arg(a, k, 0, "tensors")))
_counted("reduce", "reduce", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")))
_counted("reduce_scatter", "reduce_scatter", lambda a, k: sum(_nbytes(t) for t in _arg(a, k, 1, "input_list")))
_counted("reduce_scatter_tensor", "reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input_tensor")))
_counted("all_gather", "all_gather", lambda a, k: sum(_nbytes(t) for t in _arg(a, k, 0, "tensor_list")))
_counted("all_gather_into_tensor", "all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")))
_counted("all_gather_base", "all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")))
_counted("all_gather_coalesced", "all_gather", lambda a, k: sum(_nbytes(t) for t in _arg(a, k, 0, "output_tensors")))
_counted("all_to_all_single", "all_to_all", lambda a, k: _nbytes(_arg(a, k, 1, "input")))
_counted("broadcast", "broadcast", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")))
_counted("send", "send", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")))
_counted("isend", "send", lambda a, k: _nbytes(_arg(a, k, 0, "tensor")))


class CountingBackend:
    """Stands in for deepspeed.comm's backend: counts, then forwards (everything else is
    the wrapped backend's own attribute)."""

    def __init__(self, backend):
        self._backend = backend

    def __getattr__(self, name: str):
        target = getattr(self._backend, name)
        counted = _SIZES.get(name)
        if counted is None:
            return target
        op, size = counted

        def call(*args, **kwargs):
            ledger = comm.active_ledger()
            if ledger is not None:
                group = kwargs.get("group", args[_GROUP_POS[name]] if len(args) > _GROUP_POS[name] else None)
                if op != "broadcast" or _arg(args, kwargs, 1, "src") == self._backend.get_rank():
                    ledger.add("zero", op, size(args, kwargs), self._backend.get_world_size(group))
            return target(*args, **kwargs)

        return call


# Position of `group` in each method's positional arguments (TorchBackend's signatures).
_GROUP_POS = {"all_reduce": 2, "inference_all_reduce": 2, "all_reduce_coalesced": 2, "reduce": 3,
              "reduce_scatter": 3, "reduce_scatter_tensor": 3, "all_gather": 2, "all_gather_into_tensor": 2,
              "all_gather_base": 2, "all_gather_coalesced": 2, "all_to_all_single": 4, "broadcast": 2, "send": 2,
              "isend": 2}


def count_deepspeed_comm() -> bool:
    """Wraps deepspeed.comm's backend (once per process); False where it cannot."""
    from deepspeed.comm import comm as ds_comm

    from megabert.training.deepspeed.version import private_patches_allowed

    backend = getattr(ds_comm, "cdb", None)
    if backend is None or not private_patches_allowed():
        return False
    if not isinstance(backend, CountingBackend):
        ds_comm.cdb = CountingBackend(backend)
    return True
