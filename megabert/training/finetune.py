"""What every fine-tuning task shares, knowing no task: the vocab beside --load, the task
model from --load, the step count from --epochs, feature batches sharded over data-parallel
ranks, and forward-only prediction over every layout (gathered over data-parallel ranks).

A task's config dataclass (the "finetune" section of FinetuneConfigs) has at least the
fields of `TaskConfig`; SQuAD's and GLUE's entry scripts hand theirs to these helpers.
"""
from __future__ import annotations

import math
import os
from typing import Callable, Iterator, Optional, Protocol, Sequence

import numpy as np
import torch

from megabert.checkpoint import external
from megabert.config import FinetuneConfigs
from megabert.errors import ConfigError, DataError
from megabert.parallel import ParallelState, comm
from megabert.tensor_parallel.random import seed_default_stream
from megabert.training.build import apply_compile, build_predictor
from megabert.training.strategy import Task


class TaskConfig(Protocol):
    """The fields of a task config that the shared fine-tuning code reads."""

    vocab_file: Optional[str]
    tokenizer_type: str
    max_seq_length: int
    epochs: float
    train_iters: Optional[int]
    predict_batch_size: Optional[int]
    output_dir: Optional[str]


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


def load_task_model(model_class: type, cfg: FinetuneConfigs, ps: ParallelState, vocab_size: int,
                    **config_overrides) -> torch.nn.Module:
    """`model_class` from --load (megabert checkpoint of any TP layout, or a Hugging Face /
    TF directory); its task head is new unless the checkpoint already has one.
    `config_overrides`: ModelConfig fields the task sets (e.g. the number of labels)."""
    seed_default_stream(cfg.train.seed, ps.pp_rank, ps.device)
    model = model_class.from_pretrained(
        cfg.train.load, ps, seed=cfg.train.seed,
        num_layers_per_virtual_stage=cfg.parallel.num_layers_per_virtual_pipeline_stage, **config_overrides)
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
                    task: Task, outputs_of: Callable[[object], Sequence[torch.Tensor]], *, bf16: bool = False,
                    fp16: bool = False) -> list[np.ndarray]:
    """The arrays `outputs_of(model output)` picks (each [batch, ...], float CPU), for every
    feature in order, on every rank. DP rank r takes the r-th contiguous shard (all TP ranks
    and pipeline stages of a DP rank run the same batches together); the shards are
    gathered over the data-parallel group. Batches are padded to `batch_size` with PP > 1
    (stages exchange fixed shapes) and trimmed after."""
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
    predictor = build_predictor(model, ps, task, seq_length=seq, micro_batch_size=batch_size, bf16=bf16,
                                fp16=fp16)

    def pick(out):
        return tuple(t.float().cpu() for t in outputs_of(out))

    outputs = []
    for k in range(0, len(batches), ps.pp_size):
        outputs += predictor.forward_only(batches[k:k + ps.pp_size], pick)
    if ps.pp_size > 1:
        box = [outputs]
        comm.broadcast_object_list(box, src=ps.last_stage_rank, group=ps.pp_group)
        outputs = box[0]
    arrays = None
    if outputs:
        arrays = [np.concatenate([o[i][:m].numpy() for o, m in zip(outputs, sizes)]) for i in range(len(outputs[0]))]
    if ps.dp_size > 1:
        gathered: list[Optional[list]] = [None] * ps.dp_size
        comm.all_gather_object(gathered, arrays, group=ps.dp_group)
        # A rank with an empty shard (fewer features than DP ranks) returns None.
        parts = [g for g in gathered if g is not None]
        arrays = [np.concatenate([g[i] for g in parts]) for i in range(len(parts[0]))] if parts else None
    return arrays
