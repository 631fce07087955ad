"""Bitwise resume through the path users run: pretrain_bert.py's main() on torchrun-like
ranks (the warm worker pool), the real indexed dataset and DataLoader, dropout 0.1. A run stopped by --exit-interval and resumed
with --load gives exactly the losses (train and validation) of an uninterrupted run."""
import pytest

from tests.helpers.pretrain_runs import curve, pretrain_args, run_ranks as _launch


COMMON = ["--train-iters", "6", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


@pytest.fixture(scope="module")
def one_process_curve(dataset, tmp_path_factory):
    """The uninterrupted one-process run: the reference of the in-process and the
    DataLoader-worker cases (workers must not change which samples a step sees)."""
    full = tmp_path_factory.mktemp("full") / "full.jsonl"
    _launch(1, pretrain_args(dataset, full, *COMMON))
    return curve(full)


@pytest.mark.parametrize("name,nproc,extra", [
    ("tp1", 1, []),
    ("tp2", 2, ["--tensor-model-parallel-size", "2"]),
    ("workers2", 1, ["--num-workers", "2"]),
])
def test_stop_and_resume_is_bitwise_with_dropout(dataset, one_process_curve, tmp_path, name, nproc, extra):
    common = [*COMMON, *extra]
    part, ckpt = tmp_path / "part.jsonl", str(tmp_path / "ckpt")
    if nproc == 1:
        expected = one_process_curve
    else:
        full = tmp_path / "full.jsonl"
        _launch(nproc, pretrain_args(dataset, full, *common))
        expected = curve(full)
    _launch(nproc, pretrain_args(dataset, part, *common, "--save", ckpt, "--exit-interval", "3"))
    _launch(nproc, pretrain_args(dataset, part, *common, "--save", ckpt, "--load", ckpt))
    got = curve(part)
    assert {it for it, _, _ in expected} == {1, 2, 3, 4, 5, 6}
    assert any(key == "valid_lm_loss" for _, key, _ in expected)
    assert got == expected  # bitwise: the same floats, not approximately
