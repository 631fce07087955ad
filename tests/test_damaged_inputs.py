"""Every file a user hands in, damaged or merely odd, as a table (issue 51, items 4, 5 and 7).

Each row: the case, its kind (how main at 71416f6 ended it: a traceback, a run that ended rc 0
having done something wrong, a misleading message, an error only after training, or already one
clear line, kept as a guard), the reader or check it reaches, and the one line it must give.
Legitimate but suspicious input has a table of its own: one warning line each.
Errors are one line (a MegabertError, which the entry scripts print as `error: ...`, rc 2);
warnings are exactly one WARNING record. Most rows call the reader or the preflight directly;
a few run an entry script's command line to show the line arrives before any model is built.
"""
from __future__ import annotations

import json
import logging
import os
import re
import struct
import sys

import numpy as np
import pytest
import torch

from megabert.checkpoint.safetensors_file import read_safetensors
from megabert.config import FinetuneConfigs, OptimConfig, ParallelConfig, TrainConfig
from megabert.data import build_tokenizer
from megabert.data.packing import PackingSpec, warn_if_packing_wasted, with_fill_check
from megabert.data.samplers import warn_if_small
from megabert.errors import MegabertError
from megabert.paths import DIR, OUT_DIR, check_config_paths, check_path
from megabert.tasks.glue.data import read_examples, warn_unseen_labels
from megabert.tasks.glue.tasks import TASKS
from megabert.tasks.ner.config import NerConfig
from megabert.tasks.ner.data import read_sentences, warn_unless_entity_tags
from megabert.tasks.squad.examples import read_squad_examples
from tests.helpers.pretrain_runs import ROOT, one_line_error, run_cmd, run_main

# How main (71416f6) ended each case: a traceback, rc 0 having done something wrong, a message that
# misleads, an error only after training, or already one clear line (kept here as a guard).
TRACEBACK, SILENT, MISLEADING, LATE, GUARD = ("traceback", "rc 0, wrong", "misleading", "after training",
                                              "one line already")
LATIN1 = "café".encode("latin-1")


def _file(tmp, name, content):
    path = tmp / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(path)


def _dir(tmp, name="d"):
    os.makedirs(tmp / name, exist_ok=True)
    return str(tmp / name)


def _safetensors(tmp, name="model.safetensors", damage=None, **tensors):
    from safetensors.torch import save_file

    path = str(tmp / name)
    save_file(tensors or {"w": torch.ones(4, 4)}, path)
    if damage is not None:
        data = open(path, "rb").read()
        open(path, "wb").write(damage(data))
    return path


def _with_header(change):
    """Rewrites a safetensors file's JSON header through `change(header dict)`."""
    def damage(data):
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + n])
        change(header)
        raw = json.dumps(header).encode()
        return struct.pack("<Q", len(raw)) + raw + data[8 + n:]
    return damage


def _ner(tmp, content, name="train.txt", labelled=True):
    return lambda: read_sentences(_file(tmp, name, content), labelled=labelled)


def _glue(tmp, content, name="train.tsv"):
    return lambda: read_examples(_file(tmp, name, content), TASKS["rte"])


def _squad(tmp, data):
    content = data if isinstance(data, bytes) else json.dumps(data)
    return lambda: read_squad_examples(_file(tmp, "train.json", content), is_training=True)


def _qa(qid="q1", **extra):
    return {"id": qid, "question": "Who?", "answers": [{"text": "Ann", "answer_start": 0}], **extra}


def _squad_file(*qas):
    return {"data": [{"title": "t", "paragraphs": [{"context": "Ann wrote it.", "qas": list(qas)}]}]}


def _tokenizer(tmp, name, content, kind="HuggingFaceTokenizer"):
    return lambda: build_tokenizer(kind, _file(tmp, name, content))


def _preflight(field, value):
    """check_config_paths on a fine-tuning run (NER's config, a real --validation-file) whose `field`
    is `value`."""
    here = os.path.abspath(__file__)

    def run():
        task = NerConfig(**{"train_file": here, **({} if field in ("save", "metrics_file") else {field: value})})
        train = TrainConfig(**{field: value}) if field in ("save", "metrics_file") else TrainConfig()
        check_config_paths(FinetuneConfigs(parallel=ParallelConfig(), optim=OptimConfig(), train=train,
                                           finetune=task))
    return run


