"""Training gives the same losses whatever the layout (fp32, dropout 0), resumes exactly,
and survives an fp16 overflow; evaluation's accuracies are those of the full logits."""
import json
import os

import pytest
import torch

from megabert.checkpoint.layout import load_file, resolve_checkpoint_dir, saved_layout
from megabert.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, use_linear

from tests.helpers.dist_utils import patched, run_distributed
from tests.helpers.train_utils import batches, build_trainer, read_metrics, train_worker, valid_sample


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

    import megabert.checkpoint.run_state as ckpt_mod

    real_write = ckpt_mod.write_rank_file

    def dying_write(stage, *args, **kwargs):
        if stage.endswith("iter_0000004.tmp"):
            os.makedirs(stage, exist_ok=True)
            open(os.path.join(stage, "partial"), "w").write("x")
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(stage, *args, **kwargs)

    with patched(ckpt_mod, "write_rank_file", dying_write):
        train_worker(rank, world, ITERS + ["--save", ckpt, "--save-interval", "2", "--metrics-file", metrics])


@pytest.mark.parametrize("stage", [1, 3])
def test_weights_only_load_reaches_deepspeed_master_weights(tmp_path, stage):
    """--load --finetune into ZeRO-1 (which keeps fp32 master partitions of its own) or
    ZeRO-3 (which partitions the parameters themselves) from a plain run's checkpoint,
    which has no deepspeed/ files: the run follows the plain one started from the same
    weights, not the seed's initialisation."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(train_worker, 1, ["--train-iters", "2", "--save", ckpt])
    curves = []
    for i, extra in enumerate(([], ["--deepspeed", "--zero-stage", str(stage)])):
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

    with patched(trainer_mod.Trainer, "train_step", step_with_overflow):
        train_worker(rank, world, ITERS + ["--fp16", "--metrics-file", metrics, "--hysteresis", "1",
                                           "--initial-loss-scale", "1024"])


def test_fp16_overflow_skips_step_and_lowers_scale(tmp_path):
    path = str(tmp_path / "m.jsonl")
    run_distributed(_fp16_overflow, 1, path)
    scales = read_metrics(path, "loss_scale")
    skipped = read_metrics(path, "skipped")
    assert scales[:3] == [1024.0, 1024.0, 1024.0] and scales[3] == 512.0
    assert skipped == [1]
    assert len(read_metrics(path)) >= 4 and all(x == x for x in read_metrics(path))


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

    with patched(trainer_mod.Trainer, "train_step", step):
        train_worker(rank, world, ITERS + ["--save", ckpt, "--metrics-file", metrics])


def test_sigterm_saves_and_exits(tmp_path):
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    run_distributed(_sigterm_at_iteration_2, 1, ckpt, metrics)
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read() == "3"
    assert len(read_metrics(metrics)) == 3


# Evaluation after two steps on 50 global batches (200 samples, 400 masked tokens): enough
# hits, even for an untrained model, that a wrong argmax would change the count.
EVAL = ["--train-iters", "2", "--eval-interval", "2", "--eval-iters", "50"]


def _eval_with_reference(rank, world, argv, reference_path):
    """Trains and evaluates, then recomputes the accuracies by hand from the same model's
    full logits (torch.argmax over the vocab) on the same valid batches."""
    cfg, _, trainer = build_trainer(argv)
    try:
        trainer.train()
    finally:
        trainer.close()
    model = trainer.strategy.model.eval()
    valid = batches(0, cfg.train.micro_batch_size, 0, 1, valid_sample)
    hits = {"lm": [0, 0], "sop": [0, 0]}
    batch_ratios = []
    with torch.no_grad():
        for _ in range(cfg.train.eval_iters * trainer.batch.num_micro_batches):
            b = next(valid)
            out = model(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"],
                        attention_mask=b["attention_mask"])
            masked = b["labels"] != -100
            correct = int((out.mlm_logits.argmax(-1)[masked] == b["labels"][masked]).sum())
            hits["lm"][0] += correct
            hits["lm"][1] += int(masked.sum())
            batch_ratios.append(correct / int(masked.sum()))
            hits["sop"][0] += int((out.nsp_logits.argmax(-1) == b["next_sentence_label"]).sum())
            hits["sop"][1] += len(b["next_sentence_label"])
    reference = {f"valid_{k}_accuracy": c / n for k, (c, n) in hits.items()}
    reference.update(lm_hits=hits["lm"][0], mean_of_batch_ratios=sum(batch_ratios) / len(batch_ratios))
    with open(reference_path, "w") as f:
        json.dump(reference, f)


def _valid_row(path):
    rows = [json.loads(line) for line in open(path)]
    return next(r for r in rows if "valid_lm_loss" in r)


@pytest.fixture(scope="module")
def eval_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    metrics, by_hand = str(out / "m.jsonl"), str(out / "by_hand.json")
    run_distributed(_eval_with_reference, 1, EVAL + ["--metrics-file", metrics, "--tensorboard-dir", str(out / "tb")],
                    by_hand)
    return _valid_row(metrics), json.load(open(by_hand)), str(out / "tb")


def test_eval_accuracy_matches_full_logits(eval_reference):
    """One process: the logged accuracies are the token-weighted (sample-weighted for SOP)
    ratios of argmax hits over the whole evaluation, as computed from the full logits."""
    row, by_hand, tb = eval_reference
    assert by_hand["lm_hits"] > 0  # the comparison below is not 0 == 0
    # ...and tells a token-weighted figure from a mean of per-micro-batch ratios
    assert by_hand["mean_of_batch_ratios"] != pytest.approx(by_hand["valid_lm_accuracy"], abs=1e-6)
    for key in ("valid_lm_accuracy", "valid_sop_accuracy"):
        assert row[key] == pytest.approx(by_hand[key], abs=1e-6), key
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tb)
    events.Reload()
    assert events.Scalars("valid/lm_accuracy")[0].value == pytest.approx(row["valid_lm_accuracy"], abs=1e-6)
    assert "valid/sop_accuracy" in events.Tags()["scalars"]


@pytest.mark.parametrize("name,world,tp,extra", [
    ("tp2-masked-only", 2, 2, ["--mlm-logits-at-masked-only"]),  # rank 1 holds only padding columns
    ("pp2", 2, 1, ["--pipeline-model-parallel-size", "2"]),
    ("dp2", 2, 1, []),
])
def test_eval_accuracy_matches_across_layouts(tmp_path, eval_reference, name, world, tp, extra):
    path = str(tmp_path / "m.jsonl")
    run_distributed(train_worker, world, EVAL + ["--metrics-file", path] + extra, tp)
    row, expected = _valid_row(path), eval_reference[0]
    for key in ("valid_lm_accuracy", "valid_sop_accuracy"):
        assert row[key] == pytest.approx(expected[key], abs=1e-6), key
    assert row["valid_lm_loss"] == pytest.approx(expected["valid_lm_loss"], abs=1e-4)


def test_zero3_resume_is_exact_and_its_checkpoint_holds_whole_weights(tmp_path):
    """ZeRO-3 leaves each rank a partition of every parameter; the checkpoint's rank files
    still hold whole weights (gathered at save), so a resumed run continues exactly and the
    checkpoint exports and reshards like any other."""
    z3 = ["--deepspeed", "--zero-stage", "3", "--train-iters", "4"]
    full, part, ckpt = str(tmp_path / "full.jsonl"), str(tmp_path / "part.jsonl"), str(tmp_path / "ck")
    run_distributed(train_worker, 2, z3 + ["--metrics-file", full])
    run_distributed(train_worker, 2, z3 + ["--metrics-file", part, "--save", ckpt, "--exit-interval", "2"])
    weights = load_file(saved_layout(resolve_checkpoint_dir(ckpt)).files[(0, 0)])["model"]
    assert weights["bert.embeddings.word_embeddings.weight"].shape == (128, 32)
    run_distributed(train_worker, 2, z3 + ["--metrics-file", part, "--save", ckpt, "--load", ckpt])
    assert read_metrics(part) == read_metrics(full)


def test_zero3_linear_saves_the_parameter_not_a_view_of_its_gathered_storage():
    """Why the layers take DeepSpeed's linear under ZeRO-3: F.linear's autograd saves
    weight.t(), a view that keeps the gathered storage alive after ZeRO-3 releases the
    parameter; DeepSpeed's saves the Parameter itself and gathers it again in backward."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    held = {}
    for name, linear in (("F.linear", torch.nn.functional.linear), ("zero3", zero3_linear_wrap)):
        layer = ColumnParallelLinear(8, 4, tp_group=None)
        use_linear(layer, linear)
        gathered = layer.weight.untyped_storage().data_ptr()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            layer(torch.randn(3, 2, 8, requires_grad=True))
        layer.weight.data = torch.empty(0)  # ZeRO-3's release after the module's forward
        held[name] = any(t.untyped_storage().data_ptr() == gathered for t in saved)
    assert held == {"F.linear": True, "zero3": False}


def _linear_during_zero3_worker(rank, world):
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    before = torch.nn.functional.linear
    _, _, trainer = build_trainer(["--deepspeed", "--zero-stage", "3", "--train-iters", "1"])
    try:
        during = torch.nn.functional.linear
        layers = [m for m in trainer.strategy.model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        trainer.train()
    finally:
        trainer.close()
    # DeepSpeed's memory-efficient linear reaches the tensor-parallel layers only; torch's
    # F.linear stays torch's for the process, during the run and after it.
    assert during is before and torch.nn.functional.linear is before
    assert layers and all(layer.linear is zero3_linear_wrap for layer in layers)


def test_zero3_gives_its_linear_to_the_layers_and_leaves_torch_its_own():
    # Two ranks, as the other ZeRO-3 tests: DeepSpeed numbers modules process-wide, and a run
    # on one pooled worker alone would leave the ranks' numbering apart for the next test.
    run_distributed(_linear_during_zero3_worker, 2)
