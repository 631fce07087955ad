"""pretrain_bert.py run as a user types it: the small model's flags on the session's
corpus (conftest's `dataset`), a subprocess or torchrun launch, the metrics file's rows
and the checks end-to-end tests share."""
import json
import os
import subprocess
import sys

from tests.helpers import cli_utils
from tests.helpers.dist_utils import run_distributed

ROOT = cli_utils.ROOT
BIN = os.path.dirname(sys.executable)
# torchrun as a module: a venv that reuses a GPU image's torch has no torchrun script.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def pretrain_args(d, metrics, *extra):
    return [os.path.join(ROOT, "pretrain_bert.py"), "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "64",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
            "--data-path", str(d / "c_text_sentence"), "--vocab-file", str(d / "vocab.txt"), "--split", "90,10,0",
            "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1", "--num-workers", "0",
            "--metrics-file", str(metrics), *extra]


def rows(metrics):
    return [json.loads(line) for line in open(metrics)]


def run_cmd(cmd, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, **kw)


def check_eval_row(all_rows):
    """Evaluation logs its losses and, next to them, masked-LM and SOP accuracy (0-1)."""
    valid = [x for x in all_rows if "valid_lm_loss" in x]
    assert valid and valid[0]["valid_lm_loss"] > 0, all_rows
    assert all(0 <= valid[0][k] <= 1 for k in ("valid_lm_accuracy", "valid_sop_accuracy")), valid[0]


def run_ranks(nproc, args, log=None):
    """`torchrun --nproc-per-node nproc` + args (the script's path, then its flags) on the
    ranks of the warm worker pool: the script's main() as torchrun runs it, without three
    interpreters' start-up per launch (tests whose subject is not the launcher; the
    launchers have tests/test_examples.py and tests/test_restarts.py). With `log` (a
    path), returns what rank 0 logged, one `LEVEL message` line per record."""
    run_distributed(cli_utils.main_worker, nproc, os.path.relpath(args[0], ROOT), [str(a) for a in args[1:]],
                    None if log is None else str(log))
    return None if log is None else open(log).read()


def run_main(script, *argv):
    """An entry script's main() in process: its one-line errors without a new interpreter."""
    return cli_utils.run_main(os.path.relpath(script, ROOT), *argv)


def one_line_error(r, fragment):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert fragment in r.stderr.strip().splitlines()[-1], r.stderr[-2000:]


LOSSES = ("lm_loss", "sop_loss", "grad_norm")


def curve(path):
    """(iteration, key, value) of every train and validation row: compared exactly."""
    out = []
    for row in rows(path):
        for key, value in row.items():
            if key in LOSSES or key.startswith("valid_"):
                out.append((row["iteration"], key, value))
    return out
