"""DeepSpeed's collectives behind megabert's door: counted in the communication ledger as
`zero`, a lost peer worded as one line, groups it makes on the run's timeout.

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
megabert.training.deepspeed.version knows (0.19). On another version nothing is wrapped:
DeepSpeed's traffic is not counted and its lost peers are not worded (one warning, from the
version guard); our groups, which it uses through `mpu`, keep the run's timeout all the same.
"""
from __future__ import annotations

import datetime
from typing import Callable, Optional

import torch

from megabert.parallel import comm
from megabert.parallel.failures import GuardedWork, guarded


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


class DoorBackend:
    """Stands in for deepspeed.comm's backend, as megabert's door (megabert.parallel.comm)
    stands before torch.distributed: counts each op in the active ledger, words a lost peer
    as one line (megabert.parallel.failures; an async op's handle too), and gives a group
    DeepSpeed creates itself the run's timeout (TorchBackend.new_group passes none: gloo's
    30 minutes). Everything else is the wrapped backend's own attribute."""

    def __init__(self, backend, timeout: Optional[datetime.timedelta]):
        self._backend, self._timeout = backend, timeout

    def new_group(self, ranks):
        # NOTE: with our mpu, DeepSpeed 0.19 makes no group of its own for dense models
        # (checked at ZeRO 1-3, TP and PP 2): this is for the paths that do (MoE, ZeRO++).
        return torch.distributed.new_group(ranks, timeout=self._timeout, group_desc="deepspeed")

    def __getattr__(self, name: str):
        target = getattr(self._backend, name)
        if name not in _GROUP_POS:
            return target
        counted = _SIZES.get(name)

        def call(*args, **kwargs):
            pos = _GROUP_POS[name]
            group = kwargs["group"] if "group" in kwargs else (args[pos] if len(args) > pos else None)
            ledger = comm.active_ledger()
            if ledger is not None and counted is not None:
                op, size = counted
                if op != "broadcast" or _arg(args, kwargs, 1, "src") == self._backend.get_rank():
                    ledger.add("zero", op, size(args, kwargs), self._backend.get_world_size(group))
            peer = _peer(name, args, kwargs)
            with guarded(group, name, peer):
                out = target(*args, **kwargs)
            return GuardedWork(out, group, name, peer) if isinstance(out, torch.distributed.Work) else out

        return call


def _peer(name: str, args: tuple, kwargs: dict) -> Optional[int]:
    """The other end of a transfer (a global rank), or None for a collective."""
    if name in ("send", "isend"):
        return _arg(args, kwargs, 1, "dst")
    if name in ("recv", "irecv") and (len(args) > 1 or kwargs.get("src") is not None):
        return _arg(args, kwargs, 1, "src")
    return None


# Position of `group` in each method's positional arguments (TorchBackend's signatures):
# the ops the door wraps.
_GROUP_POS = {"all_reduce": 2, "inference_all_reduce": 2, "all_reduce_coalesced": 2, "reduce": 3,
              "reduce_scatter": 3, "reduce_scatter_tensor": 3, "all_gather": 2, "all_gather_into_tensor": 2,
              "all_gather_base": 2, "all_gather_coalesced": 2, "all_to_all_single": 4, "broadcast": 2, "send": 2,
              "isend": 2, "recv": 2, "irecv": 2, "broadcast_object_list": 2, "all_gather_object": 2,
              "all_to_all": 2, "gather": 3, "scatter": 3, "barrier": 0, "monitored_barrier": 0}


def guard_deepspeed_comm(timeout: datetime.timedelta) -> bool:
    """Starts deepspeed.comm over our process groups (what deepspeed.initialize does first)
    and puts its backend behind the door; False where the version guard forbids the
    private patch (DeepSpeed's traffic is then not counted, its lost peers end in its own
    tracebacks, and a group it made itself would wait 30 minutes)."""
    import deepspeed.comm
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm import comm as ds_comm

    from megabert.training.deepspeed.version import private_patches_allowed

    # As deepspeed.initialize calls it (which then finds it done), with our timeout.
    deepspeed.comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                                    dist_init_required=False, timeout=timeout, verbose=False)
    backend = ds_comm.cdb  # a module global, None until init_distributed (0.19)
    if backend is None or not private_patches_allowed():
        return False
    if isinstance(backend, DoorBackend):  # a later run in this process: its own timeout
        backend = backend._backend
    ds_comm.cdb = DoorBackend(backend, timeout)
    return True
