"""Saving and resuming a training run exactly.

A checkpoint holds, per (tp, pp) rank: the model shard, the optimizer state by
parameter name, the loss scaler, every RNG stream, the iteration and the consumed
samples. Only DP rank 0 of each model-parallel rank writes (DP replicas are identical,
including their RNG states, since dropout is seeded per TP/PP rank, not per DP rank).
A strategy with state of its own (an outside engine's partitioned optimizer) writes it
beside the rank files (`strategy.save_own_files`), and the model shards are also written in
our layout, so export, resharding and fine-tuning read every run the same way.

The trainer's objects (model, strategy) come in as arguments: this package knows no
trainer, only what it asks of them (`cpu_state_dict`, `optimizer_state`, `save_own_files`, ...).
"""
from __future__ import annotations

import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megabert.checkpoint import external, megatron
from megabert.checkpoint.layout import (TRACKER, checkpoint_root, commit, damaged_file, has_checkpoint,
                                        model_payload, newest_intact, os_error_behind, read_tracker,
                                        resolve_checkpoint_dir, staging_dir, tag_dir_name, write_rank_file)
from megabert.config import TrainConfig
from megabert.errors import CheckpointError
from megabert.parallel import ParallelState, comm
from megabert.parallel.param_spec import spec_table, table_to_dict

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


@dataclass(frozen=True)
class StartPoint:
    """The checkpoint a run starts from (path None: from the seed), whether it gives the
    weights only, the flag behind that choice and why it was made (for log lines)."""

    path: Optional[str] = None
    weights_only: bool = False
    flag: str = "--load"
    note: Optional[str] = None
    warn: bool = False  # the note is a warning (a damaged checkpoint passed over)


def holds_checkpoint(path: str) -> bool:
    """A megabert/Megatron checkpoint, or a Hugging Face or Google TF BERT directory."""
    return has_checkpoint(path) or external.is_external(path)


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def resolve_start(train: TrainConfig) -> StartPoint:
    """`_choose_start`, then a check that its newest checkpoint reads (see _intact)."""
    return _intact(_choose_start(train), train)


def _intact(start: StartPoint, train: TrainConfig) -> StartPoint:
    """A truncated or missing rank file in the newest checkpoint (a job killed mid-write on
    a file system without atomic rename, a full disk) stops the run in one line naming the
    file and the newest intact iteration. Under the restart pattern (--save X --load X) the
    run resumes that intact iteration after a warning instead: the same command re-run by
    torchrun or SLURM keeps going. Nothing is deleted either way."""
    if start.path is None or external.is_external(start.path) or read_tracker(start.path) == "release":
        return start
    try:
        damaged = damaged_file(resolve_checkpoint_dir(start.path))
    except CheckpointError as e:  # the pointer names an iteration directory that is not there
        damaged = str(e)
    if damaged is None:
        return start
    root = checkpoint_root(start.path)
    intact = newest_intact(root) if os.path.isdir(root) else None
    if intact is None:
        raise CheckpointError(f"{start.flag} {start.path}: {damaged}; no intact iteration under {root}: start "
                              f"from the seed with another --save directory")
    ckpt_dir, iteration = intact
    if train.save and _same_dir(root, train.save) and not start.weights_only:
        return StartPoint(ckpt_dir, False, start.flag, warn=True,
                          note=f"{damaged} cannot be read: resuming the newest intact checkpoint, {ckpt_dir} "
                               f"(iteration {iteration}); the damaged files are left in place")
    raise CheckpointError(f"{damaged} cannot be read; the newest intact checkpoint is {ckpt_dir} (iteration "
                          f"{iteration}): pass {start.flag} {ckpt_dir}, or --save and --load the same directory to "
                          f"resume it on its own")


