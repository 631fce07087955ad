"""ZeRO-3 with optimizer and parameter offload trains a tiny BERT on two CPU processes
(torch's fused AdamW stepping DeepSpeed's CPU partitions: no DeepSpeed op to compile),
follows the losses of ZeRO-3 without offload and saves."""
import dataclasses
import json

import pytest
import torch

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


def test_zero3_offload_trains_like_zero3(tmp_path):
    zero3 = ["--train-iters", str(STEPS), "--deepspeed", "--zero-stage", "3"]
    offload = ["--zero-offload-optimizer", "cpu", "--zero-offload-params", "cpu"]
    plain, offloaded = tmp_path / "plain.json", tmp_path / "offload.json"
    run_distributed(_zero3_worker, 2, zero3 + ["--metrics-file", str(tmp_path / "a.jsonl")], str(plain))
    run_distributed(_zero3_worker, 2, zero3 + offload + ["--metrics-file", str(tmp_path / "b.jsonl"),
                                                        "--save", str(tmp_path / "ck")], str(offloaded))
    a, b = json.loads(plain.read_text()), json.loads(offloaded.read_text())
    assert len(b) == STEPS and all(x == x for x in b)
    assert b == pytest.approx(a, abs=1e-4)  # the same fused AdamW, on the CPU partitions
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
        optimizer = strategy.engine.optimizer.optimizer
        assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"]
        assert ds_cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
        assert ds_cfg["zero_force_ds_cpu_optimizer"] is False
        # The partitions it steps live on the CPU.
        assert {p.device.type for g in optimizer.param_groups for p in g["params"]} == {"cpu"}
    finally:
        strategy.close()


def test_offload_steps_torchs_fused_adamw_on_the_cpu_partitions():
    # The path pretrain_bert.py and finetune_squad.py take from the flags to the engine.
    run_distributed(_optimizer_type_worker, 1)


def test_a_deepspeed_op_build_is_announced_once(tmp_path, monkeypatch, caplog):
    """For a DeepSpeed whose CPU collectives megabert cannot switch off (engine.py): the line
    before DeepSpeed's JIT build, here for its cpu_adam op, and nothing once it is built."""
    from deepspeed.git_version_info import installed_ops

    from megabert.training.deepspeed.jit_ops import note_jit_build

    monkeypatch.setitem(installed_ops, "cpu_adam", False)  # as a JIT install (DS_BUILD_CPU_ADAM unset)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with caplog.at_level("WARNING", logger="megabert.training.deepspeed.jit_ops"):
        note_jit_build("CPUAdamBuilder", "ZeRO-Offload's CPU optimizer")
    assert [r.getMessage() for r in caplog.records] == [
        "building DeepSpeed's cpu_adam op for ZeRO-Offload's CPU optimizer: a one-time C++ compile, cached for "
        "later runs, that takes a few minutes (install deepspeed with DS_BUILD_CPU_ADAM=1 to build it ahead)"]
    caplog.clear()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")  # built: nothing to say
    note_jit_build("CPUAdamBuilder", "ZeRO-Offload's CPU optimizer")
    assert not caplog.records
