"""The data-parallel gradient reduction overlapped with backward: its buckets are issued
while backward still runs, and the losses are those of the reduction after backward
(--no-overlap-grad-reduce), across data-parallel layouts."""
import re

import pytest
import torch.distributed as dist

from tests.helpers.dist_utils import run_distributed
from tests.helpers.train_utils import build_trainer, read_metrics, train_worker


ITERS = ["--train-iters", "4"]


def _order_worker(rank, world, out_file):
    # Two micro-batches per DP rank (8 = 2 x micro 2 x DP 2); buckets of ~1/4 of the model.
    _, ps, trainer = build_trainer(ITERS + ["--global-batch-size", "8", "--ddp-bucket-size", "8000"])
    reducer = trainer.strategy.reducer
    buckets = {b.flat.data_ptr() for b in reducer.buckets}
    events = []
    real_all_reduce = dist.all_reduce

    def logged_all_reduce(tensor, *args, **kwargs):
        if tensor.data_ptr() in buckets:
            events.append("B")
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = logged_all_reduce
    # The word embeddings' gradient is the last one a backward computes (the first layer).
    trainer.strategy.model.bert.embeddings.word_embeddings.weight.register_hook(lambda g: events.append("E"))
    try:
        trainer.train()
        if rank == 0:
            with open(out_file, "w") as f:
                f.write(f"{len(reducer.buckets)} {''.join(events)}")
    finally:
        dist.all_reduce = real_all_reduce
        trainer.close()


def test_reduction_starts_before_backward_ends(tmp_path):
    run_distributed(_order_worker, 2, str(tmp_path / "events.txt"))
    n, events = (tmp_path / "events.txt").read_text().split()
    assert int(n) >= 3
    # Per step: the first micro-batch's backward (E) reduces nothing; during the last
    # one's, buckets go out (B) before backward reaches the embeddings (E); the rest
    # follow when backward has ended. Each bucket once per step.
    steps = re.findall(r"E(B+)E(B*)", events)
    assert "".join(f"E{a}E{b}" for a, b in steps) == events and len(steps) == 4, events
    assert all(len(a) + len(b) == int(n) for a, b in steps), events


def _on_and_off_worker(rank, world, argv, tp, out_dir):
    # Both runs in one process group: one spawn instead of two.
    for mode, flags in (("on", []), ("off", ["--no-overlap-grad-reduce"])):
        train_worker(rank, world, argv + flags + ["--metrics-file", f"{out_dir}/{mode}.jsonl"], tp)


@pytest.mark.parametrize("name,world,tp,extra", [
    # fp16: the loss scaler's overflow check and unscale read the buffer's views.
    ("dp2-fp16", 2, 1, ["--fp16", "--initial-loss-scale", "65536"]),
    ("tp2-dp2-sequence-parallel", 4, 2, ["--sequence-parallel"]),
])
def test_overlap_gives_the_losses_of_the_reduction_after_backward(tmp_path, name, world, tp, extra):
    argv = ITERS + ["--global-batch-size", "8", "--ddp-bucket-size", "8000"] + extra  # 2 micro-batches / rank
    run_distributed(_on_and_off_worker, world, argv, tp, str(tmp_path))
    on, off = str(tmp_path / "on.jsonl"), str(tmp_path / "off.jsonl")
    assert len(read_metrics(on)) == 4
    # DP=2 sums two values either way (bitwise); with TP the sums over TP and DP swap
    # order, which float rounding may notice.
    tol = 0 if tp == 1 else 1e-6
    assert read_metrics(on) == pytest.approx(read_metrics(off), abs=tol, rel=0)
    assert read_metrics(on, "grad_norm") == pytest.approx(read_metrics(off, "grad_norm"), abs=tol * 10, rel=0)