def _readonly_dir() -> str | None:
    """A directory not even root may write (a read-only mount), or None where there is none."""
    for d in ("/sys", "/proc/sys"):
        try:
            check_path(d, "--probe", OUT_DIR)
        except MegabertError:
            return d
    return None


# (case, kind, what it reaches, the one line it gives (a regex); tmp -> the call)
ERRORS = [
    # Preflight: where a run writes, before anything is built.
    ("output-dir-is-a-file", LATE, "--output-dir", r"^--output-dir \S+/f is a file, not a directory: remove it",
     lambda t: _preflight("output_dir", _file(t, "f", "x"))),
    ("output-dir-under-a-file", LATE, "--output-dir", r"^--output-dir \S+/f/out cannot be created: \S+/f is a "
     r"file, not a directory$", lambda t: _preflight("output_dir", os.path.join(_file(t, "f", "x"), "out"))),
    ("save-is-a-file", LATE, "--save", r"^--save \S+ is a file, not a directory",
     lambda t: _preflight("save", _file(t, "f", "x"))),
    ("metrics-file-is-a-dir", LATE, "--metrics-file", r"^--metrics-file \S+ is a directory; it takes a file name",
     lambda t: _preflight("metrics_file", _dir(t))),
    ("output-dir-read-only", LATE, "--output-dir", r"^--output-dir \S+ cannot be created in /\S+ \(.+\): choose a "
     r"directory you can write to$", lambda t: _preflight("output_dir", os.path.join(_readonly_dir(), "megabert"))),
    # Preflight: what a run reads.
    ("train-file-is-a-dir", MISLEADING, "--train-file", r"^--train-file \S+ is a directory; it takes a file such "
     r"as one of its files \(train.txt\)$", lambda t: (_file(t, "train.txt", "EU B-ORG\n"),
                                                       _preflight("train_file", str(t)))[1]),
    ("train-file-missing", MISLEADING, "--train-file", r"^--train-file \S+/none.txt does not exist$",
     lambda t: _preflight("train_file", str(t / "none.txt"))),
    ("train-file-dir-missing", MISLEADING, "--train-file", r"does not exist \(nor does its directory \S+/no\)$",
     lambda t: _preflight("train_file", str(t / "no" / "train.txt"))),
    ("train-file-dangling-link", MISLEADING, "--train-file", r"^--train-file \S+ is a link to /gone/x, which does "
     r"not exist$", lambda t: (os.symlink("/gone/x", t / "l.txt"), _preflight("train_file", str(t / "l.txt")))[1]),
    ("data-dir-is-a-file", MISLEADING, "--data-dir (check_path)", r"^--data-dir \S+ is a file; it takes a directory$",
     lambda t: lambda: check_path(_file(t, "f", "x"), "--data-dir", DIR)),
    # CoNLL.
    ("conll-not-utf8", TRACEBACK, "ner.read_sentences", r"train.txt:2: byte 0xe9 at column 4 is not UTF-8 .*save the "
     r"file as UTF-8", lambda t: _ner(t, b"EU NNP B-ORG\n" + LATIN1 + b" NN O\n")),
    ("conll-columns-change", SILENT, "ner.read_sentences", r"train.txt:3: 2 columns where line 1 has 4; every line "
     r"holds the same columns", lambda t: _ner(t, "EU NNP B-NP B-ORG\nrejects VBZ B-VP O\nGerman B-MISC\n")),
    ("conll-no-tag", GUARD, "ner.read_sentences", r"train.txt:1: the token 'EU' has no tag",
     lambda t: _ner(t, "EU\nrejects\n")),
    ("conll-test-columns-change", SILENT, "ner.read_sentences (test)", r"test.txt:2: 1 columns where line 1 has 2",
     lambda t: _ner(t, "EU B-ORG\nrejects\n", name="test.txt", labelled=False)),
    # NER JSON lines.
    ("ner-json-not-utf8", TRACEBACK, "ner.read_sentences", r"train.jsonl:1: byte 0xe9 .* is not UTF-8",
     lambda t: _ner(t, b'{"tokens": ["' + LATIN1 + b'"], "ner_tags": ["O"]}\n', name="train.jsonl")),
    ("ner-json-token-number", SILENT, "ner.read_sentences", r'train.jsonl:1: "tokens" item 1 is 5, not a word',
     lambda t: _ner(t, '{"tokens": ["EU", 5], "ner_tags": ["B-ORG", "O"]}\n', name="train.jsonl")),
    ("ner-json-tag-ids", GUARD, "ner.read_sentences", r'train.jsonl:1: "ner_tags" holds class ids',
     lambda t: _ner(t, '{"tokens": ["EU"], "ner_tags": [3]}\n', name="train.jsonl")),
    ("ner-json-no-tags", GUARD, "ner.read_sentences", r'train.jsonl:2: no "ner_tags"',
     lambda t: _ner(t, '{"tokens": ["EU"], "ner_tags": ["O"]}\n{"tokens": ["EU"]}\n', name="train.jsonl")),
    ("ner-json-a-list", GUARD, "ner.read_sentences", r"train.jsonl:1: a JSON list, not an object",
     lambda t: _ner(t, '["EU", "B-ORG"]\n', name="train.jsonl")),
    # GLUE.
    ("glue-tsv-not-utf8", GUARD, "glue.read_examples", r"train.tsv:2: byte 0xe9 at column 6 is not UTF-8",
     lambda t: _glue(t, b"index\tsentence1\tsentence2\tlabel\n0\t" + LATIN1 + b"\tB\tentailment\n")),
    ("glue-tsv-short-row", GUARD, "glue.read_examples", r"train.tsv:2: 2 tab-separated columns, rte needs 4",
     lambda t: _glue(t, "index\tsentence1\tsentence2\tlabel\n0\tA\n")),
    ("glue-tsv-wrong-label", GUARD, "glue.read_examples", r"train.tsv:2: label 'positive' is not one of rte's "
     r"labels", lambda t: _glue(t, "index\tsentence1\tsentence2\tlabel\n0\tA\tB\tpositive\n")),
    ("glue-json-sentence-list", SILENT, "glue.read_examples", r"train.jsonl:1: 'sentence1' is \[\"A\"\], not a "
     r"string", lambda t: _glue(t, '{"sentence1": ["A"], "sentence2": "B", "label": 0}\n', name="train.jsonl")),
    ("glue-json-no-label", GUARD, "glue.read_examples", r"train.jsonl:2: no value for 'label'",
     lambda t: _glue(t, '{"sentence1": "A", "sentence2": "B", "label": 0}\n{"sentence1": "A", "sentence2": "B"}\n',
                     name="train.jsonl")),
    # SQuAD.
    ("squad-not-json", GUARD, "squad.read_squad_examples", r"train.json is not valid JSON \(line 1, column 2",
     lambda t: _squad(t, b"{oops")),
    ("squad-not-utf8", GUARD, "squad.read_squad_examples", r"train.json:1: byte 0xe9 .* is not UTF-8",
     lambda t: _squad(t, b'{"data": "' + LATIN1 + b'"}')),
    ("squad-no-data-list", GUARD, "squad.read_squad_examples", r'is not a SQuAD file: expected an object with '
     r'a "data" list', lambda t: _squad(t, {"version": "1.1"})),
    ("squad-duplicate-id", SILENT, "squad.read_squad_examples", r"question 1 repeats the id 'q1'",
     lambda t: _squad(t, _squad_file(_qa(), _qa()))),
    ("squad-is-impossible-string", MISLEADING, "squad.read_squad_examples", r'has "is_impossible": "false"; write true '
     r'or false', lambda t: _squad(t, _squad_file(_qa(is_impossible="false")))),
    ("squad-answers-object", GUARD, "squad.read_squad_examples", r'has no valid "answers" list',
     lambda t: _squad(t, _squad_file({**_qa(), "answers": {"text": "Ann", "answer_start": 0}}))),
    # tokenizer.json and vocab.txt.
    ("tokenizer-json-not-json", MISLEADING, "HuggingFaceTokenizer", r"tokenizer.json is not JSON \(line 1, column \d+"
     r".*BertWordPieceLowerCase", lambda t: _tokenizer(t, "tokenizer.json", "[PAD]\n[UNK]\n")),
    ("tokenizer-json-a-config", MISLEADING, "HuggingFaceTokenizer", r'tokenizer.json is an object without a "model", '
     r"not a tokenizer.json", lambda t: _tokenizer(t, "tokenizer.json", '{"model_type": "modernbert"}')),
    ("tokenizer-json-a-list", GUARD, "HuggingFaceTokenizer", r"tokenizer.json is a JSON list, not a "
     r"tokenizer.json", lambda t: _tokenizer(t, "tokenizer.json", "[1, 2]")),
    ("tokenizer-json-wrong-model", GUARD, "HuggingFaceTokenizer", r"is not a tokenizer.json the tokenizers "
     r"library reads \(.+\); save it again", lambda t: _tokenizer(t, "tokenizer.json", '{"model": {"type": "X"}}')),
    ("tokenizer-json-as-vocab", MISLEADING, "BertWordPieceLowerCase", r"vocab.txt is JSON, not a WordPiece vocab.txt"
     r".*--tokenizer-type HuggingFaceTokenizer", lambda t: _tokenizer(t, "vocab.txt", '{"model": {}}',
                                                                       kind="BertWordPieceLowerCase")),
    ("vocab-not-utf8", TRACEBACK, "BertWordPieceLowerCase", r"vocab.txt:2: byte 0xe9 .* is not UTF-8",
     lambda t: _tokenizer(t, "vocab.txt", b"[PAD]\n" + LATIN1 + b"\n", kind="BertWordPieceLowerCase")),
    ("tokenizer-model-missing-flag", MISLEADING, "build_tokenizer", r"HuggingFaceTokenizer needs --tokenizer-model",
     lambda t: lambda: build_tokenizer("HuggingFaceTokenizer", None)),
    # safetensors.
    ("safetensors-truncated", TRACEBACK, "read_safetensors", r"model.safetensors: tensor w ends at byte 64 of the "
     r"data, the file holds 54: the file is truncated", lambda t: lambda: read_safetensors(
         _safetensors(t, damage=lambda d: d[:-10]))),
    ("safetensors-empty", TRACEBACK, "read_safetensors", r"model.safetensors is 0 bytes, too short",
     lambda t: lambda: read_safetensors(_safetensors(t, damage=lambda d: b""))),
    ("safetensors-header-not-json", TRACEBACK, "read_safetensors", r"the safetensors header is not JSON",
     lambda t: lambda: read_safetensors(_safetensors(t, damage=lambda d: d[:8] + b"x" * (len(d) - 8)))),
    ("safetensors-offsets-out-of-range", TRACEBACK, "read_safetensors", r"tensor w ends at byte 1000000 of the data",
     lambda t: lambda: read_safetensors(_safetensors(t, damage=_with_header(
         lambda h: h["w"].update(data_offsets=[0, 1000000]))))),
    ("safetensors-shape-mismatch", TRACEBACK, "read_safetensors", r"tensor w: F32 \[8, 4\] needs 128 bytes, its "
     r"data_offsets span 64", lambda t: lambda: read_safetensors(_safetensors(t, damage=_with_header(
         lambda h: h["w"].update(shape=[8, 4]))))),
    ("safetensors-nan", SILENT, "read_safetensors", r"tensor w holds 1 NaN or infinite value\(s\) of 4",
     lambda t: lambda: read_safetensors(_safetensors(t, w=torch.tensor([1.0, float("nan"), 0.0, 2.0])))),
    ("safetensors-inf", SILENT, "read_safetensors", r"tensor w holds 2 NaN or infinite",
     lambda t: lambda: read_safetensors(_safetensors(t, w=torch.tensor([float("inf"), -float("inf")])))),
    ("safetensors-a-directory", TRACEBACK, "read_safetensors", r"model.safetensors is a directory, not a "
     r"safetensors file", lambda t: lambda: read_safetensors(_dir(t, "model.safetensors"))),
    ("safetensors-dangling-link", TRACEBACK, "read_safetensors", r"model.safetensors is a link to /gone/w, which "
     r"does not exist", lambda t: (os.symlink("/gone/w", t / "model.safetensors"),
                                    lambda: read_safetensors(str(t / "model.safetensors")))[1]),
]


