"""ModernBERT from seq 1024 to 8192 on the CPU: time and peak memory PER TOKEN of forward +
backward, for megabert's ModernBertForMaskedLM as pretrain_bert.py runs it (unpadded encoder,
logits at the 30% masked positions only), its global and local layers apart, and transformers'
ModernBertForMaskedLM on the same weights and batch (sdpa, sparse_prediction: logits at the
masked positions too), as ratios. Per token, a layer whose cost is linear in the sequence is
flat; the global layers' attention grows with s, the local layers' should not.

Every (seq, measured part) point runs in a fresh subprocess, so one point's heap never
counts in another's. Memory is the process's own: the peak resident set (/proc/self/status
VmHWM) over its first full-size step, reset just before it through /proc/self/clear_refs,
less the resident set before it (the model, its weights and the batch; free heap pages
handed back first with malloc_trim): it counts torch's
allocations, which tracemalloc does not see, and the allocator's slack, as a CPU run's first
step pays them. (Later steps reuse the heap's pages, so their peak above the start says
nothing; one step of 128 tokens first does the lazy one-time set-up.) Times are the median
of --reps steps after that, in CPU seconds of the process (all its threads) by default: on a
shared machine other processes stretch wall time at random, CPU time much less (--clock wall
for an idle machine). Layer columns: one layer of the kind alone, forward and backward
on the backbone's hidden states (the AttentionInputs the model builds), in its own process.
The backends in use are printed (the local layers' window: megabert's C++ kernel once it
takes one, else the blocked PyTorch path of local_attention.py). Nothing passes or fails.

    python bench/modernbert_long_context.py [--layers 4 --hidden 256 --heads 4 --reps 3 --threads 2]
    python bench/modernbert_long_context.py --seqs 1024 2048 --layers 2 --hidden 128 --heads 2   # quick
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key} (the bench reads Linux's peak RSS)")


def peak_of(step) -> int:
    """Bytes the step's resident set peaked above where it started."""
    import ctypes
    import gc

    gc.collect()
    # Free heap pages stay resident (glibc keeps them for reuse), and the step would reuse
    # them without raising the RSS: hand them back first, so that the RSS before the step is
    # what is live and every page the step needs shows in its peak.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    before = _status_kib("VmRSS")
    step()
    return (_status_kib("VmHWM") - before) * 1024


def timed(step, reps: int, clock: str) -> float:
    now = time.process_time if clock == "cpu" else time.perf_counter
    times = []
    for _ in range(reps):
        t0 = now()
        step()
        times.append(now() - t0)
    return statistics.median(times)


def build(args):
    import megabert

    cfg = megabert.modernbert_tiny(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                                   unpad_input=True, mlm_logits_at_masked_only=True)
    model = megabert.ModernBertForMaskedLM(cfg, megabert.init_parallel())
    model.train()
    return cfg, model, None


