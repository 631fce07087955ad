"""The one driver of the entry scripts: pre-training and every fine-tuning task take the same
steps,

    the command line parsed (the task's `cli`) -> the configs' files checked -> parallel state -> logging -> the run resolved (its start:
    --load, or --save once it holds a checkpoint) -> the task -> the run's tokenizer -> the
    task's inputs -> its model -> the trainer (resuming --save) -> train -> the task's outputs

and plug in what is their own through `Task`: its inputs, its model, what it trains on
(`Training`: its loss and metrics, its batches, its number of steps) and its outputs.
Pre-training is one task (megabert.tasks.pretraining.task), every fine-tuning task another
(megabert.training.finetune.FinetuneTask, with the tasks of megabert.tasks). The driver knows
no task; it builds the trainer the same way for all of them."""
from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator, Optional, Sequence

import torch

from megabert.arguments import Cli, parse_cli
from megabert.checkpoint.run_state import TrainingState
from megabert.config import Configs, FinetuneConfigs
from megabert.data import build_tokenizer
from megabert.parallel import ParallelState, destroy_parallel, init_parallel
from megabert.paths import check_config_paths
from megabert.training.build import build_trainer
from megabert.training.metrics import configure_process_logging
from megabert.training.resolve import ResolvedRun, resolve_run
from megabert.training.strategy import TrainingTask
from megabert.training.trainer import Trainer


@dataclass(frozen=True)
class Training:
    """What a task trains on. `train_batches(consumed samples)`: this rank's micro-batches
    from that point on (a resumed run sees exactly the batches the interrupted one would
    have); `valid_batches()`: a pass over the validation data, or None."""

    task: TrainingTask
    train_iters: int
    """The run's steps: --train-iters, or what the task counts from --epochs."""
    train_batches: Callable[[int], Iterator[dict]]
    valid_batches: Optional[Callable[[], Iterator[dict]]] = None
    flops_per_sample: Optional[float] = None


class Task(abc.ABC):
    """What an entry script's task plugs into the driver, in the order the driver calls it."""

    name: str = "task"
    """For log lines."""
    cli: ClassVar[Cli]
    """Its entry script's command line: pre-training's flags, or the fine-tuning flags with the
    task's own section and recipe."""

    @classmethod
    @abc.abstractmethod
    def for_run(cls, cfg: Configs | FinetuneConfigs, run: ResolvedRun) -> "Task":
        """The task of the entry script's configs `cfg`, resolved into `run`."""

    @abc.abstractmethod
    def prepare(self, run: ResolvedRun, ps: ParallelState, tokenizer) -> None:
        """Reads the task's inputs, so a missing or malformed file stops the run (a DataError
        naming it) before any model is built."""

    @abc.abstractmethod
    def build_model(self, run: ResolvedRun, ps: ParallelState, vocab_size: int) -> torch.nn.Module:
        """This rank's model (its pipeline stage), weights as the task starts from them."""

    @abc.abstractmethod
    def training(self, run: ResolvedRun, ps: ParallelState, model: torch.nn.Module, tokenizer
                 ) -> Optional[Training]:
        """What `model` trains on, or None when the run does not train."""

    def prepare_trainer(self, trainer: Trainer, run: ResolvedRun) -> None:
        """Before training: where a task's step runs differently from a mean of independent
        micro-batch losses (the embedding task's gradient cache replaces
        `trainer.strategy.runner`). Nothing by default."""

    def finish(self, run: ResolvedRun, ps: ParallelState, model: torch.nn.Module, tokenizer,
               state: Optional[TrainingState]) -> None:
        """After training (`state`: where it ended; None: nothing was trained), before the
        trainer closes: a ZeRO-3 engine holds the partitioned weights until then. Every rank
        calls it. Nothing by default."""


def run_task(task_class: type[Task], argv: Optional[Sequence[str]] = None, *, description: str = "",
             cfg: Configs | FinetuneConfigs | None = None) -> None:
    """Runs an entry script end to end with `task_class`'s pieces: its command line `argv`
    (sys.argv when None; `description`: the --help text), read as `task_class.cli` says, or
    `cfg`, configs made in code (then no flag is read)."""
    if cfg is None:
        cfg = parse_cli(argv, description, task_class.cli)  # a broken flag rule stops here, before any process group
    check_config_paths(cfg)  # every file read and every directory written, before any process group or model
    par = cfg.parallel
    ps = init_parallel(par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                       backend=par.distributed_backend, timeout_minutes=par.distributed_timeout_minutes)
    configure_process_logging(ps.is_logging_rank)
    # Flags + the DeepSpeed JSON + the world + the disk, checked once; everything below reads it.
    run = resolve_run(cfg, ps)
    task = task_class.for_run(cfg, run)
    tokenizer = build_tokenizer(*run.tokenizer_files)
    task.prepare(run, ps, tokenizer)
    model = task.build_model(run, ps, tokenizer.vocab_size)
    training = task.training(run, ps, model, tokenizer)
    trainer = None if training is None else trainer_for(run, ps, model, training)
    try:
        if trainer is not None:
            task.prepare_trainer(trainer, run)
        state = None if trainer is None else trainer.train()
        task.finish(run, ps, model, tokenizer, state)
    finally:
        if trainer is not None:
            trainer.close()
    destroy_parallel()


def trainer_for(run: ResolvedRun, ps: ParallelState, model: torch.nn.Module, training: Training) -> Trainer:
    """The trainer of `model` on `training`, from `run.start` (resuming --save). Its
    checkpoints record the run's configs: train, optim and the task's section."""
    run = dataclasses.replace(run, train=dataclasses.replace(run.train, train_iters=training.train_iters))
    section = {"data": run.data} if run.data is not None else {"finetune": run.finetune}
    configs = {"train": run.train, "optim": run.optim, **section}
    return build_trainer(model, ps, run, training.task, training.train_batches, training.valid_batches,
                         flops_per_sample=training.flops_per_sample,
                         checkpoint_extra={key: dataclasses.asdict(c) for key, c in configs.items()})
