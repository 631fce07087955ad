"""tools/preprocess_data.py on parquet and on `datasets.save_to_disk` directories: the same .bin/.idx
bytes as for the same documents in jsonl, read in bounded blocks, bad rows reported by row number.

`datasets` is not a dependency: the save_to_disk layout is written here with pyarrow as datasets'
ArrowWriter and Dataset.save_to_disk write it (Arrow IPC stream files data-XXXXX-of-YYYYY.arrow,
state.json listing them, dataset_info.json with the features)."""
import io
import json
import math
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megabert.corpus.columnar_input import column_blocks
from megabert.corpus.preprocess import EncodeOptions, preprocess
from megabert.corpus.text_input import text_stream
from megabert.corpus.tokenizer_training import train_wordpiece
from tests.helpers.cli_utils import run_main

TEXTS = [
    "The first document has two sentences. This is the second one!",
    "Dr. Smith arrived at 3 p.m. on Monday. He left at noon? Nobody knows.\nA new paragraph starts here.",
    "A single sentence without an ending",
    "Unicode: café, naïve, 東京は日本の首都です。北京是中国的首都。 Emoji 😀 too.",
    "\x07\x00",  # only control characters: one empty document, as for jsonl
] * 9
TITLES = [f"Title number {i}. Of document {i}" for i in range(len(TEXTS))]


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    return train_wordpiece(TEXTS + TITLES, str(path), vocab_size=400, min_frequency=1)


def write_jsonl(path, columns):
    rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def write_parquet(path, columns, row_group_size=7):
    pq.write_table(pa.table(columns), str(path), row_group_size=row_group_size)
    return str(path)


def write_save_to_disk(path, columns, num_shards=2, batch_rows=5):
    """The directory `datasets.Dataset.from_dict(columns).save_to_disk(path, num_shards=2)` writes."""
    os.makedirs(path)
    table = pa.table(columns)
    features = {name: {"dtype": "string", "_type": "Value"} for name in table.column_names}
    schema = table.schema.with_metadata({"huggingface": json.dumps({"info": {"features": features}})})
    per_shard = math.ceil(table.num_rows / num_shards)
    names = [f"data-{i:05d}-of-{num_shards:05d}.arrow" for i in range(num_shards)]
    for i, name in enumerate(names):
        with pa.OSFile(os.path.join(path, name), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            for batch in table.slice(i * per_shard, per_shard).to_batches(max_chunksize=batch_rows):
                writer.write_batch(batch.replace_schema_metadata(schema.metadata))
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0f1e2d3c4b5a6978",
             "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
             "_split": "train"}
    info = {"citation": "", "description": "", "features": features, "homepage": "", "license": ""}
    with open(os.path.join(path, "state.json"), "w") as f:
        json.dump(state, f, indent=2, sort_keys=True)
    with open(os.path.join(path, "dataset_info.json"), "w") as f:
        json.dump(info, f, indent=2)
    return str(path)


def _bytes(prefix):
    return [open(prefix + ext, "rb").read() for ext in (".bin", ".idx")]


@pytest.mark.parametrize("split", [True, False])
def test_parquet_and_save_to_disk_give_the_jsonl_bytes(tmp_path, vocab, split):
    columns = {"text": TEXTS, "title": TITLES, "id": [str(i) for i in range(len(TEXTS))]}
    inputs = {
        "jsonl": write_jsonl(tmp_path / "in.jsonl", columns),
        "parquet": write_parquet(tmp_path / "in.parquet", columns),
        "arrow-dir": write_save_to_disk(tmp_path / "saved", columns),
        "parquet-glob": (write_parquet(tmp_path / "part-0.parquet", {k: v[:20] for k, v in columns.items()}),
                         write_parquet(tmp_path / "part-1.parquet", {k: v[20:] for k, v in columns.items()}),
                         str(tmp_path / "part-*.parquet"))[-1],
    }
    opts = EncodeOptions("BertWordPieceLowerCase", vocab, ("text", "title"), split)
    outputs = {}
    for name, path in inputs.items():
        # 3 rows per block: blocks cross parquet row groups (7 rows) and Arrow batches (5) and files.
        stats = preprocess(path, str(tmp_path / name), opts, workers=2 if name == "parquet" else 1,
                           block_bytes=3 * 4096)
        assert stats.documents == len(TEXTS) and stats.skipped == 0, name
        outputs[name] = stats.outputs
    for name in ("parquet", "arrow-dir", "parquet-glob"):
        for ours, ref in zip(outputs[name], outputs["jsonl"]):
            assert _bytes(ours) == _bytes(ref), (name, ours)


