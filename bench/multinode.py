"""Two "nodes" on one machine: step time of DP=2, TP=2 and PP=2 across a shaped link,
next to loopback and to the planner's prediction, and how much of the data-parallel
all-reduce a step hides.

Two network namespaces joined by a veth pair whose bandwidth `tc ... tbf` limits; one
`torchrun --nnodes 2` agent in each, rendezvous and gloo over the veth
(GLOO_SOCKET_IFNAME). For each bandwidth and layout, pretrain_bert.py across the link and
on loopback, alternating, --repeats times, the fastest run of each kept (so the machine's
noise falls on both alike, and a neighbour's burst on neither); at
DP=2 with the overlapped reduction on and off, and transformers' BERT of the same shape
under PyTorch DDP, plus the gradient all-reduce timed alone across the link:

    hidden = 1 - (step across the link - step on loopback) / all-reduce alone across the link

The planner's prediction (megabert.planning.step_time): the layout's compute is its
loopback step less the communication the model exposes at loopback's bandwidth (the
all-reduce timed alone on loopback), then its communication at the link's bandwidth is
added, less what the overlap hides. Every layout runs the same global batch (2 x
--micro-batch samples of 128 tokens: DP=2 one micro-batch per rank, TP=2 and PP=2 two), so
step times rank the layouts as throughput does.

Needs root (namespaces, tc); elsewhere it says so and exits 0. Everything it creates is
removed on exit, also on Ctrl-C or an error; every run has a timeout.

    sudo .venv/bin/python bench/multinode.py [--bandwidths 1,10] [--layouts dp2,tp2,pp2] [--steps 16] [--repeats 2]
        [--micro-batch 8] [--bucket-elements 1048576] [--sides overlap,distopt,ZeRO]

At DP=2 the sides are megabert's trainer (overlapped reduction on and off, and with
--use-distributed-optimizer: reduce-scatter in backward, all-gather in forward), DeepSpeed
ZeRO-1 and ZeRO-2 (pretrain_bert.py --deepspeed --zero-stage N) and PyTorch DDP; MB/step is
the comm ledger's count (DDP's peer has none).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile

from megabert.config import BUCKET_ELEMENTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NS = ("megabert-n0", "megabert-n1")
DEV = ("mbveth0", "mbveth1")
ADDR = ("10.213.7.1", "10.213.7.2")
PORT = 29811
# About 12M parameters: the model the issue measured (hidden 384, 6 layers, vocab 2000).
# Micro-batch 8 puts the gradient all-reduce across 1 Gbit/s (0.40 s) at half the loopback
# step (0.80 s), the share the issue measured (0.42 s against 0.95 s) on a machine half as
# fast; at 4 the backward (0.28 s) is shorter than the all-reduce it should hide.
SHAPE = dict(layers=6, hidden=384, heads=6, vocab=2000, seq=128, micro=8)
# Twelve buckets for this model, for both megabert and DDP: the trainer's default (4M
# elements) makes three, and the first, a third of the model, leaves backward only 35% in.
BENCH_BUCKET = 1024 * 1024


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=60)


def make_link(gbit: float) -> None:
    remove_link()
    for ns in NS:
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", DEV[0], "type", "veth", "peer", "name", DEV[1])
    for ns, dev, addr in zip(NS, DEV, ADDR):
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        # The bucket holds 0.25 ms at the rate (64 KiB at least, one GSO packet): a bucket of
        # rate / HZ (10 ms) would pass a tensor-parallel all-reduce of a few hundred KB at the
        # veth's own speed and shape only the average, which a real link does not do.
        burst = max(int(gbit * 1e9 / 8 * 0.25e-3), 64 * 1024)
        # TCP hands the veth 64 KB GSO packets; tbf splits any packet larger than its bucket
        # into MTU-sized ones in software, 40x the packets, and their softirq work overflows
        # into ksoftirqd, which competes with the ranks for the two cores: across 1 Gbit/s
        # the gradient all-reduce then reached 78% of the rate, and overlapping it stretched
        # a 0.66 s backward-sized compute to 1.01 s. A NIC segments in hardware, so packets
        # are kept to half the bucket: 96% of the rate and 0.07 s of stretch (loopback's).
        sh("ip", "-n", ns, "link", "set", dev, "gso_max_size", str(min(65536, burst // 2)))
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{gbit}gbit",
           "burst", str(burst), "latency", "50ms")


def remove_link() -> None:
    for ns in NS:
        sh("ip", "netns", "del", ns, check=False)  # takes its end of the veth pair with it
    sh("ip", "link", "del", DEV[0], check=False)


_launches = 0


def launch(worker: list[str], link: bool, timeout: int = 900) -> list[str]:
    """Runs `worker` under torchrun on both nodes; returns node 0's stdout lines."""
    global _launches
    _launches += 1
    port = PORT + _launches % 100  # a fresh port: the last run's may still be in TIME_WAIT
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": DEV[rank] if link else "lo"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
               "--nproc-per-node", "1", "--master-addr", ADDR[0] if link else "127.0.0.1",
               "--master-port", str(port), *worker]
        if link:
            cmd = ["ip", "netns", "exec", NS[rank], *cmd]
        # A session of its own: the cleanup below takes the agent's workers down with it.
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            if p.returncode:
                raise RuntimeError(f"{' '.join(worker[:2])} failed:\n{err[-3000:]}")
            outs.append(out)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # its workers too, when interrupted or failed
            except ProcessLookupError:
                pass
    return outs[0].splitlines()


