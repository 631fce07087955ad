"""Saving and resuming a training run exactly.

A checkpoint holds, per (tp, pp) rank: the model shard, the optimizer state by
parameter name, the loss scaler, every RNG stream, the iteration and the consumed
samples. Only DP rank 0 of each model-parallel rank writes (DP replicas are identical,
including their RNG states, since dropout is seeded per TP/PP rank, not per DP rank).
A strategy with state of its own (an outside engine's partitioned optimizer) writes it
beside the rank files (`OwnFiles`), and the model shards are also written in our layout, so
export, resharding and fine-tuning read every run the same way.

What is saved comes in as values (`RankContents`, gathered by the caller) and the one thing
asked of a strategy is the small `OwnFiles` protocol defined here: this package calls nothing
on an object from a higher floor. Restoring a run (weights, optimizer, loss scale, RNG) is
megabert.training.restore's, which reads through megabert.checkpoint.reader.
"""
from __future__ import annotations

import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch

from megabert.checkpoint.layout import (commit, model_payload, os_error_behind, read_tracker, staging_dir,
                                        tag_dir_name, write_rank_file)
from megabert.config import ModelConfig
from megabert.errors import CheckpointError
from megabert.parallel import ParallelState, comm

logger = logging.getLogger(__name__)


@dataclass
class TrainingState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_iterations: int = 0  # fp16 overflow skips: they do not advance the LR schedule


@dataclass
class LoadedCheckpoint:
    """What a load gives back: the run's state, and the configs it was saved with, so the
    caller can compare them with this run's (the --seq-length of two-phase pre-training)."""

    state: TrainingState
    saved_args: dict  # the configs it was trained with ("train", "optim", "data"); {} for external weights


def capture_rng(tracker_states: dict) -> dict:
    """The process's RNG streams as a rank file holds them: torch's CPU and CUDA generators,
    Python's, and `tracker_states` (the model's dropout streams per TP rank)."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tracker_states, "python": random.getstate()}


def restore_rng(rng: dict) -> dict:
    """Sets the process's generators from a rank file's streams; returns the tracker's
    states for the model to take back."""
    torch.set_rng_state(rng["cpu"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    random.setstate(rng["python"])
    return rng["tracker"]


def _prune(root: str, keep_last: int) -> None:
    iters = sorted(int(m.group(1)) for n in os.listdir(root) if (m := re.fullmatch(r"iter_(\d{7})", n)))
    for it in iters[:-keep_last]:
        shutil.rmtree(os.path.join(root, f"iter_{it:07d}"), ignore_errors=True)


@dataclass
class RankContents:
    """What a rank file holds besides the run's position, gathered by the caller (collectives
    where weights or optimizer states are partitioned): this package reads and writes them and
    calls nothing on the objects they came from."""

    weights: dict
    """The model's TP-local state dict on the CPU ({} on ranks that do not write)."""
    model_config: ModelConfig
    model_class: str
    param_specs: dict
    layers_per_virtual_stage: Optional[int]
    rng: dict
    """capture_rng's streams."""
    optimizer: Optional[dict] = None
    """The optimizer state by parameter name, or None (kept in the strategy's own files)."""
    loss_scaler: Optional[dict] = None


class OwnFiles(Protocol):
    """State a strategy writes beside the rank files (an engine's partitioned optimizer)."""

    def save_own_files(self, root: str, state: TrainingState) -> None:
        """Collective, after the rank files."""

    def discard_own_files(self, root: str, state: TrainingState) -> None:
        """Rank 0, when the save failed: takes back what save_own_files wrote for it."""


def save_checkpoint(root: str, state: TrainingState, ps: ParallelState, contents: RankContents, *,
                    own_files: Optional[OwnFiles] = None, extra: Optional[dict] = None,
                    keep_last: Optional[int] = None) -> None:
    """Collective: every rank calls it. Atomic: see megabert.checkpoint.layout.

    A save that cannot write (a full disk, a permission, a read-only file system: an
    OSError on any rank) raises CheckpointError on every rank: one line naming --save, the
    iteration, the cause and the newest complete checkpoint. The ranks agree on each step's
    outcome before the next (so none waits in a collective that a failed peer never joins,
    and nothing is committed unless every rank wrote its part); this save's staging
    directory is removed and the committed checkpoints are left as they were."""
    save = _Save(root, state.iteration, ps)

    def prepare():
        if ps.rank == 0:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(staging_dir(root, state.iteration), ignore_errors=True)  # a save killed earlier

    def write():
        if ps.dp_rank != 0:
            return
        c = contents
        payload = model_payload(
            c.weights, c.model_config, tp_size=ps.tp_size, pp_size=ps.pp_size, model_class=c.model_class,
            param_specs=c.param_specs, layers_per_virtual_stage=c.layers_per_virtual_stage, iteration=state.iteration,
            consumed_samples=state.consumed_samples, skipped_iterations=state.skipped_iterations, rng=c.rng,
            optimizer=c.optimizer, loss_scaler=c.loss_scaler, args=extra or {})
        write_rank_file(staging_dir(root, state.iteration), ps.tp_rank, ps.pp_rank, ps.pp_size, payload)

    def publish():
        if ps.rank == 0:
            commit(root, state.iteration)
            if keep_last:
                _prune(root, keep_last)

    def discard():
        if own_files is not None:
            own_files.discard_own_files(root, state)

    save.step(prepare)
    save.step(write)
    if own_files is not None:
        # A strategy's own files are taken back when they or the commit fail.
        save.step(lambda: own_files.save_own_files(root, state), undo=discard)
    save.step(publish, undo=discard)


class _Save:
    """The steps of one save, each followed by the ranks' agreement on its outcome (an
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
