"""Fine-tuning as a task of the driver (megabert.training.driver): every fine-tuning task
(SQuAD, GLUE, NER, embeddings, the next one) is a `FinetuneTask`, and runs

    the task's inputs checked -> the task model from --load -> its training features,
    shuffled per epoch or packed into rows (resuming --save) -> its predictions, scores, outputs

plugging in what is its own: its training features, its model and head, and how it
predicts, scores and writes its outputs. The task's config section is a
megabert.config.TaskConfig; the tasks live in megabert.tasks.

Every task resumes exactly from --save: once --save holds a checkpoint of the run, the
same command again restores its weights, optimizer, loss scale, RNG streams and data
position (the consumed samples) and continues where it stopped, with the losses and
predictions of a run that was never interrupted (dropout on).
"""
from __future__ import annotations

import abc
import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from megabert.checkpoint.run_state import TrainingState
from megabert.checkpoint.start import Source
from megabert.config import FinetuneConfigs, TaskConfig
from megabert.data.packing import (PackingSpec, packed_feature_batches, rows_per_epoch, warn_if_packing_wasted,
                                   with_flat_token_positions)
from megabert.data.samplers import warn_if_small
from megabert.errors import ConfigError, DataError
from megabert.parallel import ParallelState, comm
from megabert.tensor_parallel.random import seed_default_stream
from megabert.planning.flops import bert_flops_per_sample
from megabert.training.build import apply_compile, build_predictor
from megabert.training.driver import Task, Training
from megabert.training.resolve import ResolvedRun
from megabert.training.strategy import TrainingTask

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Predictor:
    """Forward-only passes over the model (fine-tuned here, or --load as it is) at the run's
    layout and precision, for a task's predictions."""

    model: torch.nn.Module
    ps: ParallelState
    task: TrainingTask
    batch_size: int
    bf16: bool = False
    fp16: bool = False

    def outputs(self, tensors: dict[str, torch.Tensor], outputs_of: Callable[[object], Sequence[torch.Tensor]],
                **options) -> Optional[list[np.ndarray]]:
        """The arrays `outputs_of(model output)` picks for every feature in order, on every
        rank (None when there are no features); see predict_outputs (`options`: its gather
        and progress)."""
        return predict_outputs(self.model, tensors, self.ps, self.batch_size, self.task, outputs_of, bf16=self.bf16,
                               fp16=self.fp16, **options)

    @property
    def writes(self) -> bool:
        """This rank writes the outputs (rank 0; every rank holds the same predictions)."""
        return self.ps.rank == 0


class FinetuneTask(Task):
    """What a fine-tuning task plugs into the driver (megabert.training.driver), which it runs
    as any task: its features, the task model from --load, its predictions. Built from the
    run's configs (its own section, `self.config`, a TaskConfig, has the vocab already
    resolved) and the run's pre-trained model, `self.pretrained` (--load, detected once:
    megabert.checkpoint.start)."""

    def __init__(self, cfg: FinetuneConfigs, pretrained: Source):
        self.cfg, self.config, self.pretrained = cfg, cfg.finetune, pretrained

    @classmethod
    def for_run(cls, cfg: FinetuneConfigs, run: ResolvedRun) -> "FinetuneTask":
        return cls(dataclasses.replace(cfg, finetune=run.finetune), run.start.pretrained)

    @property
    @abc.abstractmethod
    def training_task(self) -> TrainingTask:
        """The inputs a micro-batch feeds the model and how its output gives the loss."""

    @abc.abstractmethod
    def check_inputs(self) -> None:
        """Reads the data files the run will use, so a missing or malformed one stops the run
        (a DataError naming it) before the model loads."""

    @abc.abstractmethod
    def load_model(self, ps: ParallelState, vocab_size: int) -> torch.nn.Module:
        """The task model from --load (any checkpoint kind: see load_task_model)."""

    def packing(self, seed: int) -> Optional[PackingSpec]:
        """How training features pack into rows (--pack-sequences), or None: unpacked."""
        return None

    @abc.abstractmethod
    def train_tensors(self, tokenizer) -> Optional[dict[str, torch.Tensor]]:
        """The training features as tensors of equal length (the training_task's inputs), or
        None when the run does not train."""

    @abc.abstractmethod
    def predict(self, tokenizer, predictor: Predictor) -> None:
        """Predicts, scores and writes the task's outputs (on `predictor.writes` ranks);
        nothing when the run does not predict. Every rank calls it: prediction is collective."""

    def train_batches(self, tensors: dict[str, torch.Tensor], run: ResolvedRun, ps: ParallelState
                      ) -> Optional[Callable[[int], Iterator[dict]]]:
        """Where the task orders its training features itself (the embedding task's several
        files and no-duplicate batches): `batches(consumed samples)`, this rank's endless
        micro-batches from that point on, as feature_batches; None (the default): the
        driver's shuffle."""
        return None

    def prepare(self, run: ResolvedRun, ps: ParallelState, tokenizer) -> None:
        self.check_inputs()

    def build_model(self, run: ResolvedRun, ps: ParallelState, vocab_size: int) -> torch.nn.Module:
        return self.load_model(ps, vocab_size)

    def training(self, run: ResolvedRun, ps: ParallelState, model: torch.nn.Module, tokenizer
                 ) -> Optional[Training]:
        """The training features, shuffled per epoch (or packed into rows: --pack-sequences),
        for --train-iters steps or --epochs passes."""
        tensors = self.train_tensors(tokenizer)
        if tensors is None:
            return None
        return feature_training(self, tensors, run, ps, model)

    def finish(self, run: ResolvedRun, ps: ParallelState, model: torch.nn.Module, tokenizer,
               state: Optional[TrainingState]) -> None:
        t = self.cfg.train
        self.predict(tokenizer, Predictor(model, ps, self.training_task, self.config.predict_batch_size or
                                          t.micro_batch_size, t.bf16, t.fp16))