def test_blocks_are_bounded_and_numbered(tmp_path):
    columns = {"text": TEXTS, "other": [str(i) for i in range(len(TEXTS))]}
    for fmt, path in [("parquet", write_parquet(tmp_path / "in.parquet", columns)),
                      ("arrow", write_save_to_disk(tmp_path / "saved", columns))]:
        blocks = list(column_blocks(path, fmt, ("text",), rows_per_block=4))
        assert all(len(cols) == 1 and 0 < len(cols[0]) <= 4 for _, cols, _ in blocks), fmt
        assert [first for first, _, _ in blocks] == [1 + sum(len(c[0]) for _, c, _ in blocks[:i])
                                                     for i in range(len(blocks))]
        assert [t for _, (col,), _ in blocks for t in col] == TEXTS, fmt
        # tools/train_tokenizer.py reads the same texts (blank ones dropped)
        assert list(text_stream(path, fmt, "text")) == [t for t in TEXTS if t.strip()]
    single = os.path.join(tmp_path / "saved", "data-00001-of-00002.arrow")  # a datasets cache file
    assert [t for _, (col,), _ in column_blocks(single, "arrow", ("text",)) for t in col] == \
        TEXTS[math.ceil(len(TEXTS) / 2):]


def test_bad_rows_are_reported_by_number(tmp_path, vocab):
    texts = ["Good one.", None, "Good two.", "   ", "Good three."]
    src = write_parquet(tmp_path / "in.parquet", {"text": texts}, row_group_size=2)
    log = io.StringIO()
    opts = EncodeOptions("BertWordPieceLowerCase", vocab, ("text",), True)
    stats = preprocess(src, str(tmp_path / "out"), opts, log=log)
    assert (stats.documents, stats.skipped) == (3, 2)
    assert "skipped 2 of 5 records in " in log.getvalue()
    assert "(row 2: null 'text'; row 4: empty 'text')" in log.getvalue()
    argv = ["--input", src, "--output-prefix", str(tmp_path / "strict"), "--vocab-file", vocab, "--strict"]
    r = run_main("tools/preprocess_data.py", *argv)
    assert r.returncode == 2 and "in.parquet row 2: null 'text'" in r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("case,words", [
    ("missing-column", "has no column 'body' (its columns: text, n)"),
    ("not-text", "column 'n' of"),
    ("dataset-dict", "is a DatasetDict (splits: train, test): give one split's directory"),
    ("plain-dir", "is a directory without a state.json"),
])
def test_cli_column_errors_are_one_line(tmp_path, vocab, case, words):
    columns = {"text": ["a b c."], "n": pa.array([1], pa.int64())}
    src = write_parquet(tmp_path / "in.parquet", columns)
    if case == "dataset-dict":
        write_save_to_disk(tmp_path / "dd" / "train", {"text": ["x."]})
        (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
        src = str(tmp_path / "dd")
    elif case == "plain-dir":
        src = str(tmp_path)
    keys = {"missing-column": ["body"], "not-text": ["n"]}.get(case, ["text"])
    r = run_main("tools/preprocess_data.py", "--input", src, "--output-prefix", str(tmp_path / "o"),
                 "--vocab-file", vocab, "--json-keys", *keys)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert words in r.stderr.strip().splitlines()[-1], r.stderr
    assert not list(tmp_path.glob("o_*"))
