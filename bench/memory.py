"""Measured peak memory per rank of pretrain_bert.py next to the layout planner's prediction.

Each layout runs a few iterations (fp32, AdamW, seq 128, micro-batch 2 by default) on a
small corpus made here, with a 30522-entry vocab so the embeddings have BERT's real size.
On the CPU the peak is the largest resident set size of any process the run started (every
rank; `resource.getrusage(RUSAGE_CHILDREN)` of a wrapper process, so runs never mix); the
training log's `mem_peak_gb` is shown too where the trainer writes it, and each rank's own peak
(its VmHWM, sampled from /proc) after the table's columns: pipeline stages differ. On GPUs the measured
figure is `mem_peak_gb` (torch.cuda.max_memory_allocated, max over ranks) and a layout needs
one GPU per rank. The prediction is megabert.planning.estimate for the same model, batch,
layout and device. Each run gets the flags a user types (`--deepspeed --zero-stage 3
--zero-offload-optimizer cpu ...`; pretrain_bert.py sizes DeepSpeed's config to the model).
`vs single` is the measured peak over the one-process peak of the same size in this
invocation; with `--budget-gb`, each run gets `--memory-budget-gb` and `planner` says what
pretrain_bert.py's preflight logged before building the model (warned or fits).

    python bench/memory.py                               # BERT-base, every layout
    python bench/memory.py --sizes bert-large --layouts single zero3 zero3-offload --budget-gb 7
    python bench/memory.py --list                        # the layouts and their flags
    python bench/memory.py --sizes bert-large --layouts single dp2 dp2-distopt dp4 dp4-distopt
    python bench/memory.py --layouts pp2 pp4 --seq 512 --micro-batch 4 --micro-batches 4   # 1F1B in flight

Memory on a shared machine: BERT-large takes 7-9 GB per process; runs go one at a time.
A layout that cannot run here prints "not run: <reason>", never a figure. Where the ranks
together need more than the RAM (BERT-large at DP=4 on 24 GB), a swap file lets them run:
a rank with pages in swap is measured as its largest VmRSS + VmSwap (sampled every 0.2 s)
and the row says how much was in swap.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from megabert.presets import PRESETS
from megabert.planning import Layout, Workload, estimate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VOCAB_SIZE = 30522  # BERT's uncased vocab: the word embeddings and MLM bias at their real size


@dataclass(frozen=True)
class BenchLayout:
    name: str
    layout: Layout


LAYOUTS = {
    "single": BenchLayout("single", Layout()),
    "tp2": BenchLayout("tp2", Layout(tp=2)),
    "pp2": BenchLayout("pp2", Layout(pp=2)),
    "pp4": BenchLayout("pp4", Layout(pp=4)),
    "tp2pp2": BenchLayout("tp2pp2", Layout(tp=2, pp=2)),
    "dp2": BenchLayout("dp2", Layout(dp=2)),
    "dp4": BenchLayout("dp4", Layout(dp=4)),
    # megabert's own ZeRO-1: --use-distributed-optimizer (moments sharded over DP).
    "dp2-distopt": BenchLayout("dp2-distopt", Layout(dp=2, distributed_optimizer=True)),
    "dp4-distopt": BenchLayout("dp4-distopt", Layout(dp=4, distributed_optimizer=True)),
    "zero1": BenchLayout("zero1", Layout(dp=2, zero_stage=1)),
    "zero2": BenchLayout("zero2", Layout(dp=2, zero_stage=2)),
    "zero3": BenchLayout("zero3", Layout(dp=2, zero_stage=3)),
    "zero3-offload": BenchLayout("zero3-offload", Layout(dp=2, zero_stage=3, offload_optimizer=True,
                                                         offload_params=True)),
}
DEFAULT_LAYOUTS = ["single", "tp2", "pp2", "tp2pp2", "dp2", "zero1", "zero2", "zero3", "zero3-offload"]

# Runs the command and reports the largest peak RSS among the processes it waited for
# (torchrun reaps its ranks, so theirs count): Linux keeps ru_maxrss of RUSAGE_CHILDREN
# as the maximum over descendants, in KiB.
_WRAPPER = ("import json, resource, subprocess, sys\n"
            "rc = subprocess.call(sys.argv[1:])\n"
            "print('BENCH_RSS ' + json.dumps({'rc': rc, 'maxrss_kib': "
            "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}), flush=True)\n")

WORDS = ("the model reads every sentence and predicts masked words from context while a second head decides "
         "whether two segments appear in their original order data parallel ranks share gradients tensor parallel "
         "ranks split matrices pipeline stages pass activations memory grows with the batch and the sequence").split()


def make_dataset(workdir: str) -> tuple[str, str]:
    """A small sentence-split corpus, preprocessed, with a vocab padded to VOCAB_SIZE entries."""
    prefix, vocab = os.path.join(workdir, "c"), os.path.join(workdir, "vocab.txt")
    if os.path.exists(prefix + "_text_sentence.idx") and os.path.exists(vocab):
        return prefix + "_text_sentence", vocab
    rng = random.Random(0)
    corpus = os.path.join(workdir, "corpus.jsonl")
    with open(corpus, "w") as f:
        for _ in range(400):
            sents = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20))).capitalize() + "."
                     for _ in range(rng.randint(4, 10))]
            f.write(json.dumps({"text": " ".join(sents)}) + "\n")
    small = os.path.join(workdir, "vocab_small.txt")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train_tokenizer.py"), "--input", corpus,
                    "--output", small, "--vocab-size", "300", "--min-frequency", "1"], check=True, capture_output=True)
    tokens = [t for t in open(small).read().split("\n") if t]
    tokens += [f"[unused{i}]" for i in range(VOCAB_SIZE - len(tokens))]
    with open(vocab, "w") as f:
        f.write("\n".join(tokens) + "\n")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus,
                    "--output-prefix", prefix, "--json-keys", "text", "--tokenizer-type", "BertWordPieceLowerCase",
                    "--vocab-file", vocab, "--split-sentences", "--workers", "1"], check=True, capture_output=True)
    return prefix + "_text_sentence", vocab


def command(size: str, bl: BenchLayout, args, data: str, vocab: str, workdir: str, port: int) -> list[str]:
    model = PRESETS[size]()
    lay = bl.layout
    world = lay.world_size
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port", str(port),
           os.path.join(ROOT, "pretrain_bert.py"),
           "--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden_size),
           "--num-attention-heads", str(model.num_attention_heads), "--seq-length", str(args.seq),
           "--max-position-embeddings", "512", "--micro-batch-size", str(args.micro_batch),
           "--global-batch-size", str(args.micro_batch * args.micro_batches * lay.dp), "--train-iters", str(args.iters),
           "--lr", "1e-4", "--data-path", data, "--vocab-file", vocab, "--split", "100,0,0",
           "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "0", "--num-workers", "0",
           "--tensor-model-parallel-size", str(lay.tp), "--pipeline-model-parallel-size", str(lay.pp),
           "--metrics-file", os.path.join(workdir, f"{size}-{bl.name}.jsonl"),
           # The planner predicts the peak of a batch with no padding (what long-document
           # corpora give, and what any run meets sooner or later); this corpus of short
           # docstrings pads ~40% of positions, which the default unpadded encoder would
           # not hold. The padded encoder holds a full batch's activations on any data.
           "--no-unpad-input"]
    if lay.distributed_optimizer:
        cmd += ["--use-distributed-optimizer"]
    if lay.zero_stage:
        # The flags users type: pretrain_bert.py sizes DeepSpeed's ZeRO buffers to the model
        # (megabert.data_parallel.zero_plan.ZeroBuckets, the numbers the planner reads).
        cmd += ["--deepspeed", "--zero-stage", str(lay.zero_stage)]
        if lay.offload_optimizer:
            cmd += ["--zero-offload-optimizer", "cpu"]
        if lay.offload_params:
            cmd += ["--zero-offload-params", "cpu"]
    return cmd


def measure(cmd: list[str], nproc: int, log_path: str) -> tuple[int, float, dict[int, float], float]:
    """(exit code, peak GB of the largest process, {rank: peak GB}, largest swap GB seen).
    The per-rank peaks are the ranks' VmHWM (Linux's peak RSS), read from /proc every 0.2 s
    while they run: it only grows, so the last reading is the peak of every step but a
    spike in the final 0.2 s. Where a rank had pages in swap, its peak is the largest
    VmRSS + VmSwap sampled (what it would hold without swap, to 0.2 s), if above its VmHWM."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc)), "MEGABERT_BENCH_RUN": tag}
    ranks: dict[int, float] = {}
    swap = [0.0]
    with open(log_path, "w") as log, tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, "-c", _WRAPPER, *cmd], stdout=out, stderr=log, text=True, env=env,
                                cwd=ROOT)
        while proc.poll() is None:
            ranks.update(_rank_peaks(tag, ranks, swap))
            time.sleep(0.2)
        out.seek(0)
        stdout = out.read()
        log.write(stdout)
    line = [x for x in stdout.splitlines() if x.startswith("BENCH_RSS ")][-1]
    info = json.loads(line[len("BENCH_RSS "):])
    return info["rc"], max([info["maxrss_kib"] * 1024 / 1e9, *ranks.values()]), ranks, swap[0]


