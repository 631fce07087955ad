"""Training gives the same losses whatever the layout (fp32, dropout 0), resumes exactly,
and survives an fp16 overflow."""
import json
import os

import pytest
import torch
from dist_utils import run_distributed
from train_utils import read_metrics, train_worker

ITERS = ["--train-iters", "6"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    path = str(out / "m.jsonl")
    run_distributed(train_worker, 1, ITERS + ["--metrics-file", path, "--tensorboard-dir", str(out / "tb")])
    losses = read_metrics(path)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert len(events.Scalars("train/lm_loss")) == 6
    row = [json.loads(line) for line in open(path)][0]
    assert {"iteration", "lm_loss", "sop_loss", "lr", "grad_norm", "samples_per_sec", "tflops"} <= set(row)
    assert len(losses) == 6 and all(l == l for l in losses)  # six finite points
    return losses


@pytest.mark.parametrize("name,world,tp,extra", [
    ("tp2", 2, 2, []),
    ("dp2", 2, 1, []),
    ("tp2-sequence-parallel", 2, 2, ["--sequence-parallel"]),
])
def test_layouts_match_single_process(tmp_path, reference, name, world, tp, extra):
    path = str(tmp_path / "m.jsonl")
    run_distributed(train_worker, world, ITERS + ["--metrics-file", path] + extra, tp)
    assert read_metrics(path) == pytest.approx(reference, abs=1e-4)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stages_match_single_process(tmp_path, reference, stage):
    path = str(tmp_path / "m.jsonl")
    run_distributed(train_worker, 2, ITERS + ["--metrics-file", path, "--deepspeed", "--zero-stage", str(stage)])
    assert read_metrics(path) == pytest.approx(reference, abs=1e-4)
    assert all(g == g and g > 0 for g in read_metrics(path, "grad_norm"))  # reported, not NaN


def test_resume_is_bitwise(tmp_path):
    full, part = str(tmp_path / "full.jsonl"), str(tmp_path / "part.jsonl")
    ckpt = str(tmp_path / "ckpt")
    common = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]  # RNG streams must resume too
    run_distributed(train_worker, 2, ["--train-iters", "6", "--metrics-file", full] + common, 2)
    run_distributed(train_worker, 2, ["--train-iters", "6", "--exit-interval", "3", "--metrics-file", part,
                                      "--save", ckpt] + common, 2)
    run_distributed(train_worker, 2, ["--train-iters", "6", "--metrics-file", part, "--load", ckpt, "--save", ckpt]
                    + common, 2)
    assert read_metrics(part) == read_metrics(full)  # bitwise, not approx
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "6"


def _kill_during_save(rank, world, ckpt, metrics):
    """Trains to iteration 2 (saved), then dies by SIGKILL halfway through saving iteration 4."""
    import signal

    import megabert.training.checkpointing as ckpt_mod

    real_write = ckpt_mod.write_rank_file

    def dying_write(stage, *args, **kwargs):
        if stage.endswith("iter_0000004.tmp"):
            os.makedirs(stage, exist_ok=True)
            open(os.path.join(stage, "partial"), "w").write("x")
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(stage, *args, **kwargs)

    ckpt_mod.write_rank_file = dying_write
    train_worker(rank, world, ITERS + ["--save", ckpt, "--save-interval", "2", "--metrics-file", metrics])


