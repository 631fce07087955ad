"""Restarts that resume on their own: a worker SIGKILLed mid-run under
`torchrun --max-restarts 1` with `--save X --load X` ends at the last iteration with the
losses of an uninterrupted run (dropout on); a damaged newest checkpoint is named, and the
newest intact one is resumed (restart pattern) or pointed at (elsewhere), deleting nothing."""
import os
import signal
import subprocess
import time

import psutil
import pytest

from tests.helpers.pretrain_runs import TORCHRUN, pretrain_args, rows, run_main, run_ranks


ITERS = 20  # saves at 5, 10, 15: the kill lands after the first, with iterations to spare


def _losses(metrics) -> dict:
    """The last lm_loss logged for each iteration (a restarted run logs some twice)."""
    return {r["iteration"]: r["lm_loss"] for r in rows(metrics) if "lm_loss" in r}


def _run_args(d, metrics, ck):
    return pretrain_args(d, metrics, "--tensor-model-parallel-size", "2", "--train-iters", str(ITERS),
                         "--eval-interval", "1000", "--save", ck, "--load", ck, "--save-interval", "5",
                         "--log-interval", "1")


def _kill_a_worker_after_first_save(proc, ck, deadline=240.0) -> int:
    """Waits for the first committed checkpoint, then SIGKILLs one training worker."""
    tracker = os.path.join(ck, "latest_checkpointed_iteration.txt")
    end = time.monotonic() + deadline
    while time.monotonic() < end and proc.poll() is None:
        if os.path.isfile(tracker):
            workers = [c for c in psutil.Process(proc.pid).children(recursive=True) if "pretrain_bert.py" in
                       " ".join(c.cmdline())]
            if workers:
                workers[-1].send_signal(signal.SIGKILL)
                return int(open(tracker).read())
        time.sleep(0.005)
    pytest.fail("the run ended (or timed out) before its first checkpoint could be interrupted")


def test_sigkilled_worker_under_max_restarts_ends_with_uninterrupted_losses(dataset, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    killed_metrics, ck = tmp_path / "killed.jsonl", str(tmp_path / "ck")
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *_run_args(dataset, killed_metrics, ck)]
    proc = subprocess.Popen(cmd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        saved_at = _kill_a_worker_after_first_save(proc, ck)
        out, err = proc.communicate(timeout=600)
    finally:  # a failed test leaves no torchrun agent or worker behind
        for p in psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)] \
                if proc.poll() is None else []:
            p.kill()
    assert proc.returncode == 0, err[-4000:]
    assert saved_at < ITERS
    ref_metrics = tmp_path / "ref.jsonl"  # the uninterrupted run: main() on the warm pool's ranks
    run_ranks(2, _run_args(dataset, ref_metrics, str(tmp_path / "ref_ck")))
    killed, ref = _losses(killed_metrics), _losses(ref_metrics)
    assert sorted(killed) == list(range(1, ITERS + 1))
    assert killed == ref  # bitwise: the resumed part replays the same dropout and data
    assert "exitcode: -9" in err  # torchrun saw the SIGKILL, restarted, and the run resumed
    assert f"loaded {ck}: iteration" in err and err.count("holds no checkpoint yet") == 1, err[-4000:]


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def test_a_damaged_newest_checkpoint_is_named_and_the_intact_one_resumed(dataset, tmp_path):
    ck = str(tmp_path / "ck")
    run_ranks(1, pretrain_args(dataset, tmp_path / "m1.jsonl", "--save", ck, "--save-interval", "2", "--train-iters", "4"))
    damaged = os.path.join(ck, "iter_0000004", "mp_rank_00", "model_optim_rng.pt")
    _truncate(damaged)
    # --load elsewhere than --save: an error naming the file and the newest intact iteration.
    r = run_main(*pretrain_args(dataset, tmp_path / "m2.jsonl", "--load", ck, "--train-iters", "6"))
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert damaged in last and "iter_0000002" in last, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) <= 5
    # The restart pattern resumes the intact iteration 2 after a warning, deleting nothing.
    again = run_ranks(1, pretrain_args(dataset, tmp_path / "m3.jsonl", "--save", ck, "--load", ck, "--train-iters", "3"),
                      log=tmp_path / "again.log")
    assert "WARNING" in again and damaged in again and "iteration 2" in again, again
    assert [x["iteration"] for x in rows(tmp_path / "m3.jsonl") if "lm_loss" in x] == [3]
    assert os.path.isfile(damaged) and os.path.getsize(damaged) > 0
