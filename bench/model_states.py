"""Model-state memory per rank, measured: the bytes of every tensor alive after a training step.

bench/memory.py measures whole peaks (RSS), where activations, the allocator's heap and the
interpreter mix in. This bench isolates the part ZeRO and model parallelism divide: after
two optimizer steps (activations freed, gradients and optimizer states allocated) each rank
sums the storages of all live tensors (`gc.get_objects()`, each storage once): parameters,
gradients, optimizer states and whatever buffers DeepSpeed keeps between steps. The largest
rank is reported next to the planner's parameters + gradients + optimizer for the same layout
(the gradients as held after backward: ZeRO-1/2 free theirs in the step, so they measure
lower here), and as a ratio to one process of the same size.

Ranks are spawned here (gloo, one file store) and build the model through
megabert.tasks.pretraining.task.build_pretraining, the path pretrain_bert.py takes, fed synthetic
batches (seq 128, micro-batch 2, vocab 30522: the embeddings at BERT's real size).

    python bench/model_states.py                                   # BERT-base
    python bench/model_states.py --sizes bert-large --layouts single zero3
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megabert.presets import PRESETS
from megabert.planning import Layout, Workload, estimate

from memory import LAYOUTS as MEMORY_LAYOUTS, VOCAB_SIZE  # bench/memory.py, beside this file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SEQ, MICRO = 128, 2
# bench/memory.py's layouts whose model states live on the rank (offload moves them to the
# host, the same memory on a CPU) and that run on 2 processes.
LAYOUTS = {name: bl.layout for name, bl in MEMORY_LAYOUTS.items()
           if name not in ("tp2pp2", "zero3-offload")}


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of all tensors the interpreter holds."""
    gc.collect()
    storages = {}
    with warnings.catch_warnings():  # isinstance() on deprecated objects (torch.distributed.reduce_op) warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        try:
            st = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # meta or sparse tensors hold no bytes here
            continue
        if st.nbytes():
            storages[(st.device.type, st.data_ptr())] = st.nbytes()
    return sum(storages.values())


def _batches(consumed: int, dp_rank: int, dp_size: int):
    """Synthetic masked-LM batches of full length (15% masked), the same for any layout."""
    start = consumed + dp_rank * MICRO
    while True:
        g = torch.Generator().manual_seed(start)
        ids = torch.randint(1000, VOCAB_SIZE, (MICRO, SEQ), generator=g)
        labels = torch.full((MICRO, SEQ), -100)
        masked = torch.rand(MICRO, SEQ, generator=g) < 0.15
        labels[masked] = ids[masked]
        yield {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
               "labels": labels, "next_sentence_label": torch.zeros(MICRO, dtype=torch.long)}
        start += MICRO * dp_size


def _argv(size: str, lay: Layout) -> list[str]:
    m = PRESETS[size]()
    argv = ["--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
            "--num-attention-heads", str(m.num_attention_heads), "--seq-length", str(SEQ),
            "--max-position-embeddings", "512", "--micro-batch-size", str(MICRO),
            "--global-batch-size", str(MICRO * lay.dp), "--train-iters", "2", "--lr", "1e-4",
            "--log-interval", "1000", "--eval-interval", "0",
            "--tensor-model-parallel-size", str(lay.tp), "--pipeline-model-parallel-size", str(lay.pp)]
    if lay.zero_stage:
        argv += ["--deepspeed", "--zero-stage", str(lay.zero_stage)]
    return argv


def _worker(rank: int, world: int, store: str, size: str, name: str, out: str) -> None:
    import megabert
    from megabert.arguments import parse_args
    from megabert.tasks.pretraining.task import build_pretraining
    from megabert.training.resolve import resolve_run

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    lay = LAYOUTS[name]
    cfg = parse_args(_argv(size, lay))
    ps = megabert.init_parallel(lay.tp, lay.pp)
    trainer = build_pretraining(resolve_run(cfg, ps), ps, VOCAB_SIZE,
                                lambda consumed: _batches(consumed, ps.dp_rank, ps.dp_size))
    trainer.train()
    mine = torch.tensor([float(live_tensor_bytes())], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"live_bytes": mine.item()}, f)
    trainer.close()
    dist.barrier()
    megabert.destroy_parallel()
    sys.stdout.flush()
    os._exit(0)  # see tests/helpers/dist_utils.py: leave gloo before the interpreter's finalisation


def measure(size: str, name: str) -> float:
    """Live model-state GB of the largest rank after two steps."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.start_processes(_worker, args=(LAYOUTS[name].world_size, os.path.join(tmp, "store"), size, name, out),
                           nprocs=LAYOUTS[name].world_size, start_method="spawn")
        with open(out) as f:
            return json.load(f)["live_bytes"] / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=["bert-base"], choices=sorted(PRESETS))
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = p.parse_args()
    print(f"fp32 AdamW | seq {SEQ} micro-batch {MICRO} | live tensors after 2 steps, largest rank (GB = 1e9 bytes)")
    print(f"{'model':10} {'layout':8} {'ranks':>5} {'measured GB':>12} {'planner GB':>11} {'meas/pred':>9} "
          f"{'vs single':>9}")
    for size in args.sizes:
        model = PRESETS[size](vocab_size=VOCAB_SIZE)
        single = None
        for name in args.layouts:
            lay = LAYOUTS[name]
            est = estimate(model, Workload(seq_length=SEQ, micro_batch_size=MICRO, device="cpu"), lay)
            states = est.parameters_gb + est.gradients_gb + est.optimizer_gb
            measured = measure(size, name)
            single = measured if name == "single" else single
            vs = f"{measured / single:9.2f}" if single else f"{'-':>9}"
            print(f"{size:10} {name:8} {lay.world_size:5d} {measured:12.2f} {states:11.2f} {measured / states:9.2f} "
                  f"{vs}", flush=True)


if __name__ == "__main__":
    main()