@pytest.mark.parametrize("case,kind,reader,message,make", ERRORS, ids=[c[0] for c in ERRORS])
def test_damaged_input_is_one_line(tmp_path, case, kind, reader, message, make):
    if case == "output-dir-read-only" and _readonly_dir() is None:
        pytest.skip("no read-only directory on this machine (as root, mode bits do not stop a write)")
    call = make(tmp_path)
    with pytest.raises(MegabertError) as e:
        call()
    text = str(e.value)
    assert "\n" not in text, text
    assert len(text) < 400, text
    assert re.search(message, text), f"{case} ({reader}): {text}"


def _warn_window():
    warn_if_packing_wasted(PackingSpec(seq_length=128, max_samples_per_row=8, window=1, seed=0))


def _warn_share():
    # 1000 features of 20 tokens in rows of 128 capped at 2 a row: 500 rows, 31% real tokens.
    warn_if_packing_wasted(PackingSpec(seq_length=128, max_samples_per_row=2, window=1024, seed=0), 1000, 20000,
                           500, what="features")


def _warn_first_window():
    # Pre-training's first packed window: 4 rows of 1 sample of 30 tokens in rows of 128, capped at 1 a row.
    window = {"row_samples": np.ones(4, dtype=np.int64), "packed_seqlens": np.full((4, 1), 30)}
    spec = PackingSpec(seq_length=128, max_samples_per_row=1, window=1024, seed=0)
    assert list(with_fill_check([window, window], spec)) == [window, window]  # checks the first only


