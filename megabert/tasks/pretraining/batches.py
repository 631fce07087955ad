"""pretrain_bert.py's batches: train/valid loaders over BERT samples of Megatron's indexed
dataset (indexed_splits) or of NVIDIA's HDF5 / LDDL parquet shards (nvidia_samples),
positioned by consumed samples (Megatron's sample counts), so a resumed run sees exactly the
samples the interrupted one would have; packed when asked, their token ids checked."""
from __future__ import annotations

import itertools
import logging
from typing import Callable, Iterable, Iterator, Optional

from megabert.data import build_pretraining_data_loader
from megabert.data.packing import PackingSpec, packed_loader, packed_micro_batches, with_fill_check
from megabert.data.samplers import warn_if_small
from megabert.data.shard_sources import HDF5, detect_nvidia_data
from megabert.config import DataConfig
from megabert.errors import ConfigError, DataError
from megabert.parallel import ParallelState
from megabert.tasks.pretraining.indexed_samples import BertDataset
from megabert.tasks.pretraining.indexed_splits import build_train_valid_test_datasets
from megabert.tasks.pretraining.masking import MaskRates, ScheduledMasking
from megabert.tasks.pretraining.nvidia_samples import build_nvidia_datasets
from megabert.training.resolve import ResolvedRun

logger = logging.getLogger(__name__)


def build_batches(run: ResolvedRun, ps: ParallelState, tokenizer
                  ) -> tuple[Callable[[int], Iterator[dict]], Optional[Callable[[], Iterator[dict]]]]:
    """(train_batches(consumed_samples), valid_batches() or None) for this DP rank."""
    t, data = run.train, run.data
    global_batch = run.batch.global_batch_size
    evals = (t.train_iters // t.eval_interval + 1) if t.eval_interval else 0
    # Packed, a global batch of rows holds up to --max-samples-per-row samples a row, and the
    # last window is packed whole.
    per_step = global_batch * data.max_samples_per_row if data.pack_sequences else global_batch
    extra = data.packing_window if data.pack_sequences else 0
    num_samples = (t.train_iters * per_step + extra, evals * t.eval_iters * per_step + extra,
                   t.eval_iters * per_step + extra)
    nvidia = detect_nvidia_data(data.data_path)
    if nvidia is not None:
        logger.info("--data-path: %s shards (%d training, %d held-out files)", nvidia.format,
                    sum(map(len, nvidia.train_files)), sum(map(len, nvidia.test_files)))
        train_ds, valid_ds = build_nvidia_datasets(nvidia, data, tokenizer, num_samples, t.seed, global_batch,
                                                   run.model.bert_binary_head)
        if evals and valid_ds is None:
            logger.info("--data-path holds no held-out shard (a file named *test*): no evaluation")
    else:
        train_ds, valid_ds, _ = build_train_valid_test_datasets(data, tokenizer, num_samples, t.seed,
                                                                run.model.bert_binary_head)
    source = " ".join(data.data_path)
    epochs = train_ds.stats.get("epochs", 0) if isinstance(train_ds, BertDataset) else 0  # its mapping's
    if ps.is_logging_rank and epochs > 1 and not data.pack_sequences:
        warn_if_small(len(train_ds) // epochs, global_batch, "samples an epoch")
    if data.mask_prob_schedule is not None:
        if nvidia is not None and nvidia.format == HDF5:
            raise ConfigError(f"--mask-prob-schedule cannot change the masks of --data-path's {HDF5} shards, which "
                              f"are stored masked; drop the flag or train on Megatron indexed data or LDDL shards")
        # Validation keeps --mask-prob, so its losses compare across the schedule.
        train_ds = ScheduledMasking(train_ds, MaskRates.of(data, global_batch))

    packing = packing_spec(data, t.seed) if data.pack_sequences else None

    def loader(ds, consumed):
        if packing is not None:
            return packed_loader(ds, packing, consumed, data.num_workers)
        return build_pretraining_data_loader(ds, consumed, t.micro_batch_size, ps.dp_rank, ps.dp_size,
                                             data.num_workers)

    def batches_of(windows_or_batches, consumed):
        if packing is None:
            return windows_or_batches
        return packed_micro_batches(windows_or_batches, packing, consumed, t.micro_batch_size, ps.dp_rank,
                                    ps.dp_size)

    def train_batches(consumed):
        if packing is not None:  # sized for the whole run: one pass
            windows = loader(train_ds, consumed)
            windows = with_fill_check(windows, packing) if ps.is_logging_rank else windows  # one warning line
            return checked_batches(batches_of(windows, consumed), tokenizer.vocab_size, source)
        return checked_batches(infinite(lambda: loader(train_ds, consumed)), tokenizer.vocab_size, source)

    if valid_ds is None or not evals:
        return train_batches, None

    # One validation loader for the whole run, its workers started here, before training (as
    # Megatron builds its validation iterator once): a new loader per evaluation forked new
    # workers from the training process mid-run, and a child forked while another thread
    # holds a lock can hang in the fork itself (seen: `make demo`'s rank 0 stuck at an
    # evaluation, its worker never started, rank 1 waiting in the TP all-reduce).
    valid_loader = loader(valid_ds, 0)
    if data.num_workers > 0:
        iter(valid_loader)  # persistent workers: every evaluation's iter() reuses them

    def valid_batches():
        return iter(checked_batches(batches_of(valid_loader, 0), tokenizer.vocab_size, source))

    return train_batches, valid_batches


def packing_spec(data: DataConfig, seed: int) -> PackingSpec:
    """--pack-sequences: how BERT samples pack (the sentence-pair label is per sample)."""
    return PackingSpec(seq_length=data.seq_length, max_samples_per_row=data.max_samples_per_row,
                       window=data.packing_window, seed=seed, sample_fields=("next_sentence_label",))


def checked_batches(batches: Iterable[dict], vocab_size: int, source: str) -> Iterator[dict]:
    """Stops with a clear error when the data holds token ids the vocab does not have
    (a dataset preprocessed with another vocab), instead of an index error deep in the
    embedding. Checked on the CPU batch, so it costs no device sync."""
    for batch in batches:
        top = max(int(batch["input_ids"].max()), int(batch["labels"].max()))
        if top >= vocab_size:
            raise DataError(f"{source} holds token id {top} but the vocab has {vocab_size} entries: the data was "
                            f"preprocessed with another vocab; pass that --vocab-file or preprocess again")
        yield batch


def infinite(loader_factory) -> Iterator[dict]:
    """Chains epochs of a loader factory (a fresh iterator each pass)."""
    return itertools.chain.from_iterable(loader_factory() for _ in itertools.count())
