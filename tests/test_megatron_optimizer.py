"""A Megatron-LM run continued by megabert takes the next step megatron-core takes.

tests/fixtures/megatron/optim (made by `python -m tests.helpers.megatron_core make-optim`):
megatron-core's BertModel at TP 2, in its DDP wrapper, with get_megatron_optimizer's Adam and
its OptimizerParamScheduler, trained two steps on fixed batches and saved in both formats with
its optimizer state (`tp2_fp32_torch`, `tp2_fp32_torch_dist`); then its third step's loss
(`tp2_fp32_next_loss.pt`) and the weights after it (`tp2_fp32_next_torch`). megabert loads the
saved directory with the moments, takes the same step on the same batch, and must land on
megatron-core's weights; with a fresh optimizer it does not. The other way, megatron-core
continues the Adam state that convert_megatron.py export writes.
"""
import importlib.util
import logging
import os
import subprocess
import sys

import pytest
import torch

import megabert
from megabert.checkpoint.manager import CheckpointManager
from megabert.checkpoint.megatron import adam_state
from megabert.checkpoint.optimizer_state import shard_optimizer_state
from megabert.checkpoint.reader import read_rank
from megabert.checkpoint.start import require_source
from megabert.config import OptimConfig
from megabert.optim import build_optimizer
from megabert.parallel.layout import StageLayout
from megabert.parallel.param_spec import spec_table
from megabert.training.checkpoint_state import local_parts
from megabert.training.strategy import LocalStrategy
from tests.helpers import cli_utils
from tests.helpers.dist_utils import run_distributed
from tests.helpers.megatron_core import OPTIM, OPTIM_STEPS, loss_of, train_batch
from tests.helpers.megatron_files import FIXTURES

OPTIM_DIR = os.path.join(FIXTURES, "optim")
TOL = 1e-5


def _optim_config(**kw) -> OptimConfig:
    return OptimConfig(**{"lr": OPTIM["lr"], "weight_decay": OPTIM["weight_decay"], "adam_beta1": OPTIM["adam_beta1"],
                          "adam_beta2": OPTIM["adam_beta2"], "adam_eps": OPTIM["adam_eps"], "clip_grad": 0.0, **kw})


def _next_step(fmt: str, ps=None, load_moments: bool = True) -> tuple[float, float]:
    """(|loss - megatron-core's|, max |weights after the step - megatron-core's|)."""
    path = os.path.join(OPTIM_DIR, f"tp2_fp32_{fmt}")
    model = megabert.BertForPreTraining.from_pretrained(path, ps, attention_backend="torch")
    optimizer = build_optimizer(model, _optim_config(), model.parallel_state.tp_group)
    strategy = LocalStrategy(model, optimizer, model.parallel_state, None, scaler=None, clip_grad=0.0)
    loaded = CheckpointManager(local_parts(strategy), model.parallel_state).restore(require_source(path),
                                                                                    load_optimizer=load_moments)
    assert loaded.state.iteration == OPTIM_STEPS
    batch = train_batch(OPTIM_STEPS + 1)
    model.train()
    out = model(batch["input_ids"], token_type_ids=batch["token_type_ids"], attention_mask=batch["attention_mask"])
    loss = loss_of(out.mlm_logits, out.nsp_logits, batch)
    loss.backward()
    optimizer.step()
    ref_loss = torch.load(os.path.join(OPTIM_DIR, "tp2_fp32_next_loss.pt"), weights_only=True)["loss"]
    after = megabert.BertForPreTraining.from_pretrained(os.path.join(OPTIM_DIR, "tp2_fp32_next_torch"), ps,
                                                        attention_backend="torch").state_dict()
    return abs(loss.item() - ref_loss), _max_diff(model.state_dict(), after)


