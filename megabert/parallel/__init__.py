"""Process groups for tensor, pipeline and data parallelism: the ParallelState built once from
the rank grid (launcher discovery: megabert.launch), the layout arithmetic, ParamSpec, the
communication door and its ledger."""
from __future__ import annotations

import datetime
import logging
from typing import Optional

import torch
import torch.distributed as dist

from megabert.errors import ConfigError
from megabert.launch import LaunchInfo, discover_launch, mpi_rendezvous, rendezvous_store
from megabert.parallel.failures import guarded, rendezvous_failure
from megabert.parallel.state import ParallelState, rank_of

__all__ = ["ParallelState", "LaunchInfo", "init_parallel", "get_parallel_state", "parallel_state_at_entry",
           "destroy_parallel", "discover_launch", "rank_of"]

logger = logging.getLogger(__name__)

# The state made by the last init_parallel(). Only the Python API's doors read it (a model's
# `from_pretrained(path)` or constructor with no `parallel_state`); layers always receive
# their groups explicitly.
_current: Optional[ParallelState] = None


def init_parallel(tensor_parallel_size: int = 1, pipeline_model_parallel_size: int = 1, *,
                  backend: Optional[str] = None, timeout_minutes: float = 10.0) -> ParallelState:
    """Initialises torch.distributed from whatever launched this process and builds the groups.

    Works under every launcher megabert.launch recognises (torchrun, mpirun, srun, ...) and
    as a plain single process. gloo on CPU, nccl on GPU unless `backend` says otherwise. A
    collective that waits longer than `timeout_minutes` for a peer raises a
    CommunicationError instead of hanging: the world group (where this call creates it) and
    every group of the state. A world group the caller made keeps the caller's timeout.
    """
    global _current
    info = discover_launch()
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    backend = backend or ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--distributed-backend nccl needs a GPU; use gloo on CPU")
    if use_cuda:
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(minutes=timeout_minutes)

    if not dist.is_initialized():
        if info.launcher == "single":
            # An in-memory store: a lone process needs no port and cannot collide with others.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            if not (info.launcher in ("openmpi", "mpich") or (info.master_addr and info.master_port)):
                raise ConfigError(f"launched by {info.launcher} but MASTER_ADDR/MASTER_PORT are not set; "
                                  f"export them (the address and a free port of rank 0's host)")
            try:
                if not (info.master_addr and info.master_port):  # MPI: rank 0 publishes an address
                    info, store = mpi_rendezvous(info, timeout)
                else:
                    store = rendezvous_store(info, timeout)
                dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size,
                                        timeout=timeout)
            except dist.DistError as e:  # a rank that never came, an address no one listens on
                where = (f"{info.master_addr}:{info.master_port}" if info.master_addr and info.master_port
                         else "the address rank 0 published over MPI")
                raise rendezvous_failure(e, where, timeout.total_seconds()) from e
    with guarded(None, "new_group"):  # every rank creates every group: a rank lost meanwhile
        state = ParallelState.build(tensor_parallel_size, pipeline_model_parallel_size, device=device,
                                    backend=dist.get_backend(), timeout=timeout, local_rank=info.local_rank,
                                    launcher=info.launcher)
    if state.rank == 0:
        logger.info("megabert: %d processes (%s, %s): tp=%d pp=%d dp=%d", state.world_size, info.launcher,
                    state.backend, state.tp_size, state.pp_size, state.dp_size)
    _current = state
    return state


def get_parallel_state() -> ParallelState:
    """The state of the last init_parallel(); an error when none was made (nothing is
    initialised on first use)."""
    if _current is None:
        raise ConfigError("megabert.init_parallel() was not called: call it first (no arguments for one process, "
                          "or your tensor/pipeline parallel sizes) or pass parallel_state=")
    return _current


def parallel_state_at_entry() -> ParallelState:
    """Where a user enters the Python API with no state (`from_pretrained(path)`): the last
    init_parallel()'s state, else a single process's, initialised here (DESIGN's Python API:
    a plain Python process needs no set-up). Several processes must say their layout."""
    if _current is not None:
        return _current
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ConfigError("torch.distributed is initialised but megabert.init_parallel() was not called; "
                          "call it with your tensor/pipeline parallel sizes first")
    return init_parallel()


def destroy_parallel() -> None:
    global _current
    _current = None
    if dist.is_initialized():
        dist.destroy_process_group()
