"""pretrain_bert.py end to end on a small corpus made here (the launchers: test_examples.py,
which runs the torchrun, deepspeed and mpirun scripts); clear errors for missing/truncated
data and a too-small vocab."""
import os
import shutil
import sys
from types import SimpleNamespace

import torch

from tests.helpers.pretrain_runs import check_eval_row, one_line_error, pretrain_args, rows, run_cmd, run_main, run_ranks


def test_interleaved_pipeline_on_real_data(dataset, tmp_path):
    """Interleaved pipeline on real data: two stages with two chunks each, evaluation
    through the forward-only schedule, losses logged by rank 0 (the first stage)."""
    metrics = tmp_path / "m.jsonl"
    run_ranks(2, pretrain_args(dataset, metrics, "--num-layers", "4", "--pipeline-model-parallel-size", "2",
                               "--num-layers-per-virtual-pipeline-stage", "1", "--save", str(tmp_path / "ck")))
    train = [x for x in rows(metrics) if "lm_loss" in x]
    assert [x["iteration"] for x in train] == [1, 2, 3] and all(x["lm_loss"] > 0 for x in train)
    assert all({"pp", "embedding"} <= set(x["comm_gb_by_group"]) for x in train), train  # p2p and tied embeddings
    check_eval_row(rows(metrics))  # computed on the last stage, logged by rank 0
    assert sorted(os.listdir(tmp_path / "ck" / "iter_0000003")) == ["mp_rank_00_000", "mp_rank_00_001"]


def test_missing_data_is_a_clear_error(dataset, tmp_path):
    args = pretrain_args(dataset, tmp_path / "m.jsonl")
    args[args.index("--data-path") + 1] = str(tmp_path / "nothing_text_sentence")
    one_line_error(run_main(*args), "nothing_text_sentence")


