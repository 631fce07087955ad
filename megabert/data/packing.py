"""Sequence packing: whole samples laid side by side in rows of --seq-length tokens.

A BERT batch padded to --seq-length spends its padding positions on nothing; fine-tuning
sets (SST-2: a sentence of ~10 tokens in a row of 128) are mostly padding. MLPerf's BERT packs
several samples into each row (Krell et al. 2021, "Efficient Sequence Packing without
Cross-contamination": 1.999 samples per row at seq 512) and keeps attention inside each one.

How rows are filled. The sample stream (the dataset's order, as the unpacked loader reads it)
is cut into windows of `window` samples. Each window is packed on its own by first-fit
decreasing: its samples by length, longest first, each into the first row with room for its
tokens and fewer than `max_samples_per_row` samples, else into a new row. The window's rows
then come out in an order drawn from (seed, window), so a global batch does not get all the
long rows of a window and the next one all the short ones. Every sample of a window lands in
exactly one of its rows, so a window's rows hold exactly samples [k W, (k + 1) W).
(MLPerf's packers work offline, on the length histogram of the whole preprocessed set, and
write packed files; packing windows as they are read needs no second copy of the data, works on
any source and keeps the unpacked sample order, so a run resumes by its sample count.)

Counting. The schedule counts consumed samples (Megatron's unit): a step consumes the samples
of its rows. A run at consumed samples c resumes in window c // W, after the rows whose
samples add up to c % W (a row boundary: steps end on rows). Windows depend on nothing but
their samples, the seed and the flags, so the row stream is the same for any number of loader
workers (each worker packs every n-th window; the loader yields them in window order) and
any data-parallel size: every rank reads the same row stream, takes micro_batch x dp_size rows
per micro-step and keeps its slice, as the unpacked sampler does with samples. (Each rank
builds the samples of every window: their lengths decide the rows.)

A packed micro-batch is fixed-shape tensors (nothing depends on host values): [rows, seq]
token fields, `position_ids` [rows, seq] (each sample from 0), `packed_seqlens` [rows, cap]
(each sample's length, 0 for an empty slot, in row order), per-sample fields as [rows, cap]
(-100 in empty slots), and `packed_counts` = [samples, real tokens, rows, row slots] of the micro-step
over all data-parallel ranks, which the trainer reads and drops. A task whose loss reads a
fraction of the tokens (the masked LM) adds their positions as a fixed [rows, slots]
(with_label_positions), so that its head too has shapes fixed by the flags alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import itertools
import logging
from typing import Iterable, Iterator, Optional

import numpy as np
import torch

from megabert.data.sample_errors import ReportingIterableLoader, read_sample, yield_failures
from megabert.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

# A packed row this short of real tokens, while --max-samples-per-row caps it, is worth a warning:
# unpacked BERT fine-tuning data is often a third real tokens, and packing exists to fix that.
LOW_REAL_TOKEN_SHARE = 0.5

# The micro-step's [samples, real tokens, rows, row slots] over every data-parallel rank (int64 [4]);
# the trainer pops it before the batch goes to the device.
PACKED_COUNTS = "packed_counts"
IGNORE = -100
# Drawn into the row-order seed, so the packer's stream differs from the samples' own draws.
_ROW_ORDER_SALT = 0x5041434B


@dataclass(frozen=True)
class PackingSpec:
    """How a task's samples pack: `sample_fields` are per-sample scalars (a sentence-level
    label) that become [rows, cap]; every other field is a [seq_length] token field whose
    first attention_mask.sum() entries are the sample. `token_fill`: the value of a token
    field past a row's samples (0 unless named)."""

    seq_length: int
    max_samples_per_row: int
    window: int
    seed: int
    sample_fields: tuple[str, ...] = ()
    token_fill: dict = field(default_factory=lambda: {"labels": IGNORE})

    def __post_init__(self):
        if self.max_samples_per_row < 1:
            raise ConfigError(f"--max-samples-per-row must be >= 1, got {self.max_samples_per_row}")
        if self.window < 1:
            raise ConfigError(f"--packing-window must be >= 1, got {self.window}")


