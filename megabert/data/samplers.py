"""The pre-training data loader: Megatron's MegatronPretrainingSampler, resumable by consumed samples.

The dataset is read in one global order. Each step takes the next micro_batch x dp_size
indices and data-parallel rank r takes its slice [r * micro_batch, (r + 1) * micro_batch),
so a resumed run (consumed_samples from the checkpoint) continues exactly where it
stopped, and every sample is seen by exactly one rank.
"""
from __future__ import annotations

import logging
from typing import Iterator

import torch

from megabert.data.sample_errors import ReportingDataLoader
from megabert.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


class PretrainingSampler(torch.utils.data.Sampler):
    """Yields this rank's micro-batches of indices from `consumed_samples` on (a batch sampler)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, drop_last: bool = True):
        if micro_batch_size < 1:
            raise ConfigError(f"--micro-batch-size must be >= 1, got {micro_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"data-parallel rank {dp_rank} is outside data-parallel size {dp_size}")
        if total_samples <= 0:
            raise DataError("the dataset has no sample")
        if consumed_samples >= total_samples:
            raise DataError(f"consumed samples {consumed_samples} >= dataset size {total_samples}: the dataset was "
                            f"built for fewer samples than the run has already used; build it for "
                            f"--train-iters x --global-batch-size samples")
        self.total, self.consumed = total_samples, consumed_samples
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        global_batch = self.micro_batch_size * self.dp_size
        remaining = self.total - self.consumed
        return remaining // global_batch if self.drop_last else -(-remaining // global_batch)

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.dp_size
        lo = self.dp_rank * self.micro_batch_size
        for start in range(self.consumed, self.total, step):
            batch = list(range(start, min(start + step, self.total)))
            if len(batch) < step and self.drop_last:
                return
            mine = batch[lo:lo + self.micro_batch_size]
            if mine:
                yield mine


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                                  num_workers: int) -> torch.utils.data.DataLoader:
    """A DataLoader of dicts of int64 tensors [micro_batch, ...] for this data-parallel rank. A
    sample that cannot be read raises in this process, one line, as without workers
    (megabert.data.sample_errors): every loader of samples read from files is built here."""
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    # NOTE: each new iterator of a DataLoader draws its workers' base seed from the global
    # torch RNG unless the loader has a generator of its own. That draw shifts the CPU
    # dropout stream, and a resumed run creates its iterator at another step than the
    # uninterrupted one did, so resume would not be bitwise. Samples never need that seed:
    # each is drawn from (seed, index) by the dataset itself.
    return ReportingDataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                               pin_memory=torch.cuda.is_available(), persistent_workers=num_workers > 0,
                               generator=torch.Generator().manual_seed(0))


def warn_if_small(count: int, global_batch: int, what: str) -> None:
    """One warning when an epoch is smaller than a global batch: a step then holds some training
    samples more than once (fine-tuning's feature_batches and pre-training's sample mapping fill it
    from the next epochs), which is legitimate but rarely meant (a one-pair file trained as a batch
    of 32 copies)."""
    if count < global_batch:
        logger.warning("the training data gives %d %s, fewer than one global batch of %d: each step repeats them "
                       "(about %.1f times); lower --global-batch-size to %d or give more data", count, what,
                       global_batch, global_batch / max(count, 1), count)