def _rank_peaks(tag: str, seen: dict[int, float], swap: list[float]) -> dict[int, float]:
    """{rank: peak GB} of this run's training processes alive now (never below `seen`):
    VmHWM, or VmRSS + VmSwap where larger; `swap[0]` keeps the largest VmSwap seen."""
    peaks = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            if env.get(b"MEGABERT_BENCH_RUN") != tag.encode() or b"RANK" not in env:
                continue
            with open(f"/proc/{pid}/status") as f:
                status = {k: int(v.split()[0]) for k, v in (x.split(":", 1) for x in f)
                          if k in ("VmHWM", "VmRSS", "VmSwap")}
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
        if "VmHWM" not in status:
            continue
        rank = int(env[b"RANK"])
        swapped = status.get("VmSwap", 0)
        swap[0] = max(swap[0], swapped * 1024 / 1e9)
        peak = max(status["VmHWM"], status.get("VmRSS", 0) + swapped)
        peaks[rank] = max(seen.get(rank, 0.0), peak * 1024 / 1e9)
    return peaks


def logged_peak(path: str) -> float | None:
    """max mem_peak_gb of the training log, where the trainer writes it."""
    if not os.path.exists(path):
        return None
    vals = [json.loads(x).get("mem_peak_gb") for x in open(path) if x.strip()]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def planner_said(log_path: str) -> str:
    """What pretrain_bert.py's memory preflight logged on rank 0: "warned", "fits" or "-"."""
    text = open(log_path).read() if os.path.exists(log_path) else ""
    if "WARNING predicted peak" in text:
        return "warned"
    return "fits" if "INFO predicted peak" in text else "-"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["bert-base"], choices=sorted(PRESETS),
                   help="model presets to run (bert-large takes 7-9 GB per process)")
    p.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS, choices=sorted(LAYOUTS))
    p.add_argument("--iters", type=int, default=3, help="training iterations per run")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches per step and data-parallel rank (pipelines keep up to PP in flight)")
    p.add_argument("--budget-gb", type=float, default=None,
                   help="pass --memory-budget-gb GB to every run and show whether the planner warned")
    p.add_argument("--workdir", default=None, help="keep data, logs and metrics here (default: a temp dir)")
    p.add_argument("--predict-only", action="store_true", help="print the predictions, run nothing")
    p.add_argument("--list", action="store_true", help="list the layouts and exit")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.list:
        for name, bl in LAYOUTS.items():
            print(f"{name:14} world {bl.layout.world_size}  {bl.layout.flags()}")
        return
    workdir = args.workdir or tempfile.mkdtemp(prefix="megabert-bench-memory-")
    os.makedirs(workdir, exist_ok=True)
    data, vocab = (None, None) if args.predict_only else make_dataset(workdir)
    budget = f" | --memory-budget-gb {args.budget_gb:g}" if args.budget_gb else ""
    print(f"fp32 AdamW | seq {args.seq} micro-batch {args.micro_batch} x {args.micro_batches} per step and DP rank | "
          f"{args.iters} iterations | "
          f"peak RSS of the largest rank (GB = 1e9 bytes){budget} | workdir {workdir}")
    print(f"{'model':10} {'layout':14} {'world':>5} {'measured GB':>12} {'predicted GB':>13} {'meas/pred':>9} "
          f"{'vs single':>9} {'planner':>7} {'mem_peak_gb':>11} {'time s':>7}  per-rank peak GB (CPU: rank 0, 1, ..)")
    import torch

    gpus = torch.cuda.device_count()
    device = "cuda" if gpus else "cpu"
    port = 29700
    for size in args.sizes:
        model = PRESETS[size](vocab_size=VOCAB_SIZE)
        single = None
        for name in args.layouts:
            bl = LAYOUTS[name]
            run = Workload(seq_length=args.seq, micro_batch_size=args.micro_batch, precision="fp32", device=device,
                           global_batch_size=args.micro_batch * args.micro_batches * bl.layout.dp)
            predicted = estimate(model, run, bl.layout).total_gb
            head = f"{size:10} {name:14} {bl.layout.world_size:5d}"
            blank = f"{'':>9} {'':>9} {'':>7} {'':>11}"
            too_few_gpus = device == "cuda" and bl.layout.world_size > gpus
            if args.predict_only or too_few_gpus:
                reason = "--predict-only" if args.predict_only else \
                    f"needs {bl.layout.world_size} GPUs, this machine has {gpus}"
                print(f"{head} {'not run':>12} {predicted:13.2f} {blank} {'':>7}  not run: {reason}", flush=True)
                continue
            port += 1
            cmd = command(size, bl, args, data, vocab, workdir, port)
            if args.budget_gb:
                cmd += ["--memory-budget-gb", f"{args.budget_gb:g}"]
            log_path = os.path.join(workdir, f"{size}-{name}.log")
            t0 = time.time()
            rc, measured, per_rank, swapped = measure(cmd, bl.layout.world_size, log_path)
            elapsed = time.time() - t0
            if rc != 0:
                print(f"{head} {'failed':>12} {predicted:13.2f} {blank} {elapsed:7.0f}  not run: exit code "
                      f"{rc}, see {log_path}", flush=True)
                continue
            logged = logged_peak(os.path.join(workdir, f"{size}-{name}.jsonl"))
            logged_s = f"{logged:11.2f}" if logged is not None else f"{'-':>11}"
            if device == "cuda":
                if logged is None:
                    print(f"{head} {'not run':>12} {predicted:13.2f} {blank} {elapsed:7.0f}  not run: "
                          f"the training log has no mem_peak_gb (GPU peaks come from the trainer)", flush=True)
                    continue
                measured = logged
            single = measured if name == "single" else single
            vs_single = f"{measured / single:9.2f}" if single else f"{'-':>9}"
            ranks = " ".join(f"{per_rank[r]:.2f}" for r in sorted(per_rank)) if device == "cpu" else ""
            if swapped:
                ranks += f" (RSS + swap: up to {swapped:.2f} GB in swap)"
            print(f"{head} {measured:12.2f} {predicted:13.2f} {measured / predicted:9.2f} {vs_single} "
                  f"{planner_said(log_path):>7} {logged_s} {elapsed:7.0f}  {ranks}", flush=True)


if __name__ == "__main__":
    main()
