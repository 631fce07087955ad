"""The launch scripts in examples/ run as written (tiny overrides from the environment),
under torchrun, the deepspeed launcher and mpirun (`make demo`'s script: tests/test_demo.py)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers.pretrain_runs import check_eval_row


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def _script_env(dataset, tmp_path, **overrides):
    return {**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"], "OMP_NUM_THREADS": "1",
            "DATA_PATH": str(dataset / "c_text_sentence"), "VOCAB_FILE": str(dataset / "vocab.txt"),
            "SIZE": "tiny", "PHASE": "1", "GLOBAL_BATCH": "4", "MICRO_BATCH": "2", "TRAIN_ITERS": "2",
            "SAVE": str(tmp_path / "bert"), "SAVE_INTERVAL": "1", "EVAL_INTERVAL": "1", "PRECISION": "",
            "TP": "2", "SPLIT": "90,10,0", "LOG_INTERVAL": "1", "GPUS_PER_NODE": "2", "NP": "2", "MASTER_PORT": "29631",
            **overrides}


def _run_script(script, env, *args):
    r = subprocess.run(["bash", os.path.join(ROOT, "examples", script), *args], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stderr


def _train_iterations(path):
    return [x["iteration"] for x in (json.loads(line) for line in open(path)) if "lm_loss" in x]


def _check_phase1(tmp_path):
    """Phase 1 trained its 2 iterations, evaluated and saved."""
    metrics = tmp_path / "bert-phase1" / "metrics.jsonl"
    assert _train_iterations(metrics) == [1, 2]
    check_eval_row([json.loads(line) for line in open(metrics)])
    assert open(tmp_path / "bert-phase1" / "latest_checkpointed_iteration.txt").read() == "2"


# torchrun's script (at PP=2) is the first run of the phase-2 test below.
@pytest.mark.parametrize("script", ["pretrain_deepspeed.sh", "pretrain_mpirun.sh"])
def test_example_scripts(dataset, tmp_path, script):
    """The deepspeed launcher and mpirun start pretrain_bert.py at TP=2 through their
    scripts: it trains, evaluates and saves."""
    if script == "pretrain_mpirun.sh" and shutil.which("mpirun", path=BIN) is None:
        pytest.fail("mpirun is not in the venv: `make install` installs mpi4py and the mpich wheel")
    _run_script(script, _script_env(dataset, tmp_path))
    _check_phase1(tmp_path)


def test_interrupted_phase2_script_continues_from_its_own_checkpoint(dataset, tmp_path):
    """torchrun's script at PP=2 trains, evaluates and saves phase 1; PHASE=2 (one process,
    so phase 1's stages are resharded) starts from phase 1's weights; after an interruption
    the same script, re-run, continues phase 2 from its own checkpoint instead of starting
    over from phase 1."""
    _run_script("pretrain_torchrun.sh", _script_env(dataset, tmp_path, TP="1", PP="2"))
    _check_phase1(tmp_path)
    phase2 = _script_env(dataset, tmp_path, PHASE="2", TRAIN_ITERS="3", EVAL_INTERVAL="100", SAVE_INTERVAL="100",
                         TP="1", GPUS_PER_NODE="1")
    log = _run_script("pretrain_torchrun.sh", phase2, "--exit-interval", "2")
    assert "initialising from --pretrained-checkpoint" in log and "weights of iteration 2 kept" in log
    log = _run_script("pretrain_torchrun.sh", phase2)
    assert "holds this run's checkpoint: resuming it" in log and "iteration 2, 8 samples consumed" in log
    assert _train_iterations(tmp_path / "bert-phase2" / "metrics.jsonl") == [1, 2, 3]


def _launchers(repo):
    show = 'source examples/launchers.sh && echo "$PYTHON|${TORCHRUN[*]}|$DEEPSPEED|$MPIRUN"'
    r = subprocess.run(["bash", "-c", show], cwd=repo, capture_output=True, text=True, env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split("|"), r.stderr


def test_launch_scripts_use_the_repo_venv_else_the_path(tmp_path):
    """The scripts run the repo's .venv tools without activation; without a .venv, the
    PATH's, with a one-line note on how to get one."""
    venv_bin = os.path.join(ROOT, ".venv", "bin")
    if os.path.isfile(os.path.join(venv_bin, "python")):
        (python, torchrun, deepspeed, mpirun), note = _launchers(ROOT)
        assert python == os.path.join(venv_bin, "python") and note == ""
        assert torchrun == f"{python} -m torch.distributed.run"
        for tool, path in (("deepspeed", deepspeed), ("mpirun", mpirun)):
            assert path == (os.path.join(venv_bin, tool) if os.path.isfile(os.path.join(venv_bin, tool)) else tool)
    (tmp_path / "examples").mkdir()
    shutil.copy(os.path.join(ROOT, "examples", "launchers.sh"), tmp_path / "examples")
    tools, note = _launchers(tmp_path)
    assert tools == ["python", "python -m torch.distributed.run", "deepspeed", "mpirun"]
    assert len(note.strip().splitlines()) == 1 and "make install" in note and "activate" in note