def _max_diff(got: dict, expected: dict) -> float:
    diffs = {k: (t - expected[k]).abs() for k, t in got.items()}
    for k in [k for k in diffs if k.endswith("attention.qkv.bias")]:
        # NOTE: the key bias adds the same q.b_k to every score of a query, which softmax
        # cancels: its gradient is 0 up to rounding, and Adam scales that rounding noise up to
        # ~lr in both projects alike. Its rows (megabert's [Q; K; V]) are left out.
        h = diffs[k].numel() // 3
        diffs[k] = torch.cat([diffs[k][:h], diffs[k][2 * h:]])
    return max(d.max().item() for d in diffs.values())


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_next_step_equals_megatron_cores(fmt, caplog):
    """Saved at TP 2, continued at TP 1: a layout change the by-name moments go through."""
    with caplog.at_level(logging.INFO):
        loss_diff, weight_diff = _next_step(fmt)
    assert loss_diff < TOL and weight_diff < TOL, (loss_diff, weight_diff)
    assert "Adam moments continued (optimizer step 2)" in caplog.text


def test_a_fresh_optimizer_lands_elsewhere():
    """The comparison above has teeth: without the moments the same step moves the weights differently."""
    _, weight_diff = _next_step("torch", load_moments=False)
    assert weight_diff > 1e-4


def _next_step_at_tp2(rank, world):
    ps = megabert.init_parallel(tensor_parallel_size=2)
    for fmt in ("torch", "torch_dist"):
        loss_diff, weight_diff = _next_step(fmt, ps)
        assert loss_diff < TOL and weight_diff < TOL, (fmt, loss_diff, weight_diff)


def test_next_step_at_megabert_tp2():
    run_distributed(_next_step_at_tp2, 2)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_moments_follow_any_layout(fmt):
    """Each rank of TP 2 x PP 2 reads its share of the moments: the whole (TP 1) moments split
    as megabert splits its own (QKV with stride 3, vocab rows padded for TP 2)."""
    path = os.path.join(OPTIM_DIR, f"tp2_fp32_{fmt}")
    model = megabert.BertForPreTraining.from_pretrained(path, attention_backend="torch")
    cfg, table = model.config, spec_table(model)
    whole = read_rank(path, tp_rank=0, tp_size=1, stage=StageLayout(cfg.num_layers), table=table,
                      model_config=cfg).payload["optimizer"]
    assert len(whole["state"]) == len(table) and all(s["step"] == OPTIM_STEPS for s in whole["state"].values())
    padded = cfg.padded_vocab_size(2)
    whole_tp2 = {"state": {k: {**s, **{m: _repad(s[m], table[k], padded) for m in adam_state.MOMENTS}}
                           for k, s in whole["state"].items()}, "param_groups": []}
    seen = set()
    for pp_rank in range(2):
        stage = StageLayout(cfg.num_layers, 2, pp_rank)
        for tp_rank in range(2):
            got = read_rank(path, tp_rank=tp_rank, tp_size=2, stage=stage, table=table, model_config=cfg,
                            padded_vocab_size=padded).payload["optimizer"]["state"]
            expected = shard_optimizer_state(whole_tp2, table, set(got), tp_rank, 2)["state"]
            assert set(got) == {k for k, spec in table.items() if stage.holds(spec)}
            for name, s in got.items():
                for m in adam_state.MOMENTS:
                    assert torch.equal(s[m], expected[name][m]), (name, m)
            seen |= set(got)
    assert seen == set(table)


def _repad(t, spec, padded):
    if spec.valid_rows is None:
        return t
    return torch.cat([t[:spec.valid_rows], t.new_zeros((padded - spec.valid_rows,) + tuple(t.shape[1:]))])


