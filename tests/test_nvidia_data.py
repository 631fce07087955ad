"""NVIDIA's pre-training files read as they are: the public reader row by row against DLE's
`pretraining_dataset` and LDDL's per-row encoding (re-stated here from their code; the shards
NVIDIA's own tools made are checked in test_nvidia_fixtures.py), --data-path detection and its
errors, and megabert's global order: a permutation per epoch, independent of workers,
binned batches from one bin, dynamic masks fixed by the sample index."""
import io
import os
import pickle

import h5py
import numpy as np
import pytest
import torch

from megabert.config import DataConfig
from megabert.data import build_pretraining_data_loader, build_tokenizer
from megabert.errors import ConfigError, DataError
from megabert.tasks.pretraining import pretraining_samples
from megabert.data.shard_sources import detect_nvidia_data
from megabert.tasks.pretraining.nvidia_samples import build_nvidia_datasets
from tests.helpers.nvidia_shards import SPECIAL, VOCAB, write_dle_hdf5, write_lddl_parquet, write_vocab

KEYS = ("input_ids", "token_type_ids", "attention_mask", "labels")


def dle_reference_rows(path, max_pred_length):
    """DLE's run_pretraining.py `pretraining_dataset.__getitem__`, line for line (ignore -1)."""
    with h5py.File(path, "r") as f:
        keys = ['input_ids', 'input_mask', 'segment_ids', 'masked_lm_positions', 'masked_lm_ids',
                'next_sentence_labels']
        inputs = [np.asarray(f[key][:]) for key in keys]
    for index in range(len(inputs[0])):
        [input_ids, input_mask, segment_ids, masked_lm_positions, masked_lm_ids, next_sentence_labels] = [
            torch.from_numpy(x[index].astype(np.int64)) if i < 5 else torch.from_numpy(
                np.asarray(x[index].astype(np.int64))) for i, x in enumerate(inputs)]
        masked_lm_labels = torch.ones(input_ids.shape, dtype=torch.long) * -1
        k = max_pred_length
        padded_mask_indices = (masked_lm_positions == 0).nonzero()
        if len(padded_mask_indices) != 0:
            k = padded_mask_indices[0].item()
        masked_lm_labels[masked_lm_positions[:k]] = masked_lm_ids[:k]
        yield [input_ids, segment_ids, input_mask, masked_lm_labels, next_sentence_labels]


