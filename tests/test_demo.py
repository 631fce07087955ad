"""`make demo`'s script (examples/demo.py) runs end to end at a small size: corpus, vocab,
dataset, TP=2 pre-training under torchrun, loss curve, Hugging Face export, SQuAD and GLUE
fine-tuning with their figures and files. A file of its own: the suite's longest test, which
pytest-xdist can then start beside the others."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def test_demo_script_runs_small(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo.py"), "--workdir", str(tmp_path),
                        "--train-iters", "10", "--max-documents", "300",
                        "--squad-epochs", "1", "--glue-epochs", "1"], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"]})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "masked-LM loss" in r.stdout
    assert os.path.getsize(tmp_path / "loss_curve.png") > 10_000
    assert os.path.isfile(tmp_path / "hf_export" / "model.safetensors")
    results = json.load(open(tmp_path / "squad" / "eval_results.json"))
    assert set(results) == {"exact_match", "f1"} and 0 <= results["exact_match"] <= results["f1"] <= 100
    assert "exact match" in r.stdout and "not in this demo yet" not in r.stdout
    glue = json.load(open(tmp_path / "glue" / "out" / "eval_results.json"))
    assert glue["eval_samples"] > 0 and 0 <= glue["eval_accuracy"] <= 1 and "GLUE task in SST-2 format" in r.stdout
    assert open(tmp_path / "glue" / "out" / "SST-2.tsv").readline() == "index\tprediction\n"


DEMO_DATA = [["tools/make_demo_corpus.py", "--output", "{w}/corpus.jsonl", "--max-documents", "150"],
             ["tools/train_tokenizer.py", "--input", "{w}/corpus.jsonl", "--output", "{w}/vocab.txt", "--vocab-size",
              "2000"],
             ["tools/preprocess_data.py", "--input", "{w}/corpus.jsonl", "--json-keys", "text", "--output-prefix",
              "{w}/demo", "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", "{w}/vocab.txt",
              "--split-sentences", "--workers", "2"]]


def _demo_data(w, hash_seed=None):
    """`make demo`'s first three steps (corpus, WordPiece vocab, preprocessing with 2 workers) at
    a small size: in this process, or (`hash_seed`) in a fresh interpreter with other hash
    seeds (Python's and Rust's)."""
    steps = [[a.format(w=w) for a in argv] for argv in DEMO_DATA]
    if hash_seed is None:
        from tests.helpers.cli_utils import run_main

        for tool, *argv in steps:
            r = run_main(tool, *argv)
            assert r.returncode == 0, r.stderr
        return
    script = ("import os, runpy, sys\n"
              f"for argv in {steps!r}:\n"
              f"    sys.argv = [os.path.join({ROOT!r}, argv[0])] + argv[1:]\n"
              "    try:\n"
              "        runpy.run_path(sys.argv[0], run_name='__main__')\n"
              "    except SystemExit as e:\n"
              "        assert not e.code, e.code\n")
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed), "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_demo_data_is_the_same_on_every_run(tmp_path):
    """Issue 51: the demo's figures differed between runs, first of all because its vocab did.
    Two runs (this process and another with other hash seeds) write the same corpus, vocab and
    dataset, byte for byte."""
    for name in ("1", "2"):
        (tmp_path / name).mkdir()
    _demo_data(tmp_path / "1")
    _demo_data(tmp_path / "2", hash_seed=int(os.environ.get("PYTHONHASHSEED") or 0) + 1)
    for name in ("corpus.jsonl", "vocab.txt", "demo_text_sentence.bin", "demo_text_sentence.idx"):
        assert open(tmp_path / "1" / name, "rb").read() == open(tmp_path / "2" / name, "rb").read(), name
