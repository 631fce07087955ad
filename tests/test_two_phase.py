"""Two-phase pre-training (NVIDIA / DeepSpeed BERT recipe) through pretrain_bert.py: phase 2
starts from phase 1's weights with --pretrained-checkpoint, and the very same phase-2
command re-run after an interruption continues from its own checkpoint, bitwise as an
uninterrupted phase 2."""
import pytest

from megabert.checkpoint.layout import commit, staging_dir, write_rank_file
from megabert.checkpoint.start import decide_start
from megabert.config import TrainConfig
from megabert.errors import CheckpointError

from tests.helpers.pretrain_runs import curve, one_line_error, pretrain_args, rows, run_main, run_ranks


def _run(args, log):
    """pretrain_bert.py as one process (main() on the warm pool's rank); what it logged."""
    return run_ranks(1, args, log=log)


def _checkpoint(root, iteration):
    """A committed checkpoint of one rank file (what decide_start reads: the pointer and
    each rank file's zip index, no tensor)."""
    write_rank_file(staging_dir(str(root), iteration), 0, 0, 1, {"iteration": iteration})
    commit(str(root), iteration)


def test_start_point_prefers_the_runs_own_checkpoint(tmp_path):
    p1, own = tmp_path / "p1", tmp_path / "p2"
    _checkpoint(p1, 3)
    own.mkdir()
    (own / "metrics.jsonl").write_text("")  # metrics alone are no checkpoint
    for kw in ({"load": str(own)}, {"save": str(own)}, {}):
        start = decide_start(TrainConfig(pretrained_checkpoint=str(p1), **kw))
        assert (start.path, start.weights_only) == (str(p1), True)
    _checkpoint(own, 2)
    for kw, flag in (({"load": str(own)}, "--load"), ({"save": str(own)}, "--save")):
        start = decide_start(TrainConfig(pretrained_checkpoint=str(p1), **kw))
        assert (start.path, start.weights_only, start.flag) == (str(own), False, flag)
    with pytest.raises(CheckpointError, match="--pretrained-checkpoint .* holds no checkpoint"):
        decide_start(TrainConfig(pretrained_checkpoint=str(tmp_path), save=str(tmp_path / "new")))


def test_interrupted_phase2_continues_from_its_own_checkpoint(dataset, tmp_path):
    p1, p2, ref = (str(tmp_path / n) for n in ("p1", "p2", "ref"))
    # Phase 1 at seq 32 and TP 2; phase 2 at seq 64 and TP 1 (P1 is resharded on load). The
    # runs are main() on the warm pool's ranks; the launcher and the shell recipe's
    # same-command resume: tests/test_examples.py.
    run_ranks(2, pretrain_args(dataset, tmp_path / "p1.jsonl", "--tensor-model-parallel-size", "2", "--save", p1))
    phase2 = ["--seq-length", "64", "--train-iters", "4", "--pretrained-checkpoint", p1]
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    _run(pretrain_args(dataset, full, *phase2, "--load", ref, "--save", ref), tmp_path / "full.log")
    cmd = pretrain_args(dataset, part, *phase2, "--load", p2, "--save", p2)
    log = _run([*cmd, "--exit-interval", "2"], tmp_path / "part1.log")
    assert f"--load {p2} holds no checkpoint yet: initialising from --pretrained-checkpoint {p1}" in log
    assert "--pretrained-checkpoint: weights of iteration 3 kept; iteration, optimizer and data position reset" in log
    assert "was trained at --seq-length 32; this run trains at --seq-length 64" in log
    assert [x["iteration"] for x in rows(part) if "lm_loss" in x] == [1, 2]
    log = _run(cmd, tmp_path / "part2.log")  # the same command again: resumes P2 at iteration 3
    assert f"--load {p2} holds this run's checkpoint: resuming it; --pretrained-checkpoint {p1} is not used" in log
    assert f"loaded {p2}: iteration 2, 8 samples consumed" in log and "differs from the" not in log
    assert [x["iteration"] for x in rows(part) if "lm_loss" in x] == [1, 2, 3, 4]
    assert curve(part) == curve(full)  # bitwise, dropout 0.1 included
    # Resuming at another --seq-length is allowed, with a warning naming both lengths.
    log = _run(pretrain_args(dataset, tmp_path / "w.jsonl", "--train-iters", "4", "--load", p2), tmp_path / "w.log")
    warnings = [line for line in log.splitlines() if "differs from the" in line]
    assert len(warnings) == 1 and "--seq-length 32 differs from the 64 that" in warnings[0], log[-2000:]


def test_pretrained_checkpoint_without_checkpoint_is_a_clear_error(dataset, tmp_path):
    (tmp_path / "empty").mkdir()
    args = pretrain_args(dataset, tmp_path / "m.jsonl", "--pretrained-checkpoint", str(tmp_path / "empty"),
                         "--save", str(tmp_path / "p2"))
    one_line_error(run_main(*args), f"--pretrained-checkpoint {tmp_path / 'empty'} holds no checkpoint")