def lddl_reference_row(row, vocab_file):
    """LDDL's lddl/torch/bert.py `_to_encoded_inputs` for a batch of this one row (ignore -1,
    padded to a multiple of 8), ids through transformers' BertTokenizer as LDDL does."""
    from transformers import BertTokenizer

    tok = BertTokenizer(vocab_file)
    a, b = tuple(row["A"].split()), tuple(row["B"].split())
    seq = ((len(a) + len(b) + 3 - 1) // 8 + 1) * 8
    input_ids = torch.zeros(seq, dtype=torch.long)
    tokens = ('[CLS]',) + a + ('[SEP]',) + b + ('[SEP]',)
    input_ids[:len(tokens)] = torch.as_tensor(tok.convert_tokens_to_ids(tokens))
    token_type_ids, attention_mask = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
    token_type_ids[len(a) + 2:len(a) + len(b) + 3] = 1
    attention_mask[:len(a) + len(b) + 3] = 1
    labels = torch.full_like(input_ids, -1)
    if "masked_lm_positions" in row:
        pos = torch.from_numpy(np.load(io.BytesIO(row["masked_lm_positions"])).astype(int))
        labels[pos] = torch.as_tensor(tok.convert_tokens_to_ids(row["masked_lm_labels"].split()))
    return input_ids, token_type_ids, attention_mask, labels, int(row["is_random_next"])


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    return write_vocab(tmp_path_factory.mktemp("vocab") / "vocab.txt")


def test_hdf5_rows_equal_dle_pretraining_dataset(tmp_path):
    """Every row, across block boundaries (2,600 rows: blocks of at least 1,024)."""
    path = tmp_path / "training_shard_0.hdf5"
    write_dle_hdf5(path, 2600, seq_length=16, max_pred=3)
    ours = pretraining_samples(str(path))
    assert len(ours) == 2600
    for i, ref in enumerate(dle_reference_rows(path, 3)):
        row = ours[i]
        for key, want in zip(KEYS, ref[:4]):
            want = torch.where(want == -1, -100, want) if key == "labels" else want
            assert row[key].dtype == torch.int64 and torch.equal(row[key], want), (i, key)
        assert row["next_sentence_label"].shape == () and int(row["next_sentence_label"]) == int(ref[4])


@pytest.mark.parametrize("static", [True, False])
def test_parquet_rows_equal_lddl_encoding(tmp_path, vocab, static):
    path = tmp_path / "shard-0.parquet"
    rows = write_lddl_parquet(path, 60, static=static, row_group_size=16)
    ours = pretraining_samples(str(path), vocab_file=vocab)
    assert len(ours) == 60
    for i, row in enumerate(rows):
        *ref, nsp = lddl_reference_row(row, vocab)
        got = ours[i]
        n = len(got["input_ids"])
        assert n == row["num_tokens"] and (ref[2][n:] == 0).all()
        for key, want in zip(KEYS, ref):
            want = torch.where(want == -1, -100, want)[:n]
            assert torch.equal(got[key], want), (i, key)
        if not static:
            assert (got["labels"] == -100).all()
        assert int(got["next_sentence_label"]) == nsp


def test_public_reader_errors(tmp_path, vocab):
    write_lddl_parquet(tmp_path / "shard-0.parquet", 4)
    with pytest.raises(ConfigError, match="vocab_file"):
        pretraining_samples(str(tmp_path / "shard-0.parquet"))
    (tmp_path / "small.txt").write_text("\n".join(VOCAB[:10]) + "\n")
    with pytest.raises(DataError, match="small.txt lacks"):
        [pretraining_samples(str(tmp_path / "shard-0.parquet"), vocab_file=str(tmp_path / "small.txt"))[i]
         for i in range(4)]
    with pytest.raises(DataError, match="not a DeepLearningExamples"):
        pretraining_samples(str(tmp_path / "missing.hdf5"))


def _data(path, **kw) -> DataConfig:
    return DataConfig(data_path=[str(p) for p in path] if isinstance(path, list) else [str(path)], **kw)


def test_detection_forms_and_held_out_files(tmp_path):
    for name in ("a_training_0.hdf5", "a_training_1.hdf5", "a_test_0.hdf5"):
        write_dle_hdf5(tmp_path / name, 4, seq_length=16, max_pred=3)
    names = lambda files: [os.path.basename(f) for f in files]  # noqa: E731
    src = detect_nvidia_data([str(tmp_path)])
    assert src.format.endswith("HDF5") and src.weights == [1.0]
    assert names(src.train_files[0]) == ["a_training_0.hdf5", "a_training_1.hdf5"]
    assert names(src.test_files[0]) == ["a_test_0.hdf5"]
    assert names(detect_nvidia_data([str(tmp_path / "*_1.hdf5")]).train_files[0]) == ["a_training_1.hdf5"]
    listed = detect_nvidia_data([str(tmp_path / "a_training_1.hdf5"), str(tmp_path / "a_training_0.hdf5")])
    assert len(listed.train_files[0]) == 2
    weighted = detect_nvidia_data(["1", str(tmp_path / "a_training_0.hdf5"), "3", str(tmp_path / "a_training_1.hdf5")])
    assert weighted.weights == [0.25, 0.75] and len(weighted.train_files) == 2
    assert detect_nvidia_data([str(tmp_path / "corpus_text_sentence")]) is None  # a Megatron prefix
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .hdf5 or LDDL .parquet"):
        detect_nvidia_data([str(tmp_path / "empty")])
    write_lddl_parquet(tmp_path / "shard-0.parquet", 4)
    with pytest.raises(ConfigError, match="mixes"):
        detect_nvidia_data([str(tmp_path)])
    with pytest.raises(ConfigError, match="mixes NVIDIA shards with Megatron prefixes"):
        detect_nvidia_data([str(tmp_path / "a_training_0.hdf5"), str(tmp_path / "c_text_sentence")])


def _build(path, vocab, n=40, seed=7, global_batch=4, task="nsp", **kw):
    data = _data(path, vocab_file=vocab, binary_head_task=task, **kw)
    tok = build_tokenizer("BertWordPieceLowerCase", vocab)
    return build_nvidia_datasets(detect_nvidia_data(data.data_path), data, tok, (n, n, 0), seed, global_batch, True)


def test_flags_are_checked_against_the_files(tmp_path, vocab):
    write_dle_hdf5(tmp_path / "training.hdf5", 4, seq_length=16, max_pred=3)
    with pytest.raises(ConfigError, match="--seq-length 16"):
        _build(tmp_path, vocab, seq_length=32)
    with pytest.raises(ConfigError, match="--max-predictions-per-seq 3"):
        _build(tmp_path, vocab, seq_length=16, max_predictions_per_seq=2)
    with pytest.raises(ConfigError, match="--binary-head-task sop cannot train on .* HDF5 shards"):
        _build(tmp_path, vocab, seq_length=16, task="sop")
    (tmp_path / "p").mkdir()
    write_lddl_parquet(tmp_path / "p" / "shard-0.parquet", 8, max_tokens=29)
    with pytest.raises(ConfigError, match="up to .* tokens but --seq-length is 16"):
        _build(tmp_path / "p", vocab, seq_length=16)


def _rows_seen(ds, n):
    """The identity of each sample: its input ids (rows are distinct random draws)."""
    return [tuple(ds[i]["input_ids"].tolist()) for i in range(n)]


def test_order_is_a_seeded_permutation_per_epoch(tmp_path, vocab):
    for k in range(3):
        write_dle_hdf5(tmp_path / f"training_{k}.hdf5", 1500 if k == 0 else 7, seq_length=16, max_pred=3, seed=k)
    train, valid = _build(tmp_path, vocab, n=2 * 1514, seq_length=16)
    assert valid is None  # no held-out (*test*) file
    epoch0, epoch1 = _rows_seen(train, 1514), [tuple(train[1514 + i]["input_ids"].tolist()) for i in range(1514)]
    stored = [tuple(row["input_ids"].tolist()) for k in range(3)
              for row in pretraining_samples(str(tmp_path / f"training_{k}.hdf5"))]
    assert sorted(epoch0) == sorted(stored) == sorted(epoch1)  # every row once per epoch
    assert epoch0 != stored and epoch0 != epoch1  # shuffled, differently each epoch
    again, _ = _build(tmp_path, vocab, n=2 * 1514, seq_length=16)
    assert _rows_seen(again, 200) == epoch0[:200]
    other, _ = _build(tmp_path, vocab, n=2 * 1514, seq_length=16, seed=8)
    assert _rows_seen(other, 200) != epoch0[:200]


def _batches(ds, consumed, micro, dp_rank, dp_size, workers):
    return [{k: v.clone() for k, v in b.items()}
            for b in build_pretraining_data_loader(ds, consumed, micro, dp_rank, dp_size, workers)]


def test_loader_workers_and_ranks_see_the_global_order(tmp_path, vocab):
    """Two workers, or two data-parallel ranks, or a start at consumed samples: the same samples."""
    for k in range(2):
        write_lddl_parquet(tmp_path / f"shard-{k}.parquet", 30, static=False, row_group_size=8, seed=k)
    train, _ = _build(tmp_path, vocab, n=48, seq_length=32)
    one = _batches(train, 0, 4, 0, 1, 0)
    two_workers = _batches(train, 0, 4, 0, 1, 2)
    for a, b in zip(one, two_workers):
        assert all(torch.equal(a[k], b[k]) for k in a)
    rank0, rank1 = _batches(train, 0, 2, 0, 2, 0), _batches(train, 0, 2, 1, 2, 0)
    for full, r0, r1 in zip(one, rank0, rank1):
        assert torch.equal(full["input_ids"], torch.cat([r0["input_ids"], r1["input_ids"]]))
    resumed = _batches(train, 16, 4, 0, 1, 0)
    for a, b in zip(one[4:], resumed):
        assert all(torch.equal(a[k], b[k]) for k in a)
    spawned = pickle.loads(pickle.dumps(train))  # what a spawned worker receives: no open file, no cache
    assert not spawned.cache._blocks and np.array_equal(spawned[5]["input_ids"], train[5]["input_ids"])


def test_dynamic_masking_is_drawn_per_sample_index(tmp_path, vocab):
    write_lddl_parquet(tmp_path / "shard-0.parquet", 50, static=False, max_tokens=29)
    train, _ = _build(tmp_path, vocab, n=100, seq_length=32)
    rows = pretraining_samples(str(tmp_path / "shard-0.parquet"), vocab_file=vocab)
    stored = {tuple(rows[i]["token_type_ids"].tolist()) + tuple(rows[i]["input_ids"].tolist()): i
              for i in range(len(rows))}
    masked = total = 0
    for idx in range(100):
        s = train[idx]
        n = int(s["attention_mask"].sum())
        assert (s["input_ids"][n:] == 0).all() and (s["labels"][n:] == -100).all()
        chosen = s["labels"] != -100
        restored = np.where(chosen, s["labels"], s["input_ids"])[:n]
        assert (tuple(s["token_type_ids"][:n].tolist()) + tuple(restored.tolist())) in stored  # labels restore the row
        special = np.isin(restored, [VOCAB.index(t) for t in SPECIAL])
        assert not (chosen[:n] & special).any()  # never [CLS] or [SEP]
        masked, total = masked + chosen.sum(), total + (~special).sum()
        np.testing.assert_array_equal(train[idx]["input_ids"], s["input_ids"])  # fixed by the index
    assert 0.12 < masked / total < 0.18
    assert not np.array_equal(train[0]["labels"], train[50]["labels"])  # another epoch, other masks


def test_binned_batches_come_from_one_bin(tmp_path, vocab):
    sizes = {0: 23, 1: 41, 2: 9}
    for b, n in sizes.items():
        write_lddl_parquet(tmp_path / f"shard-0.parquet_{b}", n, min_tokens=b * 10 + 2, max_tokens=b * 10 + 10,
                           row_group_size=8, bin_id=b, seed=b)
    gb = 4
    train, _ = _build(tmp_path, vocab, n=3 * 72, seq_length=32, global_batch=gb)
    per_epoch = sum(n // gb for n in sizes.values()) * gb
    assert train.order.epoch_length == per_epoch == 68
    lengths = np.array([int(train[i]["attention_mask"].sum()) for i in range(2 * per_epoch)])
    bins = (lengths - 1) // 10
    assert (bins.reshape(-1, gb) == bins.reshape(-1, gb)[:, :1]).all()  # one bin per global batch
    assert (np.bincount(bins[:per_epoch]) == [20, 40, 8]).all()
    first = [bins[i * gb] for i in range(per_epoch // gb)]
    assert first != sorted(first)  # the bins interleave
    one = _batches(train, 0, 2, 0, 1, 0)
    for a, b in zip(one[6:], _batches(train, 12, 2, 0, 1, 0)):  # resumed at consumed samples 12
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_weighted_directories_blend_by_weight(tmp_path, vocab):
    for name, seed in (("a", 1), ("b", 2)):
        (tmp_path / name).mkdir()
        write_dle_hdf5(tmp_path / name / "training.hdf5", 30, seq_length=16, max_pred=3, seed=seed)
    data = _data(["1", tmp_path / "a", "3", tmp_path / "b"], vocab_file=vocab, binary_head_task="nsp",
                 seq_length=16)
    tok = build_tokenizer("BertWordPieceLowerCase", vocab)
    train, valid = build_nvidia_datasets(detect_nvidia_data(data.data_path), data, tok, (40, 8, 0), 3, 4, True)
    assert len(train) == 40 and valid is None
    assert list(np.bincount(train.dataset_index)) == [10, 30]
    rows_b = {tuple(r["input_ids"].tolist()) for r in pretraining_samples(str(tmp_path / "b" / "training.hdf5"))}
    from_b = [tuple(train[i]["input_ids"].tolist()) in rows_b for i in range(40)]
    assert from_b == [bool(k) for k in train.dataset_index]
