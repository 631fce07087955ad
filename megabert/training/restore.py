"""A run's start (megabert.checkpoint.start's RunStart, decided once) put into the model and
the strategy: the weights, and on a resume the optimizer, the loss scale, the RNG streams,
the iteration and the data position. Nothing here detects a format: the start says what
its checkpoint is."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from megabert.checkpoint.megatron import adam_state
from megabert.checkpoint.run_state import LoadedCheckpoint, TrainingState, restore_rng
from megabert.checkpoint.start import Format, RunStart, Source
from megabert.parallel import ParallelState

if TYPE_CHECKING:
    from megabert.training.resolve import ResolvedRun
    from megabert.training.strategy import Strategy

logger = logging.getLogger(__name__)


def preload_weights(run: "ResolvedRun", model, ps: ParallelState) -> Optional[LoadedCheckpoint]:
    """Weights go into the whole model before an engine wraps it (ZeRO-3 then partitions them
    and ZeRO-1/2 copy them into their fp32 masters), and a weights-only start is done here
    (fresh optimizer and loss scale). None: nothing loaded yet (the seed, or a plain resume,
    which reads its rank file once, in continue_run)."""
    start = run.start
    if start.source is None or not (start.weights_only or run.deepspeed_config is not None):
        return None
    return restore(start.source, model, ps, load_optimizer=False)


def continue_run(run: "ResolvedRun", model, ps: ParallelState, strategy: "Strategy",
                 preloaded: Optional[LoadedCheckpoint]) -> TrainingState:
    """The iteration, samples and the rest the start restores (a fresh TrainingState for the
    seed or a weights-only start), with its log lines."""
    start = run.start
    if start.source is None:
        return TrainingState()
    loaded = preloaded
    if not start.weights_only:
        loaded = restore(start.source, model, ps, strategy=strategy, load_optimizer=restores_optimizer(run, ps),
                         load_model=preloaded is None)
    state = loaded.state
    if ps.is_logging_rank:
        logger.info("loaded %s: iteration %d, %d samples consumed", start.path, state.iteration,
                    state.consumed_samples)
        _note_seq_length(loaded.saved_args, run.seq_length, start)
        if start.weights_only and state.iteration:
            logger.info("%s: weights of iteration %d kept; iteration, optimizer and data position reset to 0",
                        start.flag, state.iteration)
    return TrainingState() if start.weights_only else state


def restore(source: Source, model, ps: ParallelState, *, strategy: Optional["Strategy"] = None,
            load_optimizer: bool = True, load_model: bool = True) -> LoadedCheckpoint:
    """Restores what a save wrote, at the same or another TP/PP layout. A Hugging Face / TF
    directory or a converted ('release') checkpoint gives weights only and starts at
    iteration 0. Weights only (`load_optimizer=False`, or those) come from our rank files,
    whichever way the checkpoint was trained, so a plain run's checkpoint also starts a run
    under any strategy. `strategy` (None: weights only, into `model`) restores its optimizer,
    loss scale and whatever it keeps of the weights. `load_model=False`: the weights are
    already in the model (loaded before an engine partitioned it); only the rest is restored."""
    weights_loaded = strategy.weights_loaded if strategy is not None else (lambda: None)
    path = source.path
    ckpt = model.read_checkpoint(source, optimizer=load_optimizer and strategy is not None)
    payload = ckpt.payload
    if ckpt.external:  # Hugging Face, Google TF or Megatron-LM: weights, and Megatron's position
        if load_model:
            model.load_local_state_dict(payload["model"], source=path)
        weights_loaded()
        if source.format is Format.MEGATRON:  # a Megatron-LM run: its iteration and samples
            state = TrainingState(int(payload["iteration"]),
                                  int(payload["megatron_args"].get("consumed_train_samples") or 0))
            if load_optimizer and strategy is not None:
                _continue_megatron_optimizer(source, payload, state, strategy, ps)
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
    release = source.format is Format.RELEASE or state.iteration == 0
    if release or not load_optimizer or strategy is None:
        weights_loaded()
        if release:
            return LoadedCheckpoint(TrainingState(), saved_args)
    else:
        strategy.load_optimizer_state(source, payload, state)
    if strategy is not None and strategy.scaler is not None and payload.get("loss_scaler") is not None:
        strategy.scaler.load_state_dict(payload["loss_scaler"])
    if payload.get("rng") is not None:  # None when resharded: the streams were another layout's
        model.rng.set_states(restore_rng(payload["rng"]))
    return LoadedCheckpoint(state, saved_args)


def restores_optimizer(run: "ResolvedRun", ps: ParallelState) -> bool:
    """Whether a resume restores the checkpoint's optimizer state: not with --no-load-optim;
    for a Megatron-LM run's directory, only into the optimizer its Adam state belongs to
    (megabert.checkpoint.megatron.adam_state), with one info line either way."""
    source = run.start.source
    reason, note = None, None
    if not run.train.load_optim:
        reason = "--no-load-optim"
    elif source.format is Format.MEGATRON:
        args = source.megatron_args
        reason = ("--deepspeed: the optimizer is DeepSpeed's" if run.deepspeed_config is not None
                  else adam_state.mismatch(args, run.optim))
        note = adam_state.hyperparameter_note(args, run.optim)
    if ps.is_logging_rank:
        if reason is not None:
            logger.info("%s: optimizer state not restored (%s); the optimizer starts afresh", source.path, reason)
        elif note is not None:
            logger.info("%s: its Adam moments continue under this run's %s", source.path, note)
    return reason is None


def _continue_megatron_optimizer(source: Source, payload: dict, state: TrainingState, strategy: "Strategy",
                                 ps: ParallelState) -> None:
    """Megatron's Adam moments (read and resharded by name: megabert.checkpoint.megatron) into
    the run's optimizer, under the run's own param groups and flags (LR, betas, eps, weight
    decay); a checkpoint without them starts the optimizer afresh with one info line."""
    path = source.path
    if payload.get("optimizer") is None:
        if ps.rank == 0:
            logger.info("%s: Megatron-LM optimizer state not continued: %s; the optimizer starts afresh", path,
                        payload.get("optimizer_note"))
        return
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in strategy.optimizer.param_groups]
    strategy.load_optimizer_state(source, {**payload, "optimizer": {**payload["optimizer"], "param_groups": groups}},
                                  state)
    if ps.rank == 0:
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
