"""BERT pre-training pieces handed to the generic Trainer: the loss function, batch
checks and the model/optimizer/engine/checkpoint assembly shared by entry scripts."""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Callable, Iterable, Iterator, Optional

import torch

from megabert.config import Configs, validate_layout
from megabert.errors import DataError
from megabert.model import BertForPreTraining
from megabert.model.bert_pipeline import BertForPreTrainingPipelineStage
from megabert.optim import build_optimizer
from megabert.parallel import ParallelState
from megabert.pipeline_parallel import PipeComm, PipelineSchedule
from megabert.training import deepspeed_engine
from megabert.training.checkpointing import TrainingState, load_checkpoint
from megabert.training.metrics import bert_flops_per_sample
from megabert.training.precision import DynamicLossScaler, autocast
from megabert.training.trainer import Trainer

logger = logging.getLogger(__name__)


def make_output_loss(binary_head_task: Optional[str]):
    """BertPreTrainingOutput -> (loss, {"lm_loss", "sop_loss"|"nsp_loss"})."""

    def output_loss(out):
        metrics = {"lm_loss": out.mlm_loss}
        if binary_head_task and out.nsp_loss is not None:
            metrics[f"{binary_head_task}_loss"] = out.nsp_loss
        return out.loss, metrics

    return output_loss


def make_loss_fn(binary_head_task: Optional[str]):
    """(model, batch) -> (loss, {"lm_loss", "sop_loss"|"nsp_loss"})."""
    output_loss = make_output_loss(binary_head_task)

    def loss_fn(model, batch: dict):
        out = model(batch["input_ids"], token_type_ids=batch["token_type_ids"],
                    attention_mask=batch["attention_mask"], labels=batch["labels"],
                    next_sentence_label=batch.get("next_sentence_label") if binary_head_task else None)
        return output_loss(out)

    return loss_fn


def build_pipeline(cfg: Configs, ps: ParallelState, model_cfg, binary_head_task: Optional[str]):
    """This rank's pipeline stage and the schedule that drives it."""
    model = BertForPreTrainingPipelineStage(model_cfg, ps, seed=cfg.train.seed,
                                            num_layers_per_virtual_stage=cfg.parallel.num_layers_per_virtual_pipeline_stage)
    global_batch = cfg.train.global_batch_size or cfg.train.micro_batch_size * ps.dp_size
    num_micro = global_batch // (cfg.train.micro_batch_size * ps.dp_size)
    # The residual stream stays fp32 under autocast, so stages exchange fp32.
    comm = PipeComm(ps, model.activation_shape(cfg.data.seq_length, cfg.train.micro_batch_size), torch.float32)
    schedule = PipelineSchedule(model, ps, comm, num_micro, make_output_loss(binary_head_task),
                                autocast=lambda: autocast(ps.device, cfg.train.bf16, cfg.train.fp16))
    return model, schedule


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
    if cfg.train.deepspeed:
        deepspeed_config(cfg, ps)  # a JSON that contradicts the flags stops the run before any data work
    return dp


def deepspeed_config(cfg: Configs, ps: ParallelState) -> dict:
    """DeepSpeed's config from the flags, merged with --deepspeed_config (conflicts raise)."""
    ds_cfg = deepspeed_engine.build_config(cfg.train, cfg.optim, ps)
    if cfg.train.deepspeed_config:
        ds_cfg = deepspeed_engine.merge_user_config(cfg.train.deepspeed_config, ds_cfg, cfg.train)
    return ds_cfg


def build_pretraining(cfg: Configs, ps: ParallelState, vocab_size: int,
                      train_batches: Callable[[int], Iterator[dict]],
                      valid_batches: Optional[Callable[[], Iterator[dict]]] = None) -> Trainer:
    """Model, optimizer, DeepSpeed engine and checkpoint state -> a ready Trainer.
    `train_batches(consumed_samples)` gives the training batches from that point on, so a
    resumed run sees exactly the samples the interrupted one would have."""
    model_cfg = dataclasses.replace(cfg.model, vocab_size=vocab_size)
    torch.manual_seed(cfg.train.seed + 100 * ps.pp_rank)  # default stream: same on TP ranks (see random.py)
    binary_head_task = cfg.data.binary_head_task if model_cfg.bert_binary_head else None
    pipeline = None
    if ps.pp_size > 1:
        model, pipeline = build_pipeline(cfg, ps, model_cfg, binary_head_task)
    else:
        model = BertForPreTraining(model_cfg, ps, seed=cfg.train.seed)
    optimizer = build_optimizer(model, cfg.optim, ps.tp_group)
    engine = None
    if cfg.train.deepspeed:
        engine = deepspeed_engine.initialize(model, optimizer, deepspeed_config(cfg, ps), ps)
    state = TrainingState()
    scaler = DynamicLossScaler(cfg.optim) if cfg.train.fp16 and engine is None else None
    if cfg.train.load:
        state = load_checkpoint(cfg.train.load, model, optimizer, ps, scaler=scaler, engine=engine,
                                load_optimizer=not cfg.train.finetune)
        if cfg.train.finetune:
            state = TrainingState()
        if ps.is_logging_rank:
            logger.info("loaded %s: iteration %d, %d samples consumed", cfg.train.load, state.iteration,
                        state.consumed_samples)
    masked = int(round(cfg.data.mask_prob * cfg.data.seq_length)) if model_cfg.mlm_logits_at_masked_only else None
    return Trainer(model=model, optimizer=optimizer, ps=ps, train=cfg.train, optim=cfg.optim,
                   loss_fn=make_loss_fn(binary_head_task), pipeline=pipeline,
                   train_batches=train_batches(state.consumed_samples), valid_batches=valid_batches, engine=engine,
                   state=state, scaler=scaler, flops_per_sample=bert_flops_per_sample(model_cfg, cfg.data.seq_length, masked),
                   checkpoint_extra={"train": dataclasses.asdict(cfg.train), "optim": dataclasses.asdict(cfg.optim),
                                     "data": dataclasses.asdict(cfg.data)})


def infinite(loader_factory) -> Iterator[dict]:
    """Chains epochs of a loader factory (a fresh iterator each pass)."""
    return itertools.chain.from_iterable(loader_factory() for _ in itertools.count())
