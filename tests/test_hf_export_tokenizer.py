"""`convert_hf.py export` writes a tokenizer transformers uses as it stands: AutoTokenizer
has the full vocab and the casing the model was trained with, pipeline("fill-mask") answers
with real words, every file is 0644, and a missing vocab is a one-line error."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.cli_utils import run_main


transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "tf_bert_tiny")
VOCAB = os.path.join(FIXTURE, "vocab.txt")
SENTENCES = ["The CAT sat on the Mat!", "a big red dog ran, and they sat in the park.", "Paris, France: music"]


def convert(*args):
    """convert_hf.py's main() in process (cli_utils): its errors, exit codes and files as on
    the command line; test_hf_roundtrip runs the real command line."""
    return run_main("tools/checkpoint/convert_hf.py", *map(str, args))


def make_checkpoint(tmp_path, favourite="cat", tp=1):
    """A megabert checkpoint imported from the fixture's HF twin, whose MLM bias makes
    `favourite` the answer to every [MASK]; the source's vocab.txt is copied beside it."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    state = load_file(os.path.join(FIXTURE, "hf", "model.safetensors"))
    tokens = open(VOCAB).read().split("\n")
    state["cls.predictions.bias"][tokens.index(favourite)] += 100.0
    save_file(state, hf_dir / "model.safetensors")
    shutil.copyfile(os.path.join(FIXTURE, "hf", "config.json"), hf_dir / "config.json")
    shutil.copyfile(VOCAB, hf_dir / "vocab.txt")
    r = convert("import", "--hf-dir", hf_dir, "--output", tmp_path / "ckpt", "--tensor-model-parallel-size", tp)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ckpt" / "vocab.txt").read_text() == open(VOCAB).read()
    return tmp_path / "ckpt"


def set_trained_args(ckpt, data_args):
    """What a training run records in every rank file: payload["args"]["data"]."""
    for root, _, files in os.walk(ckpt):
        for name in files:
            if name == "model_optim_rng.pt":
                path = os.path.join(root, name)
                payload = torch.load(path, weights_only=True)
                payload["args"] = {"data": data_args}
                torch.save(payload, path)


def test_export_loads_in_auto_tokenizer_and_fill_mask(tmp_path):
    ckpt = make_checkpoint(tmp_path)
    out = tmp_path / "export"
    r = convert("export", "--load", ckpt, "--hf-dir", out)
    assert r.returncode == 0, r.stderr
    names = sorted(os.listdir(out))
    assert names == ["config.json", "model.safetensors", "special_tokens_map.json", "tokenizer_config.json",
                     "vocab.txt"]
    for name in names:
        assert os.stat(out / name).st_mode & 0o777 == 0o644, name
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "BertTokenizer" and config["do_lower_case"] is True
    assert config["model_max_length"] == 64  # max_position_embeddings

    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ref = transformers.BertTokenizer(VOCAB, do_lower_case=True)
    assert len(tok) == 86 and tok.get_vocab() == ref.get_vocab()
    for s in SENTENCES:
        assert tok(s)["input_ids"] == ref(s)["input_ids"], s
    assert tok.tokenize("The CAT") == ["the", "cat"]

    fill = transformers.pipeline("fill-mask", model=str(out), device="cpu")
    answers = fill("the [MASK] sat on the mat.")
    assert answers[0]["token_str"] == "cat" and answers[0]["sequence"] == "the cat sat on the mat."
    assert all(a["token_str"] in ref.get_vocab() and a["token_str"] != "[UNK]" for a in answers)


def test_export_uses_the_vocab_and_casing_the_checkpoint_was_trained_with(tmp_path):
    ckpt = make_checkpoint(tmp_path, tp=2)
    trained_vocab = tmp_path / "trained_vocab.txt"
    shutil.move(ckpt / "vocab.txt", trained_vocab)
    set_trained_args(ckpt, {"tokenizer_type": "BertWordPieceCase", "vocab_file": str(trained_vocab)})
    out = tmp_path / "export"
    r = convert("export", "--load", ckpt, "--hf-dir", out)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "tokenizer_config.json").read_text())["do_lower_case"] is False
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ref = transformers.BertTokenizer(str(trained_vocab), do_lower_case=False)
    for s in SENTENCES:
        assert tok(s)["input_ids"] == ref(s)["input_ids"], s
    assert tok.tokenize("The cat") == ["[UNK]", "cat"]  # cased: "The" is not in this lower-case vocab
    r = convert("export", "--load", ckpt, "--hf-dir", tmp_path / "lower", "--tokenizer-type", "BertWordPieceLowerCase")
    assert r.returncode == 0 and json.loads((tmp_path / "lower" / "tokenizer_config.json").read_text())["do_lower_case"]


def test_no_vocab_is_a_one_line_error(tmp_path):
    ckpt = make_checkpoint(tmp_path)
    os.remove(ckpt / "vocab.txt")
    r = convert("export", "--load", ckpt, "--hf-dir", tmp_path / "out")
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "it names no vocab file and it has no vocab.txt beside it; pass --vocab-file" in r.stderr
    set_trained_args(ckpt, {"tokenizer_type": "BertWordPieceLowerCase", "vocab_file": "/gone/vocab.txt"})
    r = convert("export", "--load", ckpt, "--hf-dir", tmp_path / "out")
    assert r.returncode == 2 and "trained with --vocab-file /gone/vocab.txt, which does not exist here" in r.stderr
    r = convert("export", "--load", ckpt, "--hf-dir", tmp_path / "out", "--vocab-file", tmp_path / "missing.txt")
    assert r.returncode == 2 and "--vocab-file" in r.stderr and "missing.txt does not exist" in r.stderr
    r = convert("export", "--load", ckpt, "--hf-dir", tmp_path / "out", "--vocab-file", VOCAB)
    assert r.returncode == 0, r.stderr
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out")).vocab_size == 86


def test_vocab_larger_than_the_model_is_a_clear_error(tmp_path):
    ckpt = make_checkpoint(tmp_path)
    big = tmp_path / "big_vocab.txt"
    big.write_text(open(VOCAB).read() + "\n".join(f"extra{i}" for i in range(20)) + "\n")
    r = convert("export", "--load", ckpt, "--hf-dir", tmp_path / "out", "--vocab-file", big)
    assert r.returncode == 2 and "has 106 tokens but the model has 86 word embeddings" in r.stderr


def test_save_hf_writes_the_tokenizer_too(tmp_path):
    import megabert

    model = megabert.BertForPreTraining.from_pretrained(os.path.join(FIXTURE, "hf"), megabert.init_parallel())
    model.save_hf(str(tmp_path / "out"), VOCAB)
    for name in ("model.safetensors", "config.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        assert os.stat(tmp_path / "out" / name).st_mode & 0o777 == 0o644, name
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert tok.tokenize("The CAT sat") == ["the", "cat", "sat"] and tok.model_max_length == 64