def _ner_task_check(t):
    """NerTask.check_inputs on a training file tagged B-ORG / O and a validation file with a B-PER."""
    from megabert.checkpoint.start import Format, Source
    from megabert.tasks.ner.finetuning import NerTask

    ft = NerConfig(train_file=_file(t, "train.txt", "EU B-ORG\nrejects O\n"),
                   validation_file=_file(t, "valid.txt", "Peter B-PER\nrejects O\n"), output_dir=str(t / "out"))
    cfg = FinetuneConfigs(parallel=ParallelConfig(), optim=OptimConfig(), train=TrainConfig(), finetune=ft)
    return lambda: NerTask(cfg, Source(_hf_dir_without_tokenizer(t), Format.HF)).check_inputs()


# (case, what it reaches, the one warning it gives; tmp -> the call)
WARNINGS = [
    ("one-pair-repeated-to-a-batch", "samplers.warn_if_small", r"the training data gives 1 features, fewer than one "
     r"global batch of 32: each step repeats them \(about 32.0 times\); lower --global-batch-size to 1",
     lambda t: lambda: warn_if_small(1, 32, "features")),
    ("packing-window-1", "packing.warn_if_packing_wasted", r"--packing-window 1 puts each of the samples in a row of "
     r"its own: --pack-sequences packs nothing", lambda t: _warn_window),
    ("low-real-token-share", "packing.warn_if_packing_wasted", r"packed rows are 31% real tokens with 2.0 features a "
     r"row, capped by --max-samples-per-row 2: raise it \(rows of 128 tokens hold about 6 of these\)",
     lambda t: _warn_share),
    ("pretraining-rows-mostly-padding", "packing.with_fill_check", r"packed rows are 23% real tokens with 1.0 "
     r"samples a row, capped by --max-samples-per-row 1: raise it \(rows of 128 tokens hold about 4 of these\)",
     lambda t: _warn_first_window),
    ("glue-dev-label-never-trained", "glue.warn_unseen_labels", r"dev.tsv has labels the training data never "
     r"shows: not_entailment \(1 of 2 rows\)", lambda t: lambda: warn_unseen_labels(
         TASKS["rte"], _glue(t, "index\tsentence1\tsentence2\tlabel\n0\tA\tB\tentailment\n")(), "dev.tsv",
         _glue(t, "index\tsentence1\tsentence2\tlabel\n0\tA\tB\tentailment\n1\tA\tC\tnot_entailment\n",
               name="dev.tsv")())),
    ("ner-validation-tag-never-trained", "NerTask.check_inputs", r"valid.txt has tags the model never predicts "
     r"\(not in the training file\): B-PER$", _ner_task_check),
    ("conll-pos-column-as-tags", "ner.warn_unless_entity_tags", r"train.txt: no tag in the last column is an entity "
     r"tag \(O, B-X, I-X; found NN, NNP, VBZ\)", lambda t: lambda: warn_unless_entity_tags(
         "train.txt", tuple(sorted({s for x in read_sentences(_file(t, "train.txt", "EU NNP\nrejects VBZ\nit NN\n"))
                                    for s in x.tags})))),
]


