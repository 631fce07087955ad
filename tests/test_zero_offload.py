"""ZeRO-3 with optimizer and parameter offload trains a tiny BERT on two CPU processes
(DeepSpeedCPUAdam, a JIT-built op: the first run on a machine compiles it, about 1.5
minutes on 2 cores) and follows the losses of ZeRO-3 without offload."""
import dataclasses
import itertools
import json

import pytest
import torch.distributed as dist
from dist_utils import run_distributed
from train_utils import TINY, VOCAB, batches

import megabert
from megabert.arguments import parse_args
from megabert.optim import build_optimizer
from megabert.training import deepspeed_engine

STEPS = 3


def _zero3_worker(rank, world, offload: bool, out: str):
    flags = ["--zero-offload-optimizer", "cpu", "--zero-offload-params", "cpu"] if offload else []
    cfg = parse_args(TINY + ["--deepspeed", "--zero-stage", "3", *flags])
    ps = megabert.init_parallel(1, 1)
    model = megabert.BertForPreTraining(dataclasses.replace(cfg.model, vocab_size=VOCAB), ps, seed=cfg.train.seed)
    # The wiring pretraining.build_pretraining needs (see deepspeed_engine.resolve_deepspeed_config).
    ds_cfg, optim = deepspeed_engine.resolve_deepspeed_config(cfg, ps, cfg.model.hidden_size)
    optimizer = build_optimizer(model, optim, ps.tp_group, cpu_offload=deepspeed_engine.offloads_optimizer(ds_cfg))
    engine = deepspeed_engine.initialize(model, optimizer, ds_cfg, ps)
    assert type(engine.optimizer.optimizer).__name__ == ("DeepSpeedCPUAdam" if offload else "AdamW")
    losses = []
    for b in itertools.islice(batches(0, cfg.train.micro_batch_size, ps.dp_rank, ps.dp_size), STEPS):
        loss = engine(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["labels"],
                      b["next_sentence_label"]).loss
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    engine.destroy()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(losses, f)


@pytest.mark.timeout(900)  # a cold cpu_adam build adds about 90 s
def test_zero3_offload_trains_like_zero3(tmp_path):
    plain, offloaded = tmp_path / "plain.json", tmp_path / "offload.json"
    run_distributed(_zero3_worker, 2, False, str(plain))
    run_distributed(_zero3_worker, 2, True, str(offloaded))
    a, b = json.loads(plain.read_text()), json.loads(offloaded.read_text())
    assert len(b) == STEPS and all(x == x for x in b)
    assert b == pytest.approx(a, abs=1e-4)  # same AdamW update, vectorised on the CPU
    assert b[-1] < b[0]


def test_first_build_of_cpu_adam_is_announced_once(tmp_path, monkeypatch, caplog):
    from deepspeed.git_version_info import installed_ops

    from megabert.optim.cpu_adam import note_jit_build

    monkeypatch.setitem(installed_ops, "cpu_adam", False)  # as a JIT install (DS_BUILD_CPU_ADAM unset)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with caplog.at_level("WARNING", logger="megabert.optim.cpu_adam"):
        note_jit_build("CPUAdamBuilder", "ZeRO-Offload's CPU optimizer")
    assert [r.getMessage() for r in caplog.records] == [
        "building DeepSpeed's cpu_adam op for ZeRO-Offload's CPU optimizer: a one-time C++ compile, cached for "
        "later runs, that takes a few minutes (install deepspeed with DS_BUILD_CPU_ADAM=1 to build it ahead)"]
    caplog.clear()
    (tmp_path / "cpu_adam" / "cpu_adam.so").write_bytes(b"")  # built: nothing to say
    note_jit_build("CPUAdamBuilder", "ZeRO-Offload's CPU optimizer")
    assert not caplog.records
