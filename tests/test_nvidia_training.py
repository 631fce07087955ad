"""pretrain_bert.py trains on NVIDIA's files as they are, at TP=2 with dropout (its main() on
the warm pool's two ranks):
a run resumed with --load from a checkpoint of iteration 2 gives exactly the losses (train and
validation) of the uninterrupted run. DLE: the HDF5 shards DLE's create_pretraining_data.py
made (tests/fixtures/nvidia), its *test* file as the validation set. LDDL: the dynamic-masking
shards LDDL's preprocessor made (masks drawn per sample index, so the resumed run masks alike).
No flag names the binary head's objective: the shards' next-sentence labels make it NSP."""
import logging
import os

import pytest
from tests.helpers.nvidia_shards import DLE_PHASE1, LDDL, NVIDIA_VOCAB as VOCAB
from tests.helpers.pretrain_runs import ROOT, one_line_error, rows, run_main, run_ranks as _launch

LOSSES = ("lm_loss", "nsp_loss", "grad_norm")


def _curve(path, since=1):
    """(iteration, key, value) of every train and validation row from `since` on: compared exactly."""
    return [(row["iteration"], key, value) for row in rows(path) if row["iteration"] >= since
            for key, value in row.items() if key in LOSSES or key.startswith("valid_")]


def nvidia_args(data, metrics, *extra):
    return [os.path.join(ROOT, "pretrain_bert.py"), "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "128", "--max-position-embeddings", "128",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3",
            "--data-path", str(data), "--vocab-file", VOCAB,
            "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1", "--num-workers", "0",
            "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--tensor-model-parallel-size", "2",
            "--metrics-file", str(metrics), *extra]


@pytest.mark.parametrize("kind", ["dle_hdf5", "lddl_dynamic"])
def test_stop_and_resume_is_bitwise_at_tp2(kind, tmp_path):
    data = DLE_PHASE1 if kind == "dle_hdf5" else os.path.join(LDDL, "phase1_dynamic")
    full, part, ckpt, ckpt2 = tmp_path / "full.jsonl", tmp_path / "part.jsonl", tmp_path / "ckpt", tmp_path / "ck2"
    _launch(2, nvidia_args(data, full, "--save", str(ckpt), "--save-interval", "2"))
    # Resume from the iteration-2 checkpoint of that run (Megatron's tracker file names the one to load).
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    _launch(2, nvidia_args(data, part, "--load", str(ckpt), "--save", str(ckpt2)))
    expected = _curve(full)
    assert {it for it, _, _ in expected} == {1, 2, 3, 4}
    assert {key for _, key, _ in expected} >= {"lm_loss", "nsp_loss"}
    if kind == "dle_hdf5":
        assert any(key == "valid_lm_loss" for _, key, _ in expected)  # pydocs_test_0.hdf5
    assert min(it for it, _, _ in _curve(part)) == 3
    assert _curve(part) == _curve(full, since=3)  # bitwise: the same floats


def test_data_path_of_shards_with_another_seq_length_is_a_one_line_error(tmp_path):
    r = run_main(*nvidia_args(DLE_PHASE1, tmp_path / "m.jsonl", "--seq-length", "256",
                              "--max-position-embeddings", "256", "--tensor-model-parallel-size", "1"))
    one_line_error(r, "holds rows of 128 tokens but --seq-length is 256: pass --seq-length 128")


def _tiny(data, metrics, *extra):
    return nvidia_args(data, metrics, "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
                       "--train-iters", "1", "--eval-interval", "0", "--tensor-model-parallel-size", "1", *extra)


NSP_LINE = "shards, whose sentence pairs are next-sentence pairs: the binary head trains NSP"


@pytest.mark.parametrize("flags,head", [((), "nsp_loss"), (("--bert-no-binary-head",), None)])
def test_the_shards_choose_nsp_with_one_info_line(tmp_path, caplog, flags, head):
    caplog.set_level(logging.INFO, logger="megabert")
    r = run_main(*_tiny(os.path.join(LDDL, "phase1_dynamic"), tmp_path / "m.jsonl", *flags))
    assert r.returncode == 0, r.stderr[-2000:]
    said = [rec.getMessage() for rec in caplog.records if NSP_LINE in rec.getMessage()]
    losses = {key for row in rows(tmp_path / "m.jsonl") for key in row if key.endswith(("sop_loss", "nsp_loss"))}
    if head is None:
        assert not said and not losses
    else:
        assert said == ["--data-path holds LDDL parquet " + NSP_LINE + " (--bert-no-binary-head trains none)"]
        assert losses == {head}


def test_sop_asked_for_on_the_shards_is_a_one_line_error(tmp_path):
    r = run_main(*_tiny(DLE_PHASE1, tmp_path / "m.jsonl", "--binary-head-task", "sop"))
    one_line_error(r, "--binary-head-task sop cannot train on --data-path's DeepLearningExamples HDF5 shards: they "
                      "hold next-sentence pairs (B is random or the next segment), not sentence order; drop the flag "
                      "(they train NSP) or pass --bert-no-binary-head")