def test_what_does_not_continue_says_why():
    args = {"optimizer": "adam", "adam_beta1": 0.9, "adam_beta2": 0.98, "adam_eps": 1e-8, "weight_decay": 0.01}
    assert adam_state.mismatch(args, _optim_config()) is None
    assert adam_state.hyperparameter_note(args, _optim_config()) is None
    assert "sgd" in adam_state.mismatch({**args, "optimizer": "sgd"}, _optim_config())
    assert "--optimizer lamb" in adam_state.mismatch(args, _optim_config(optimizer="lamb"))
    assert "--no-bias-correction" in adam_state.mismatch(args, _optim_config(bias_correction=False))
    assert "decoupled" in adam_state.mismatch({**args, "decoupled_weight_decay": False}, _optim_config())
    assert adam_state.hyperparameter_note(args, _optim_config(adam_eps=1e-6)) == \
        "--adam-eps 1e-06 (Megatron's run: 1e-08)"
    # megatron-core's fixtures without optimizer state: the weights load, the moments are None with the reason
    path = os.path.join(FIXTURES, "tp2_torch_dist")
    model = megabert.BertForPreTraining.from_pretrained(path, attention_backend="torch")
    payload = read_rank(path, tp_rank=0, tp_size=1, stage=StageLayout(2), table=spec_table(model),
                        model_config=model.config).payload
    assert payload["optimizer"] is None and "holds no optimizer state" in payload["optimizer_note"]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_bf16_run_gives_its_fp32_master_weights(fmt):
    """megatron-core's bf16 run (Float16OptimizerWithFloat16Params): with its optimizer state the
    weights are its fp32 masters (`fp32_from_fp16_params` / `optimizer.state.fp32_param.*`),
    which round to the bf16 model weights and hold the bits bf16 drops; the moments come along."""
    path = os.path.join(OPTIM_DIR, f"tp2_bf16_{fmt}")
    model = megabert.BertForPreTraining.from_pretrained(path, attention_backend="torch")
    cfg, table = model.config, spec_table(model)
    bf16_weights = model.state_dict()
    payload = read_rank(path, tp_rank=0, tp_size=1, stage=StageLayout(cfg.num_layers), table=table,
                        model_config=cfg).payload
    masters = payload["model"]
    assert set(masters) == set(table)
    for name, t in masters.items():
        assert t.dtype == torch.float32, name
        assert torch.equal(t.to(torch.bfloat16), bf16_weights[name].to(torch.bfloat16)), name
    assert sum(not torch.equal(t, bf16_weights[n]) for n, t in masters.items()) > len(masters) // 2
    assert set(payload["optimizer"]["state"]) == set(table)
    assert all(s["step"] == OPTIM_STEPS for s in payload["optimizer"]["state"].values())


def test_exported_adam_state_gives_megatron_cores_next_step(tmp_path):
    """convert_megatron.py export of a run with Adam moments (here megatron-core's TP-2 run, re-laid
    at TP 1) writes them as Megatron-LM saves them: megatron-core itself loads weights and
    optimizer from each format (load_state_dict / dist_checkpointing.load) and its next step
    lands on the weights of the original run's next step."""
    if importlib.util.find_spec("megatron") is None:  # not imported here: megatron-core runs in its own process
        pytest.skip("megatron-core is not installed (the test extra)")
    dirs = []
    for fmt in ("torch", "torch_dist"):
        dirs.append(str(tmp_path / fmt))
        r = cli_utils.run_main("tools/checkpoint/convert_megatron.py", "export", "--load",
                               os.path.join(OPTIM_DIR, "tp2_fp32_torch"), "--megatron-dir", dirs[-1], "--format", fmt)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "optimizer state: Adam moments at step 2" in r.stdout
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "tests.helpers.megatron_core", "next-step", "1", str(tmp_path / "out"),
                        *dirs], cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    after = _weights(os.path.join(OPTIM_DIR, "tp2_fp32_next_torch"))
    for i in range(len(dirs)):
        got = _weights(str(tmp_path / "out" / str(i)))
        assert _max_diff(got, after) < TOL, dirs[i]


def _weights(path):
    return megabert.BertForPreTraining.from_pretrained(path, attention_backend="torch").state_dict()