def _choose_start(train: TrainConfig) -> StartPoint:
    """--load (with --finetune: weights only), or Megatron-LM's --pretrained-checkpoint rule:
    the run's own checkpoint (--load, else --save) as soon as it holds one, so the same
    command re-run after an interruption resumes instead of starting over; until then the
    pretrained weights. Reads the file system only: every rank decides alike, and a wrong
    path stops the run before its data is built."""
    pretrained = train.pretrained_checkpoint
    if not pretrained:
        if train.load and not holds_checkpoint(train.load):
            if train.save and _same_dir(train.load, train.save) and not train.finetune:
                # Megatron's restart pattern: the same command, re-run by torchrun --max-restarts,
                # another launcher's restart or a requeued SLURM job, resumes once there is something.
                return StartPoint(None, note=f"--load {train.load} holds no checkpoint yet (it is also --save): "
                                             f"starting from the seed; a re-run of this command resumes from it")
            what = ("does not exist" if not os.path.exists(train.load) else
                    f"holds no checkpoint (no {TRACKER}, no mp_rank_* directories, no Hugging Face or TF BERT files)")
            raise CheckpointError(f"--load {train.load} {what}; point it at a checkpoint, or at this run's --save "
                                  f"directory to start fresh now and resume on a re-run")
        # A Hugging Face / TF directory or a converted ('release') checkpoint has weights only;
        # a Megatron-LM run's directory continues from its iteration, as Megatron's --load.
        weights_only = train.finetune or bool(train.load and (
            (external.is_external(train.load) and not megatron.is_megatron_dir(train.load))
            or read_tracker(train.load) == "release"))
        return StartPoint(train.load, weights_only, "--finetune" if train.finetune else "--load")
    own, own_flag = (train.load, "--load") if train.load else (train.save, "--save")
    if own and holds_checkpoint(own):
        return StartPoint(own, False, own_flag, f"{own_flag} {own} holds this run's checkpoint: resuming it; "
                                                f"--pretrained-checkpoint {pretrained} is not used")
    if not holds_checkpoint(pretrained):
        what = ("does not exist" if not os.path.exists(pretrained) else
                f"holds no checkpoint (no {TRACKER}, no mp_rank_* directories, no Hugging Face or TF BERT files)")
        raise CheckpointError(f"--pretrained-checkpoint {pretrained} {what}; point it at the --save directory of "
                              f"the run to start from (phase 1)")
    where = f"{own_flag} {own} holds no checkpoint yet" if own else "no --load or --save to resume from"
    return StartPoint(pretrained, True, "--pretrained-checkpoint",
                      f"{where}: initialising from --pretrained-checkpoint {pretrained}")


def _rng_state(model) -> dict:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": model.rng.get_states(), "python": random.getstate()}


