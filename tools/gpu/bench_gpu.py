"""`make bench-gpu`: everything a GPU machine should tell us, in one call.

Steps, each with its log under OUT (default bench_out/):
  install        `make install` (from WHEELHOUSE when that folder exists: the GPU image has
                 no registry), which builds the CUDA kernels against the machine's torch
                 (MEGABERT_CUDA=require when this python has a CUDA torch)
  versions       torch, CUDA, GPU, driver, nvcc and whether the CUDA kernels loaded
  gpu            a CUDA GPU is visible                  } the run stops here when not,
  cuda-kernels   megabert's CUDA extension loaded      } with one line saying why
  tests          the test files with CUDA tests (CUDA_TEST_FILES: the kernels against PyTorch,
                 --cuda-graphs against eager training, the packed step's graph capture and
                 host syncs)
  kernels        bench/kernels.py --device cuda (fp32, bf16, fp16)
  bert-large     bench/gpu_bert_large.py: BERT-large bf16 phase 1/2, megabert (padded,
                 --pack-sequences, and that with --cuda-graphs, both again with
                 --bf16-residual) against transformers: seq/s, real tokens/s, MFU of real
                 tokens, peak memory, the targets; kernel-time breakdown; host syncs per step
  bert-large-compiled
                 the same for megabert --pack-sequences --cuda-graphs --compile alone
                 (the compiled layers captured in the micro-batch's graph), with the graphs
                 compiled and graph breaks after warm-up (at most COMPILED_TIMEOUT_S)
  modernbert     bench/gpu_modernbert.py: ModernBERT-base bf16 seq 1024, micro-batch 16,
                 megabert (pretrain_bert.py --model-family modernbert) against transformers'
                 ModernBertForMaskedLM (sdpa; flash_attention_2 too where flash_attn imports):
                 seq/s, real tokens/s, MFU of real tokens, peak memory, the ratio; kernel-time
                 breakdown; host syncs per step (at most MODERNBERT_TIMEOUT_S)
  optimizer      bench/gpu_optimizer_step.py: the optimizer's pieces of a BERT-large step timed
                 alone against the device's copy bandwidth (at most OPTIMIZER_TIMEOUT_S)
  varlen         bench/gpu_varlen_attention.py (BERT-large bf16 seq 512, padded batches:
                 varlen attention vs SDPA with a padding mask)
  memory         bench/memory.py --layouts single (BERT-base and -large, one GPU)
and summary.json: what ran, exit codes, seconds, key figures (tools/gpu/bench_figures.py)
and the versions. The measuring steps run even when one of them fails; the exit code is
non-zero when any step failed. A machine without a GPU goes through install and versions
and stops at `gpu`.

    python3 tools/gpu/bench_gpu.py        # OUT, WHEELHOUSE from the environment
    python3 tools/gpu/bench_gpu.py --steps bert-large modernbert --deadline-s 540

--steps runs only the named measuring steps, in that order (a lease too short for all of
them); --deadline-s bounds the whole run from its start: each step is stopped at the
deadline (exit code 124) and none starts with under 30 s left (recorded as skipped).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

import bench_figures

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

VPY = os.path.join(ROOT, ".venv", "bin", "python")  # the Makefile's VENV
# BERT-large's compilation (every layer, forward and backward, both phases) is the one step
# whose time we cannot bound from earlier runs; past this it is stopped (exit code 124) so
# that the steps after it still run within a lease's ~10 minutes.
COMPILED_TIMEOUT_S = 240
# ModernBERT-base's step should take about a minute on an H100 (estimated from its FLOPs, not
# yet run there: two models, the epilogues' compilation, 23 steps a side of ~10 TFLOP, the
# breakdown); past this it is stopped, so that a slow start cannot eat the lease.
MODERNBERT_TIMEOUT_S = 150
# The test files with CUDA tests (the rest of each file runs too: seconds on the CPU).
CUDA_TEST_FILES = ("tests/test_fused_kernels.py", "tests/test_cuda_graphs.py", "tests/test_packed_fixed_shape.py",
                   "tests/test_host_syncs.py", "tests/test_unpacked_mlm_positions.py", "tests/test_planning_metrics.py")
# The optimizer's pieces (bench/gpu_optimizer_step.py): BERT-large's states and ~60 timed steps, well under a minute.
OPTIMIZER_TIMEOUT_S = 90


def gpu_problem(versions: dict) -> Optional[str]:
    """Why the GPU steps cannot run (None when they can), from the versions step's report."""
    if not versions.get("torch_cuda"):
        return (f"no CUDA GPU visible (torch.cuda.is_available() is False: torch {versions.get('torch')} has no "
                f"CUDA; on a GPU machine keep its CUDA torch: make install reuses a CUDA torch of PYTHON)")
    if not versions.get("cuda_available"):
        return f"no CUDA GPU visible (torch.cuda.is_available() is False, torch {versions.get('torch')})"
    return None


