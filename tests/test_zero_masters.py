"""fp32 ZeRO keeps one copy of the weights: DeepSpeed's fp32 master partition shares the
parameter partition's storage (stage 1, 2 and 3), through training steps; bf16 keeps its
separate fp32 master. That the shared runs train like one process is
test_training.test_zero_stages_match_single_process; that they resume exactly is
test_training.test_zero3_resume_is_exact_and_its_checkpoint_holds_whole_weights."""
import json

import pytest
import torch.distributed as dist

import megabert.say_once
from tests.helpers.dist_utils import run_distributed
from tests.helpers.train_utils import build_trainer


def _pairs(optimizer, stage):
    """(master, parameter partition) of every group on this rank."""
    if stage == 3:
        return list(zip(optimizer.fp32_partitioned_groups_flat, optimizer.fp16_partitioned_groups_flat))
    return [(m, optimizer.parallel_partitioned_bit16_groups[i][dist.get_rank(optimizer.real_dp_process_group[i])])
            for i, m in enumerate(optimizer.single_partition_of_fp32_groups)]


def _masters_worker(rank, world, argv, stage, out):
    _, _, trainer = build_trainer(argv + ["--deepspeed", "--zero-stage", str(stage), "--train-iters", "2"])
    try:
        optimizer = trainer.strategy.engine.optimizer
        before = [m.data_ptr() == p.data_ptr() for m, p in _pairs(optimizer, stage)]
        trainer.train()
        pairs = _pairs(optimizer, stage)
        after = [m.data_ptr() == p.data_ptr() for m, p in pairs]
        equal = all(bool((m.float() == p.float()).all()) for m, p in pairs)
        from deepspeed.comm import comm

        if rank == 0:
            with open(out, "w") as f:
                json.dump({"before": before, "after": after, "equal": equal, "shm": comm.cdb.shm_comm_op is not None,
                           "dtypes": sorted({str(m.dtype) + "/" + str(p.dtype) for m, p in pairs})}, f)
    finally:
        trainer.close()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp32_master_shares_the_parameter_partition(tmp_path, stage):
    out = tmp_path / "r.json"
    run_distributed(_masters_worker, 2, [], stage, str(out))
    r = json.loads(out.read_text())
    assert r["before"] and len(r["after"]) == len(r["before"]) and all(r["before"]) and all(r["after"]), r
    assert r["equal"] and r["dtypes"] == ["torch.float32/torch.float32"]
    assert not r["shm"]  # DeepSpeed's inference-only shared-memory op is neither built nor loaded


def test_bf16_keeps_a_separate_fp32_master(tmp_path):
    out = tmp_path / "r.json"
    run_distributed(_masters_worker, 2, ["--bf16"], 3, str(out))
    r = json.loads(out.read_text())
    assert not any(r["before"]) and not any(r["after"]), r
    assert r["dtypes"] == ["torch.float32/torch.bfloat16"]


def test_version_guard_switches_the_private_patch_off_on_an_unknown_deepspeed(monkeypatch, caplog):
    import deepspeed

    from megabert.training.deepspeed import version

    assert version.known_version(deepspeed.__version__)  # the installed one is pinned in pyproject.toml
    assert version.known_version("0.19.3+cu130") and not version.known_version("0.20.0")
    assert not version.known_version("0.18.9")
    monkeypatch.setattr(deepspeed, "__version__", "0.99.0")
    monkeypatch.setattr(megabert.say_once, "_said", set())
    monkeypatch.delenv("MEGABERT_DEEPSPEED_PATCHES", raising=False)
    with caplog.at_level("WARNING", logger="megabert.training.deepspeed.version"):
        assert not version.private_patches_allowed() and not version.private_patches_allowed()
    assert len(caplog.records) == 1 and "deepspeed 0.99.0 is outside" in caplog.text
    monkeypatch.setenv("MEGABERT_DEEPSPEED_PATCHES", "1")
    assert version.private_patches_allowed()
