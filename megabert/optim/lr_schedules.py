"""Learning-rate schedules: warmup, then constant / linear / cosine / polynomial decay to
min_lr or Megatron's WSD (warmup-stable-decay; Megatron's OptimizerParamScheduler), or
DeepSpeedExamples' BERT schedule
warmup_exp_decay_exp. The schedule is a pure function of the iteration, so a resumed
run needs only the iteration to continue exactly.

Warmup starts from lr_warmup_init (Megatron's --lr-warmup-init, default 0):
    lr(it) = init + (lr - init) * it / warmup_iters          for it <= warmup_iters
No optimizer step runs at lr 0 (issue 51): the warm-up's ramp starts one step before the
first (it = 0 is never taken) and the decay's ramp ends one step after the last of
--lr-decay-iters (at it = decay_iters + 1, never taken), so the first step is above the
warm-up's start, the last above --min-lr, and each step has a lr of its own (the warm-up's
last step is the only one at the peak). transformers and Megatron take lr(step - 1) and
spend their first step at 0; megabert took lr(step) on a decay ending at the last step and
spent that one at --min-lr. docs/recipes.md.
warmup_exp_decay_exp keeps init as bing_bert keeps its --lr_offset, added to the whole
curve: lr(it) = init + (lr - init) * f(it), f rising as (it / warmup)^2, then decaying."""
from __future__ import annotations

import math

from megabert.config import OptimConfig


class LRSchedule:
    def __init__(self, cfg: OptimConfig, train_iters: int):
        self.cfg = cfg
        self.decay_iters = cfg.lr_decay_iters or max(train_iters, 1)
        if cfg.lr_warmup_fraction is not None:
            self.warmup_iters = int(cfg.lr_warmup_fraction * self.decay_iters)
        else:
            self.warmup_iters = cfg.lr_warmup_iters
        # The decay runs from the peak at `decay_start` (the warm-up's last step; with no
        # warm-up, the first step) to --min-lr at `decay_end`, one step past the last one.
        self.decay_start = max(self.warmup_iters, 1)
        self.decay_end = self.decay_iters + 1

    def __call__(self, iteration: int) -> float:
        """LR for the optimizer step that completes `iteration` (1-based)."""
        c, it = self.cfg, iteration
        if c.lr_decay_style == "warmup_exp_decay_exp":
            # DeepSpeedExamples (bing_bert): polynomial warmup of degree 2, then
            # exponential decay by lr_exp_decay_rate every lr_exp_decay_iters.
            # bing_bert's lr = learning_rate * f(step) + lr_offset, with --lr the peak
            # learning_rate + lr_offset and --lr-warmup-init the offset.
            if it < self.warmup_iters:
                shape = (it / self.warmup_iters) ** 2
            else:
                shape = c.lr_exp_decay_rate ** ((it - self.decay_start) / c.lr_exp_decay_iters)
            return max(c.min_lr, c.lr_warmup_init + (c.lr - c.lr_warmup_init) * shape)
        if self.warmup_iters > 0 and it <= self.warmup_iters:
            return c.lr_warmup_init + (c.lr - c.lr_warmup_init) * it / self.warmup_iters
        if c.lr_decay_style == "constant":
            return c.lr
        if it > self.decay_iters:
            return c.min_lr
        ratio = (it - self.decay_start) / (self.decay_end - self.decay_start)
        if c.lr_decay_style == "WSD":
            coeff = self._wsd_coeff(it)
        elif c.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif c.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        elif c.lr_decay_style == "polynomial":
            coeff = (1.0 - ratio) ** c.lr_decay_power
        else:
            raise ValueError(f"unknown --lr-decay-style {c.lr_decay_style}")
        return c.min_lr + (c.lr - c.min_lr) * coeff

    def _wsd_coeff(self, it: int) -> float:
        """Megatron's WSD: 1 until the anneal starts (--lr-wsd-decay-iters before the end of
        the decay), then the decay style over the anneal's fraction done (exponential goes
        as 2 * 0.5^t - 1, so every style reaches 0 at t = 1, which is `decay_end`, one step
        past the last)."""
        c = self.cfg
        anneal_start = self.decay_iters - c.lr_wsd_decay_iters
        if it <= anneal_start:
            return 1.0
        t = (it - anneal_start) / (self.decay_end - anneal_start)
        if c.lr_wsd_decay_style == "linear":
            return 1.0 - t
        if c.lr_wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * t) + 1.0)
        if c.lr_wsd_decay_style == "exponential":
            return 2.0 * 0.5 ** t - 1.0
        if c.lr_wsd_decay_style == "minus_sqrt":
            return 1.0 - math.sqrt(t)
        raise ValueError(f"unknown --lr-wsd-decay-style {c.lr_wsd_decay_style}")

    def apply(self, optimizer, iteration: int) -> float:
        lr = self(iteration)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        return lr