def kernels_problem(versions: dict) -> Optional[str]:
    if versions.get("cuda_kernels"):
        return None
    return (f"megabert's CUDA kernels did not load ({versions.get('cuda_kernels_error')}); see install.log, or "
            f"build with MEGABERT_CUDA=require for the error")


def stop_line(problem: str, passed: list[str], out: str) -> str:
    """The one line a stopped run ends with."""
    before = ", ".join(passed) if passed else "nothing"
    return f"bench-gpu: {problem}; everything before this step passed: {before}; logs and summary.json in {out}"


class Run:
    """Runs the steps, logs each under `out` and keeps summary.json current after every step,
    so that a run killed at its time limit still leaves what it did."""

    def __init__(self, out: str):
        self.out = out
        self.summary: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "root": ROOT, "steps": [],
                              "versions": None, "stopped": None, "ok": None}
        os.makedirs(out, exist_ok=True)

    def step(self, name: str, cmd: list[str], figures: Optional[Callable] = None, env: Optional[dict] = None,
             timeout: Optional[float] = None) -> int:
        log = os.path.join(self.out, f"{name}.log")
        print(f"bench-gpu: {name}: {' '.join(cmd)} (log: {log})", flush=True)
        t0 = time.time()
        with open(log, "w") as f:
            # A session of its own, so that a step stopped at its limit takes its children
            # (torch.compile's worker processes) with it.
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                f.write(f"\nbench-gpu: {name} stopped after its {timeout:.0f} s limit\n")
                rc = 124
        entry = {"name": name, "command": cmd, "exit_code": rc, "seconds": round(time.time() - t0, 1),
                 "log": os.path.basename(log)}
        if figures is not None:
            with open(log, errors="replace") as f:
                entry["figures"] = figures(f.read().splitlines())
        self.summary["steps"].append(entry)
        self.write()
        print(f"bench-gpu: {name}: exit code {rc} in {entry['seconds']} s", flush=True)
        return rc

    def skip(self, name: str, why: str) -> None:
        print(f"bench-gpu: {name}: skipped ({why})", flush=True)
        self.summary["steps"].append({"name": name, "exit_code": None, "skipped": why})
        self.write()

    def passed(self) -> list[str]:
        return [s["name"] for s in self.summary["steps"] if s["exit_code"] == 0]

    def stop(self, problem: str) -> None:
        line = stop_line(problem, self.passed(), self.out)
        self.summary["stopped"], self.summary["ok"] = line, False
        self.write()
        sys.exit(line)

    def write(self) -> None:
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(self.summary, f, indent=1)


MIN_STEP_S = 30  # --deadline-s: a step that would get less is skipped


