"""ZeRO-3 with optimizer and parameter offload trains a tiny BERT on two CPU processes
(DeepSpeedCPUAdam, a JIT-built op: the first run on a machine compiles it, about 1.5
minutes on 2 cores), follows the losses of ZeRO-3 without offload and saves."""
import dataclasses
import json

import pytest

import megabert
from megabert.arguments import parse_args
from megabert.parallel.layout import BatchLayout

from tests.helpers.dist_utils import run_distributed
from tests.helpers.train_utils import TINY, VOCAB, read_metrics, train_worker


STEPS = 3


def _zero3_worker(rank, world, argv, out):
    train_worker(rank, world, argv)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(read_metrics(argv[argv.index("--metrics-file") + 1]), f)


@pytest.mark.timeout(900)  # a cold cpu_adam build adds about 90 s
def test_zero3_offload_trains_like_zero3(tmp_path):
    zero3 = ["--train-iters", str(STEPS), "--deepspeed", "--zero-stage", "3"]
    offload = ["--zero-offload-optimizer", "cpu", "--zero-offload-params", "cpu"]
    plain, offloaded = tmp_path / "plain.json", tmp_path / "offload.json"
    run_distributed(_zero3_worker, 2, zero3 + ["--metrics-file", str(tmp_path / "a.jsonl")], str(plain))
    run_distributed(_zero3_worker, 2, zero3 + offload + ["--metrics-file", str(tmp_path / "b.jsonl"),
                                                        "--save", str(tmp_path / "ck")], str(offloaded))
    a, b = json.loads(plain.read_text()), json.loads(offloaded.read_text())
    assert len(b) == STEPS and all(x == x for x in b)
    assert b == pytest.approx(a, abs=1e-4)  # same AdamW update, vectorised on the CPU
    assert b[-1] < b[0]
    # The offloaded states are saved as DeepSpeed's checkpoint, committed like any other.
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text() == str(STEPS)
    assert (tmp_path / "ck" / "deepspeed" / f"iter_{STEPS:07d}").is_dir()


def _optimizer_type_worker(rank, world):
    from megabert.tasks.pretraining.task import pretraining_task
    from megabert.training.build import build_strategy
    from megabert.training.resolve import resolve_run

    cfg = parse_args(TINY + ["--deepspeed", "--zero-stage", "2", "--zero-offload-optimizer", "cpu"])
    ps = megabert.init_parallel(1, 1)
    model = megabert.BertForPreTraining(dataclasses.replace(cfg.model, vocab_size=VOCAB), ps, seed=cfg.train.seed)
    resolved = resolve_run(cfg, ps)
    ds_cfg = resolved.deepspeed_config
    run = dataclasses.replace(resolved, batch=BatchLayout.of(2, 4, 1))
    strategy = build_strategy(model, ps, run, pretraining_task("sop"))
    try:
        assert type(strategy.engine.optimizer.optimizer).__name__ == "DeepSpeedCPUAdam"
        assert ds_cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    finally:
        strategy.close()


def test_offload_flag_builds_deepspeed_cpu_adam():
    # The path pretrain_bert.py and finetune_squad.py take from the flags to the engine.
    run_distributed(_optimizer_type_worker, 1)


def test_first_build_of_cpu_adam_is_announced_once(tmp_path, monkeypatch, caplog):
    from deepspeed.git_version_info import installed_ops

    from megabert.training.deepspeed.cpu_adam import note_jit_build

    monkeypatch.setitem(installed_ops, "cpu_adam", False)  # as a JIT install (DS_BUILD_CPU_ADAM unset)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with caplog.at_level("WARNING", logger="megabert.training.deepspeed.cpu_adam"):
        note_jit_build("CPUAdamBuilder", "ZeRO-Offload's CPU optimizer")
    assert [r.getMessage() for r in caplog.records] == [
        "building DeepSpeed's cpu_adam op for ZeRO-Offload's CPU optimizer: a one-time C++ compile, cached for "
        "later runs, that takes a few minutes (install deepspeed with DS_BUILD_CPU_ADAM=1 to build it ahead)"]
    caplog.clear()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")  # built: nothing to say
    note_jit_build("CPUAdamBuilder", "ZeRO-Offload's CPU optimizer")
    assert not caplog.records