def first_fit_decreasing(lengths: np.ndarray, capacity: int, max_per_row: int) -> list[list[int]]:
    """Rows of indices into `lengths`: longest first (ties by index), each into the first row
    with room for it and fewer than `max_per_row` entries, else a new row. Within a row the
    indices are ascending (the stream's order)."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    free = np.empty(len(lengths), dtype=np.int64)
    count = np.empty(len(lengths), dtype=np.int64)
    rows: list[list[int]] = []
    for i in order:
        n = int(lengths[i])
        if n > capacity or n < 1:
            raise DataError(f"a sample of {n} tokens cannot be packed into rows of {capacity}")
        fits = np.flatnonzero((free[:len(rows)] >= n) & (count[:len(rows)] < max_per_row))
        if fits.size:
            r = int(fits[0])
            rows[r].append(i)
            free[r] -= n
            count[r] += 1
        else:
            free[len(rows)], count[len(rows)] = capacity - n, 1
            rows.append([i])
    return [sorted(r) for r in rows]


def pack_rows(samples: list[dict], rows: list[list[int]], spec: PackingSpec) -> dict[str, np.ndarray]:
    """Samples (dicts of numpy arrays, token fields padded to seq_length) -> one array per
    field over `rows` (lists of sample indices), plus position_ids, packed_seqlens and
    row_samples [rows] (samples per row)."""
    s, cap = spec.seq_length, spec.max_samples_per_row
    n = len(rows)
    token_fields = [k for k in samples[0] if k not in spec.sample_fields]
    out = {k: np.full((n, s), spec.token_fill.get(k, 0), dtype=np.int64) for k in token_fields}
    out.update({k: np.full((n, cap), IGNORE, dtype=np.asarray(samples[0][k]).dtype) for k in spec.sample_fields})
    out["position_ids"] = np.zeros((n, s), dtype=np.int64)
    out["packed_seqlens"] = np.zeros((n, cap), dtype=np.int64)
    out["row_samples"] = np.array([len(r) for r in rows], dtype=np.int64)
    for r, members in enumerate(rows):
        at = 0
        for slot, i in enumerate(members):
            sample = samples[i]
            length = int(sample["attention_mask"].sum())
            for k in token_fields:
                out[k][r, at:at + length] = sample[k][:length]
            for k in spec.sample_fields:
                out[k][r, slot] = sample[k]
            out["position_ids"][r, at:at + length] = np.arange(length)
            out["packed_seqlens"][r, slot] = length
            at += length
    return out


def sample_length(sample: dict) -> int:
    """Real tokens of a padded sample: its attention mask is 1 on a prefix."""
    return int(np.asarray(sample["attention_mask"]).sum())


def pack_window(dataset, k: int, spec: PackingSpec) -> dict[str, np.ndarray]:
    """Window k of the sample stream (samples [k W, min((k + 1) W, len))) packed into rows,
    in the order drawn from (seed, k)."""
    lo, hi = k * spec.window, min((k + 1) * spec.window, len(dataset))
    samples = [read_sample(dataset, i) for i in range(lo, hi)]  # a damaged sample: one line naming its file
    lengths = np.array([sample_length(x) for x in samples], dtype=np.int64)
    rows = first_fit_decreasing(lengths, spec.seq_length, spec.max_samples_per_row)
    order = np.random.default_rng([spec.seed, _ROW_ORDER_SALT, k]).permutation(len(rows))
    return pack_rows(samples, [rows[i] for i in order], spec)


class PackedWindows(torch.utils.data.IterableDataset):
    """Windows first_window, first_window + 1, ... of a map-style dataset, each packed
    (pack_window). Worker w of n packs windows first + w, first + w + n, ...: the DataLoader
    takes one item from each worker in turn, so it yields them in window order for any n."""

    def __init__(self, dataset, spec: PackingSpec, first_window: int = 0):
        self.dataset, self.spec, self.first_window = dataset, spec, first_window
        self.num_windows = -(-len(dataset) // spec.window)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        windows = range(self.first_window + worker, self.num_windows, workers)
        # A read error comes back as a SampleFailure, raised by the loader in the main process
        # as its one line (a worker's own traceback would bury it).
        yield from yield_failures(pack_window(self.dataset, k, self.spec) for k in windows)


def packed_loader(dataset, spec: PackingSpec, consumed_samples: int, num_workers: int
                  ) -> torch.utils.data.DataLoader:
    """A DataLoader of packed windows from the one that holds sample `consumed_samples`."""
    if consumed_samples >= len(dataset):
        raise DataError(f"consumed samples {consumed_samples} >= dataset size {len(dataset)}: the dataset was built "
                        f"for fewer samples than the run has already used")
    # NOTE: a generator of its own, as build_pretraining_data_loader's: a new iterator must
    # not draw its workers' base seed from the global RNG (resume would not be bitwise).
    return ReportingIterableLoader(PackedWindows(dataset, spec, consumed_samples // spec.window),
                                   batch_size=None, num_workers=num_workers, persistent_workers=num_workers > 0,
                                   generator=torch.Generator().manual_seed(0))


def packed_micro_batches(windows: Iterable[dict], spec: PackingSpec, consumed_samples: int, micro_batch_size: int,
                         dp_rank: int, dp_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """This data-parallel rank's packed micro-batches from the row stream of `windows` (the
    first of which holds sample `consumed_samples`): each micro-step takes the next
    micro_batch_size x dp_size rows, rank r keeps rows [r mbs, (r + 1) mbs). A stream that
    ends mid-step drops the rest (as drop_last)."""
    step = micro_batch_size * dp_size
    skip = consumed_samples % spec.window
    pending: list[dict[str, np.ndarray]] = []
    have = 0
    for window in windows:
        window = {k: np.asarray(v) for k, v in window.items()}
        if skip:
            done = np.cumsum(window["row_samples"])
            at = int(np.searchsorted(done, skip)) + 1
            if at > len(done) or done[at - 1] != skip:
                raise DataError(f"resuming at {consumed_samples} consumed samples falls inside a packed row: the "
                                f"checkpoint was written with other packing flags (--packing-window, "
                                f"--max-samples-per-row, --seq-length); resume with the flags it was trained with")
            window = {k: v[at:] for k, v in window.items()}
            skip = 0
        pending.append(window)
        have += len(window["row_samples"])
        while have >= step:
            rows = _take(pending, step)
            have -= step
            mine = {k: torch.from_numpy(np.ascontiguousarray(v[dp_rank * micro_batch_size:
                                                                (dp_rank + 1) * micro_batch_size]))
                    for k, v in rows.items() if k != "row_samples"}
            real = int(rows["attention_mask"].sum())
            mine[PACKED_COUNTS] = torch.tensor([int(rows["row_samples"].sum()), real, step, step * spec.seq_length],
                                               dtype=torch.int64)
            yield mine


def _take(pending: list[dict[str, np.ndarray]], n: int) -> dict[str, np.ndarray]:
    """The first n rows of the pending windows (removed from them)."""
    parts = []
    while n:
        head = pending[0]
        rows = len(head["row_samples"])
        if rows <= n:
            parts.append(pending.pop(0))
            n -= rows
        else:
            parts.append({k: v[:n] for k, v in head.items()})
            pending[0] = {k: v[n:] for k, v in head.items()}
            n = 0
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


class EpochStream:
    """Fine-tuning's sample stream as a dataset: sample i is feature perm_e[i mod n] of epoch
    e = i // n, perm_e the permutation seeded by (seed, e) (megabert.training.finetune's
    feature_batches order), endless."""

    def __init__(self, tensors: dict[str, torch.Tensor], seed: int):
        self.tensors, self.seed = tensors, seed
        self.n = len(tensors["input_ids"])
        self._epoch, self._perm = -1, None

    def __len__(self) -> int:
        return 1 << 62

    def epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._epoch = epoch
            self._perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))
        return self._perm

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        epoch, j = divmod(int(i), self.n)
        index = int(self.epoch_order(epoch)[j])
        return {k: t[index].numpy() for k, t in self.tensors.items()}


def packed_feature_batches(tensors: dict[str, torch.Tensor], spec: PackingSpec, *, micro_batch: int, dp_rank: int,
                           dp_size: int, seed: int, consumed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Fine-tuning's features (as feature_batches orders them, epoch after epoch) in packed
    micro-batches for this DP rank, from `consumed` samples on."""
    stream = EpochStream(tensors, seed)
    windows = (pack_window(stream, k, spec) for k in itertools.count(consumed // spec.window))
    return packed_micro_batches(windows, spec, consumed, micro_batch, dp_rank, dp_size)


def rows_per_epoch(tensors: dict[str, torch.Tensor], spec: PackingSpec) -> int:
    """Rows that first-fit decreasing makes of one epoch's features, window by window (the
    first epoch's order; other epochs pack about alike): what sizes a run given in epochs."""
    lengths = tensors["attention_mask"].sum(1).numpy()
    order = EpochStream(tensors, spec.seed).epoch_order(0).numpy()
    return sum(len(first_fit_decreasing(lengths[order[lo:lo + spec.window]], spec.seq_length,
                                        spec.max_samples_per_row))
               for lo in range(0, len(order), spec.window))


def warn_if_packing_wasted(spec: PackingSpec, num_samples: int = 0, real_tokens: int = 0, rows: int = 0,
                           what: str = "samples") -> None:
    """One warning line when --pack-sequences gains nothing or little: --packing-window 1 puts each
    sample in a row of its own; and, given an epoch's counts, rows that are mostly padding while
    --max-samples-per-row is what stops them filling."""
    if spec.window == 1:
        logger.warning("--packing-window 1 puts each of the %s in a row of its own: --pack-sequences packs nothing; "
                       "give a window of hundreds (default 1024)", what)
        return
    if not rows:
        return
    share, per_row = real_tokens / (rows * spec.seq_length), num_samples / rows
    if share < LOW_REAL_TOKEN_SHARE and per_row > spec.max_samples_per_row - 0.5:
        fit = int(spec.seq_length * num_samples / max(real_tokens, 1))  # samples of the mean length a row holds
        logger.warning("packed rows are %.0f%% real tokens with %.1f %s a row, capped by --max-samples-per-row %d: "
                       "raise it (rows of %d tokens hold about %d of these)", 100 * share, per_row, what,
                       spec.max_samples_per_row, spec.seq_length, fit)


def with_fill_check(windows: Iterable[dict], spec: PackingSpec) -> Iterator[dict]:
    """`windows` as they come, the first one's rows checked by warn_if_packing_wasted (pre-training
    learns how its samples pack only from its first packed window)."""
    for k, window in enumerate(windows):
        if k == 0:
            rows = np.asarray(window["row_samples"])
            warn_if_packing_wasted(spec, int(rows.sum()), int(np.asarray(window["packed_seqlens"]).sum()), len(rows))
        yield window


def packing_stats(batches: list[dict]) -> Optional[torch.Tensor]:
    """[samples, real tokens, rows, row slots] summed over packed micro-batches, popped from them; None
    when they are not packed."""
    counts = [b.pop(PACKED_COUNTS) for b in batches if PACKED_COUNTS in b]
    return torch.stack(counts).sum(0) if counts else None


def label_positions(labels: np.ndarray, slots: int) -> np.ndarray:
    """int64 [rows, slots]: each row's positions whose label is not -100, ascending, then -1 in
    the slots left over (NVIDIA's masked_lm_positions, padded). None when a row holds more than
    `slots` of them."""
    labelled = labels != IGNORE
    if int(labelled.sum(1).max(initial=0)) > slots:
        return None
    positions = np.arange(labels.shape[1])
    key = np.where(labelled, positions, positions + labels.shape[1])
    order = np.sort(key, axis=1)[:, :slots]  # the labelled positions first, in order
    return np.where(order < labels.shape[1], order, -1).astype(np.int64)


def host_array(t) -> np.ndarray:
    """A batch field as a host array. Batches come from the DataLoader on the host; one already on
    a device (a caller that keeps its batches there) is read back, one device wait per call."""
    return t.cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


def with_label_positions(batches: Iterable[dict], slots: int, key: str, too_many: str) -> Iterator[dict]:
    """Packed micro-batches (those with packed_seqlens; others pass as they are) with
    `key` = label_positions(labels, slots) added, on the host (no device sync). A row with more
    labelled positions than `slots` stops the run with `too_many` (what to change)."""
    for batch in batches:
        if "packed_seqlens" in batch:
            labels = host_array(batch["labels"])
            positions = label_positions(labels, slots)
            if positions is None:
                most = int((labels != IGNORE).sum(1).max())
                raise DataError(f"a packed row holds {most} masked positions, more than the {slots} slots a row "
                                f"has: {too_many}")
            batch = {**batch, key: torch.from_numpy(positions)}
        yield batch


def flat_label_positions(labels: np.ndarray) -> np.ndarray:
    """int64 [n]: row x seq + column of every label that is not -100, row-major (the order of
    labels[labels != -100]): exactly the labelled positions, however many a row holds."""
    return np.flatnonzero(labels != IGNORE).astype(np.int64)


def _with_flat_positions(batches: Iterable[dict], key: str, field: str, select) -> Iterator[dict]:
    """Unpacked micro-batches (without packed_seqlens; others pass as they are) with `key` = the
    row x seq + column, row-major, of every position where `select(batch[field])` holds, added on
    the host: their number is then known without reading the device (no nonzero() there, a host
    sync on a GPU)."""
    for batch in batches:
        if "packed_seqlens" not in batch and field in batch:
            flat = np.flatnonzero(select(host_array(batch[field]))).astype(np.int64)
            batch = {**batch, key: torch.from_numpy(flat)}
        yield batch


def with_flat_token_positions(batches: Iterable[dict], key: str) -> Iterator[dict]:
    """The real tokens (attention_mask != 0): what the unpadded encoder takes instead of a
    nonzero() of the mask (megabert.model.unpad.TokenLayout)."""
    return _with_flat_positions(batches, key, "attention_mask", lambda mask: mask != 0)


def with_flat_label_positions(batches: Iterable[dict], key: str) -> Iterator[dict]:
    """The labelled positions: flat_label_positions(labels), what the MLM head reads by index."""
    return _with_flat_positions(batches, key, "labels", lambda labels: labels != IGNORE)
