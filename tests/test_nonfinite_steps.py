"""A NaN or inf gradient in bf16 or fp32 (no loss scaler to absorb it) skips the update: the
weights and the optimizer state (moments, step counters) come out of that step bitwise as they
went in, the run logs `skipped` and a warning at its logging step, and training goes on. torch's
fused AdamW decides on the device (found_inf, megabert.optim.clip.guarded_step); our LAMB and
Adam on the host. Unlike fp16's overflow skips, these steps advance the LR schedule."""
import copy
import logging

import pytest
import torch

from tests.helpers.dist_utils import patched, run_distributed
from tests.helpers.train_utils import build_trainer, read_metrics


def _snapshot(trainer):
    strategy = trainer.strategy
    return ({n: p.detach().clone() for n, p in strategy.model.named_parameters()},
            copy.deepcopy(strategy.optimizer.state_dict()["state"]))


def _assert_same(a, b):
    assert a[0].keys() == b[0].keys()
    for n in a[0]:
        assert torch.equal(a[0][n], b[0][n]), n
    assert a[1].keys() == b[1].keys()
    for i in a[1]:
        for k, v in a[1][i].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b[1][i][k])), (i, k)


@pytest.mark.parametrize("argv", [["--bf16"], [], ["--bf16", "--optimizer", "lamb"],
                                  ["--bf16", "--no-bias-correction"]],
                         ids=["bf16-fused-adamw", "fp32-fused-adamw", "bf16-lamb", "bf16-adam-no-bias-correction"])
def test_nonfinite_gradient_skips_the_update(argv, caplog):
    _, _, trainer = build_trainer(argv + ["--train-iters", "4", "--log-interval", "2"])
    try:
        trainer.train_step()
        trainer.train_step()
        trainer.flush_metrics()
        before = _snapshot(trainer)
        p = trainer.strategy.params[0]
        handle = p.register_hook(lambda g: g * float("nan"))
        trainer.train_step()
        handle.remove()
        _assert_same(before, _snapshot(trainer))
        trainer.train_step()  # the next step updates again
        assert not torch.equal(before[0]["bert.embeddings.word_embeddings.weight"],
                               trainer.strategy.model.bert.embeddings.word_embeddings.weight)
        with caplog.at_level(logging.WARNING):
            metrics = trainer.flush_metrics()
    finally:
        trainer.close()
    assert metrics["skipped"] == 1 and "not finite at 1 of the last 2 steps" in caplog.text
    assert trainer.state.skipped_iterations == 0  # the LR schedule went on
    assert all(torch.isfinite(q).all() for q in trainer.strategy.params)


def _dist_opt_nan(rank, world, metrics_file):
    import megabert.training.trainer as trainer_mod

    real_step = trainer_mod.Trainer.train_step

    def step_with_nan(self):
        if self.state.iteration == 1:
            handle = self.strategy.params[0].register_hook(lambda g: g * float("inf"))
            # The last step's all-gathers may still be writing the parameters (overlapped with
            # this step's forward): the snapshot must see them landed, or it races them.
            self.strategy.buffers.wait_params()
            before = {n: p.detach().clone() for n, p in self.strategy.model.named_parameters()}
            out = real_step(self)
            handle.remove()
            self.strategy.buffers.wait_params()
            for n, q in self.strategy.model.named_parameters():
                assert torch.equal(before[n], q), n
            return out
        return real_step(self)

    with patched(trainer_mod.Trainer, "train_step", step_with_nan):
        _, _, trainer = build_trainer(["--bf16", "--use-distributed-optimizer", "--train-iters", "3",
                                       "--log-interval", "1", "--metrics-file", metrics_file])
        try:
            trainer.train()
        finally:
            trainer.close()


def test_nonfinite_gradient_skips_the_distributed_optimizers_update(tmp_path):
    path = str(tmp_path / "m.jsonl")
    run_distributed(_dist_opt_nan, 2, path)
    assert read_metrics(path, "skipped") == [1]
    assert [x == x for x in read_metrics(path)] == [True, True, True]  # the losses stay finite
