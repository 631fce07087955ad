"""SQuAD fine-tuning pieces handed to the generic Trainer: the QA task, feature batches
sharded over data-parallel ranks, the model from --load, and prediction (logits of
every feature, through pipeline stages and gathered over data-parallel ranks)."""
from __future__ import annotations

import logging
import math
import os
from typing import Iterator, Optional

import numpy as np
import torch

from megabert.config import FinetuneConfigs
from megabert.checkpoint import external
from megabert.errors import ConfigError, DataError
from megabert.tasks.squad import BertForQuestionAnswering
from megabert.parallel import ParallelState, comm
from megabert.tensor_parallel.random import seed_default_stream
from megabert.training.build import apply_compile, build_predictor
from megabert.training.strategy import Task

logger = logging.getLogger(__name__)


def qa_task() -> Task:
    """QuestionAnsweringOutput -> (mean of the start and end cross entropies, {"qa_loss"})."""
    return Task(inputs=("input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions"),
                output_loss=lambda out: (out.loss, {"qa_loss": out.loss}))


def resolve_vocab_file(cfg: FinetuneConfigs) -> str:
    """--vocab-file, else the vocab.txt that came with --load: a Hugging Face or Google TF
    directory's own, or the one convert_hf.py import put beside a megabert checkpoint."""
    if cfg.finetune.vocab_file:
        return cfg.finetune.vocab_file
    candidate = external.external_vocab_file(cfg.train.load) or os.path.join(cfg.train.load, "vocab.txt")
    if os.path.isfile(candidate):
        return candidate
    raise ConfigError(f"--vocab-file is required: {cfg.train.load} has no vocab.txt; pass the vocab the model was "
                      f"pre-trained with")


def load_qa_model(cfg: FinetuneConfigs, ps: ParallelState, vocab_size: int) -> BertForQuestionAnswering:
    """BertForQuestionAnswering from --load (megabert checkpoint of any TP layout, or a
    Hugging Face directory); the QA head is new unless the checkpoint already has one."""
    seed_default_stream(cfg.train.seed, ps.pp_rank, ps.device)
    model = BertForQuestionAnswering.from_pretrained(
        cfg.train.load, ps, seed=cfg.train.seed,
        num_layers_per_virtual_stage=cfg.parallel.num_layers_per_virtual_pipeline_stage)
    if cfg.finetune.max_seq_length > model.config.max_position_embeddings:
        raise ConfigError(f"--max-seq-length {cfg.finetune.max_seq_length} exceeds the model's "
                          f"{model.config.max_position_embeddings} position embeddings ({cfg.train.load})")
    if vocab_size > model.config.vocab_size:
        raise DataError(f"the tokenizer of {resolve_vocab_file(cfg)} has {vocab_size} ids but the model of "
                        f"{cfg.train.load} has {model.config.vocab_size}: pass the vocab it was pre-trained with")
    apply_compile(model, ps, cfg.train)
    return model


def num_train_steps(num_features: int, finetune, global_batch: int) -> int:
    """--train-iters, else ceil(--epochs x features / global batch)."""
    if finetune.train_iters is not None:
        return finetune.train_iters
    return max(1, math.ceil(finetune.epochs * num_features / global_batch))


def feature_batches(tensors: dict[str, torch.Tensor], *, global_batch: int, micro_batch: int, dp_rank: int,
                    dp_size: int, seed: int) -> Iterator[dict]:
    """Micro-batches for this DP rank, endless: every epoch is a fresh permutation of all
    features seeded by (seed, epoch), identical on every rank; each global batch of
    indices is cut into dp_size equal slices and this rank's slice into micro-batches.
    A global batch may span two epochs, so no feature is dropped."""
    n = len(tensors["input_ids"])
    per_rank = global_batch // dp_size
    pending: list[int] = []
    epoch = 0
    while True:
        g = torch.Generator().manual_seed(seed * 1000 + epoch)
        pending += torch.randperm(n, generator=g).tolist()
        epoch += 1
        while len(pending) >= global_batch:
            step, pending = pending[:global_batch], pending[global_batch:]
            mine = step[dp_rank * per_rank:(dp_rank + 1) * per_rank]
            for k in range(0, per_rank, micro_batch):
                index = torch.tensor(mine[k:k + micro_batch])
                yield {key: t[index] for key, t in tensors.items()}


def _logits(out) -> tuple[torch.Tensor, torch.Tensor]:
    return out.start_logits.float().cpu(), out.end_logits.float().cpu()


@torch.no_grad()
def predict_logits(model: torch.nn.Module, tensors: dict[str, torch.Tensor], ps: ParallelState, batch_size: int,
                   bf16: bool = False, fp16: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Start and end logits [n_features, max_seq_length] of every feature, on every rank.
    DP rank r takes the r-th contiguous shard (all TP ranks and pipeline stages of a DP rank
    run the same batches together); the shards are gathered over the data-parallel group.
    Batches are padded to `batch_size` (stages exchange fixed shapes) and trimmed after."""
    n, seq = tensors["input_ids"].shape
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
    predictor = build_predictor(model, ps, qa_task(), seq_length=seq, micro_batch_size=batch_size, bf16=bf16,
                                fp16=fp16)
    outputs = []
    for k in range(0, len(batches), ps.pp_size):
        outputs += predictor.forward_only(batches[k:k + ps.pp_size], _logits)
    if ps.pp_size > 1:
        box = [outputs]
        comm.broadcast_object_list(box, src=ps.last_stage_rank, group=ps.pp_group)
        outputs = box[0]
    start = np.concatenate([o[0][:m].numpy() for o, m in zip(outputs, sizes)]) if outputs \
        else np.zeros((0, seq), np.float32)
    end = np.concatenate([o[1][:m].numpy() for o, m in zip(outputs, sizes)]) if outputs \
        else np.zeros((0, seq), np.float32)
    if ps.dp_size > 1:
        gathered: list[Optional[tuple]] = [None] * ps.dp_size
        comm.all_gather_object(gathered, (start, end), group=ps.dp_group)
        start = np.concatenate([g[0] for g in gathered])
        end = np.concatenate([g[1] for g in gathered])
    return start, end
