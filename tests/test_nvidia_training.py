"""pretrain_bert.py trains on NVIDIA's files as they are, under torchrun at TP=2 with dropout:
a run resumed with --load from a checkpoint of iteration 2 gives exactly the losses (train and
validation) of the uninterrupted run. DLE: the HDF5 shards DLE's create_pretraining_data.py
made (tests/fixtures/nvidia), its *test* file as the validation set. LDDL: binned shards with
dynamic masking (masks drawn per sample index, batches drawn one bin at a time)."""
import os

import pytest
from nvidia_shards import write_lddl_parquet, write_vocab
from test_nvidia_fixtures import PHASE1, VOCAB
from test_pretrain_e2e import ROOT, rows
from test_resume_dataloader import _launch

LOSSES = ("lm_loss", "nsp_loss", "grad_norm")


def _curve(path, since=1):
    """(iteration, key, value) of every train and validation row from `since` on: compared exactly."""
    return [(row["iteration"], key, value) for row in rows(path) if row["iteration"] >= since
            for key, value in row.items() if key in LOSSES or key.startswith("valid_")]


def nvidia_args(data, vocab, metrics, seq_length, *extra):
    return [os.path.join(ROOT, "pretrain_bert.py"), "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", str(seq_length), "--max-position-embeddings",
            str(seq_length), "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
            "--lr", "1e-3", "--data-path", str(data), "--vocab-file", str(vocab), "--binary-head-task", "nsp",
            "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1", "--num-workers", "0",
            "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--tensor-model-parallel-size", "2",
            "--metrics-file", str(metrics), *extra]


@pytest.fixture(scope="module")
def lddl_binned(tmp_path_factory):
    d = tmp_path_factory.mktemp("lddl")
    for b in range(2):
        write_lddl_parquet(d / f"shard-0.parquet_{b}", 30, static=False, min_tokens=16 * b + 2,
                           max_tokens=16 * b + 16, bin_id=b, row_group_size=8, seed=b)
    return d, write_vocab(d / "vocab.txt"), 32


@pytest.mark.parametrize("kind", ["dle_hdf5", "lddl_binned_dynamic"])
def test_stop_and_resume_is_bitwise_at_tp2(kind, lddl_binned, tmp_path):
    data, vocab, seq = (PHASE1, VOCAB, 128) if kind == "dle_hdf5" else lddl_binned
    full, part, ckpt, ckpt2 = tmp_path / "full.jsonl", tmp_path / "part.jsonl", tmp_path / "ckpt", tmp_path / "ck2"
    _launch(2, nvidia_args(data, vocab, full, seq, "--save", str(ckpt), "--save-interval", "2"))
    # Resume from the iteration-2 checkpoint of that run (Megatron's tracker file names the one to load).
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2")
    _launch(2, nvidia_args(data, vocab, part, seq, "--load", str(ckpt), "--save", str(ckpt2)))
    expected = _curve(full)
    assert {it for it, _, _ in expected} == {1, 2, 3, 4}
    assert {key for _, key, _ in expected} >= {"lm_loss", "nsp_loss"}
    if kind == "dle_hdf5":
        assert any(key == "valid_lm_loss" for _, key, _ in expected)  # pydocs_test_0.hdf5
    assert min(it for it, _, _ in _curve(part)) == 3
    assert _curve(part) == _curve(full, since=3)  # bitwise: the same floats
