"""The MMIDIDX reader/writer against megatron-core, every dtype code, and corrupt files."""
import os

import numpy as np
import pytest
import torch

from megabert.data.indexed_dataset import DTYPES, IndexedDataset, IndexedDatasetWriter, best_dtype
from megabert.errors import DataError

mcore = pytest.importorskip("megatron.core.datasets.indexed_dataset")


def _documents(rng, n_docs=20, vocab=60000):
    """Documents as lists of sentences; some empty documents and empty sentences included."""
    docs = []
    for d in range(n_docs):
        n_sent = 0 if d % 7 == 3 else int(rng.integers(1, 6))
        docs.append([rng.integers(0, vocab, size=int(rng.integers(0 if s == 2 else 1, 30))) for s in range(n_sent)])
    return docs


def _write_ours(prefix, docs, dtype):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in docs:
            if doc:
                w.add_document(np.concatenate(doc), [len(s) for s in doc])
            else:
                w.end_document()


def _write_megatron(prefix, docs, dtype):
    b = mcore.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        for s in doc:
            b.add_item(torch.from_numpy(s.astype(np.int64)))
        b.end_document()
    b.finalize(prefix + ".idx")


def _assert_same(ours, theirs, docs):
    flat = [s for doc in docs for s in doc]
    assert len(ours) == len(theirs) == len(flat)
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    for i, s in enumerate(flat):
        np.testing.assert_array_equal(ours[i], s.astype(ours.dtype))
        np.testing.assert_array_equal(theirs[i], s.astype(ours.dtype))


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64])
def test_megatron_core_reads_ours_and_we_read_theirs(tmp_path, dtype):
    docs = _documents(np.random.default_rng(0))
    _write_ours(str(tmp_path / "ours"), docs, dtype)
    _write_megatron(str(tmp_path / "theirs"), docs, dtype)
    for name in ("bin", "idx"):  # the same bytes, so compatibility holds both ways
        assert (tmp_path / f"ours.{name}").read_bytes() == (tmp_path / f"theirs.{name}").read_bytes()
    _assert_same(IndexedDataset(str(tmp_path / "theirs")), mcore.IndexedDataset(str(tmp_path / "ours")), docs)


@pytest.mark.parametrize("code", sorted(DTYPES))
def test_every_dtype_code_round_trips(tmp_path, code):
    dtype = DTYPES[code]
    docs = [[np.arange(5, dtype=dtype), np.arange(3, dtype=dtype)], [np.array([7], dtype=dtype)]]
    prefix = str(tmp_path / "d")
    _write_ours(prefix, docs, dtype)
    assert (tmp_path / "d.idx").read_bytes()[17] == code
    ds = IndexedDataset(prefix)
    assert ds.dtype == dtype and ds.num_documents == 2
    np.testing.assert_array_equal(ds.document(0)[1], docs[0][1])
    np.testing.assert_array_equal(ds.get(0, offset=1, length=3), [1, 2, 3])
    assert [list(x) for x in ds[0:2]] == [list(range(5)), list(range(3))]
    theirs = mcore.IndexedDataset(prefix)  # kept alive: its __del__ closes the mmap under any view
    assert theirs[2].tolist() == [7]


def test_merge_and_pickle(tmp_path):
    import pickle

    rng = np.random.default_rng(1)
    a, b = _documents(rng, 5), _documents(rng, 6)
    _write_ours(str(tmp_path / "a"), a, np.uint16)
    _write_ours(str(tmp_path / "b"), b, np.uint16)
    with IndexedDatasetWriter(str(tmp_path / "m"), np.uint16) as w:
        w.add_index(str(tmp_path / "a"))
        w.add_index(str(tmp_path / "b"))
    _write_ours(str(tmp_path / "ab"), a + b, np.uint16)
    assert (tmp_path / "m.idx").read_bytes() == (tmp_path / "ab.idx").read_bytes()
    ds = pickle.loads(pickle.dumps(IndexedDataset(str(tmp_path / "m"))))
    _assert_same(ds, mcore.IndexedDataset(str(tmp_path / "ab")), a + b)
    assert best_dtype(30522) == np.uint16 and best_dtype(65500) == np.int32


def test_empty_dataset(tmp_path):
    with IndexedDatasetWriter(str(tmp_path / "e"), np.uint16):
        pass
    ds = IndexedDataset(str(tmp_path / "e"))
    assert len(ds) == 0 and ds.num_documents == 0


def _corrupt(tmp_path, how):
    prefix = str(tmp_path / "c")
    _write_ours(prefix, _documents(np.random.default_rng(2), 4), np.uint16)
    idx, bin_ = tmp_path / "c.idx", tmp_path / "c.bin"
    if how == "magic":
        idx.write_bytes(b"XXXXXXXXX" + idx.read_bytes()[9:])
    elif how == "version":
        raw = bytearray(idx.read_bytes()); raw[9] = 2; idx.write_bytes(bytes(raw))
    elif how == "dtype":
        raw = bytearray(idx.read_bytes()); raw[17] = 42; idx.write_bytes(bytes(raw))
    elif how == "idx-truncated":
        idx.write_bytes(idx.read_bytes()[:-8])
    elif how == "header-truncated":
        idx.write_bytes(idx.read_bytes()[:20])
    elif how == "bin-truncated":
        bin_.write_bytes(bin_.read_bytes()[:-2])
    elif how == "bin-missing":
        os.remove(bin_)
    elif how == "idx-missing":
        os.remove(idx)
    return prefix


@pytest.mark.parametrize("how,words", [
    ("magic", "not a Megatron MMIDIDX"), ("version", "version 2"), ("dtype", "dtype code 42"),
    ("idx-truncated", "truncated or corrupt"), ("header-truncated", "truncated"),
    ("bin-truncated", "truncated"), ("bin-missing", "does not exist"), ("idx-missing", "does not exist"),
])
def test_corrupt_files_name_the_file(tmp_path, how, words):
    prefix = _corrupt(tmp_path, how)
    with pytest.raises(DataError, match=words) as e:
        IndexedDataset(prefix)
    assert "c.idx" in str(e.value) or "c.bin" in str(e.value)


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(str(tmp_path / "f"), np.uint16) as w:
            w.add_item([1, 2, 3])
            raise RuntimeError("boom")
    assert not os.listdir(tmp_path)
