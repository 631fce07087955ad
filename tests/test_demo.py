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
