"""--use-distributed-optimizer: optimizer states sharded over DP, gradients reduce-scattered,
parameters all-gathered. The losses are plain DP's (fp32, dropout 0) at DP=2, TP2xDP2 and
PP2xDP2 (interleaved and 1F1B) with AdamW and LAMB, and with fp16 loss scaling (an
overflow skipped alike); a step sends a ring all-reduce's bytes; a resume is bitwise;
checkpoints move between runs with and without it and between DP sizes."""
import json

import pytest
import torch
from tests.helpers.dist_utils import run_distributed
from tests.helpers.train_utils import build_trainer, read_metrics, train_worker

from megabert.arguments import parse_args
from megabert.errors import ConfigError

DO = ["--use-distributed-optimizer"]
# 2 micro-batches per DP rank (8 = micro 2 x 2 x DP 2), buckets of ~1/4 of the model.
STEP = ["--global-batch-size", "8", "--ddp-bucket-size", "8000"]
ITERS = ["--train-iters", "3"]


def _pair_worker(rank, world, runs, tp, out_dir):
    # Every run of a layout in one process group: one spawn, not one per run.
    for name, argv in runs:
        train_worker(rank, world, argv + ["--metrics-file", f"{out_dir}/{name}.jsonl"], tp)


# fp16 with dynamic loss scaling: a first step that overflows at 2^18 (skipped, the scale
# halved: hysteresis 1), then steps that do not.
FP16 = ["--fp16", "--initial-loss-scale", str(2 ** 18), "--hysteresis", "1"]
VPP = ["--num-layers-per-virtual-pipeline-stage", "1"]
ADAM, LAMB = ["--optimizer", "adam"], ["--optimizer", "lamb"]


@pytest.mark.parametrize("name,world,tp,extra,variants", [
    ("dp2", 2, 1, [], {"adam": ADAM, "lamb": LAMB, "fp16": ADAM + FP16}),
    ("tp2-dp2-sequence-parallel", 4, 2, ["--sequence-parallel"], {"adam": ADAM, "lamb": LAMB}),
    # Two stages of two layers, interleaved in chunks of one and not (1F1B): the tied
    # embeddings' shards are summed over the embedding group.
    ("pp2-dp2", 4, 1, ["--pipeline-model-parallel-size", "2", "--num-layers", "4"],
     {"adam": ADAM + VPP, "lamb": LAMB + VPP, "1f1b": ADAM}),
])
def test_losses_equal_plain_data_parallel(tmp_path, name, world, tp, extra, variants):
    # Every variant of a layout in one spawn: its process group is the expensive part.
    runs = [(f"{variant}-{mode}", ITERS + STEP + extra + flags + mode_flags)
            for variant, flags in variants.items() for mode, mode_flags in (("plain", []), ("sharded", DO))]
    run_distributed(_pair_worker, world, runs, tp, str(tmp_path))
    for variant in variants:
        plain, sharded = str(tmp_path / f"{variant}-plain.jsonl"), str(tmp_path / f"{variant}-sharded.jsonl")
        assert len(read_metrics(sharded)) == 3
        # Not bitwise: the global norm (clipping is on) sums the shards' squares in another order.
        assert read_metrics(sharded) == pytest.approx(read_metrics(plain), abs=1e-6, rel=0), variant
        assert read_metrics(sharded, "grad_norm") == pytest.approx(read_metrics(plain, "grad_norm"), abs=1e-6,
                                                                   rel=0, nan_ok=True), variant
    if "fp16" in variants:
        # The overflow is found over every rank's shards, the step skipped on all of them.
        for mode in ("plain", "sharded"):
            path = str(tmp_path / f"fp16-{mode}.jsonl")
            assert read_metrics(path, "loss_scale") == [2.0 ** 18, 2.0 ** 17, 2.0 ** 17], mode
            assert read_metrics(path, "skipped") == [1], mode


class _ForwardCalls:
    """Numbers every module call process-wide (torch's global module hooks, which run before a
    module's own pre-hooks): `current` is the running call's number, None outside forward."""

    def __enter__(self):
        self.calls, self.depth = 0, 0

        def pre(module, args):
            self.calls, self.depth = self.calls + 1, self.depth + 1

        def post(module, args, output):
            self.depth -= 1

        self._handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                         torch.nn.modules.module.register_module_forward_hook(post)]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()

    @property
    def current(self):
        return self.calls if self.depth else None


def _bytes_worker(rank, world, out_dir):
    for mode, flags in (("plain", []), ("sharded", DO)):
        _, ps, trainer = build_trainer(["--train-iters", "3", "--metrics-file", f"{out_dir}/{mode}.jsonl"]
                                       + STEP + flags)
        try:
            with _ForwardCalls() as calls:
                landed = []  # per parameter bucket gathered: the module call that waited for it
                if mode == "sharded":
                    trainer.strategy.reducer.register_gather_hook(lambda params: landed.append(calls.current))
                trainer.train()
            if mode == "sharded" and rank == 0:
                buffers = trainer.strategy.reducer
                padded = sum(b.numel() * b.element_size() for b in buffers.buffers.values())
                params = sum(p.numel() * p.element_size() for p in buffers.params)
                with open(f"{out_dir}/sizes.json", "w") as f:
                    json.dump({"padded": padded, "params": params, "buckets": len(buffers.buckets),
                               "landed": landed}, f)
        finally:
            trainer.close()


