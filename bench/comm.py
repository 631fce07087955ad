"""Measured bytes per training step, by group, next to the layout planner's prediction.

Each layout runs pretrain_bert.py for a few iterations on a small corpus (bench/memory.py's,
30522-entry vocab, so the embeddings have BERT's real size) with a small BERT (4 layers,
hidden 128, seq 64, micro-batch 2, two micro-batches per rank and step, fp32). The measured
figures are the last logged step's `comm_gb` and `comm_gb_by_group` from the metrics JSONL:
the busiest rank's bytes, counted by megabert's communication ledger (megabert.parallel.comm;
DeepSpeed's collectives as `zero`) in the planner's unit, the bytes a rank sends under ring
collectives. The prediction is megabert.planning.communication for the same model, batch and
layout (the busiest stage). Target: measured / predicted within 5% for every layout.

Columns, MB (1e6 bytes) per step: tp (TP and sequence-parallel collectives), pp (pipeline
p2p), dp (DP gradient all-reduce, or all of DeepSpeed's traffic), emb (tied word-embedding
sum), rest (what the planner does not model: the grad-norm all-reduce over TP x PP, the loss
averaging over DP, cross-entropy's per-token sums are in tp), then the totals and their ratio.

    python bench/comm.py                       # every layout below (CPU, gloo: ~4 minutes on 2 cores)
    python bench/comm.py --layouts tp2 zero3   # some

Runs use --no-unpad-input, as bench/memory.py: the planner predicts batches without padding
(what long-document corpora give), and this corpus pads; the unpadded encoder's collectives
shrink with the padding (the `tp2-unpad` row shows by how much on this corpus).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

from memory import VOCAB_SIZE, make_dataset  # bench/memory.py: the same corpus

from megabert.arguments import parse_args as parse_pretrain_args
from megabert.planning import Layout, Workload, communication

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "128", "--micro-batch-size", "2"]
MICRO_BATCHES = 2  # per data-parallel rank and step: gradient accumulation and pipeline fill both show

# name -> (Layout, extra flags)
LAYOUTS = {
    "tp2": (Layout(tp=2), []),
    "tp2-sp": (Layout(tp=2, sequence_parallel=True), ["--sequence-parallel"]),
    "tp2-unpad": (Layout(tp=2), ["--unpad-input"]),
    "pp2": (Layout(pp=2), []),
    "pp2-interleaved": (Layout(pp=2, virtual_stages=2), ["--num-layers-per-virtual-pipeline-stage", "1"]),
    "dp2": (Layout(dp=2), []),
    "dp2-no-overlap": (Layout(dp=2), ["--no-overlap-grad-reduce"]),
    "dp2-distopt": (Layout(dp=2, distributed_optimizer=True), ["--use-distributed-optimizer"]),
    "tp2pp2": (Layout(tp=2, pp=2), []),
    "zero1": (Layout(dp=2, zero_stage=1), ["--deepspeed", "--zero-stage", "1"]),
    "zero2": (Layout(dp=2, zero_stage=2), ["--deepspeed", "--zero-stage", "2"]),
    "zero3": (Layout(dp=2, zero_stage=3), ["--deepspeed", "--zero-stage", "3"]),
}
# measured labels -> planner field
COLUMNS = {"tp": (("tp", "sp"), "tensor_parallel"), "pp": (("pp",), "pipeline_parallel"),
           "dp": (("dp", "zero"), "data_parallel"), "emb": (("embedding",), "embedding_sync")}


def flags(layout: Layout, extra: list[str]) -> list[str]:
    out = MODEL + ["--global-batch-size", str(2 * MICRO_BATCHES * layout.dp),
                   "--tensor-model-parallel-size", str(layout.tp), "--pipeline-model-parallel-size", str(layout.pp)]
    return out + (extra if "--unpad-input" in extra else ["--no-unpad-input"] + extra)


def predict(layout: Layout, extra: list[str]):
    cfg = parse_pretrain_args(flags(layout, extra))  # the model exactly as pretrain_bert.py builds it
    model = dataclasses.replace(cfg.model, vocab_size=VOCAB_SIZE)
    work = Workload(seq_length=cfg.data.seq_length, micro_batch_size=cfg.train.micro_batch_size,
                    global_batch_size=cfg.train.global_batch_size, precision="fp32", device="cpu",
                    mlm_logits_at_masked_only=True, mask_prob=cfg.data.mask_prob)
    return communication(model, work, layout)


def run(name: str, layout: Layout, extra: list[str], data: str, vocab: str, workdir: str, port: int, iters: int):
    """(exit code, the last training row of the metrics JSONL or None, log path)."""
    metrics, log = os.path.join(workdir, f"{name}.jsonl"), os.path.join(workdir, f"{name}.log")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(layout.world_size),
           "--master-port", str(port), os.path.join(ROOT, "pretrain_bert.py"), *flags(layout, extra),
           "--train-iters", str(iters), "--lr", "1e-4", "--data-path", data, "--vocab-file", vocab,
           "--split", "100,0,0", "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "0",
           "--num-workers", "0", "--metrics-file", metrics]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    rows = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
    rows = [r for r in rows if "comm_gb" in r]
    return rc, (rows[-1] if rows else None), log


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--iters", type=int, default=3, help="training iterations per run (the last one is reported)")
    p.add_argument("--workdir", default=None, help="keep data, logs and metrics here (default: a temp dir)")
    args = p.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="megabert-bench-comm-")
    os.makedirs(workdir, exist_ok=True)
    data, vocab = make_dataset(workdir)
    print(f"fp32, 4 layers, hidden 128, seq 64, micro-batch 2 x {MICRO_BATCHES} per DP rank, vocab {VOCAB_SIZE} | "
          f"MB (1e6 bytes) sent per step by the busiest rank | step {args.iters} of {args.iters} | workdir {workdir}")
    cols = list(COLUMNS)
    print(f"{'':16} | {'measured (ledger)':^46} | {'predicted (planner)':^39} |")
    print(f"{'layout':16} | " + " ".join(f"{c:>7}" for c in cols) + f" {'rest':>6} {'total':>7} | "
          + " ".join(f"{c:>7}" for c in cols) + f" {'total':>7} | {'meas/pred':>9}")
    port = 29750
    for name in args.layouts:
        layout, extra = LAYOUTS[name]
        predicted = predict(layout, extra)
        port += 1
        t0 = time.time()
        rc, row, log = run(name, layout, extra, data, vocab, workdir, port, args.iters)
        if rc != 0 or row is None:
            print(f"{name:16} | not run: exit code {rc}, see {log}", flush=True)
            continue
        by_group = {k: v * 1e3 for k, v in row["comm_gb_by_group"].items()}  # GB -> MB
        measured = {c: sum(by_group.get(k, 0.0) for k in labels) for c, (labels, _) in COLUMNS.items()}
        total = row["comm_gb"] * 1e3
        rest = max(total - sum(measured.values()), 0.0)  # (float rounding)
        pred = {c: getattr(predicted, field) / 1e6 for c, (_, field) in COLUMNS.items()}
        pred_total = sum(pred.values())
        print(f"{name:16} | " + " ".join(f"{measured[c]:7.3f}" for c in cols) + f" {rest:6.3f} {total:7.3f} | "
              + " ".join(f"{pred[c]:7.3f}" for c in cols) + f" {pred_total:7.3f} | "
              f"{total / pred_total:9.3f}   ({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
