"""pretrain_bert.py: bad flags and files are one-line errors, never tracebacks."""
import json

import pytest

from tests.helpers.cli_utils import run_main


def run(*args):
    return run_main("pretrain_bert.py", *args)


def last_line(r):
    return r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("args,message", [
    (["--deepspeed", "--zero-stage", "2", "--pipeline-model-parallel-size", "2"],
     "--zero-stage 2 cannot combine with --pipeline-model-parallel-size 2 > 1"),
    (["--num-layers-per-virtual-pipeline-stage", "1"],
     "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1"),
    (["--deepspeed", "--pipeline-model-parallel-size", "2"],
     "--deepspeed with --pipeline-model-parallel-size 2 needs --zero-stage 1"),
    (["--bf16", "--fp16"], "--bf16 and --fp16 are mutually exclusive"),
    (["--memory-budget-gb", "0"], "--memory-budget-gb must be a positive number of GB per rank, got 0.0"),
    (["--zero-stage", "1"], "--zero-stage 1 needs --deepspeed"),
    (["--pretrained-checkpoint", "p1", "--load", "p2", "--finetune"],
     "--pretrained-checkpoint already takes the weights only and resumes the run's own checkpoint"),
    (["--deepspeed", "--optimizer", "lamb"], "--optimizer lamb with --deepspeed is not supported"),
    (["--tensor-model-parallel-size", "2"], "world size 1 is not divisible by --tensor-model-parallel-size 2"),
    (["--num-attention-heads", "3", "--hidden-size", "96", "--tensor-model-parallel-size", "1",
      "--ffn-hidden-size", "100", "--global-batch-size", "3"], "--global-batch-size 3 is not divisible by"),
])
def test_flag_errors(args, message):
    r = run("--data-path", "nowhere", *args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert message in last_line(r)


def test_deepspeed_config_conflict(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"train_batch_size": 64}))
    (tmp_path / "vocab.txt").write_text("[PAD]\n")  # read only after the conflict: any file that exists
    r = run("--data-path", "nowhere", "--deepspeed", "--deepspeed_config", str(cfg), "--micro-batch-size", "4",
            "--global-batch-size", "8", "--vocab-file", str(tmp_path / "vocab.txt"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "sets train_batch_size=64 but the flags give 8 (--global-batch-size)" in last_line(r)
