"""SQuAD fine-tuning pieces handed to the generic Trainer: the QA loss, feature batches
sharded over data-parallel ranks, the model from --load, and prediction (logits of
every feature, gathered over data-parallel ranks)."""
from __future__ import annotations

import logging
import math
import os
from typing import Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from megabert.config import FinetuneConfigs
from megabert.checkpoint import hf as hf_io
from megabert.errors import ConfigError, DataError
from megabert.model import BertForQuestionAnswering
from megabert.parallel import ParallelState
from megabert.training.precision import autocast

logger = logging.getLogger(__name__)


def qa_loss_fn(model, batch: dict):
    """(model, batch) -> (mean of the start and end cross entropies, {"qa_loss"})."""
    out = model(batch["input_ids"], token_type_ids=batch["token_type_ids"], attention_mask=batch["attention_mask"],
                start_positions=batch["start_positions"], end_positions=batch["end_positions"])
    return out.loss, {"qa_loss": out.loss}


def resolve_vocab_file(cfg: FinetuneConfigs) -> str:
    """--vocab-file, or the vocab.txt of a Hugging Face --load directory."""
    if cfg.finetune.vocab_file:
        return cfg.finetune.vocab_file
    candidate = os.path.join(cfg.train.load, "vocab.txt")
    if hf_io.is_hf_dir(cfg.train.load) and os.path.isfile(candidate):
        return candidate
    raise ConfigError("--vocab-file is required: the vocab the model was pre-trained with")


def load_qa_model(cfg: FinetuneConfigs, ps: ParallelState, vocab_size: int) -> BertForQuestionAnswering:
    """BertForQuestionAnswering from --load (megabert checkpoint of any TP layout, or a
    Hugging Face directory); the QA head is new unless the checkpoint already has one."""
    torch.manual_seed(cfg.train.seed)
    model = BertForQuestionAnswering.from_pretrained(cfg.train.load, ps, seed=cfg.train.seed)
    if cfg.finetune.max_seq_length > model.config.max_position_embeddings:
        raise ConfigError(f"--max-seq-length {cfg.finetune.max_seq_length} exceeds the model's "
                          f"{model.config.max_position_embeddings} position embeddings ({cfg.train.load})")
    if vocab_size > model.config.vocab_size:
        raise DataError(f"the tokenizer of {resolve_vocab_file(cfg)} has {vocab_size} ids but the model of "
                        f"{cfg.train.load} has {model.config.vocab_size}: pass the vocab it was pre-trained with")
    return model


def num_train_steps(num_features: int, cfg: FinetuneConfigs, global_batch: int) -> int:
    """--train-iters, else ceil(--epochs x features / global batch)."""
    if cfg.finetune.train_iters is not None:
        return cfg.finetune.train_iters
    return max(1, math.ceil(cfg.finetune.epochs * num_features / global_batch))


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


@torch.no_grad()
def predict_logits(model: torch.nn.Module, tensors: dict[str, torch.Tensor], ps: ParallelState, batch_size: int,
                   bf16: bool = False, fp16: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Start and end logits [n_features, max_seq_length] of every feature, on every rank.
    DP rank r takes the r-th contiguous shard (all TP ranks of a DP rank run the same
    batches together); the shards are gathered over the data-parallel group."""
    model.eval()
    n = len(tensors["input_ids"])
    shard = np.array_split(np.arange(n), ps.dp_size)[ps.dp_rank]
    starts, ends = [], []
    for k in range(0, len(shard), batch_size):
        index = torch.as_tensor(shard[k:k + batch_size])
        batch = {key: tensors[key][index].to(ps.device) for key in ("input_ids", "token_type_ids", "attention_mask")}
        with autocast(ps.device, bf16, fp16):
            out = model(batch["input_ids"], token_type_ids=batch["token_type_ids"],
                        attention_mask=batch["attention_mask"])
        starts.append(out.start_logits.float().cpu().numpy())
        ends.append(out.end_logits.float().cpu().numpy())
    seq = tensors["input_ids"].shape[1]
    start = np.concatenate(starts) if starts else np.zeros((0, seq), np.float32)
    end = np.concatenate(ends) if ends else np.zeros((0, seq), np.float32)
    if ps.dp_size > 1:
        gathered: list[Optional[tuple]] = [None] * ps.dp_size
        dist.all_gather_object(gathered, (start, end), group=ps.dp_group)
        start = np.concatenate([g[0] for g in gathered])
        end = np.concatenate([g[1] for g in gathered])
    model.train()
    return start, end
