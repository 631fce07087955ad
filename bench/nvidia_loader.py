#!/usr/bin/env python
"""Loader throughput and memory on DeepLearningExamples' HDF5 shards: megabert's reader (lazy
blocks, global order, DataLoader positioned by consumed samples) against DLE's own loop
(`pretraining_dataset` + RandomSampler + DataLoader per file, the next file built in a
ProcessPoolExecutor(1) while the current one trains, as run_pretraining.py at 56ccaf80 does).
Prints figures; never passes or fails on them.

Both sides read the same shards once through (an epoch), with the same micro-batch and
worker count, each in a fresh process, interleaved round by round. Memory is the peak PSS
(proportional set size: pages shared after fork counted once) of the process tree: main
process, loader workers and DLE's pool process, sampled every 50 ms.

The shards: the rows DLE's create_pretraining_data.py made in tests/fixtures/nvidia (phase 1,
seq 128 / 20 predictions), drawn at random to --rows per file and written with DLE's dtypes
and gzip, so compression is that of real shards.

    python bench/nvidia_loader.py [--files 4] [--rows 50000] [--micro-batch 32] [--workers 2] [--rounds 3]
    python bench/nvidia_loader.py --files 2 --rows 400000 --samples 20000 --rounds 1   # memory at DLE's shard size
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import h5py
import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from megabert.config import DataConfig
from megabert.data import build_pretraining_data_loader, build_tokenizer
from megabert.data.shard_sources import detect_nvidia_data
from megabert.tasks.pretraining.nvidia_samples import build_nvidia_datasets

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "nvidia", "dle",
                       "hdf5_lower_case_1_seq_len_128_max_pred_20_masked_lm_prob_0.15_random_seed_12345_"
                       "dupe_factor_2", "pydocs")
KEYS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")
DTYPES = ("i4", "i1", "i1", "i4", "i4", "i1")


def make_shards(out: str, files: int, rows: int, seed: int = 0) -> list[str]:
    source = {k: [] for k in KEYS}
    for name in ("pydocs_training_0.hdf5", "pydocs_training_1.hdf5"):
        with h5py.File(os.path.join(FIXTURE, name), "r") as f:
            for k in KEYS:
                source[k].append(f[k][:])
    source = {k: np.concatenate(v) for k, v in source.items()}
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(files):
        pick = rng.integers(0, len(source["input_ids"]), rows)
        path = os.path.join(out, f"bench_training_{i}.hdf5")
        with h5py.File(path, "w") as f:
            for k, dtype in zip(KEYS, DTYPES):
                f.create_dataset(k, data=source[k][pick], dtype=dtype, compression="gzip")
        paths.append(path)
    return paths


# --- DLE's side: its loader code's behaviour, restated (run_pretraining.py at 56ccaf80) ---

class DLEPretrainingDataset(Dataset):
    """DLE's pretraining_dataset: the whole file read into memory, labels built per item."""

    def __init__(self, input_file, max_pred_length):
        self.input_file, self.max_pred_length = input_file, max_pred_length
        with h5py.File(input_file, "r") as f:
            self.inputs = [np.asarray(f[key][:]) for key in KEYS]

    def __len__(self):
        return len(self.inputs[0])

    def __getitem__(self, index):
        [input_ids, input_mask, segment_ids, masked_lm_positions, masked_lm_ids, next_sentence_labels] = [
            torch.from_numpy(x[index].astype(np.int64)) if i < 5 else torch.from_numpy(
                np.asarray(x[index].astype(np.int64))) for i, x in enumerate(self.inputs)]
        masked_lm_labels = torch.ones(input_ids.shape, dtype=torch.long) * -1
        k = self.max_pred_length
        padded = (masked_lm_positions == 0).nonzero()
        if len(padded) != 0:
            k = padded[0].item()
        masked_lm_labels[masked_lm_positions[:k]] = masked_lm_ids[:k]
        return [input_ids, segment_ids, input_mask, masked_lm_labels, next_sentence_labels]


def _dle_create(input_file, max_pred, micro_batch, workers):
    """DLE's create_pretraining_dataset: runs in the pool process, the DataLoader comes back pickled."""
    data = DLEPretrainingDataset(input_file, max_pred)
    return DataLoader(data, sampler=RandomSampler(data), batch_size=micro_batch, num_workers=workers,
                      pin_memory=False), input_file


