"""Bitwise resume through the path users run: pretrain_bert.py under torchrun, the real
indexed dataset and DataLoader, dropout 0.1. A run stopped by --exit-interval and resumed
with --load gives exactly the losses (train and validation) of an uninterrupted run."""
import os

import pytest
from test_pretrain_e2e import BIN, _run, pretrain_args, rows

LOSSES = ("lm_loss", "sop_loss", "grad_norm")


def _launch(nproc, args):
    r = _run([os.path.join(BIN, "torchrun"), "--standalone", "--nproc-per-node", str(nproc), *args])
    assert r.returncode == 0, r.stderr[-4000:]


def _curve(path):
    """(iteration, key, value) of every train and validation row: compared exactly."""
    out = []
    for row in rows(path):
        for key, value in row.items():
            if key in LOSSES or key.startswith("valid_"):
                out.append((row["iteration"], key, value))
    return out


COMMON = ["--train-iters", "6", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


@pytest.fixture(scope="module")
def one_process_curve(dataset, tmp_path_factory):
    """The uninterrupted one-process run: the reference of the in-process and the
    DataLoader-worker cases (workers must not change which samples a step sees)."""
    full = tmp_path_factory.mktemp("full") / "full.jsonl"
    _launch(1, pretrain_args(dataset, full, *COMMON))
    return _curve(full)


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
        expected = _curve(full)
    _launch(nproc, pretrain_args(dataset, part, *common, "--save", ckpt, "--exit-interval", "3"))
    _launch(nproc, pretrain_args(dataset, part, *common, "--save", ckpt, "--load", ckpt))
    got = _curve(part)
    assert {it for it, _, _ in expected} == {1, 2, 3, 4, 5, 6}
    assert any(key == "valid_lm_loss" for _, key, _ in expected)
    assert got == expected  # bitwise: the same floats, not approximately
