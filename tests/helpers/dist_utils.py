"""Runs a test body in N worker processes joined by a gloo process group.

The workers are spawned once and kept for the whole session, one pool for every world size
(a job of N ranks runs on workers 0..N-1; the pool grows to the largest N asked for):
spawning and importing torch, megabert and DeepSpeed costs 2-4 s per process on a 2-core
machine, more than most test bodies. Each call still gets what a fresh launch gives it: a
new default process group (its own file store), megabert's parallel state built by the body, the
environment restored afterwards, and every group destroyed at the end. A call that fails,
hangs past its peers' failure or kills its process throws the pool away; the next call
spawns a new one."""
from __future__ import annotations

import atexit
import contextlib
import gc
import os
import queue
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import megabert

from tests.helpers.compiler_state import reset_compiler_state

GRACE_S = 20.0
"""How long the other ranks may take to notice a rank's failure before the pool is killed."""


def _exit_with_parent(parent: int) -> None:
    """Workers are not daemons (a body may start DataLoader workers, which daemons cannot),
    so one whose pytest died would wait for jobs forever: leave instead."""
    while os.getppid() == parent:
        time.sleep(2.0)
    os._exit(1)


def _serve(rank: int, parent: int, jobs, results) -> None:
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(1)  # N processes on a 2-core machine: oversubscription only slows them
    os.environ.pop("RANK", None)
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, init_file, world_size, args = job
        environ = dict(os.environ)
        error = None
        try:
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
            fn(rank, world_size, *args)
            # NOTE: a rank that tears gloo down while its peer is still sending can abort the
            # peer ("terminate called without an active exception"): leave together. (An entry
            # script's main() destroys the group itself at its end, as it does under torchrun.)
            if dist.is_initialized():
                dist.barrier()
        except BaseException:  # noqa: B902  (SystemExit too: the driver reports it)
            error = traceback.format_exc()
        finally:
            megabert.destroy_parallel()
            reset_compiler_state()
            os.environ.clear()
            os.environ.update(environ)
            gc.collect()
            sys.stdout.flush()
            sys.stderr.flush()
        results.put((rank, error))
    # Skip the interpreter's finalisation: a gloo group that survives until then is destroyed
    # among C++ static destructors, which aborted a worker once on a loaded machine.
    os._exit(0)


class _Pool:
    def __init__(self):
        self._ctx = mp.get_context("spawn")
        self.jobs, self.procs = [], []
        self.results = self._ctx.Queue()

    def grow(self, size: int) -> None:
        """Spawns workers until there are `size`: rank r of every job runs on worker r."""
        while len(self.procs) < size:
            jobs = self._ctx.SimpleQueue()
            proc = self._ctx.Process(target=_serve, args=(len(self.procs), os.getpid(), jobs, self.results))
            proc.start()
            self.jobs.append(jobs)
            self.procs.append(proc)

    def run(self, fn: Callable, world_size: int, args: tuple) -> None:
        self.grow(world_size)
        with tempfile.TemporaryDirectory() as tmp:
            for q in self.jobs[:world_size]:
                q.put((fn, os.path.join(tmp, "store"), world_size, args))
            try:
                errors = self._collect(world_size)
            except BaseException:  # a test timeout or Ctrl-C while the workers run: they may never finish
                self.kill()
                raise
        if errors:
            raise RuntimeError("\n".join(f"worker {r} of {world_size} failed:\n{e}" for r, e in errors))

    def _collect(self, world_size: int) -> list[tuple[int, str]]:
        """Waits for ranks 0..world_size-1; [(rank, traceback)] of the failures. A rank that
        died, or that is still busy GRACE_S after another failed, breaks the pool."""
        done, errors, waited_after_error = set(), [], 0.0
        while len(done) < world_size:
            try:
                rank, error = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs[:world_size]) if not p.is_alive() and r not in done]
                if errors:
                    waited_after_error += 1.0
                if dead or waited_after_error > GRACE_S:
                    self.kill()
                    missing = sorted(set(range(world_size)) - done)
                    return errors + [(r, "the worker died" if r in dead else "still running after a peer failed")
                                     for r in missing]
                continue
            done.add(rank)
            if error is not None:
                errors.append((rank, error))
        if errors:
            self.close()  # a failed body may leave state behind: the next call starts clean
        return errors

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for q, p in zip(self.jobs, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


@contextlib.contextmanager
def patched(owner, name: str, value):
    """owner.name = value for the block. Workers outlive the call, so a body that replaces
    a module or class attribute must put it back, or the next test inherits the patch."""
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


_pool: Optional[_Pool] = None  # the session's one pool, once spawned


@atexit.register
def _close_pool() -> None:
    if _pool is not None:
        _pool.close()


def run_distributed(fn: Callable, world_size: int, *args) -> None:
    """Calls fn(rank, world_size, *args) in `world_size` worker processes; a failure in
    any worker fails the test with that worker's traceback. `fn` must be module-level."""
    global _pool
    if _pool is None or not _pool.alive():
        if _pool is not None:
            _pool.kill()
        _pool = _Pool()
    _pool.run(fn, world_size, args)