def test_a_step_sends_a_ring_all_reduce_of_the_gradients(tmp_path):
    run_distributed(_bytes_worker, 2, str(tmp_path))
    sizes = json.loads((tmp_path / "sizes.json").read_text())
    n = 2
    ring = lambda nbytes: 2 * (n - 1) / n * nbytes  # noqa: E731  (reduce-scatter + all-gather)
    rows = [[json.loads(line) for line in open(tmp_path / f"{m}.jsonl")] for m in ("plain", "sharded")]
    assert len(rows[1]) == 3
    # From the second step on: a step's all-gathers are issued two at a time, the rest as
    # the next step's forward waits for them (in that step's count); the first step has
    # no gathers of a step before it.
    for plain, sharded in list(zip(*rows))[1:]:
        plain_dp, sharded_dp = plain["comm_gb_by_group"]["dp"] * 1e9, sharded["comm_gb_by_group"]["dp"] * 1e9
        # Both runs average the same losses over DP; beyond that, plain DP all-reduces the
        # gradients and the distributed optimizer reduce-scatters and all-gathers the
        # buffer, padded to 128 elements per bucket.
        assert sharded_dp - plain_dp == pytest.approx(ring(sizes["padded"]) - ring(sizes["params"]), abs=1.0)
        assert sizes["padded"] - sizes["params"] < 128 * 4 * sizes["buckets"]
        # The global norm: one float64 over every rank instead of none at TP = PP = 1.
        assert sharded["comm_gb"] * 1e9 - sharded_dp == pytest.approx(ring(8), abs=1e-3)
    # The forwards of the steps after the first waited for the parameter buckets one module at
    # a time (--overlap-param-gather, the default), each gathered bucket once per step (the
    # last step's gathers are waited for when training ends, outside forward).
    in_forward, buckets = [call for call in sizes["landed"] if call is not None], sizes["buckets"]
    assert len(in_forward) == 2 * buckets, sizes
    assert len(set(in_forward[buckets:])) > 1, sizes  # the last step's, spread over its forward


def _resume_worker(rank, world, d):
    def run(name, *flags):
        train_worker(rank, world, STEP + ["--train-iters", "4", "--metrics-file", f"{d}/{name}.jsonl", *flags])

    run("full", *DO)
    run("resumed", *DO, "--exit-interval", "2", "--save", f"{d}/sharded")
    run("resumed", *DO, "--load", f"{d}/sharded", "--save", f"{d}/sharded")
    # The same checkpoint (of iteration 2) resumed without the flag.
    run("plain-from-sharded", "--load", f"{d}/sharded/iter_0000002", "--save", f"{d}/plain2")
    # And the reverse: a plain run's checkpoint resumed with the flag.
    run("plain", "--exit-interval", "2", "--save", f"{d}/plain")
    run("sharded-from-plain", *DO, "--load", f"{d}/plain", "--save", f"{d}/sharded2")


def _dp1_worker(rank, world, d):
    train_worker(rank, world, STEP + ["--train-iters", "4", "--metrics-file", f"{d}/dp1.jsonl", *DO,
                                      "--load", f"{d}/sharded/iter_0000002", "--save", f"{d}/dp1"])


def test_resume_is_bitwise_and_checkpoints_move_between_layouts(tmp_path):
    run_distributed(_resume_worker, 2, str(tmp_path))
    full = read_metrics(str(tmp_path / "full.jsonl"))
    assert read_metrics(str(tmp_path / "resumed.jsonl")) == full  # bitwise, not approx
    # The states are saved whole, by parameter name, as plain DP saves them.
    saved = torch.load(tmp_path / "sharded" / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt",
                       weights_only=True)
    assert set(saved["optimizer"]["state"]) == set(saved["model"])
    for name, state in saved["optimizer"]["state"].items():
        assert state["exp_avg"].shape == saved["model"][name].shape and float(state["step"]) == 2.0
    assert read_metrics(str(tmp_path / "plain-from-sharded.jsonl")) == pytest.approx(full[2:], abs=1e-6, rel=0)
    assert read_metrics(str(tmp_path / "sharded-from-plain.jsonl")) == pytest.approx(full[2:], abs=1e-6, rel=0)
    # Another DP size: one rank takes the 4 micro-batches (sums in another order).
    run_distributed(_dp1_worker, 1, str(tmp_path))
    assert read_metrics(str(tmp_path / "dp1.jsonl")) == pytest.approx(full[2:], abs=1e-6, rel=0)


@pytest.mark.parametrize("flags,message", [
    (DO + ["--deepspeed"], "--use-distributed-optimizer cannot combine with --deepspeed"),
    (DO + ["--no-overlap-grad-reduce"], "drop --no-overlap-grad-reduce"),
])
def test_flag_rules(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(["--train-iters", "1"] + flags)


def test_planner_shards_the_moments_and_keeps_the_ring_bytes():
    from megabert.presets import bert_large
    from megabert.planning import Layout, Workload, communication, estimate
    from megabert.planning.step_time import Links, step_time

    model, run = bert_large(), Workload(precision="bf16", micro_batch_size=8, global_batch_size=64)
    plain, sharded = Layout(dp=4), Layout(dp=4, distributed_optimizer=True)
    assert estimate(model, run, sharded).optimizer_gb == pytest.approx(estimate(model, run, plain).optimizer_gb / 4)
    assert communication(model, run, sharded).data_parallel == communication(model, run, plain).data_parallel
    assert "--use-distributed-optimizer" in sharded.flags() and sharded.short().endswith("+do")
    # The all-gather hides behind forward too: never more exposed than plain DP.
    links = Links(gpus_per_node=1, intra_gbit=10, inter_gbit=10)
    assert step_time(model, run, sharded, links, 0.5).exposed_s <= step_time(model, run, plain, links, 0.5).exposed_s
    with pytest.raises(ConfigError, match="--deepspeed"):
        Layout(dp=2, zero_stage=1, distributed_optimizer=True)
