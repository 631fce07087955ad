"""Runs a test body in N spawned processes joined by a gloo process group."""
from __future__ import annotations

import gc
import os
import sys
import tempfile
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megabert


def _worker(rank: int, fn: Callable, world_size: int, init_file: str, args: tuple) -> None:
    torch.set_num_threads(1)  # N processes on a 2-core machine: oversubscription only slows them
    os.environ.pop("RANK", None)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    fn(rank, world_size, *args)
    # NOTE: a rank that tears gloo down while its peer is still sending can abort the
    # peer ("terminate called without an active exception"); leave together, drop every
    # reference to the groups (megabert's current ParallelState included) while both ranks
    # are still here, and skip the interpreter's finalisation: a gloo group that survives
    # until then is destroyed among C++ static destructors, and on a loaded machine that
    # aborted a worker after its test body had passed (seen once in CI).
    dist.barrier()
    megabert.destroy_parallel()
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn: Callable, world_size: int, *args) -> None:
    """Calls fn(rank, world_size, *args) in `world_size` processes; a failure in any
    worker fails the test with that worker's traceback. `fn` must be module-level."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(fn, world_size, os.path.join(tmp, "store"), args),
                           nprocs=world_size, join=True, start_method="spawn")
