"""Which training pairs make each global batch, when the order is more than one shuffle:
several training files (each global batch from one of them) and --no-duplicates.

Every rank computes the same sequence of global batches from the seed alone, and takes its
DP slice of each: so every rank runs the same number of steps (the count is fixed before
training and every file's stream is endless; sentence-transformers' first no-duplicates
sampler over-reported its length and left DDP ranks waiting, #3348), and a resumed run
regenerates the sequence and skips the global batches it has consumed.

A file's stream: epoch after epoch, a permutation of its pairs seeded by (seed, file,
epoch), cut into global batches in order; the pairs left over at an epoch's end open the
next one's first batch (no pair is dropped). One file without --no-duplicates gives the
driver's own order (megabert.training.finetune.feature_batches).

--no-duplicates (sentence-transformers' NoDuplicatesBatchSampler, and FlagEmbedding's
same-dataset batches): a batch takes the waiting pairs in order, passing over any pair
that repeats a text (query, positive or negative) already in the batch; the passed-over
pairs keep their place at the front of the queue for the next batch. A copy of a passage
in the same batch would otherwise be scored as a negative of its own query's positive
(a false negative). Deferred pairs are counted (`deferrals`) and logged.
"""
from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from megabert.errors import DataError
from megabert.tasks.embeddings.data import Pair

@dataclass(frozen=True)
class TrainingFile:
    name: str  # for the per-file loss: the file name without .jsonl
    path: str
    start: int  # its first pair's index among all files' pairs (the features' rows)
    pairs: list[Pair]


def file_names(paths: Sequence[str]) -> list[str]:
    """Short names of the training files (their base names without .jsonl), made unique."""
    names = []
    for i, path in enumerate(paths):
        name = os.path.basename(path).removesuffix(".jsonl")
        names.append(name if name not in names else f"{name}_{i}")
    return names


class BatchPlan:
    """The global batches of a run: (file index, the pairs' row indices), step after step."""

    def __init__(self, files: Sequence[TrainingFile], *, global_batch: int, seed: int, no_duplicates: bool,
                 sampling: str = "proportional", weights: Optional[Sequence[float]] = None):
        self.files, self.global_batch, self.seed = list(files), global_batch, seed
        self.sampling = sampling
        self.weights = list(weights) if weights is not None else [float(len(f.pairs)) for f in files]
        self.keys = [[texts_of(p) for p in f.pairs] for f in files] if no_duplicates else None
        self.deferrals = 0  # pairs passed over for a later batch, summed over the batches handed out
        self.deferred_pairs: set[tuple[int, int]] = set()
        if no_duplicates:
            for d, f in enumerate(self.files):
                if fill(deque(range(len(f.pairs))), self.keys[d], global_batch) is None:
                    distinct = len(set().union(*self.keys[d]))
                    raise DataError(f"--no-duplicates: {f.path} cannot fill one global batch of {global_batch} pairs "
                                    f"without repeating a text ({len(f.pairs)} pairs, {distinct} distinct texts); "
                                    f"lower --global-batch-size or drop --no-duplicates")

    def file_order(self) -> Iterator[int]:
        """The file of each step, endless."""
        if len(self.files) == 1:
            while True:
                yield 0
        if self.sampling == "round_robin":
            while True:
                yield from range(len(self.files))
        g = torch.Generator().manual_seed(self.seed)
        p = torch.tensor(self.weights, dtype=torch.float64)
        while True:  # drawn 1024 at a time: the same sequence whatever the run's length
            yield from torch.multinomial(p, 1024, replacement=True, generator=g).tolist()

    def stream(self, d: int) -> Iterator[list[int]]:
        """File d's global batches (indices into its pairs), endless."""
        n, size = len(self.files[d].pairs), self.global_batch
        pending: deque[int] = deque()
        epoch = 0
        while True:
            # File 0's permutations are the driver's (feature_batches'): seed * 1000 + epoch.
            g = torch.Generator().manual_seed(self.seed * 1000 + epoch + 1_000_003 * d)
            pending.extend(torch.randperm(n, generator=g).tolist())
            epoch += 1
            while len(pending) >= size:
                if self.keys is None:
                    yield [pending.popleft() for _ in range(size)]
                    continue
                taken = fill(pending, self.keys[d], size)
                if taken is None:
                    if len(pending) > 2 * n + size:  # more than two epochs' worth and still no batch
                        raise DataError(f"--no-duplicates: {self.files[d].path} left {len(pending)} pairs that cannot "
                                        f"fill a global batch of {size} without repeating a text; lower "
                                        f"--global-batch-size or drop --no-duplicates")
                    break  # too few distinct pairs wait: the next epoch's join them
                batch, skipped = taken
                self.deferrals += len(skipped)
                self.deferred_pairs.update((d, i) for i in skipped)
                yield batch

    def global_batches(self, skip: int = 0) -> Iterator[tuple[int, list[int]]]:
        """(file index, row indices of all files' features) per step, from step `skip` on."""
        streams = [self.stream(d) for d in range(len(self.files))]
        for step, d in enumerate(self.file_order()):
            batch = next(streams[d])
            if step >= skip:
                start = self.files[d].start
                yield d, [start + i for i in batch]


def texts_of(pair: Pair) -> frozenset[str]:
    return frozenset((pair.query, pair.positive, *pair.negatives))


def fill(pending: deque, keys: list[frozenset], size: int) -> Optional[tuple[list[int], list[int]]]:
    """(batch, passed over) of the waiting pairs: the first `size` pairs in order that share no
    text, taken off `pending`, the passed-over ones back at its front in their order; None
    (and `pending` as it was) when the waiting pairs cannot fill a batch."""
    taken, skipped, seen = [], [], set()
    scanned = []
    while pending and len(taken) < size:
        i = pending.popleft()
        scanned.append(i)
        if seen.isdisjoint(keys[i]):
            taken.append(i)
            seen.update(keys[i])
        else:
            skipped.append(i)
    if len(taken) < size:
        pending.extendleft(reversed(scanned))
        return None
    pending.extendleft(reversed(skipped))
    return taken, skipped


def plan_batches(plan: BatchPlan, tensors: dict[str, torch.Tensor], *, micro_batch: int, dp_rank: int, dp_size: int,
                 consumed: int, on_step=None) -> Iterator[dict]:
    """This DP rank's micro-batches of the plan's global batches, from `consumed` samples on
    (a whole number of global batches). `on_step(file index)` runs as a step's first
    micro-batch is handed out, before the step trains on it."""
    per_rank = plan.global_batch // dp_size
    for d, step in plan.global_batches(skip=consumed // plan.global_batch):
        if on_step is not None:
            on_step(d)
        mine = step[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        for k in range(0, per_rank, micro_batch):
            index = torch.tensor(mine[k:k + micro_batch])
            yield {key: t[index] for key, t in tensors.items()}