def feature_training(task: FinetuneTask, tensors: dict[str, torch.Tensor], run: ResolvedRun, ps: ParallelState,
                     model: torch.nn.Module) -> Training:
    """`task`'s training on its features `tensors`."""
    ft, t, batch = run.finetune, run.train, run.batch
    n = len(tensors["input_ids"])
    packing = task.packing(t.seed)
    rows = n if packing is None else rows_per_epoch(tensors, packing)  # what a global batch counts
    warn_if_small(rows, batch.global_batch_size, "features" if packing is None else "packed rows")
    if packing is None:
        train_iters = num_train_steps(n, ft, batch.global_batch_size)
        logger.info("fine-tuning %s for %d steps of %d features (%.2f epochs of %d)", task.name, train_iters,
                    batch.global_batch_size, train_iters * batch.global_batch_size / n, n)

        def batches(consumed):
            out = feature_batches(tensors, global_batch=batch.global_batch_size, micro_batch=t.micro_batch_size,
                                  dp_rank=ps.dp_rank, dp_size=ps.dp_size, seed=t.seed, consumed=consumed)
            # The unpadded encoder's real tokens, found on the host (no nonzero() on the device),
            # for the tasks whose model takes them.
            wanted = model.config.unpad_input and "token_positions" in task.training_task.inputs
            return with_flat_token_positions(out, "token_positions") if wanted else out

        batches = task.train_batches(tensors, run, ps) or batches
    else:
        # --epochs counts passes over the features; a step holds global batch rows of several each.
        warn_if_packing_wasted(packing, n, int(tensors["attention_mask"].sum()), rows, what="features")
        train_iters = num_train_steps(rows, ft, batch.global_batch_size)
        logger.info("fine-tuning %s for %d steps of %d packed rows (%d features in %d rows an epoch, %.2f a row)",
                    task.name, train_iters, batch.global_batch_size, n, rows, n / rows)

        def batches(consumed):
            return packed_feature_batches(tensors, packing, micro_batch=t.micro_batch_size, dp_rank=ps.dp_rank,
                                          dp_size=ps.dp_size, seed=t.seed, consumed=consumed)
    return Training(task.training_task, train_iters, batches,
                    flops_per_sample=bert_flops_per_sample(model.config, ft.max_seq_length, masked_tokens=0))


def write_json(path: str, value) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, ensure_ascii=False)


def load_task_model(model_class: type, cfg: FinetuneConfigs, pretrained: Source, ps: ParallelState,
                    vocab_size: int, **config_overrides) -> torch.nn.Module:
    """`model_class` from `pretrained`, the run's --load (megabert checkpoint of any TP layout,
    a Megatron-LM run, or a Hugging Face / TF directory); its task head is new unless the
    checkpoint already has one.
    `config_overrides`: ModelConfig fields the task sets (e.g. the number of labels);
    --recompute-granularity unless the task sets it."""
    seed_default_stream(cfg.train.seed, ps.pp_rank, ps.device)
    config_overrides.setdefault("recompute_granularity", cfg.finetune.recompute_granularity)
    model = model_class.from_pretrained(
        pretrained, ps, seed=cfg.train.seed,
        num_layers_per_virtual_stage=cfg.parallel.num_layers_per_virtual_pipeline_stage,
        first_stage_layers=cfg.parallel.decoder_first_pipeline_num_layers,
        last_stage_layers=cfg.parallel.decoder_last_pipeline_num_layers, **config_overrides)
    if cfg.finetune.max_seq_length > model.config.max_position_embeddings:
        raise ConfigError(f"--max-seq-length {cfg.finetune.max_seq_length} exceeds the model's "
                          f"{model.config.max_position_embeddings} position embeddings ({cfg.train.load})")
    if vocab_size > model.config.vocab_size:
        raise DataError(f"the tokenizer of {cfg.finetune.vocab_file} has {vocab_size} ids but the model of "
                        f"{cfg.train.load} has {model.config.vocab_size}: pass the vocab it was pre-trained with")
    apply_compile(model, ps, cfg.train)
    return model


