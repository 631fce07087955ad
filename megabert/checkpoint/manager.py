"""One manager for a run's checkpoints (the idea of torchtitan's components/checkpoint.py).

What a checkpoint holds is a set of small stateful objects (`CheckpointParts`), each with
`state_dict()` / `load_state_dict()`: the model's weights, the optimizer (ours or the
distributed optimizer's, by parameter name), the loss scaler, the RNG streams, and the train
state with the data position. `CheckpointManager` writes them as one rank file per (tp, pp)
rank, restores them from any checkpoint a run may start from, and owns what a save does
around them: the atomic publish (megabert.checkpoint.layout), keep-last pruning, and the files
an outside engine keeps beside ours (`EngineFiles`: its partitioned optimizer; the model
shards are written in our layout all the same, so export, resharding and fine-tuning read
every run alike).

Only DP rank 0 of each model-parallel rank writes: DP replicas are identical, their RNG
states included, since dropout is seeded per TP/PP rank, not per DP rank. The parts are
handed in (megabert.training.checkpoint_state builds them): this package calls nothing on them
but what the protocols below declare.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Optional, Protocol

from megabert.checkpoint.layout import commit, model_payload, staging_dir
from megabert.checkpoint.megatron import adam_state
from megabert.checkpoint.reader import RankCheckpoint
from megabert.checkpoint.run_state import LoadedCheckpoint, RNGStreams, SaveSteps, TrainingState, write_rank_payload
from megabert.checkpoint.start import Format, RunStart, Source
from megabert.config import ModelConfig, OptimConfig
from megabert.errors import CheckpointError
from megabert.parallel import ParallelState

logger = logging.getLogger(__name__)


class Stateful(Protocol):
    """torch's convention: what state_dict() gives, load_state_dict() takes back."""

    def state_dict(self): ...

    def load_state_dict(self, state) -> None: ...


class ModelPart(Protocol):
    """The model's weights, and what a rank file says of the model."""

    config: ModelConfig
    model_class: str
    param_specs: dict
    layers_per_virtual_stage: Optional[int]

    def state_dict(self, keep: bool = True) -> dict:
        """Collective: the TP-local weights on the CPU where `keep`, else {}."""

    def load_state_dict(self, weights: dict, source: str = "state dict") -> None: ...

    def read(self, source: Source, optimizer: bool) -> RankCheckpoint:
        """This rank's view of any checkpoint, in the model's shapes (megabert.checkpoint.reader)."""


class OptimizerPart(Stateful, Protocol):
    """The optimizer state by parameter name (megabert.checkpoint.optimizer_state)."""

    param_groups: list  # live: their hyperparameters continue a Megatron-LM run's moments


class EngineFiles(Protocol):
    """An outside engine's state, in files of its own beside the rank files."""

    name: str  # the engine's name and the flag that runs it, for log lines
    flag: str

    def save_files(self, root: str, state: TrainingState) -> None:
        """Collective, after the rank files."""

    def discard_files(self, root: str, state: TrainingState) -> None:
        """Rank 0, when the save failed: takes back what save_files wrote for it."""

    def load_files(self, source: Source, state: TrainingState) -> None:
        """Restores what save_files wrote beside `source`'s rank files."""

    def weights_loaded(self) -> None:
        """New weights went into the model: the copies the engine keeps of them must follow."""


@dataclass
class CheckpointParts:
    """What a checkpoint holds, each part a stateful object. Without an optimizer and an
    engine: the weights only (a predictor, or weights loaded before an engine wraps them)."""

    model: ModelPart
    rng: RNGStreams
    optimizer: Optional[OptimizerPart] = None  # None where there is none or the engine keeps it
    scaler: Optional[Stateful] = None
    engine: Optional[EngineFiles] = None

    @property
    def trains(self) -> bool:
        return self.optimizer is not None or self.engine is not None


