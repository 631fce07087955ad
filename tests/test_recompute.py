"""Activation recompute replays dropout exactly (default and per-TP-rank streams):
loss and every gradient equal those without recompute, with dropout on."""
import pytest
import torch

import megabert
from megabert.config import ModelConfig

from tests.helpers.dist_utils import run_distributed
from tests.helpers.train_utils import batches


def _grads(ps, granularity):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=99,
                      max_position_embeddings=32, hidden_dropout=0.2, attention_dropout=0.2,
                      attention_backend="torch", recompute_granularity=granularity)
    torch.manual_seed(5)
    model = megabert.BertForPreTraining(cfg, ps, seed=3)
    b = next(batches(0, 4, 0, 1))
    out = model(b["input_ids"], b["token_type_ids"], b["attention_mask"], b["labels"], b["next_sentence_label"])
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _check(rank, world):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    loss0, g0 = _grads(ps, None)
    for granularity in ("full", "selective"):
        loss, g = _grads(ps, granularity)
        assert torch.equal(loss, loss0), granularity
        assert g0 and set(g) == set(g0), granularity
        for n in g0:
            assert torch.equal(g[n], g0[n]), (granularity, n)


@pytest.mark.parametrize("world", [1, 2])
def test_recompute_is_exact_with_dropout(world):
    run_distributed(_check, world)