def make_data(work: str) -> str:
    """A small corpus, its WordPiece vocab and indexed dataset (as tests/conftest.py's dataset)."""
    import random

    rng = random.Random(0)
    words = [f"w{i}" for i in range(1500)]
    with open(os.path.join(work, "corpus.jsonl"), "w") as f:
        for _ in range(400):
            sents = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 30))).capitalize() + "."
                     for _ in range(12)]
            f.write(json.dumps({"text": " ".join(sents)}) + "\n")
    tools = os.path.join(ROOT, "tools")
    subprocess.run([sys.executable, os.path.join(tools, "train_tokenizer.py"), "--input", f"{work}/corpus.jsonl",
                    "--output", f"{work}/vocab.txt", "--vocab-size", str(SHAPE["vocab"]), "--min-frequency", "1"],
                   check=True, capture_output=True)
    subprocess.run([sys.executable, os.path.join(tools, "preprocess_data.py"), "--input", f"{work}/corpus.jsonl",
                    "--output-prefix", f"{work}/c", "--json-keys", "text", "--tokenizer-type",
                    "BertWordPieceLowerCase", "--vocab-file", f"{work}/vocab.txt", "--split-sentences",
                    "--workers", "1"], check=True, capture_output=True)
    return work


LAYOUTS = {"dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}  # (TP, PP) of two ranks
GLOBAL_BATCH = 2 * SHAPE["micro"]  # one micro-batch per rank at DP=2, two at TP=2 and PP=2
BUCKET = BENCH_BUCKET  # --bucket-elements: megabert's --ddp-bucket-size and DDP's bucket_cap_mb


def megabert_step(work: str, steps: int, link: bool, layout: str, overlap: bool = True,
                  extra: tuple[str, ...] = ()) -> tuple[float, float]:
    """(median step seconds, MB the busiest rank sent per step by the comm ledger)."""
    metrics = os.path.join(work, f"m-{link}-{layout}-{overlap}-{'_'.join(extra)}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    s = SHAPE
    tp, pp = LAYOUTS[layout]
    launch([os.path.join(ROOT, "pretrain_bert.py"), "--num-layers", str(s["layers"]), "--hidden-size",
            str(s["hidden"]), "--num-attention-heads", str(s["heads"]), "--seq-length", str(s["seq"]),
            "--max-position-embeddings", "512", "--micro-batch-size", str(s["micro"]),
            "--global-batch-size", str(GLOBAL_BATCH), "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--train-iters", str(steps),
            "--data-path", f"{work}/c_text_sentence", "--vocab-file", f"{work}/vocab.txt", "--split", "100,0,0",
            "--log-interval", "1", "--eval-interval", "0", "--num-workers", "0", "--metrics-file", metrics,
            "--ddp-bucket-size", str(BUCKET), *([] if overlap else ["--no-overlap-grad-reduce"]), *extra], link)
    rows = [json.loads(line) for line in open(metrics) if "iteration_time_s" in line]
    return (statistics.median(r["iteration_time_s"] for r in rows[2:]),
            statistics.median(r["comm_gb"] * 1e3 for r in rows[2:]))


def peer(args: list[str], link: bool) -> float:
    lines = launch([os.path.join(ROOT, "bench", "_multinode_peer.py"), *args], link)
    return json.loads([line for line in lines if line.startswith("{")][-1])["median_s"]


def model_config():
    import megabert

    s = SHAPE
    return megabert.ModelConfig(num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
                                vocab_size=s["vocab"], max_position_embeddings=512)


def param_count() -> int:
    import megabert
    from megabert.parallel import ParallelState

    model = megabert.BertForPreTraining(model_config(), ParallelState.offline(), device="meta")
    return sum(p.numel() for p in model.parameters())


def predict(layout: str, overlap: bool, loop_s: float, loop_gbit: float, link_gbit: float, *, zero_stage: int = 0,
            distributed_optimizer: bool = False) -> float:
    """The planner's step across the link: the loopback step less what the model exposes at
    loopback's bandwidth (its compute), plus what it exposes at the link's."""
    from megabert.planning import Layout, Workload
    from megabert.planning.step_time import Links, step_time

    model, (tp, pp) = model_config(), LAYOUTS[layout]
    run = Workload(seq_length=SHAPE["seq"], micro_batch_size=SHAPE["micro"], global_batch_size=GLOBAL_BATCH,
                   device="cpu", overlap_grad_reduce=overlap)
    lay = Layout(tp=tp, pp=pp, dp=2 // (tp * pp), zero_stage=zero_stage, distributed_optimizer=distributed_optimizer)
    exposed = lambda gbit, compute: step_time(  # noqa: E731  one rank per "node": every group crosses
        model, run, lay, Links(gpus_per_node=1, intra_gbit=gbit, inter_gbit=gbit), compute,
        bucket_elements=BUCKET).exposed_s
    # The exposed DP share depends on the compute (the backward window): two fixed-point passes.
    compute = loop_s - exposed(loop_gbit, loop_s)
    compute = loop_s - exposed(loop_gbit, compute)
    return compute + exposed(link_gbit, compute)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bandwidths", default="1,10", help="Gbit/s of the link, comma-separated")
    p.add_argument("--layouts", default="dp2,tp2,pp2", help="of dp2, tp2, pp2, comma-separated")
    p.add_argument("--steps", type=int, default=16, help="training steps per run (the first two are not timed)")
    p.add_argument("--bucket-elements", type=int, default=BENCH_BUCKET,
                   help="DP bucket of both megabert (--ddp-bucket-size) and DDP (bucket_cap_mb); the trainer's "
                        f"default is {BUCKET_ELEMENTS}")
    p.add_argument("--micro-batch", type=int, default=SHAPE["micro"],
                   help="sequences per micro-batch (the step's compute; the all-reduce does not change)")
    p.add_argument("--sides", default=None,
                   help="only the DP sides whose name contains one of these words, comma-separated (e.g. "
                        "overlap,distopt,ZeRO; default: all)")
    p.add_argument("--repeats", type=int, default=2, help="loopback/link pairs per side (the fastest of each kept)")
    args = p.parse_args()
    if args.repeats < 1 or args.steps < 4 or args.micro_batch < 1:
        p.error(f"--repeats and --micro-batch must be >= 1 and --steps >= 4, got {args.repeats}, "
                f"{args.micro_batch} and {args.steps}")
    if os.geteuid() != 0:
        print("bench/multinode.py needs root (network namespaces and tc); skipped")
        return
    layouts = args.layouts.split(",")
    if not set(layouts) <= set(LAYOUTS):
        p.error(f"--layouts takes {', '.join(LAYOUTS)}, got {args.layouts}")
    global BUCKET, GLOBAL_BATCH
    BUCKET = args.bucket_elements
    SHAPE["micro"], GLOBAL_BATCH = args.micro_batch, 2 * args.micro_batch
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # run the cleanup below on a kill too
    n = param_count()
    s = SHAPE
    shape = [str(s[k]) for k in ("layers", "hidden", "heads", "vocab", "seq", "micro")]
    # (name, layout, overlap: True/False for megabert's trainer, else the DDP peer's model)
    # (name, layout, overlap or the DDP peer's model, extra flags of pretrain_bert.py)
    sides = [("megabert overlap", "dp2", True, ()), ("megabert no-overlap", "dp2", False, ()),
             ("megabert distopt", "dp2", True, ("--use-distributed-optimizer",)),
             ("DeepSpeed ZeRO-1", "dp2", True, ("--deepspeed", "--zero-stage", "1")),
             ("DeepSpeed ZeRO-2", "dp2", True, ("--deepspeed", "--zero-stage", "2")),
             ("DDP, megabert's model", "dp2", "megabert", ()), ("DDP, transformers", "dp2", "transformers", ())]
    sides = [x for x in sides if "dp2" in layouts] + [(f"megabert {x}", x, True, ()) for x in layouts if x != "dp2"]
    if args.sides:
        wanted = args.sides.split(",")
        sides = [x for x in sides if any(w in x[0] for w in wanted)]
    rows = []
    with tempfile.TemporaryDirectory() as work:
        make_data(work)
        # Loopback's bandwidth, from the same all-reduce alone: ring all-reduce sends 2(n-1)/n x 4n bytes.
        wire_gbit = lambda secs: 4.0 * n * 8 / secs / 1e9  # noqa: E731  (two ranks: 2(n-1)/n = 1)
        loop_gbit = wire_gbit(min(peer(["allreduce", str(n)], False) for _ in range(args.repeats)))
        try:
            for gbit in (float(b) for b in args.bandwidths.split(",")):
                make_link(gbit)
                alone = min(peer(["allreduce", str(n)], True) for _ in range(args.repeats))
                for name, layout, overlap, extra in sides:
                    ddp = isinstance(overlap, str)
                    run = (lambda link: (peer(["ddp", overlap, *shape, str(args.steps), str(BUCKET)], link), None)) \
                        if ddp else (lambda link: megabert_step(work, args.steps, link, layout, overlap, extra))
                    pairs = [(run(False), run(True)) for _ in range(args.repeats)]
                    loop, link = min(lo[0] for lo, _ in pairs), min(li[0] for _, li in pairs)
                    mb = pairs[0][1][1]
                    zero = int(extra[extra.index("--zero-stage") + 1]) if "--zero-stage" in extra else 0
                    pred = None if ddp else predict(layout, overlap, loop, loop_gbit, gbit, zero_stage=zero,
                                                    distributed_optimizer="--use-distributed-optimizer" in extra)
                    hidden = 1 - (link - loop) / alone if layout == "dp2" else None
                    rows.append((gbit, name, loop, link, pred, alone, hidden, mb))
                    print(f"  {gbit:g} Gbit/s {name}: loopback {loop:.3f} s, link {link:.3f} s", file=sys.stderr,
                          flush=True)
        finally:
            remove_link()
    print(f"BERT {s['layers']} layers, hidden {s['hidden']}, {n / 1e6:.1f}M parameters, seq {s['seq']}, micro-batch "
          f"{s['micro']}, {GLOBAL_BATCH} samples per step, two ranks in two network namespaces (veth + tc tbf), "
          f"1 thread per rank, gloo; loopback all-reduce {loop_gbit:.1f} Gbit/s")
    print(f"{'Gbit/s':>6} {'side':22} {'loopback s':>10} {'link s':>8} {'samples/s':>9} {'planner s':>9} "
          f"{'planner/link':>12} {'all-reduce s':>12} {'hidden':>7} {'MB/step':>8}")
    for gbit, name, lo, li, pred, alone, hidden, mb in rows:
        print(f"{gbit:6g} {name:22} {lo:10.3f} {li:8.3f} {GLOBAL_BATCH / li:9.2f} "
              f"{f'{pred:.3f}' if pred else '-':>9} {f'{pred / li:.2f}' if pred else '-':>12} {alone:12.3f} "
              f"{f'{hidden:.0%}' if hidden is not None else '-':>7} {f'{mb:.1f}' if mb is not None else '-':>8}")
    print(f"a ring all-reduce of the {n / 1e6:.1f}M fp32 gradients over two ranks sends {4.0 * n / 1e6:.1f} MB "
          f"per rank (MB/step: the comm ledger's count of the busiest rank, loss averaging and norms included)")
    for gbit in sorted({r[0] for r in rows}):
        ranked = {"megabert overlap": "dp2", "megabert tp2": "tp2", "megabert pp2": "pp2"}
        mine = [r for r in rows if r[0] == gbit and r[1] in ranked]
        measured = [ranked[r[1]] for r in sorted(mine, key=lambda r: r[3])]
        planned = [ranked[r[1]] for r in sorted(mine, key=lambda r: r[4])]
        print(f"{gbit:g} Gbit/s, fastest first: measured {measured}, planner {planned}"
              f"{' (same)' if measured == planned else ' (DIFFERENT)'}")


if __name__ == "__main__":
    main()
