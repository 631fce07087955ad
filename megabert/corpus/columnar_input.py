"""Reading corpora stored as columns: parquet files and `datasets.save_to_disk` directories (Arrow).

Today's corpora on the Hugging Face hub (Wikipedia, FineWeb, C4, ...) ship as parquet, and a corpus
prepared with `datasets` is often kept as `Dataset.save_to_disk` writes it: a directory holding
`state.json` (its `_data_files` list the data files in row order), `dataset_info.json` and
`data-XXXXX-of-YYYYY.arrow` files in Arrow's IPC *stream* format. Both are read with pyarrow alone.

Memory stays bounded: parquet is read one row group at a time and only the requested columns
(`iter_batches`), Arrow files are memory-mapped and read one record batch at a time, and both are
handed on in blocks of at most `rows_per_block` rows.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

from megabert.errors import DataError

PARQUET_SUFFIXES = (".parquet", ".pq")
ARROW_SUFFIXES = (".arrow",)
COLUMNAR_FORMATS = ("parquet", "arrow")
STATE_JSON = "state.json"  # what datasets.save_to_disk writes beside the data files
DATASET_DICT_JSON = "dataset_dict.json"  # DatasetDict.save_to_disk: one sub-directory per split


def is_arrow_dataset_dir(path: str) -> bool:
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, STATE_JSON))
                                    or os.path.isfile(os.path.join(path, DATASET_DICT_JSON)))


def arrow_dataset_files(path: str) -> list[str]:
    """The data files of a `save_to_disk` directory, in row order (state.json's `_data_files`)."""
    dict_json = os.path.join(path, DATASET_DICT_JSON)
    if os.path.isfile(dict_json) and not os.path.isfile(os.path.join(path, STATE_JSON)):
        with open(dict_json, encoding="utf-8") as f:
            splits = json.load(f).get("splits", [])
        example = os.path.join(path, splits[0] if splits else "train")
        raise DataError(f"--input {path} is a DatasetDict (splits: {', '.join(splits) or 'none listed'}): "
                        f"give one split's directory, e.g. --input {example}")
    try:
        with open(os.path.join(path, STATE_JSON), encoding="utf-8") as f:
            entries = json.load(f)["_data_files"]
        files = [os.path.join(path, e["filename"]) for e in entries]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"--input {path}: cannot read the data files from its {STATE_JSON} ({e}); is it a "
                        f"directory written by datasets' save_to_disk?") from None
    for p in files:
        if not os.path.isfile(p):
            raise DataError(f"--input {path}: {STATE_JSON} lists {os.path.basename(p)}, which does not exist")
    return files


def _check_columns(path: str, schema, keys: tuple[str, ...]) -> None:
    import pyarrow as pa

    for key in keys:
        if key not in schema.names:
            raise DataError(f"--json-keys {key}: {path} has no column {key!r} (its columns: "
                            f"{', '.join(schema.names)})")
        kind = schema.field(key).type
        # pyarrow's string_view type (and its is_string_view) came with pyarrow 16; older ones lack both.
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or getattr(pa.types, "is_string_view", lambda t: False)(kind)):
            raise DataError(f"--json-keys {key}: column {key!r} of {path} holds {kind}, not text")


def _parquet_batches(path: str, keys: tuple[str, ...], rows_per_block: int):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read --input {path} as parquet: {e}") from None
    _check_columns(path, pf.schema_arrow, keys)
    # iter_batches decodes one row group at a time, and only the requested columns.
    yield from pf.iter_batches(batch_size=rows_per_block, columns=list(keys))


def _ipc_batches(path: str, keys: tuple[str, ...], rows_per_block: int):
    import pyarrow as pa

    with pa.memory_map(path, "r") as source:
        try:
            reader = pa.ipc.open_stream(source)  # datasets' ArrowWriter writes the stream format
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                reader = pa.ipc.open_file(source)
            except pa.ArrowInvalid as e:
                raise DataError(f"cannot read --input {path} as Arrow IPC: {e}") from None
        _check_columns(path, reader.schema, keys)
        batches = (reader if isinstance(reader, pa.ipc.RecordBatchStreamReader) else
                   (reader.get_batch(i) for i in range(reader.num_record_batches)))
        for batch in batches:
            batch = batch.select(list(keys))
            for start in range(0, batch.num_rows, rows_per_block):
                yield batch.slice(start, rows_per_block)


def column_blocks(path: str, fmt: str, keys: tuple[str, ...], rows_per_block: int = 256
                  ) -> Iterator[tuple[int, tuple[list, ...], int]]:
    """Yields (number of the block's first row, counted from 1, one list of values per key, bytes of
    text in the block) for a parquet file, an Arrow file or a save_to_disk directory."""
    if fmt == "parquet":
        files, read = [path], _parquet_batches
    elif os.path.isdir(path):
        files, read = arrow_dataset_files(path), _ipc_batches
    else:
        files, read = [path], _ipc_batches
    row = 1
    for file in files:
        for batch in read(file, keys, rows_per_block):
            if batch.num_rows == 0:
                continue
            columns = tuple(batch.column(k).to_pylist() for k in keys)
            nbytes = sum(batch.column(k).nbytes for k in keys)
            yield row, columns, nbytes
            row += batch.num_rows