def measuring_steps() -> list[tuple[str, list[str], Optional[Callable], Optional[float]]]:
    """(name, command, figures parser, time limit) of each step after install and versions."""
    return [
        ("tests", [VPY, "-m", "pytest", "-q", "-rfs", *CUDA_TEST_FILES], bench_figures.pytest_counts, None),
        ("kernels", [VPY, "bench/kernels.py", "--device", "cuda", "--dtype", "float32", "bfloat16", "float16"],
         bench_figures.kernel_times, None),
        ("bert-large", [VPY, "bench/gpu_bert_large.py"], bench_figures.bert_large, None),
        ("bert-large-compiled", [VPY, "bench/gpu_bert_large.py", "--sides", "megabert-packed-graphs", "--compile",
                                 "--rounds", "10"], bench_figures.bert_large, COMPILED_TIMEOUT_S),
        ("modernbert", [VPY, "bench/gpu_modernbert.py"], bench_figures.modernbert, MODERNBERT_TIMEOUT_S),
        ("optimizer", [VPY, "bench/gpu_optimizer_step.py"], bench_figures.optimizer_pieces, OPTIMIZER_TIMEOUT_S),
        ("varlen", [VPY, "bench/gpu_varlen_attention.py"], bench_figures.varlen_attention, None),
        ("memory", [VPY, "bench/memory.py", "--sizes", "bert-base", "bert-large", "--layouts", "single"],
         bench_figures.memory, None),
    ]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", nargs="+", choices=[s[0] for s in measuring_steps()],
                   help="only these measuring steps, in this order (default: all)")
    p.add_argument("--deadline-s", type=float, help="the whole run's time, install included (a lease's)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    started = time.time()
    out = os.path.abspath(os.environ.get("OUT") or os.path.join(ROOT, "bench_out"))
    wheelhouse = os.environ.get("WHEELHOUSE", "wheelhouse")
    run = Run(out)
    make = ["make", "-C", ROOT, "install"]
    if wheelhouse and os.path.isdir(os.path.join(ROOT, wheelhouse)):
        make.append(f"WHEELHOUSE={wheelhouse}")
    run.summary["wheelhouse"] = make[-1].split("=", 1)[1] if make[-1].startswith("WHEELHOUSE=") else None
    # Where the venv will reuse a CUDA torch, a CUDA build that fails must stop the run with
    # its error in install.log, not fall back to the CPU kernels (pip -q hides that line).
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda or '')"],
                           capture_output=True, text=True, check=False)
    install_env = dict(os.environ, MEGABERT_CUDA="require") if probe.stdout.strip() else None
    if run.step("install", make, env=install_env) != 0:
        run.stop(f"`{' '.join(make)}` failed; the end of install.log says why")
    rc = run.step("versions", [VPY, os.path.join(HERE, "versions.py")])
    with open(os.path.join(out, "versions.log"), errors="replace") as f:
        report = f.read().strip().splitlines()
    try:
        versions = json.loads(report[-1]) if rc == 0 and report else None
    except json.JSONDecodeError:
        versions = None
    if versions is None:
        run.stop("the versions step failed (importing torch or megabert in .venv); see versions.log")
    run.summary["versions"] = versions
    run.write()
    for problem in (gpu_problem(versions), kernels_problem(versions)):
        if problem:
            run.stop(problem)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    steps = {name: (cmd, figures, timeout) for name, cmd, figures, timeout in measuring_steps()}
    failed = []
    for name in args.steps or list(steps):
        cmd, figures, timeout = steps[name]
        if args.deadline_s is not None:
            left = args.deadline_s - (time.time() - started)
            if left < MIN_STEP_S:
                run.skip(name, f"{left:.0f} s left of --deadline-s {args.deadline_s:.0f}")
                continue
            timeout = left if timeout is None else min(timeout, left)
        if run.step(name, cmd, figures, env, timeout) != 0:
            failed.append(name)
    run.summary["ok"] = not failed
    run.write()
    if failed:
        sys.exit(f"bench-gpu: {', '.join(failed)} failed (exit codes in {out}/summary.json, logs beside it)")
    print(f"bench-gpu: all steps passed; logs and summary.json in {out}")


if __name__ == "__main__":
    main()
