"""The checkpoint manager over its stateful parts: what one saves, another restores exactly
(weights, optimizer moments by name, loss scale, RNG streams, train state and data position)."""
from __future__ import annotations

import random

import torch

import megabert
from megabert.checkpoint.manager import CheckpointManager
from megabert.checkpoint.run_state import TrainingState
from megabert.checkpoint.start import require_source
from megabert.config import ModelConfig, OptimConfig
from megabert.optim import build_optimizer
from megabert.optim.grad_scaler import DynamicLossScaler
from megabert.training.checkpoint_state import local_parts
from megabert.training.strategy import LocalStrategy


def _strategy(ps, seed: int) -> LocalStrategy:
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=40, max_position_embeddings=16,
                      attention_backend="torch", layernorm_backend="torch")
    model = megabert.BertForPreTraining(cfg, ps, seed=seed)
    optim = OptimConfig(lr=1e-2)
    return LocalStrategy(model, build_optimizer(model, optim, ps.tp_group), ps, None, scaler=DynamicLossScaler(optim),
                         clip_grad=0.0)


def test_what_one_manager_saves_another_restores(tmp_path):
    ps = megabert.init_parallel()
    saved = _strategy(ps, seed=1)
    ids = torch.randint(0, 40, (2, 8))
    saved.model(ids).mlm_logits.float().square().mean().backward()
    saved.optimizer.step()
    saved.scaler.update(overflow=True)
    state = TrainingState(iteration=3, consumed_samples=24, skipped_iterations=1)
    CheckpointManager(local_parts(saved), ps).save(str(tmp_path), state)
    rng_after_save = torch.get_rng_state(), random.getstate()

    torch.manual_seed(7)
    random.seed(7)
    fresh = _strategy(ps, seed=2)
    loaded = CheckpointManager(local_parts(fresh), ps).restore(require_source(str(tmp_path)))

    assert loaded.state == state
    assert all(torch.equal(a, b) for a, b in zip(saved.model.state_dict().values(), fresh.model.state_dict().values()))
    moments = [[s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
               for opt in (saved.optimizer, fresh.optimizer)]
    assert moments[0] and len(moments[0]) == len(moments[1]) and all(torch.equal(a, b) for a, b in zip(*moments))
    assert fresh.scaler.state_dict() == saved.scaler.state_dict()
    assert torch.equal(torch.get_rng_state(), rng_after_save[0]) and random.getstate() == rng_after_save[1]
