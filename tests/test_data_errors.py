"""Damaged data ends in one line, with the DataLoader workers users run (--num-workers 2):
pretrain_bert.py's main() in process on shards damaged byte by byte (bit rot inside an HDF5
gzip chunk and inside parquet pages, truncation, wrong dtypes and shapes, junk positions),
a corrupt Megatron index, a damaged held-out (validation) shard, and a vocab that lacks the
shard's WordPieces (a DataError raised inside a worker). Each ends in exactly one stderr line
that names the file and, for what the readers' libraries raise, the row and its row band or
row group."""
import os
import re
import shutil

import numpy as np
import pyarrow as pa
import pytest
import torch

from megabert.config import DataConfig
from megabert.data import build_pretraining_data_loader, build_tokenizer
from megabert.errors import DataError
from megabert.tasks.pretraining import pretraining_samples
from megabert.data.shard_sources import detect_nvidia_data
from megabert.tasks.pretraining.nvidia_samples import build_nvidia_datasets
from tests.helpers.nvidia_shards import (VOCAB, flip_hdf5_chunk, flip_parquet_pages, replace_parquet_column,
                                         truncate, write_dle_hdf5, write_dle_hdf5_as, write_lddl_parquet, write_vocab)
from tests.helpers.pretrain_runs import ROOT, run_main

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (INFO|WARNING) ")
HDF5_READ = r"row (\d+) \(in row band (\d+), rows (\d+)-(\d+)\) cannot be read \(.+\): the file is damaged or " \
            r"not a DeepLearningExamples HDF5 shard"
PARQUET_READ = r"row (\d+) \(in row group (\d+), rows (\d+)-(\d+)\) cannot be read \(.+\): the file is damaged or " \
               r"not an LDDL parquet shard"


def _args(data, vocab, *extra):
    return [os.path.join(ROOT, "pretrain_bert.py"), "--num-layers", "1", "--hidden-size", "16",
            "--num-attention-heads", "2", "--seq-length", "32", "--max-position-embeddings", "32",
            "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
            "--data-path", str(data), "--vocab-file", str(vocab), "--num-workers", "2", *extra]


def _hdf5(d, name="training_0.hdf5", **kw):
    os.makedirs(d, exist_ok=True)
    return write_dle_hdf5(os.path.join(d, name), 64, seq_length=32, max_pred=5, **kw), os.path.join(d, name)


def _parquet(d, name="shard-0.parquet"):
    os.makedirs(d, exist_ok=True)
    write_lddl_parquet(os.path.join(d, name), 64, static=True, row_group_size=16)
    return os.path.join(d, name)


def _bitrot_hdf5(d):
    _, path = _hdf5(d)
    flip_hdf5_chunk(path)
    return path


def _bitrot_parquet(d):
    path = _parquet(d)
    flip_parquet_pages(path)
    return path


def _truncated(make):
    def build(d):
        path = make(d)
        truncate(path)
        return path
    return build


def _hdf5_with(key, change):
    def build(d):
        arrays, path = _hdf5(d)
        arrays[key] = change(arrays[key])
        write_dle_hdf5_as(path, arrays)
        return path
    return build


def _parquet_with(column, values):
    def build(d):
        path = _parquet(d)
        replace_parquet_column(path, column, values)
        return path
    return build


def _bitrot_validation(d):
    _hdf5(d)
    _, path = _hdf5(d, "test_0.hdf5", seed=1)
    flip_hdf5_chunk(path)
    return path


def _wordpieces_not_in_vocab(d):
    return _parquet(d)


def _junk_positions(d):
    """np.load would take these bytes for a pickle and suggest allow_pickle=True."""
    return _parquet_with("masked_lm_positions", pa.array([b"junk" * 5] * 64, pa.binary()))(d)


# case -> (build(dir) -> the file it damaged, the error line's pattern after the file's name, extra flags)
CASES = {
    "hdf5_bitrot_in_gzip_chunk": (_bitrot_hdf5, ": " + HDF5_READ.replace(r"\(.+\)", r"\(OSError: .*filter returned "
                                                                                  r"failure during read.*\)"), ()),
    "hdf5_truncated": (_truncated(lambda d: _hdf5(d)[1]), r" cannot be read as HDF5 \(.*truncated file", ()),
    "hdf5_float_positions": (_hdf5_with("masked_lm_positions", lambda a: a.astype(np.float32)),
                             r" is not a DeepLearningExamples BERT shard: dataset masked_lm_positions holds float32 "
                             r"\[64, 5\], where DLE writes 2-D integers", ()),
    "hdf5_segment_ids_narrower": (_hdf5_with("segment_ids", lambda a: a[:, :-1]),
                                  r": dataset segment_ids is \[64, 31\] but input_ids is \[64, 32\]: the file is "
                                  r"damaged", ()),
    "hdf5_positions_past_the_row": (_hdf5_with("masked_lm_positions", lambda a: a + 40),
                                    ": " + HDF5_READ.replace(r"\(.+\)", r"\(ValueError: masked_lm_positions "
                                                                        r"\[.*\] lie outside the row's 32 tokens\)"),
                                    ()),
    "validation_shard_bitrot": (_bitrot_validation, ": " + HDF5_READ, ("--eval-interval", "1", "--eval-iters", "1")),
    "parquet_bitrot_in_pages": (_bitrot_parquet, ": " + PARQUET_READ.replace(r"\(.+\)", r"\(OSError: .+\)"), ()),
    "parquet_truncated": (_truncated(_parquet), r" cannot be read as parquet \(Parquet magic bytes not found", ()),
    "parquet_A_int64": (_parquet_with("A", pa.array(range(64), pa.int64())),
                        r" is not an LDDL BERT shard: its column A holds int64, where LDDL writes strings", ()),
    "parquet_junk_positions": (_junk_positions,
                               ": " + PARQUET_READ.replace(r"\(.+\)", r"\(ValueError: the magic string is not "
                                                                      r"correct; .*\)"), ()),
    "wordpieces_not_in_vocab": (_wordpieces_not_in_vocab,
                                r" holds the WordPiece 'w\d+', which --vocab-file .*small.txt lacks: pass the vocab "
                                r"the shards were made with", ()),
}


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """{case: (data dir, damaged file, vocab)}, all written once."""
    root = tmp_path_factory.mktemp("damaged")
    vocab = write_vocab(root / "vocab.txt")
    small = root / "small.txt"
    small.write_text("\n".join(VOCAB[:10]) + "\n")  # the special tokens and w0-w4
    out = {}
    for case, (build, _, _) in CASES.items():
        d = str(root / case)
        out[case] = (d, build(d), small if case == "wordpieces_not_in_vocab" else vocab)
    return out


def one_error_line(stderr: str) -> str:
    """The one line that is not a log record; no traceback, no worker's report."""
    lines = [line for line in stderr.strip().splitlines() if not LOG_LINE.match(line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    assert "DataLoader worker" not in stderr and "allow_pickle" not in stderr, stderr[-3000:]
    return lines[0]


def _check_rows(line, num_rows=64, group_rows=16):
    """The row named lies in the band / row group named, and that band has the shard's layout."""
    m = re.search(r"row (\d+) \(in row (?:band|group) (\d+), rows (\d+)-(\d+)\)", line)
    if m is None:
        return
    row, block, lo, hi = map(int, m.groups())
    assert lo <= row <= hi, line
    if "row group" in line:
        assert (lo, hi) == (block * group_rows, block * group_rows + group_rows - 1), line
    else:
        assert (block, lo, hi) == (0, 0, num_rows - 1), line  # 64 rows: one block


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_data_ends_in_one_line_with_workers(damaged, case):
    data, path, vocab = damaged[case]
    _, pattern, extra = CASES[case]
    r = run_main(*_args(data, vocab, *extra))
    assert r.returncode == 2, r.stderr[-3000:]
    line = one_error_line(r.stderr)
    assert re.fullmatch("error: " + re.escape(path) + pattern + ".*", line), line
    _check_rows(line)


@pytest.mark.parametrize("case", ["hdf5_bitrot_in_gzip_chunk", "wordpieces_not_in_vocab"])
def test_packed_rows_speak_as_unpacked_ones(damaged, case):
    """--pack-sequences reads its windows in the workers through another loader: the same one line."""
    data, path, vocab = damaged[case]
    _, pattern, extra = CASES[case]
    r = run_main(*_args(data, vocab, *extra, "--pack-sequences", "--packing-window", "8"))
    assert r.returncode == 2, r.stderr[-3000:]
    line = one_error_line(r.stderr)
    assert re.fullmatch("error: " + re.escape(path) + pattern + ".*", line), line


def test_workers_speak_as_the_main_process(damaged):
    """0 or 2 workers: the same exception class and the same line, through the loader's API;
    the public one-file reader says it alike."""
    for case in ("hdf5_bitrot_in_gzip_chunk", "wordpieces_not_in_vocab"):
        data_dir, path, case_vocab = damaged[case]
        data = DataConfig(data_path=[data_dir], vocab_file=str(case_vocab), binary_head_task="nsp", seq_length=32)
        tok = build_tokenizer("BertWordPieceLowerCase", str(case_vocab))
        train, _ = build_nvidia_datasets(detect_nvidia_data(data.data_path), data, tok, (8, 0, 0), 1234, 2, True)
        lines = set()
        for workers in (0, 2):
            with pytest.raises(DataError) as e:
                next(iter(build_pretraining_data_loader(train, 0, 2, 0, 1, workers)))
            assert type(e.value) is DataError and path in str(e.value)
            lines.add(str(e.value))
        assert len(lines) == 1, lines
    with pytest.raises(DataError, match=re.escape(damaged["hdf5_bitrot_in_gzip_chunk"][1]) + ": row 0 .*row band 0"):
        pretraining_samples(damaged["hdf5_bitrot_in_gzip_chunk"][1])[0]


def test_a_bug_in_a_dataset_keeps_its_traceback():
    """Only datasets that read files (and say where) turn exceptions into DataErrors: anything
    else is a bug, and torch reports it as before."""
    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            raise ZeroDivisionError("a bug")

    with pytest.raises(ZeroDivisionError, match="a bug"):
        next(iter(build_pretraining_data_loader(Broken(), 0, 2, 0, 1, 0)))


def test_megatron_index_with_corrupt_pointers_names_the_files(dataset, tmp_path):
    """Index checks at open cover the header, the sizes and both ends; a pointer in the middle
    is found when a worker reads it."""
    for ext in (".bin", ".idx"):
        shutil.copy(dataset / f"c_text_sentence{ext}", tmp_path / f"c_text_sentence{ext}")
    idx = bytearray((tmp_path / "c_text_sentence.idx").read_bytes())
    n = int(np.frombuffer(idx, np.uint64, 1, 18)[0])  # after the magic, version and dtype code
    np.frombuffer(idx, np.int64, n, 34 + 4 * n)[1:-1] = 1 << 40  # the pointers after the lengths
    (tmp_path / "c_text_sentence.idx").write_bytes(idx)
    r = run_main(*_args(tmp_path / "c_text_sentence", dataset / "vocab.txt", "--split", "100,0,0"))
    line = one_error_line(r.stderr)
    assert re.fullmatch(r"error: " + re.escape(str(tmp_path / "c_text_sentence")) + r"\.bin/\.idx: sample \d+ of the "
                        r"train split \(sentences \d+-\d+\) cannot be read \(ValueError: .*\): the files are damaged "
                        r"or not a Megatron \.bin/\.idx pair; make them again with tools/preprocess_data\.py", line)
