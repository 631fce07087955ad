"""NVIDIA LDDL's BERT parquet shards (DLE's BERT recipe since 2022, NGC "BERT for PyTorch"),
read lazily, one parquet row group at a time.

A shard (`shard-N.parquet`, or `shard-N.parquet_B` for bin B of binned data) holds columns
`A`, `B` (space-joined WordPiece strings, already masked when the preprocessor ran with
`--masking`), `is_random_next` (1 = B is random), `num_tokens` (|A| + |B| + 3), with static
masking `masked_lm_positions` (an np.save'd uint16 array of positions in `[CLS] A [SEP] B
[SEP]`) and `masked_lm_labels` (space-joined WordPieces), and `bin_id` when binned.

A row is encoded as LDDL's `_to_encoded_inputs` encodes it: `[CLS] A [SEP] B [SEP]` through
the vocab, segment 1 from B to its [SEP], static labels at the stored positions. A WordPiece
the vocab lacks is an error here (LDDL maps it to [UNK] silently): it means --vocab-file is
not the vocab the shards were made with.
"""
from __future__ import annotations

import io
import re
from typing import Optional

import numpy as np

from megabert.errors import DataError
from megabert.tasks.pretraining.masking import IGNORE_INDEX

REQUIRED_COLUMNS = ("A", "B", "is_random_next", "num_tokens")
STATIC_COLUMNS = ("masked_lm_positions", "masked_lm_labels")


def _column_types() -> dict:
    """{column: (test of its Arrow type, what LDDL writes)} for every column megabert reads."""
    import pyarrow.types as t  # imported on use, as pyarrow.parquet below

    def text(x):
        return t.is_string(x) or t.is_large_string(x)

    return {"A": (text, "strings"), "B": (text, "strings"), "masked_lm_labels": (text, "strings"),
            "is_random_next": (lambda x: t.is_boolean(x) or t.is_integer(x), "bools"),
            "num_tokens": (t.is_integer, "integers"),
            "masked_lm_positions": (lambda x: t.is_binary(x) or t.is_large_binary(x), "np.save'd bytes")}


# LDDL's names: `.parquet` in the extension, `_<bin>` after it for binned data.
_BINNED = re.compile(r"\.parquet_(\d+)$")


def bin_of(path: str) -> Optional[int]:
    m = _BINNED.search(path)
    return int(m.group(1)) if m else None


def load_positions(blob: bytes) -> np.ndarray:
    """LDDL's np.save'd position array (1-D uint16); never unpickled. The header is read first:
    given bytes that are not an .npy, np.load takes them for a pickle and suggests allow_pickle,
    advice that must not reach a user holding a damaged or hostile file."""
    buf = io.BytesIO(blob)
    version = np.lib.format.read_magic(buf)  # ValueError for anything but an .npy
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read_header(buf)
    if dtype.kind not in "iu" or len(shape) != 1:
        raise ValueError(f"masked_lm_positions holds a {dtype} array of shape {shape}, not LDDL's 1-D uint16 "
                         f"positions")
    return np.load(io.BytesIO(blob), allow_pickle=False).astype(np.int64)


class WordPieceIds:
    """WordPiece strings -> ids through a vocab, with the error that names the shard and the token."""

    def __init__(self, vocab: dict[str, int], vocab_source: str):
        self.vocab, self.source = vocab, vocab_source
        for token in ("[CLS]", "[SEP]"):
            if token not in vocab:
                raise DataError(f"vocab {vocab_source} has no {token}: LDDL shards need BERT's WordPiece vocab")
        self.cls, self.sep = vocab["[CLS]"], vocab["[SEP]"]

    def ids(self, tokens: list[str], path: str) -> list[int]:
        try:
            return [self.vocab[t] for t in tokens]
        except KeyError as e:
            raise DataError(f"{path} holds the WordPiece {e.args[0]!r}, which --vocab-file {self.source} lacks: "
                            f"pass the vocab the shards were made with") from None


def non_special(token_type_ids: np.ndarray) -> np.ndarray:
    """The positions dynamic masking may choose in an unpadded `[CLS] A [SEP] B [SEP]` row: all but
    [CLS] and both [SEP] (the complement of LDDL's special_tokens_mask)."""
    n = len(token_type_ids)
    maskable = np.ones(n, dtype=bool)
    first_b = int(np.argmax(token_type_ids))  # B's first token, or its [SEP] when B is empty
    maskable[[0, first_b - 1, n - 1]] = False
    return maskable


