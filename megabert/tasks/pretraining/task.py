"""BERT pre-training pieces handed to the generic Trainer: the task (inputs, loss, evaluation counts),
batch checks, DeepSpeed config, and the assembly used by pretrain_bert.py."""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Callable, Iterable, Iterator, Optional

import torch

from megabert.config import Configs
from megabert.rules import validate_layout
from megabert.errors import DataError
from megabert.tasks.pretraining import BertForPreTraining
from megabert.tasks.pretraining import BertPreTrainingOutput
from megabert.parallel import ParallelState
from megabert.parallel.layout import BatchLayout
from megabert.tensor_parallel.random import seed_default_stream
from megabert.training.build import RunSpec, apply_compile, build_trainer, resolve_optimization
from megabert.training.checkpointing import resolve_start
from megabert.training.metrics import bert_flops_per_sample
from megabert.training.strategy import Counts, Task
from megabert.training.trainer import Trainer

logger = logging.getLogger(__name__)


PRETRAINING_INPUTS = ("input_ids", "token_type_ids", "attention_mask", "labels", "next_sentence_label")


def pretraining_task(binary_head_task: Optional[str]) -> Task:
    """BertPreTrainingOutput -> (loss, {"lm_loss", "sop_loss"|"nsp_loss"}); at evaluation
    also the counts behind "lm_accuracy" and "sop_accuracy"|"nsp_accuracy"."""

    def output_loss(out):
        metrics = {"lm_loss": out.mlm_loss}
        if binary_head_task and out.nsp_loss is not None:
            metrics[f"{binary_head_task}_loss"] = out.nsp_loss
        return out.loss, metrics

    def output_counts(out) -> Counts:
        counts = {"lm_accuracy": masked_lm_counts(out)}
        if binary_head_task and out.nsp_logits is not None and out.nsp_labels is not None:
            counts[f"{binary_head_task}_accuracy"] = sentence_pair_counts(out)
        return counts

    inputs = PRETRAINING_INPUTS if binary_head_task else PRETRAINING_INPUTS[:-1]
    return Task(inputs=inputs, output_loss=output_loss, output_counts=output_counts)


def masked_lm_counts(out: BertPreTrainingOutput) -> torch.Tensor:
    """tensor([correct, masked]): masked positions (label != -100) whose argmax over the
    full vocab is the label, and their number. MLPerf judges BERT by this ratio (72.0%)."""
    labels = out.mlm_labels
    masked = labels != -100
    correct = (out.mlm_predictions == labels) & masked
    return torch.stack([correct.sum(), masked.sum()])


def sentence_pair_counts(out: BertPreTrainingOutput) -> torch.Tensor:
    """tensor([correct, samples]) of the binary (SOP/NSP) head's argmax."""
    labels = out.nsp_labels
    correct = out.nsp_logits.argmax(dim=-1) == labels
    return torch.stack([correct.sum(), torch.tensor(labels.numel(), device=labels.device)])


def checked_batches(batches: Iterable[dict], vocab_size: int, source: str) -> Iterator[dict]:
    """Stops with a clear error when the data holds token ids the vocab does not have
    (a dataset preprocessed with another vocab), instead of an index error deep in the
    embedding. Checked on the CPU batch, so it costs no device sync."""
    for batch in batches:
        top = int(batch["input_ids"].max())
        if top >= vocab_size:
            raise DataError(f"{source} holds token id {top} but the vocab has {vocab_size} entries: the data was "
                            f"preprocessed with another vocab; pass that --vocab-file or preprocess again")
        yield batch


def validate_run(cfg: Configs, ps: ParallelState) -> int:
    """Checks that need the world size (the rest ran in parse_args); returns the DP size."""
    dp = validate_layout(cfg.model, cfg.parallel, ps.world_size, cfg.train)
    # A DeepSpeed JSON that contradicts the flags stops the run before any data work.
    resolve_optimization(cfg, ps, cfg.model.hidden_size)
    # Likewise a --pretrained-checkpoint that holds nothing, before index mappings are built.
    resolve_start(cfg.train)
    return dp


def build_pretraining(cfg: Configs, ps: ParallelState, vocab_size: int,
                      train_batches: Callable[[int], Iterator[dict]],
                      valid_batches: Optional[Callable[[], Iterator[dict]]] = None) -> Trainer:
    """This rank's BertForPreTraining (its pipeline stage), optimizer, DeepSpeed engine and
    checkpoint state -> a ready Trainer."""
    model_cfg = dataclasses.replace(cfg.model, vocab_size=vocab_size)
    seed_default_stream(cfg.train.seed, ps.pp_rank, ps.device)
    model = BertForPreTraining(model_cfg, ps, seed=cfg.train.seed,
                               num_layers_per_virtual_stage=cfg.parallel.num_layers_per_virtual_pipeline_stage)
    apply_compile(model, ps, cfg.train)
    binary_head_task = cfg.data.binary_head_task if model_cfg.bert_binary_head else None
    optim, ds_cfg = resolve_optimization(cfg, ps, model_cfg.hidden_size)
    run = RunSpec(optim=optim, train=cfg.train, task=pretraining_task(binary_head_task),
                  batch=BatchLayout.of(cfg.train.micro_batch_size, cfg.train.global_batch_size, ps.dp_size),
                  seq_length=cfg.data.seq_length, deepspeed_config=ds_cfg)
    masked = int(round(cfg.data.mask_prob * cfg.data.seq_length)) if model_cfg.mlm_logits_at_masked_only else None
    return build_trainer(model, ps, run, train_batches, valid_batches,
                         flops_per_sample=bert_flops_per_sample(model_cfg, cfg.data.seq_length, masked),
                         checkpoint_extra={"train": dataclasses.asdict(cfg.train), "optim": dataclasses.asdict(optim),
                                           "data": dataclasses.asdict(cfg.data)})


def infinite(loader_factory) -> Iterator[dict]:
    """Chains epochs of a loader factory (a fresh iterator each pass)."""
    return itertools.chain.from_iterable(loader_factory() for _ in itertools.count())