def _set_rng_state(model, rng: dict) -> None:
    torch.set_rng_state(rng["cpu"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    model.rng.set_states(rng["tracker"])
    random.setstate(rng["python"])


def _prune(root: str, keep_last: int) -> None:
    iters = sorted(int(m.group(1)) for n in os.listdir(root) if (m := re.fullmatch(r"iter_(\d{7})", n)))
    for it in iters[:-keep_last]:
        shutil.rmtree(os.path.join(root, f"iter_{it:07d}"), ignore_errors=True)


def save_checkpoint(root: str, state: TrainingState, strategy, *, extra: Optional[dict] = None,
                    keep_last: Optional[int] = None) -> None:
    """Collective: every rank calls it. Atomic: see megabert.checkpoint.layout. `strategy`
    gives the weights, the optimizer state and any files of its own (see training.strategy).

    A save that cannot write (a full disk, a permission, a read-only file system: an
    OSError on any rank) raises CheckpointError on every rank: one line naming --save, the
    iteration, the cause and the newest complete checkpoint. The ranks agree on each step's
    outcome before the next (so none waits in a collective that a failed peer never joins,
    and nothing is committed unless every rank wrote its part); this save's staging
    directory is removed and the committed checkpoints are left as they were."""
    model, ps = strategy.model, strategy.ps
    save = _Save(root, state.iteration, ps)

    def prepare():
        if ps.rank == 0:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(staging_dir(root, state.iteration), ignore_errors=True)  # a save killed earlier

    def write():
        if ps.dp_rank != 0:
            return
        payload = model_payload(
            weights, model.config, tp_size=ps.tp_size,
            pp_size=ps.pp_size, model_class=type(model).__name__, param_specs=table_to_dict(spec_table(model)),
            layers_per_virtual_stage=model.virtual_stage_layers, iteration=state.iteration,
            consumed_samples=state.consumed_samples, skipped_iterations=state.skipped_iterations,
            rng=_rng_state(model), optimizer=optimizer,
            loss_scaler=strategy.scaler.state_dict() if strategy.scaler is not None else None, args=extra or {})
        write_rank_file(staging_dir(root, state.iteration), ps.tp_rank, ps.pp_rank, ps.pp_size, payload)

    def publish():
        if ps.rank == 0:
            commit(root, state.iteration)
            if keep_last:
                _prune(root, keep_last)

    save.step(prepare)
    weights = strategy.cpu_state_dict(keep=ps.dp_rank == 0)  # collective when parameters are partitioned
    optimizer = strategy.optimizer_state()  # collective when the states are sharded over DP
    save.step(write)
    # A strategy's own files (an engine's partitioned optimizer) are taken back when they or the commit fail.
    save.step(lambda: strategy.save_own_files(root, state), undo=lambda: strategy.discard_own_files(root, state))
    save.step(publish, undo=lambda: strategy.discard_own_files(root, state))


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


def load_checkpoint(path: str, model, ps: ParallelState, *, strategy=None, load_optimizer: bool = True,
                    load_model: bool = True) -> LoadedCheckpoint:
    """Restores what `save_checkpoint` wrote, at the same or another TP/PP layout. A
    Hugging Face directory or a converted ('release') checkpoint gives weights only and
    starts at iteration 0. Weights only (`load_optimizer=False`, or those two) come from
    our rank files, whichever way the checkpoint was trained, so a plain run's checkpoint
    also starts a run under any strategy. `strategy` (None: weights only, into `model`) restores its
    optimizer, loss scale and whatever it keeps of the weights. `load_model=False`: the
    weights are already in the model (loaded before an engine partitioned it); only the
    rest is restored."""
    weights_loaded = strategy.weights_loaded if strategy is not None else (lambda: None)
    ckpt = model.read_checkpoint(path, optimizer=load_optimizer and strategy is not None)
    payload = ckpt.payload
    if ckpt.external:  # a Hugging Face or Google TF directory: weights only
        model.load_local_state_dict(payload["model"], source=path)
        weights_loaded()
        if "megatron_args" in payload:  # a Megatron-LM run: its iteration and samples (megabert.checkpoint.megatron)
            state = TrainingState(int(payload["iteration"]),
                                  int(payload["megatron_args"].get("consumed_train_samples") or 0))
            if load_optimizer and strategy is not None:
                _continue_megatron_optimizer(path, payload, state, strategy, ps)
            return LoadedCheckpoint(state, {})
        return LoadedCheckpoint(TrainingState(), {})
    if ckpt.resharded and ps.rank == 0:
        vpp = model.virtual_stage_layers
        logger.warning("%s was saved at tp=%d pp=%d; resharded in memory to tp=%d pp=%d%s "
                       "(RNG streams restart from the seed)", path, ckpt.saved_tp, ckpt.saved_pp, ps.tp_size,
                       ps.pp_size, f" ({vpp} layers per virtual stage)" if vpp else "")
    if load_model:
        model.load_local_state_dict(payload["model"], source=path)
    state = TrainingState(int(payload.get("iteration", 0)), int(payload.get("consumed_samples", 0)),
                          int(payload.get("skipped_iterations", 0)))
    saved_args = payload.get("args") or {}
    release = read_tracker(path) == "release" or state.iteration == 0
    if release or not load_optimizer or strategy is None:
        weights_loaded()
        if release:
            return LoadedCheckpoint(TrainingState(), saved_args)
    else:
        strategy.load_optimizer_state(path, payload, state)
    if strategy is not None and strategy.scaler is not None and payload.get("loss_scaler") is not None:
        strategy.scaler.load_state_dict(payload["loss_scaler"])
    if payload.get("rng") is not None:  # None when resharded: the streams were another layout's
        _set_rng_state(model, payload["rng"])
    return LoadedCheckpoint(state, saved_args)


def _continue_megatron_optimizer(path: str, payload: dict, state: TrainingState, strategy, ps: ParallelState) -> None:
    """Megatron's Adam moments (read and resharded by name: megabert.checkpoint.megatron) into
    the run's optimizer, under the run's own param groups and flags (LR, betas, eps, weight
    decay); a checkpoint without them starts the optimizer afresh with one info line."""
    if payload.get("optimizer") is None:
        if ps.rank == 0:
            logger.info("%s: Megatron-LM optimizer state not continued: %s; the optimizer starts afresh", path,
                        payload.get("optimizer_note"))
        return
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in strategy.optimizer.param_groups]
    strategy.load_optimizer_state(path, {**payload, "optimizer": {**payload["optimizer"], "param_groups": groups}},
                                  state)
    if ps.rank == 0:
        logger.info("%s: Megatron-LM's Adam moments continued (optimizer step %d)", path,
                    int(next(iter(payload["optimizer"]["state"].values()))["step"]))