def test_truncated_data_is_a_clear_error(dataset, tmp_path):
    for ext in (".bin", ".idx"):
        shutil.copy(str(dataset / "c_text_sentence") + ext, str(tmp_path / "t_text_sentence") + ext)
    with open(str(tmp_path / "t_text_sentence.bin"), "r+b") as f:
        f.truncate(os.path.getsize(str(tmp_path / "t_text_sentence.bin")) // 2)
    args = pretrain_args(dataset, tmp_path / "m.jsonl")
    args[args.index("--data-path") + 1] = str(tmp_path / "t_text_sentence")
    one_line_error(run_main(*args), "t_text_sentence.bin")


def test_vocab_smaller_than_data_is_a_clear_error(dataset, tmp_path):
    lines = open(dataset / "vocab.txt").read().splitlines()
    (tmp_path / "small.txt").write_text("\n".join(lines[:60]) + "\n")
    args = pretrain_args(dataset, tmp_path / "m.jsonl")
    args[args.index("--vocab-file") + 1] = str(tmp_path / "small.txt")
    one_line_error(run_main(*args), "preprocessed with another vocab")


# Big enough that model states, not the fixed per-process overhead, set TP=2 apart from one process.
MEMORY_MODEL = ("--hidden-size", "512", "--num-attention-heads", "8")


def _budget_between_one_process_and_tp2(d) -> float:
    """A per-rank budget the planner puts between its one-process and its TP=2 prediction
    for MEMORY_MODEL on the CPU, so the test follows the planner's calibration."""
    from megabert.arguments import parse_args
    from megabert.data import build_tokenizer
    from megabert.planning import preflight
    from megabert.training.resolve import resolve_run

    vocab_size = build_tokenizer("BertWordPieceLowerCase", str(d / "vocab.txt")).vocab_size

    def predicted(tp: int) -> float:
        cfg = parse_args(pretrain_args(d, "m.jsonl", *MEMORY_MODEL, "--tensor-model-parallel-size", str(tp))[1:])
        run = resolve_run(cfg, SimpleNamespace(world_size=tp, dp_size=1, pp_size=1, device=torch.device("cpu")))
        return preflight(run, "cpu", budget_gb=1.0, vocab_size=vocab_size).estimate.total_gb

    one, tp2 = predicted(1), predicted(2)
    assert tp2 < one - 0.02, (one, tp2)
    return round((one + tp2) / 2, 3)


def test_memory_budget_warning_names_the_flags_that_fit(dataset, tmp_path):
    """Over --memory-budget-gb, one process logs the planner's warning before the model is
    built (the TP=2 and PP=2 flags, with their predictions), then trains anyway."""
    budget = _budget_between_one_process_and_tp2(dataset)
    metrics = tmp_path / "m.jsonl"
    # A process of its own: the backends' lines that mark the model's build are logged once per process.
    r = run_cmd([sys.executable, *pretrain_args(dataset, metrics, *MEMORY_MODEL, "--memory-budget-gb", str(budget))])
    assert r.returncode == 0, r.stderr[-4000:]
    log = r.stderr
    lines = log.splitlines()
    warned = [i for i, line in enumerate(lines) if "WARNING predicted peak" in line]
    assert len(warned) == 1, log[-4000:]
    warning = lines[warned[0]]
    assert f"exceeds the {budget:g} GB budget (tp1.pp1.dp1.z0;" in warning
    assert warning.endswith("(budget from --memory-budget-gb)")
    assert "--tensor-model-parallel-size 2 (" in warning and "GB on 2 ranks, fits)" in warning
    assert "--pipeline-model-parallel-size 2 (" in warning
    built = [i for i, line in enumerate(lines) if "attention backend:" in line]  # logged as the model is built
    assert built and warned[0] < built[0], log[-4000:]
    assert len([x for x in rows(metrics) if "lm_loss" in x]) == 3


def test_memory_budget_fit_is_one_info_line(dataset, tmp_path):
    """The same budget with TP=2, which the planner says fits: one info line, and it trains."""
    budget = _budget_between_one_process_and_tp2(dataset)
    metrics = tmp_path / "m.jsonl"
    log = run_ranks(2, pretrain_args(dataset, metrics, *MEMORY_MODEL, "--tensor-model-parallel-size", "2",
                                     "--memory-budget-gb", str(budget)), log=tmp_path / "log")
    fit = [line for line in log.splitlines() if "INFO predicted peak" in line]
    assert len(fit) == 1 and f"(tp2.pp1.dp1.z0) fits the {budget:g} GB budget from --memory-budget-gb" in fit[0], fit
    assert "exceeds the" not in log
    assert len([x for x in rows(metrics) if "lm_loss" in x]) == 3


def test_save_and_load_the_same_empty_dir_starts_fresh_then_resumes(dataset, tmp_path):
    """Megatron's restart pattern: `--save X --load X` on a first run starts from the seed
    with one info line, so the same command re-run (torchrun --max-restarts, a requeued
    SLURM job) resumes from what it saved; a --load elsewhere that holds nothing is an error."""
    ck = str(tmp_path / "ck")
    first = run_ranks(1, pretrain_args(dataset, tmp_path / "m1.jsonl", "--save", ck, "--load", ck, "--train-iters", "2"),
                      log=tmp_path / "first.log")
    assert f"--load {ck} holds no checkpoint yet (it is also --save): starting from the seed" in first
    again = run_ranks(1, pretrain_args(dataset, tmp_path / "m2.jsonl", "--save", ck, "--load", ck), log=tmp_path / "again.log")
    assert "holds no checkpoint yet" not in again
    assert [r["iteration"] for r in rows(tmp_path / "m2.jsonl") if "lm_loss" in r] == [3]
    elsewhere = tmp_path / "empty"
    elsewhere.mkdir()
    r = run_main(*pretrain_args(dataset, tmp_path / "m3.jsonl", "--save", ck, "--load", str(elsewhere)))
    one_line_error(r, f"--load {elsewhere} holds no checkpoint")
    assert os.path.isfile(os.path.join(ck, "latest_checkpointed_iteration.txt"))  # a failed load deletes nothing