@pytest.mark.parametrize("case,reader,message,make", WARNINGS, ids=[c[0] for c in WARNINGS])
def test_suspicious_input_warns_once(tmp_path, caplog, case, reader, message, make):
    call = make(tmp_path)
    with caplog.at_level(logging.WARNING, logger="megabert"):
        call()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert re.search(message, lines[0]), f"{case} ({reader}): {lines[0]}"


def test_entity_tags_and_enough_data_do_not_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="megabert"):
        warn_unless_entity_tags("train.txt", ("B-ORG", "I-ORG", "O"))
        warn_unless_entity_tags("train.txt", ("E-PER", "S-LOC"))
        warn_if_small(64, 32, "features")
        warn_if_packing_wasted(PackingSpec(seq_length=128, max_samples_per_row=8, window=1024, seed=0), 1000, 90000,
                               800)
    assert not caplog.records


# The command line: a handful of rows through the real entry scripts, each stopping before any
# model is built (the preflight, or the run's resolution, which reads --load's config alone).
def _hf_dir_without_tokenizer(t):
    """config.json of a BERT and a weights file (not read before the error), no vocab.txt or tokenizer.json."""
    d = _dir(t, "hf")
    _file(t / "hf", "config.json", json.dumps({"model_type": "bert", "num_hidden_layers": 1, "hidden_size": 32,
                                               "num_attention_heads": 2, "intermediate_size": 64,
                                               "vocab_size": 100, "max_position_embeddings": 64}))
    _file(t / "hf", "model.safetensors", b"")
    return d