def num_train_steps(num_features: int, finetune: TaskConfig, global_batch: int) -> int:
    """--train-iters, else ceil(--epochs x features / global batch)."""
    if finetune.train_iters is not None:
        return finetune.train_iters
    return max(1, math.ceil(finetune.epochs * num_features / global_batch))


def feature_batches(tensors: dict[str, torch.Tensor], *, global_batch: int, micro_batch: int, dp_rank: int,
                    dp_size: int, seed: int, consumed: int = 0) -> Iterator[dict]:
    """Micro-batches for this DP rank, endless: every epoch is a fresh permutation of all
    features seeded by (seed, epoch), identical on every rank; each global batch of
    indices is cut into dp_size equal slices and this rank's slice into micro-batches.
    A global batch may span two epochs, so no feature is dropped. `consumed`: samples the
    run has already trained on (a resume), skipped from the front of the same stream, so
    the resumed run sees exactly the batches the interrupted one would have."""
    n = len(tensors["input_ids"])
    per_rank = global_batch // dp_size
    pending: list[int] = []
    epoch = 0
    while True:
        g = torch.Generator().manual_seed(seed * 1000 + epoch)
        pending += torch.randperm(n, generator=g).tolist()
        epoch += 1
        skip = min(consumed, len(pending))
        pending, consumed = pending[skip:], consumed - skip
        while len(pending) >= global_batch:
            step, pending = pending[:global_batch], pending[global_batch:]
            mine = step[dp_rank * per_rank:(dp_rank + 1) * per_rank]
            for k in range(0, per_rank, micro_batch):
                index = torch.tensor(mine[k:k + micro_batch])
                yield {key: t[index] for key, t in tensors.items()}


@torch.no_grad()
def predict_outputs(model: torch.nn.Module, tensors: dict[str, torch.Tensor], ps: ParallelState, batch_size: int,
                    task: TrainingTask, outputs_of: Callable[[object], Sequence[torch.Tensor]], *, bf16: bool = False,
                    fp16: bool = False, gather: bool = True, progress: Optional[Callable[[int], None]] = None
                    ) -> list[np.ndarray]:
    """The arrays `outputs_of(model output)` picks (each [batch, ...], float CPU), for every
    feature in order, on every rank. DP rank r takes the r-th contiguous shard (all TP ranks
    and pipeline stages of a DP rank run the same batches together); the shards are
    gathered over the data-parallel group (`gather=False`: each DP rank keeps its own shard's,
    None for an empty one). Batches are padded to `batch_size` with PP > 1 (stages exchange
    fixed shapes) and trimmed after. `progress(n)`: n more of this rank's features done."""
    n, seq = tensors["input_ids"].shape[0], tensors["input_ids"].shape[-1]  # [n, s], or [n, texts, s]
    shard = np.array_split(np.arange(n), ps.dp_size)[ps.dp_rank]
    batches, sizes = [], []
    for k in range(0, len(shard), batch_size):
        index = torch.as_tensor(shard[k:k + batch_size])
        sizes.append(len(index))
        index = torch.cat([index, index[:1].repeat(batch_size - len(index))]) if ps.pp_size > 1 else index
        batches.append({key: tensors[key][index].to(ps.device)
                        for key in ("input_ids", "token_type_ids", "attention_mask")})
    # The one forward-only path: Strategy.forward_only through the runner (the pipeline
    # schedule with PP > 1, whose last stage alone returns outputs).
    predictor = build_predictor(model, ps, task, seq_length=seq, micro_batch_size=batch_size, bf16=bf16,
                                fp16=fp16)

    def pick(out):
        return tuple(t.float().cpu() for t in outputs_of(out))

    outputs = []
    for k in range(0, len(batches), ps.pp_size):
        outputs += predictor.forward_only(batches[k:k + ps.pp_size], pick)
        if progress is not None:
            progress(sum(sizes[k:k + ps.pp_size]))
    if ps.pp_size > 1:
        box = [outputs]
        comm.broadcast_object_list(box, src=ps.last_stage_rank, group=ps.pp_group)
        outputs = box[0]
    arrays = None
    if outputs:
        arrays = [np.concatenate([o[i][:m].numpy() for o, m in zip(outputs, sizes)]) for i in range(len(outputs[0]))]
    if ps.dp_size > 1 and gather:
        gathered: list[Optional[list]] = [None] * ps.dp_size
        comm.all_gather_object(gathered, arrays, group=ps.dp_group)
        # A rank with an empty shard (fewer features than DP ranks) returns None.
        parts = [g for g in gathered if g is not None]
        arrays = [np.concatenate([g[i] for g in parts]) for i in range(len(parts[0]))] if parts else None
    return arrays