def test_weights_only_load_reaches_deepspeed_master_weights(tmp_path):
    """--load --finetune into ZeRO-1 (which keeps fp32 master partitions of its own) from a
    plain run's checkpoint, which has no deepspeed/ files: the run follows the plain one
    started from the same weights, not the seed's initialisation."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(train_worker, 1, ["--train-iters", "2", "--save", ckpt])
    curves = []
    for i, extra in enumerate(([], ["--deepspeed", "--zero-stage", "1"])):
        path = str(tmp_path / f"m{i}.jsonl")
        run_distributed(train_worker, 1, ["--train-iters", "3", "--load", ckpt, "--finetune", "--metrics-file", path,
                                          *extra])
        curves.append(read_metrics(path))
    assert curves[1] == pytest.approx(curves[0], abs=1e-4)


def test_sigkill_during_save_keeps_last_complete_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(Exception):
        run_distributed(_kill_during_save, 1, ckpt, str(tmp_path / "a.jsonl"))
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "2"
    assert os.path.isdir(os.path.join(ckpt, "iter_0000004.tmp"))  # the torn save, never pointed to
    resumed = str(tmp_path / "b.jsonl")
    run_distributed(train_worker, 1, ITERS + ["--load", ckpt, "--metrics-file", resumed])
    assert len(read_metrics(resumed)) == 4  # iterations 3..6
    assert read_metrics(resumed)[0] == read_metrics(str(tmp_path / "a.jsonl"))[2]


def _fp16_overflow(rank, world, metrics):
    """Injects an inf into one gradient at iteration 3 through a tensor hook."""
    import megabert.training.trainer as trainer_mod

    real_step = trainer_mod.Trainer.train_step

    def step_with_overflow(self):
        if self.state.iteration == 2:
            p = self.strategy.params[0]
            handle = p.register_hook(lambda g: g * float("inf"))
            out = real_step(self)
            handle.remove()
            assert all(torch.isfinite(q).all() for q in self.strategy.params), "NaN/inf reached the weights"
            return out
        return real_step(self)

    trainer_mod.Trainer.train_step = step_with_overflow
    train_worker(rank, world, ITERS + ["--fp16", "--metrics-file", metrics, "--hysteresis", "1",
                                       "--initial-loss-scale", "1024"])


def test_fp16_overflow_skips_step_and_lowers_scale(tmp_path):
    path = str(tmp_path / "m.jsonl")
    run_distributed(_fp16_overflow, 1, path)
    scales = read_metrics(path, "loss_scale")
    skipped = read_metrics(path, "skipped")
    assert scales[:3] == [1024.0, 1024.0, 1024.0] and scales[3] == 512.0
    assert skipped == [1]
    assert all(x == x for x in read_metrics(path))


def test_reshard_tp2_checkpoint_and_continue_at_tp1(tmp_path, reference):
    """Train at TP=2, stop at 3, reshard (weights and Adam moments) to TP=1, continue:
    the curve is the single-process curve. Also prunes to the newest checkpoint."""
    import subprocess
    import sys

    ckpt, ckpt1 = str(tmp_path / "tp2"), str(tmp_path / "tp1")
    part = str(tmp_path / "m.jsonl")
    run_distributed(train_worker, 2, ITERS + ["--exit-interval", "3", "--save", ckpt, "--save-interval", "1",
                                              "--keep-last-checkpoints", "1", "--metrics-file", part], 2)
    assert sorted(d for d in os.listdir(ckpt) if d.startswith("iter_")) == ["iter_0000003"]
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "checkpoint",
                        "reshard.py")
    r = subprocess.run([sys.executable, tool, "--load", ckpt, "--save", ckpt1, "--tensor-model-parallel-size", "1"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    run_distributed(train_worker, 1, ITERS + ["--load", ckpt1, "--metrics-file", part])
    assert read_metrics(part) == pytest.approx(reference, abs=1e-4)


def test_fused_kernels_train_to_the_same_losses(tmp_path, reference):
    """The reference run uses --attention-backend torch and PyTorch LayerNorm; the fused
    softmax and LayerNorm kernels must follow the same curve (fp32, dropout 0)."""
    from megabert import fused_kernels

    assert fused_kernels.is_available(), fused_kernels.load_error()
    path = str(tmp_path / "m.jsonl")
    run_distributed(train_worker, 1, ITERS + ["--metrics-file", path, "--attention-backend", "fused",
                                              "--layernorm-backend", "fused"])
    assert read_metrics(path) == pytest.approx(reference, abs=1e-4)


def _sigterm_at_iteration_2(rank, world, ckpt, metrics):
    """A real SIGTERM (what SLURM sends before preemption) arrives during iteration 3."""
    import signal

    import megabert.training.trainer as trainer_mod

    real_step = trainer_mod.Trainer.train_step

    def step(self):
        if self.state.iteration == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(self)

    trainer_mod.Trainer.train_step = step
    train_worker(rank, world, ITERS + ["--save", ckpt, "--metrics-file", metrics])


def test_sigterm_saves_and_exits(tmp_path):
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    run_distributed(_sigterm_at_iteration_2, 1, ckpt, metrics)
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "3"
    assert len(read_metrics(metrics)) == 3