def _cli_cases(t):
    f, d = _file(t, "f", "x"), _dir(t)
    return [
        (["finetune_ner.py", "--load", _hf_dir_without_tokenizer(t), "--train-file", f], "--vocab-file (or "
         "--tokenizer-model) is required: " + str(t / "hf") + " has neither a vocab.txt nor a tokenizer.json"),
        (["pretrain_bert.py", "--data-path", "x", "--save", f], f"--save {f} is a file, not a directory"),
        (["pretrain_bert.py", "--data-path", "x", "--load", str(t / "hf")], "--vocab-file (or --tokenizer-model) is "
         f"required: pre-training takes only a tokenizer.json from beside --load, and {t / 'hf'} has "
         f"none"),
        (["finetune_glue.py", "--task-name", "rte", "--data-dir", d, "--output-dir", d, "--load", f],
         f"--load {f} is a file; it takes a checkpoint's directory (such as {t})"),
        (["tools/checkpoint/reshard.py", "--load", d, "--save", os.path.join(f, "x"), "--tensor-model-parallel-size",
          "1"], f"--save {os.path.join(f, 'x')} cannot be created: {f} is a file, not a directory"),
        (["tools/checkpoint/convert_megatron.py", "import", "--megatron-dir", str(t / "none"), "--output", d],
         f"--megatron-dir {t / 'none'} does not exist"),
        (["finetune_ner.py", "--load", d, "--train-file", f, "--output-dir", f], f"--output-dir {f} is a file"),
        (["finetune_squad.py", "--load", d, "--train-file", d], f"--train-file {d} is a directory; it takes a file"),
        (["tools/preprocess_data.py", "--input", f, "--output-prefix", os.path.join(f, "p"), "--vocab-file", f],
         f"--output-prefix {os.path.join(f, 'p')}: directory {f} is a file, not a directory"),
        (["tools/checkpoint/convert_hf.py", "import", "--hf-dir", f, "--output", d], f"--hf-dir {f} is a file; it "
         f"takes a directory"),
    ]


def test_entry_scripts_stop_in_one_line_before_building(tmp_path):
    """In process (cli_utils: the scripts' main() and cli_main), and the first once as a command line."""
    cases = _cli_cases(tmp_path)
    for argv, fragment in cases:
        r = run_main(os.path.join(ROOT, argv[0]), *argv[1:])
        one_line_error(r, "error: " + fragment)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (argv, r.stderr)
    argv, fragment = next(c for c in cases if c[0][0] == "finetune_ner.py" and "--output-dir" in c[0])
    r = run_cmd([sys.executable, os.path.join(ROOT, argv[0]), *argv[1:]], cwd=tmp_path)
    one_line_error(r, "error: " + fragment)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr


def test_convert_hf_import_refuses_a_tensor_the_config_does_not_size(tmp_path):
    """A transformers BERT whose query weight lost half its rows: the import stops in one line
    naming the tensors and writes nothing (it used to write a checkpoint that --load refused)."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=64)
    hf = tmp_path / "hf"
    transformers.BertForPreTraining(cfg).save_pretrained(hf)
    state = load_file(hf / "model.safetensors")
    state["bert.encoder.layer.0.attention.self.query.weight"] = torch.zeros(16, 32)
    save_file(state, hf / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "ckpt"
    r = run_main(os.path.join(ROOT, "tools/checkpoint/convert_hf.py"), "import", "--hf-dir", str(hf),
                 "--output", str(out))
    one_line_error(r, f"error: {hf}: bert.encoder.layer.0.attention.self.query.weight+")
    assert "has shape (80, 32) but config.json's sizes give (96, 32)" in r.stderr
    assert not out.exists() or not any(out.iterdir())