class CheckpointManager:
    """Saves, restores and resumes a run's `CheckpointParts`."""

    def __init__(self, parts: CheckpointParts, ps: ParallelState):
        self.parts, self.ps = parts, ps

    def save(self, root: str, state: TrainingState, *, extra: Optional[dict] = None,
             keep_last: Optional[int] = None) -> None:
        """Collective: every rank calls it. Atomic: see megabert.checkpoint.layout.

        A save that cannot write (a full disk, a permission, a read-only file system: an
        OSError on any rank) raises CheckpointError on every rank: one line naming --save, the
        iteration, the cause and the newest complete checkpoint. The ranks agree on each step's
        outcome before the next (so none waits in a collective that a failed peer never joins,
        and nothing is committed unless every rank wrote its part); this save's staging
        directory is removed and the committed checkpoints are left as they were."""
        parts, ps = self.parts, self.ps
        weights = parts.model.state_dict(keep=ps.dp_rank == 0)  # collective where parameters are partitioned
        optimizer = parts.optimizer.state_dict() if parts.optimizer is not None else None  # collective: DP shards
        rng = parts.rng.state_dict()
        scaler = parts.scaler.state_dict() if parts.scaler is not None else None
        save, engine = SaveSteps(root, state.iteration, ps), parts.engine

        def prepare():
            if ps.rank == 0:
                os.makedirs(root, exist_ok=True)
                shutil.rmtree(staging_dir(root, state.iteration), ignore_errors=True)  # a save killed earlier

        def write():
            if ps.dp_rank != 0:
                return
            m = parts.model
            write_rank_payload(root, state.iteration, ps, model_payload(
                weights, m.config, tp_size=ps.tp_size, pp_size=ps.pp_size, model_class=m.model_class,
                param_specs=m.param_specs, layers_per_virtual_stage=m.layers_per_virtual_stage, **state.state_dict(),
                rng=rng, optimizer=optimizer, loss_scaler=scaler, args=extra or {}))

        def publish():
            if ps.rank == 0:
                commit(root, state.iteration)
                if keep_last:
                    _prune(root, keep_last)

        def discard():
            if engine is not None:
                engine.discard_files(root, state)

        save.step(prepare)
        save.step(write)
        if engine is not None:
            # The engine's files are taken back when they or the commit fail.
            save.step(lambda: engine.save_files(root, state), undo=discard)
        save.step(publish, undo=discard)

    def restore(self, source: Source, *, load_optimizer: bool = True, load_model: bool = True) -> LoadedCheckpoint:
        """Restores what a save wrote, at the same or another TP/PP layout. A Hugging Face / TF
        directory or a converted ('release') checkpoint gives weights only and starts at
        iteration 0. Weights only (`load_optimizer=False`, or parts that do not train) come
        from our rank files, whichever way the checkpoint was trained, so a plain run's
        checkpoint also starts a run under any strategy. `load_model=False`: the weights are
        already in the model (loaded before an engine partitioned it); only the rest is restored."""
        parts, path = self.parts, source.path
        ckpt = parts.model.read(source, optimizer=load_optimizer and parts.trains)
        payload = ckpt.payload
        if ckpt.external:  # Hugging Face, Google TF or Megatron-LM: weights, and Megatron's position
            if load_model:
                parts.model.load_state_dict(payload["model"], source=path)
            self._weights_loaded()
            if source.format is Format.MEGATRON:  # a Megatron-LM run: its iteration and samples
                state = TrainingState(int(payload["iteration"]),
                                      int(payload["megatron_args"].get("consumed_train_samples") or 0))
                if load_optimizer and parts.trains:
                    self._continue_megatron_optimizer(source, payload, state)
                return LoadedCheckpoint(state, {})
            return LoadedCheckpoint(TrainingState(), {})
        if ckpt.resharded and self.ps.rank == 0:
            vpp = parts.model.layers_per_virtual_stage
            logger.warning("%s was saved at tp=%d pp=%d; resharded in memory to tp=%d pp=%d%s "
                           "(RNG streams restart from the seed)", path, ckpt.saved_tp, ckpt.saved_pp, self.ps.tp_size,
                           self.ps.pp_size, f" ({vpp} layers per virtual stage)" if vpp else "")
        if load_model:
            parts.model.load_state_dict(payload["model"], source=path)
        state = TrainingState()
        state.load_state_dict(payload)
        saved_args = payload.get("args") or {}
        release = source.format is Format.RELEASE or state.iteration == 0
        if release or not load_optimizer or not parts.trains:
            self._weights_loaded()
            if release:
                return LoadedCheckpoint(TrainingState(), saved_args)
        else:
            self._load_optimizer(source, payload, state)
        if parts.scaler is not None and payload.get("loss_scaler") is not None:
            parts.scaler.load_state_dict(payload["loss_scaler"])
        if payload.get("rng") is not None:  # None when resharded: the streams were another layout's
            parts.rng.load_state_dict(payload["rng"])
        return LoadedCheckpoint(state, saved_args)

    def resume(self, start: RunStart, *, optim: OptimConfig, load_optim: bool, seq_length: int,
               preloaded: Optional[LoadedCheckpoint] = None) -> TrainingState:
        """The train state a run's start restores (a fresh one for the seed or a weights-only
        start), with its log lines. `preloaded`: the weights went in before an engine wrapped
        the model (megabert.training.checkpoint_state.preload_weights); `load_optim`: not
        --no-load-optim."""
        if start.source is None:
            return TrainingState()
        loaded = preloaded
        if not start.weights_only:
            restores = self._restores_optimizer(start.source, optim, load_optim)
            loaded = self.restore(start.source, load_optimizer=restores, load_model=preloaded is None)
        state = loaded.state
        if self.ps.is_logging_rank:
            logger.info("loaded %s: iteration %d, %d samples consumed", start.path, state.iteration,
                        state.consumed_samples)
            _note_seq_length(loaded.saved_args, seq_length, start)
            if start.weights_only and state.iteration:
                logger.info("%s: weights of iteration %d kept; iteration, optimizer and data position reset to 0",
                            start.flag, state.iteration)
        return TrainingState() if start.weights_only else state

    def _weights_loaded(self) -> None:
        if self.parts.engine is not None:
            self.parts.engine.weights_loaded()

    def _load_optimizer(self, source: Source, payload: dict, state: TrainingState) -> None:
        """The optimizer of a resumed run, from its rank file's view (`payload`) or the files
        beside it."""
        if self.parts.engine is not None:
            self.parts.engine.load_files(source, state)
            return
        if payload.get("optimizer") is None:
            raise CheckpointError(f"{source.path} holds no optimizer state (saved by an engine that keeps it in "
                                  f"files of its own?); resume it with that engine's flag, or start the optimizer "
                                  f"fresh with --finetune")
        self.parts.optimizer.load_state_dict(payload["optimizer"])

    def _restores_optimizer(self, source: Source, optim: OptimConfig, load_optim: bool) -> bool:
        """Whether a resume restores the checkpoint's optimizer state: not with --no-load-optim;
        for a Megatron-LM run's directory, only into the optimizer its Adam state belongs to
        (megabert.checkpoint.megatron.adam_state), with one info line either way."""
        reason, note = None, None
        if not load_optim:
            reason = "--no-load-optim"
        elif source.format is Format.MEGATRON:
            args = source.megatron_args
            engine = self.parts.engine
            reason = (f"{engine.flag}: the optimizer is {engine.name}'s" if engine is not None
                      else adam_state.mismatch(args, optim))
            note = adam_state.hyperparameter_note(args, optim)
        if self.ps.is_logging_rank:
            if reason is not None:
                logger.info("%s: optimizer state not restored (%s); the optimizer starts afresh", source.path, reason)
            elif note is not None:
                logger.info("%s: its Adam moments continue under this run's %s", source.path, note)
        return reason is None

    def _continue_megatron_optimizer(self, source: Source, payload: dict, state: TrainingState) -> None:
        """Megatron's Adam moments (read and resharded by name: megabert.checkpoint.megatron) into
        the run's optimizer, under the run's own param groups and flags (LR, betas, eps, weight
        decay); a checkpoint without them starts the optimizer afresh with one info line."""
        path = source.path
        if payload.get("optimizer") is None:
            if self.ps.rank == 0:
                logger.info("%s: Megatron-LM optimizer state not continued: %s; the optimizer starts afresh", path,
                            payload.get("optimizer_note"))
            return
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []}
                  for g in self.parts.optimizer.param_groups]
        self._load_optimizer(source, {**payload, "optimizer": {**payload["optimizer"], "param_groups": groups}}, state)
        if self.ps.rank == 0:
            logger.info("%s: Megatron-LM's Adam moments continued (optimizer step %d)", path,
                        int(next(iter(payload["optimizer"]["state"].values()))["step"]))


def _note_seq_length(saved_args: dict, seq_length: int, start: RunStart) -> None:
    """Phase 2 of BERT's two-phase recipe starts from phase 1's weights at a longer
    --seq-length: worth an info line. Resuming a run at another length is rarely meant: it
    keeps the iteration count, the LR schedule and the consumed samples, which now index a
    dataset built for the new length; so a warning that names both values."""
    saved = (saved_args.get("data") or {}).get("seq_length")
    if saved is None or saved == seq_length:
        return
    if start.weights_only:
        logger.info("%s was trained at --seq-length %d; this run trains at --seq-length %d", start.path, saved,
                    seq_length)
    else:
        logger.warning("--seq-length %d differs from the %d that %s was saved with: it continues its iteration, LR "
                       "schedule and data position at the new length; to start a new phase from its weights, use "
                       "--pretrained-checkpoint (or --load --finetune)", seq_length, saved, start.path)


def _prune(root: str, keep_last: int) -> None:
    iters = sorted(int(m.group(1)) for n in os.listdir(root) if (m := re.fullmatch(r"iter_(\d{7})", n)))
    for it in iters[:-keep_last]:
        shutil.rmtree(os.path.join(root, f"iter_{it:07d}"), ignore_errors=True)
