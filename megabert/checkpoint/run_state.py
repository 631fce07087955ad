"""A run's state as a rank file holds it, and the rank file's writing.

Besides the model shard and the optimizer (megabert.checkpoint.manager gathers them from
their stateful objects), a rank file holds the run's position (`TrainingState`: iteration,
data position, fp16 skips) and every RNG stream (`RNGStreams`); both are small stateful
objects here. `write_rank_payload` writes one rank's file into a save's staging directory;
`SaveSteps` makes the ranks agree on each step of a save, which the manager orders around it
(the atomic publish).
"""
from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, fields
from typing import Callable, Optional, Protocol

import torch

from megabert.checkpoint.layout import os_error_behind, read_tracker, staging_dir, tag_dir_name, write_rank_file
from megabert.errors import CheckpointError
from megabert.parallel import ParallelState, comm

@dataclass
class TrainingState:
    """The train state and the data position: the data loaders start at `consumed_samples`
    (a resumed run sees the samples the interrupted one would have)."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0  # fp16 overflow skips: they do not advance the LR schedule

    def state_dict(self) -> dict:
        """The rank file's top-level keys of the same names."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def load_state_dict(self, payload: dict) -> None:
        """From a rank file (keys it lacks, written by older versions, count from 0)."""
        for f in fields(self):
            setattr(self, f.name, int(payload.get(f.name, 0)))


@dataclass
class LoadedCheckpoint:
    """What a load gives back: the run's state, and the configs it was saved with, so the
    caller can compare them with this run's (the --seq-length of two-phase pre-training)."""

    state: TrainingState
    saved_args: dict  # the configs it was trained with ("train", "optim", "data"); {} for external weights


class StreamTracker(Protocol):
    """The model's dropout streams (megabert.tensor_parallel.random.RNGStatesTracker)."""

    def get_states(self) -> dict: ...

    def set_states(self, states: dict) -> None: ...


class RNGStreams:
    """The process's RNG streams as a rank file holds them: torch's CPU and CUDA generators,
    Python's, and the tracker's (the model's dropout streams per TP rank)."""

    def __init__(self, tracker: StreamTracker):
        self.tracker = tracker

    def state_dict(self) -> dict:
        return {"cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                "tracker": self.tracker.get_states(), "python": random.getstate()}

    def load_state_dict(self, rng: dict) -> None:
        torch.set_rng_state(rng["cpu"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        random.setstate(rng["python"])
        self.tracker.set_states(rng["tracker"])


def write_rank_payload(root: str, iteration: int, ps: ParallelState, payload: dict) -> None:
    """This rank's file of a save of `iteration`, into its staging directory."""
    write_rank_file(staging_dir(root, iteration), ps.tp_rank, ps.pp_rank, ps.pp_size, payload)


class SaveSteps:
    """The steps of one save (megabert.checkpoint.manager), each followed by the ranks' agreement on its outcome (an
    all-gather that also serves as the barrier between steps)."""

    def __init__(self, root: str, iteration: int, ps: ParallelState):
        self.root, self.iteration, self.ps = root, iteration, ps

    def step(self, fn: Callable[[], None], undo: Optional[Callable[[], None]] = None) -> None:
        error = None
        try:
            fn()
        except Exception as e:  # noqa: B902  (every rank must learn of it, whatever it is)
            error = e
        failed = self._first_failure(error)
        if failed is None:
            return
        rank, cause = failed
        if self.ps.rank == 0:
            if undo is not None:
                undo()
            shutil.rmtree(staging_dir(self.root, self.iteration), ignore_errors=True)
        if self.ps.world_size > 1:
            # Every rank leaves after the clean-up: a launcher stops the others as soon as one exits.
            comm.barrier()
        if error is not None and os_error_behind(error) is None:
            raise error  # not the file system: a bug, with its traceback
        where = f" (rank {rank})" if self.ps.world_size > 1 else ""
        raise CheckpointError(f"cannot save iteration {self.iteration} to --save {self.root}: {cause}{where}; "
                              f"{self._newest()}") from error

    def _first_failure(self, error: Optional[BaseException]) -> Optional[tuple[int, str]]:
        """(rank, cause) of the lowest rank whose step failed, the same on every rank; None
        when every rank succeeded."""
        os_error = os_error_behind(error) if error is not None else None
        mine = None if error is None else str(os_error) if os_error is not None else f"{type(error).__name__}: {error}"
        if self.ps.world_size == 1:
            return None if mine is None else (self.ps.rank, mine)
        everyone: list[Optional[str]] = [None] * self.ps.world_size
        comm.all_gather_object(everyone, mine)
        return next(((r, m) for r, m in enumerate(everyone) if m is not None), None)

    def _newest(self) -> str:
        """What a user can resume now."""
        try:
            tag = read_tracker(self.root)
        except (CheckpointError, OSError):
            tag = None
        if tag is None:
            return (f"{self.root} holds no complete checkpoint yet: make room (or fix its permissions, or point --save "
                    f"elsewhere) and start again")
        return (f"the newest complete checkpoint, {os.path.join(self.root, tag_dir_name(tag))} (iteration {tag}), is "
                f"intact: make room (or fix the permissions, or point --save elsewhere) and resume it with --load "
                f"{self.root}")
