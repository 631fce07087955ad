"""The plain transformers fine-tuning loop that tests/test_squad_recipe.py and
tests/test_ner_recipe.py hold finetune_squad.py and finetune_ner.py against: torch's AdamW,
BERT's learning rates (10% warm-up, then linear decay, as megabert's schedule computes them,
so that the loop follows any change to it), optional clipping, one loss per step."""
from __future__ import annotations

from typing import Iterator

import torch

from megabert.config import OptimConfig
from megabert.optim import LRSchedule


def plain_loop_losses(model: torch.nn.Module, batches: Iterator[dict], *, steps: int, lr: float, eps: float,
                      weight_decay: float, clip: float, no_decay: tuple[str, ...] = ("bias", "LayerNorm.weight")
                      ) -> list[float]:
    """Each step's loss, `model` (a transformers model in train mode) trained on `steps` of
    `batches`. Parameters whose names hold a `no_decay` part take no weight decay (Trainer's
    groups; () decays every parameter, as torch's AdamW on model.parameters())."""
    groups = [{"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)],
               "weight_decay": weight_decay},
              {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)],
               "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, eps=eps)
    schedule = LRSchedule(OptimConfig(lr=lr, lr_warmup_fraction=0.1), steps)
    losses = []
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        loss = model(**next(batches)).loss
        losses.append(loss.item())
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses
