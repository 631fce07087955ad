"""NVIDIA's pre-training formats in tests: where the shards NVIDIA's own code made live
(tests/fixtures/nvidia, see its README), and small shards written here to the exact schemas
(DLE's create_pretraining_data.py: gzip HDF5 datasets and dtypes; LDDL's preprocessor: parquet
columns and types, np.save'd uint16 positions) with a tiny WordPiece vocab."""
from __future__ import annotations

import io
import os

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

NVIDIA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "nvidia")
NVIDIA_VOCAB = os.path.join(NVIDIA, "text", "vocab.txt")
DLE = os.path.join(NVIDIA, "dle")
DLE_PHASE1 = os.path.join(DLE, "hdf5_lower_case_1_seq_len_128_max_pred_20_masked_lm_prob_0.15_random_seed_12345_"
                          "dupe_factor_2", "pydocs")
LDDL = os.path.join(NVIDIA, "lddl")

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [f"w{i}" for i in range(40)] + [f"##p{i}" for i in range(10)]
VOCAB = SPECIAL + WORDS
CLS, SEP, MASK = 2, 3, 4


def write_vocab(path) -> str:
    with open(path, "w") as f:
        f.write("\n".join(VOCAB) + "\n")
    return str(path)


def _pair(rng, max_tokens):
    n = int(rng.integers(2, max_tokens + 1))
    n_a = int(rng.integers(1, n))
    ids = rng.integers(len(SPECIAL), len(VOCAB), n)
    return ids[:n_a], ids[n_a:]


def _static_mask(rng, tokens, maskable_count_of, max_pred):
    """DLE/LDDL's static masking: round(0.15 x tokens) of the non-special positions (capped)."""
    positions = np.flatnonzero(maskable_count_of)
    k = min(max_pred, max(1, int(round(len(tokens) * 0.15))))
    chosen = np.sort(rng.choice(positions, size=min(k, len(positions)), replace=False))
    labels = tokens[chosen].copy()
    out = tokens.copy()
    out[chosen] = MASK
    return out, chosen, labels


def write_dle_hdf5(path, num_rows: int, seq_length: int = 32, max_pred: int = 5, seed: int = 0):
    """A DLE shard: `[CLS] A [SEP] B [SEP]` rows, masked, 0-padded, with DLE's dtypes and gzip."""
    rng = np.random.default_rng(seed)
    f = {k: np.zeros((num_rows, seq_length), np.int32) for k in ("input_ids", "input_mask", "segment_ids")}
    f["masked_lm_positions"] = np.zeros((num_rows, max_pred), np.int32)
    f["masked_lm_ids"] = np.zeros((num_rows, max_pred), np.int32)
    f["next_sentence_labels"] = np.zeros(num_rows, np.int32)
    for r in range(num_rows):
        a, b = _pair(rng, seq_length - 3)
        tokens = np.concatenate([[CLS], a, [SEP], b, [SEP]])
        maskable = np.isin(np.arange(len(tokens)), [0, len(a) + 1, len(tokens) - 1], invert=True)
        out, pos, labels = _static_mask(rng, tokens, maskable, max_pred)
        f["input_ids"][r, :len(tokens)] = out
        f["input_mask"][r, :len(tokens)] = 1
        f["segment_ids"][r, len(a) + 2:len(tokens)] = 1
        f["masked_lm_positions"][r, :len(pos)] = pos
        f["masked_lm_ids"][r, :len(pos)] = labels
        f["next_sentence_labels"][r] = rng.integers(0, 2)
    dtypes = {"input_ids": "i4", "input_mask": "i1", "segment_ids": "i1", "masked_lm_positions": "i4",
              "masked_lm_ids": "i4", "next_sentence_labels": "i1"}
    with h5py.File(path, "w") as h:
        for key, dtype in dtypes.items():
            h.create_dataset(key, data=f[key], dtype=dtype, compression="gzip")
    return f


def _np_bytes(a) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def write_lddl_parquet(path, num_rows: int, max_tokens: int = 29, static: bool = True, bin_id=None,
                       min_tokens: int = 2, row_group_size=None, seed: int = 0) -> list[dict]:
    """An LDDL shard; with bin_id, every row's num_tokens lies in that bin's range [min_tokens, max_tokens]."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num_rows):
        n = int(rng.integers(max(min_tokens - 3, 2), max_tokens - 3 + 1))
        n_a = int(rng.integers(1, n))
        ids = rng.integers(len(SPECIAL), len(VOCAB), n)
        a, b = ids[:n_a], ids[n_a:]
        row = {"is_random_next": bool(rng.integers(0, 2)), "num_tokens": n + 3}
        if static:
            tokens = np.concatenate([[CLS], a, [SEP], b, [SEP]])
            maskable = np.isin(np.arange(len(tokens)), [0, n_a + 1, len(tokens) - 1], invert=True)
            out, pos, labels = _static_mask(rng, tokens, maskable, 1 << 16)
            a, b = out[1:1 + n_a], out[2 + n_a:-1]
            row["masked_lm_positions"] = _np_bytes(pos.astype(np.uint16))
            row["masked_lm_labels"] = " ".join(VOCAB[t] for t in labels)
        row["A"] = " ".join(VOCAB[t] for t in a)
        row["B"] = " ".join(VOCAB[t] for t in b)
        if bin_id is not None:
            row["bin_id"] = bin_id
        rows.append(row)
    schema = [("A", pa.string()), ("B", pa.string()), ("is_random_next", pa.bool_()), ("num_tokens", pa.uint16())]
    if static:
        schema += [("masked_lm_positions", pa.binary()), ("masked_lm_labels", pa.string())]
    if bin_id is not None:
        schema += [("bin_id", pa.int64())]
    table = pa.Table.from_pylist(rows, schema=pa.schema(schema))
    pq.write_table(table, path, row_group_size=row_group_size)
    return rows


# ------------------------------------------------------------------ damage, byte by byte


def _flip(path, offset: int, count: int = 1) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(count)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in old))


def flip_hdf5_chunk(path, key: str = "input_ids") -> None:
    """One flipped byte in the middle of every gzip chunk of a dataset (bit rot on disk)."""
    with h5py.File(path, "r") as f:
        ds = f[key]
        chunks = [ds.id.get_chunk_info(i) for i in range(ds.id.get_num_chunks())]
    for chunk in chunks:
        _flip(path, chunk.byte_offset + chunk.size // 2)


def flip_parquet_pages(path, column: str = "A", count: int = 8) -> None:
    """`count` flipped bytes in the middle of a column's pages in every row group (dictionary
    and data pages, snappy-compressed as LDDL writes them)."""
    meta = pq.ParquetFile(path).metadata
    k = meta.schema.names.index(column)
    for g in range(meta.num_row_groups):
        chunk = meta.row_group(g).column(k)
        start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
        _flip(path, start + chunk.total_compressed_size // 2, count)


def truncate(path, fraction: float = 2 / 3) -> None:
    os.truncate(path, int(os.path.getsize(path) * fraction))


def write_dle_hdf5_as(path, arrays: dict) -> None:
    """A DLE-like shard of the given arrays (a wrong dtype or shape written as it is)."""
    with h5py.File(path, "w") as h:
        for key, value in arrays.items():
            h.create_dataset(key, data=value, compression="gzip")


def replace_parquet_column(path, column: str, values) -> None:
    """The shard with one column replaced by `values` (a pyarrow array), row groups kept."""
    file = pq.ParquetFile(path)
    groups = file.metadata.row_group(0).num_rows
    table = file.read()
    table = table.set_column(table.schema.get_field_index(column), column, values)
    pq.write_table(table, path, row_group_size=groups)