def make_batch(cfg, seq: int) -> dict:
    """One row of `seq` tokens, 30% of them predicted (ModernBERT's recipe), no padding."""
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, cfg.vocab_size, (1, seq), generator=gen)
    labels = torch.where(torch.rand(ids.shape, generator=gen) < 0.3, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def backends(model) -> dict:
    """What runs: the attention back-end of each layer kind, the kernels' build."""
    from megabert import fused_kernels

    layers = list(model.bert.encoder.layers.values())
    kinds = {}
    for layer in layers:
        attn = layer.attn
        if attn.is_global:
            kinds["global"] = "varlen kernel" if attn.varlen else model.ctx.attention_backend
        else:
            kinds["local"] = "window blocks (PyTorch, local_attention.py)" if attn.blocked else \
                f"{model.ctx.attention_backend} (window in the kernel)"
    kinds["kernels"] = "megabert CPU kernels built" if fused_kernels.is_available() else "no compiled kernels"
    return kinds


def measure(make_step, args) -> dict:
    """Warm up on 128 tokens, then the first full-size step's peak, then the median time."""
    make_step(128)()
    step = make_step(args.seq)
    peak = peak_of(step)
    return {"s": timed(step, args.reps, args.clock), "peak": peak}


def point_megabert(args) -> dict:
    import torch

    from megabert.model.unpad import TokenLayout

    cfg, model, _ = build(args)

    def model_step(seq):
        batch = make_batch(cfg, seq)

        def step():
            model.zero_grad(set_to_none=True)
            model(**batch).loss.backward()
        return step

    if args.part == "model":
        return {**measure(model_step, args), "backends": backends(model)}
    # One layer of the kind alone, on the hidden states the backbone feeds its layers.
    layer_id = 0 if args.part == "global" else 1
    assert cfg.is_global_layer(layer_id) == (args.part == "global")
    layer, backbone = model.bert.encoder.layers[str(layer_id)], model.bert

    def layer_step(seq):
        batch = make_batch(cfg, seq)
        with torch.no_grad():
            hidden = backbone.embeddings(batch["input_ids"])
        tokens = TokenLayout(batch["attention_mask"])
        inputs = backbone._inputs(hidden, batch["attention_mask"], tokens)
        x = tokens.unpad(hidden).detach().requires_grad_(True)

        def step():
            layer.zero_grad(set_to_none=True)
            layer(x, inputs).sum().backward()
        return step

    return measure(layer_step, args)


def point_transformers(args) -> dict:
    import transformers

    cfg, model, _ = build(args)
    with tempfile.TemporaryDirectory() as d:
        model.save_hf(d)
        del model
        theirs = transformers.ModernBertForMaskedLM.from_pretrained(d, attn_implementation="sdpa",
                                                                    sparse_prediction=True)
    theirs.train()

    def model_step(seq):
        batch = make_batch(cfg, seq)

        def step():
            theirs.zero_grad(set_to_none=True)
            theirs(**batch).loss.backward()
        return step

    return measure(model_step, args)


def run_point(args, seq: int, side: str, part: str = "model") -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--point", side, "--part", part, "--seq", str(seq), "--layers", str(args.layers),
           "--hidden", str(args.hidden), "--heads", str(args.heads), "--reps", str(args.reps),
           "--threads", str(args.threads), "--clock", args.clock]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": str(args.threads)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no stderr)"])[-1]
        return {"error": f"exit {r.returncode}: {tail}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def per_token(seconds: float, peak: int, seq: int) -> str:
    return f"{seconds / seq * 1e6:9.1f} {peak / seq / 1024:8.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--layers", type=int, default=4, help="layers 0, 3, ... global, the others local (%(default)s)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="cpu: the process's CPU seconds (robust on a shared machine); wall: elapsed")
    p.add_argument("--no-transformers", action="store_true", help="megabert's rows only")
    p.add_argument("--point", choices=("megabert", "transformers"), help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--part", choices=("model", "global", "local"), default="model", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.point:  # one subprocess, one point
        import torch

        torch.set_num_threads(args.threads)
        fn = point_megabert if args.point == "megabert" else point_transformers
        print(json.dumps(fn(args)))
        return

    print(f"ModernBERT {args.layers} layers (global every 3rd, window 128), hidden {args.hidden}, {args.heads} heads, "
          f"vocab 50368, batch 1, 30% masked, fp32, {args.threads} threads; forward + backward, median of {args.reps} "
          f"({args.clock} time)")
    print("per token: time in us, peak memory above the step's start in KiB (VmHWM, fresh process per point; the "
          "model's includes its parameter gradients, made in the step); ratio: transformers / megabert")
    head = (f"{'seq':>5} | {'model us':>9} {'KiB':>8} | {'global us':>9} {'KiB':>8} | {'local us':>9} {'KiB':>8} | "
            f"{'HF us':>9} {'KiB':>8} | {'time x':>6} {'mem x':>6}")
    printed_backends = False
    for seq in args.seqs:
        ours = run_point(args, seq, "megabert")
        if "error" in ours:
            print(f"{seq:5d} | megabert: {ours['error']}")
            continue
        kinds = {kind: run_point(args, seq, "megabert", kind) for kind in ("global", "local")}
        if not printed_backends:
            print("backends: " + ", ".join(f"{k}: {v}" for k, v in ours["backends"].items()))
            print(head)
            printed_backends = True
        theirs = {"error": "skipped"} if args.no_transformers else run_point(args, seq, "transformers")
        row = f"{seq:5d} | {per_token(ours['s'], ours['peak'], seq)} | "
        for kind in ("global", "local"):
            k = kinds[kind]
            row += f"{'error':>18} | " if "error" in k else f"{per_token(k['s'], k['peak'], seq)} | "
        if "error" in theirs:
            row += f"transformers: {theirs['error']}"
        else:
            row += (f"{per_token(theirs['s'], theirs['peak'], seq)} | "
                    f"{theirs['s'] / ours['s']:6.2f} {theirs['peak'] / max(ours['peak'], 1):6.2f}")
        print(row, flush=True)


if __name__ == "__main__":
    main()