def run_dle(files, micro_batch, workers, limit=None, seed=12345) -> int:
    from concurrent.futures import ProcessPoolExecutor

    files = list(files)
    random.Random(seed).shuffle(files)
    pool = ProcessPoolExecutor(1)
    samples = 0
    future = pool.submit(_dle_create, files[0], 20, micro_batch, workers)
    for i in range(len(files)):
        loader, _ = future.result()
        if i + 1 < len(files):  # the next file is read while this one trains
            future = pool.submit(_dle_create, files[i + 1], 20, micro_batch, workers)
        for batch in loader:
            samples += len(batch[0])
            if limit and samples >= limit:
                break
        del loader
        if limit and samples >= limit:
            break
    pool.shutdown(cancel_futures=True)
    return samples


# --- megabert's side: what pretrain_bert.py builds ---

def run_megabert(files, micro_batch, workers, limit=None, seed=12345) -> int:
    data = DataConfig(data_path=list(files), vocab_file=os.path.join(ROOT, "tests", "fixtures", "nvidia", "text",
                                                                     "vocab.txt"), binary_head_task="nsp")
    source = detect_nvidia_data(data.data_path)
    tokenizer = build_tokenizer("BertWordPieceLowerCase", data.vocab_file)
    total = sum(h5py.File(f, "r")["input_ids"].shape[0] for f in files)
    train, _ = build_nvidia_datasets(source, data, tokenizer, (total, 0, 0), seed, micro_batch, True)
    samples = 0
    for batch in build_pretraining_data_loader(train, 0, micro_batch, 0, 1, workers):
        samples += len(batch["input_ids"])
        if limit and samples >= limit:
            break
    return samples


def child(args) -> None:
    t0 = time.perf_counter()  # after the imports: each side's own work from reading the files on
    run = run_megabert if args.side == "megabert" else run_dle
    samples = run(args.files, args.micro_batch, args.workers, args.samples)
    print(json.dumps({"samples": samples, "seconds": time.perf_counter() - t0}))


def _pss(pid: int) -> int:
    """Proportional set size in bytes from the kernel's one-line summary (cheap, unlike full smaps)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def _tree_pss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += _pss(p.pid)
        except (FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess):
            pass
    return total


def measure(side: str, files, micro_batch: int, workers: int, samples) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--micro-batch", str(micro_batch),
           "--workers", str(workers), "--samples", str(samples or 0), "--shards", *files]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    peak, done = [0], threading.Event()

    def sample():
        ps = psutil.Process(proc.pid)
        while not done.is_set():
            try:
                peak[0] = max(peak[0], _tree_pss(ps))
            except psutil.NoSuchProcess:
                return
            time.sleep(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out, _ = proc.communicate()
    done.set()
    thread.join()
    if proc.returncode:
        raise SystemExit(f"{side} failed with exit code {proc.returncode}")
    result = json.loads(out.strip().splitlines()[-1])
    return {**result, "peak_mb": peak[0] / 2 ** 20}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=4, help="shards to write")
    p.add_argument("--rows", type=int, default=50000, help="rows per shard")
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers of both sides (DLE's own: 4)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--samples", type=int, default=0, help="stop each side after this many samples (0: one epoch); "
                   "with large --rows, shows memory without reading everything")
    p.add_argument("--side", choices=("megabert", "dle"), help=argparse.SUPPRESS)
    p.add_argument("--shards", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        args.files = args.shards
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        files = make_shards(tmp, args.files, args.rows)
        size = sum(os.path.getsize(f) for f in files) / 2 ** 20
        print(f"{args.files} shards x {args.rows} rows (seq 128, 20 predictions), {size:.0f} MB gzip, written in "
              f"{time.perf_counter() - t0:.0f} s; micro-batch {args.micro_batch}, {args.workers} workers each; "
              f"{args.rounds} interleaved rounds, {os.cpu_count()} CPUs"
              + (f", first {args.samples} samples of each" if args.samples else ", one epoch each"))
        results = {"megabert": [], "dle": []}
        for r in range(args.rounds):
            for side in (("megabert", "dle") if r % 2 == 0 else ("dle", "megabert")):
                results[side].append(measure(side, files, args.micro_batch, args.workers, args.samples))
    print(f"{'reader':34} {'samples/s':>10} {'peak PSS MB':>12} {'samples/s vs DLE':>17}")
    dle_rate = statistics.median(x["samples"] / x["seconds"] for x in results["dle"])
    for side, label in (("megabert", "megabert (lazy blocks, global order)"), ("dle", "DLE pretraining_dataset")):
        rate = statistics.median(x["samples"] / x["seconds"] for x in results[side])
        peak = max(x["peak_mb"] for x in results[side])
        print(f"{label:34} {rate:10.0f} {peak:12.0f} {rate / dle_rate:16.2f}x")


if __name__ == "__main__":
    main()