class ParquetShard:
    """One LDDL shard: row groups and masking kind read from the parquet footer at construction,
    rows read by row group. pyarrow opens the file on each read, so a shard is safe to hand
    to DataLoader worker processes."""

    def __init__(self, path: str):
        self.path = path
        try:
            import pyarrow.parquet as pq  # imported on use: every megabert process imports this module

            file = pq.ParquetFile(path)
            meta, schema = file.metadata, file.schema_arrow
        except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ... for a file that is not parquet
            raise DataError(f"{path} cannot be read as parquet ({e}): the file is damaged or not an LDDL parquet "
                            f"shard; check --data-path") from None
        names = meta.schema.names
        missing = [c for c in REQUIRED_COLUMNS if c not in names]
        if missing:
            raise DataError(f"{path} is not an LDDL BERT shard: it has no column {', '.join(missing)} "
                            f"(expected {', '.join(REQUIRED_COLUMNS)})")
        for column, (fits, what) in _column_types().items():
            if column in names and not fits(schema.field(column).type):
                raise DataError(f"{path} is not an LDDL BERT shard: its column {column} holds "
                                f"{schema.field(column).type}, where LDDL writes {what}")
        self.static_masking = all(c in names for c in STATIC_COLUMNS)
        self.columns = ("A", "B", "is_random_next") + (STATIC_COLUMNS if self.static_masking else ())
        self.bin = bin_of(path)
        self.group_rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self.num_rows = sum(self.group_rows)
        self._group_start = np.concatenate([[0], np.cumsum(self.group_rows)]).astype(np.int64)
        self.max_tokens = self._max_num_tokens(meta, names.index("num_tokens"))

    @staticmethod
    def _max_num_tokens(meta, column: int) -> Optional[int]:
        """The longest row from the footer's statistics (no data read); None when not recorded."""
        top = 0
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(column).statistics
            if stats is None or not stats.has_min_max:
                return None
            top = max(top, int(stats.max))
        return top

    @property
    def num_blocks(self) -> int:
        return len(self.group_rows)

    def block_range(self, block: int) -> tuple[int, int]:
        return int(self._group_start[block]), int(self._group_start[block + 1])

    def read_block(self, block: int) -> dict:
        """The rows of one row group: {column: Arrow array}. Kept as Arrow buffers, not Python
        strings (a third of the memory); a row's values are taken out as it is read."""
        import pyarrow.parquet as pq

        table = pq.ParquetFile(self.path).read_row_group(block, columns=list(self.columns))
        return {c: table.column(c).combine_chunks() for c in self.columns}

    def block_row(self, data: dict, i: int, words: WordPieceIds) -> dict:
        """Row i of a block as megabert trains on it: int64 arrays of the row's own length
        (|A| + |B| + 3, no padding); labels all IGNORE_INDEX for dynamic masking."""
        a, b = data["A"][i].as_py().split(), data["B"][i].as_py().split()
        input_ids = np.empty(len(a) + len(b) + 3, dtype=np.int64)
        input_ids[0], input_ids[len(a) + 1], input_ids[-1] = words.cls, words.sep, words.sep
        input_ids[1:len(a) + 1] = words.ids(a, self.path)
        input_ids[len(a) + 2:-1] = words.ids(b, self.path)
        token_type_ids = np.zeros(len(input_ids), dtype=np.int64)
        token_type_ids[len(a) + 2:] = 1
        labels = np.full(len(input_ids), IGNORE_INDEX, dtype=np.int64)
        if self.static_masking:
            positions = load_positions(data["masked_lm_positions"][i].as_py())
            targets = data["masked_lm_labels"][i].as_py().split()
            lo, hi = (int(positions.min()), int(positions.max())) if len(positions) else (0, 0)
            if len(positions) != len(targets) or not 0 <= lo <= hi < len(input_ids):
                raise DataError(f"{self.path}: row {i} of its row group has {len(positions)} masked positions "
                                f"({lo} to {hi}) for {len(targets)} labels and {len(input_ids)} tokens: the shard "
                                f"is damaged; make it again")
            labels[positions] = words.ids(targets, self.path)
        return {"input_ids": input_ids, "token_type_ids": token_type_ids,
                "attention_mask": np.ones(len(input_ids), dtype=np.int64), "labels": labels,
                "next_sentence_label": np.array(int(data["is_random_next"][i].as_py()), dtype=np.int64)}
