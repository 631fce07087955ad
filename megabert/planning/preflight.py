"""The planner from a run's own configs: what pretrain_bert.py calls after parsing and
before it builds the model, so a layout that will not fit is named (one line, with the
flags that would make it fit) instead of running out of memory minutes later.

    check = preflight(configs, dp_size=ps.dp_size, device=ps.device, vocab_size=tokenizer.vocab_size)
    if check is not None:
        logger.log(logging.INFO if check.fits else logging.WARNING, check.message())
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from megabert.config import Configs
from megabert.planning.memory import MemoryEstimate, estimate
from megabert.planning.search import fit_warning
from megabert.planning.spec import Layout, Workload


def run_and_layout(configs: Configs, dp_size: int, device: str = "cuda") -> tuple[Workload, Layout]:
    """The Workload and Layout that pretrain_bert.py's configs describe."""
    m, p, t = configs.model, configs.parallel, configs.train
    precision = "bf16" if t.bf16 else "fp16" if t.fp16 else "fp32"
    pp = p.pipeline_model_parallel_size
    per_chunk = p.num_layers_per_virtual_pipeline_stage
    virtual = m.num_layers // (pp * per_chunk) if per_chunk else 1
    run = Workload(seq_length=configs.data.seq_length, micro_batch_size=t.micro_batch_size,
                  global_batch_size=t.global_batch_size, precision=precision,
                  recompute=m.recompute_granularity or "none", mlm_logits_at_masked_only=True,
                  mask_prob=configs.data.mask_prob, device=device)
    zero_stage = t.zero_stage if t.deepspeed else 0
    layout = Layout(tp=p.tensor_model_parallel_size, pp=pp, dp=dp_size, virtual_stages=virtual,
                    sequence_parallel=m.sequence_parallel and p.tensor_model_parallel_size > 1,
                    zero_stage=zero_stage, offload_optimizer=zero_stage > 0 and t.zero_offload_optimizer == "cpu",
                    offload_params=zero_stage == 3 and t.zero_offload_params == "cpu")
    return run, layout


@dataclass(frozen=True)
class Preflight:
    """The planner's prediction for this rank's layout against the per-rank budget."""

    estimate: MemoryEstimate
    budget_gb: float
    budget_source: str
    """Where the budget came from: "--memory-budget-gb" or "the GPU's memory"."""

    @property
    def fits(self) -> bool:
        return self.estimate.total_gb <= self.budget_gb

    def message(self) -> str:
        """One line: the planner's warning (parts and flags to change) or the fit."""
        warning = fit_warning(self.estimate, self.budget_gb)
        if warning is not None:
            return f"{warning} (budget from {self.budget_source})"
        return (f"predicted peak {self.estimate.total_gb:.2f} GB per rank ({self.estimate.layout.short()}) fits the "
                f"{self.budget_gb:g} GB budget from {self.budget_source}")


def resolve_budget(configs: Configs, device: torch.device, budget_gb: Optional[float]) -> Optional[tuple[float, str]]:
    """(budget in GB, where it came from): `budget_gb`, else --memory-budget-gb, else the
    GPU's total memory; None on the CPU without one (RSS has no fixed ceiling)."""
    if budget_gb is not None:
        return budget_gb, "the caller"
    if configs.train.memory_budget_gb is not None:
        return configs.train.memory_budget_gb, "--memory-budget-gb"
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 1e9, "the GPU's memory"
    return None


def preflight(configs: Configs, dp_size: int, device: torch.device | str, budget_gb: Optional[float] = None,
              vocab_size: Optional[int] = None) -> Optional[Preflight]:
    """The prediction for this run against its budget, or None when there is no budget.

    `vocab_size`: the tokenizer's, which the model is built with (ModelConfig's default
    otherwise). On the CPU the prediction is peak RSS, offloaded states included."""
    device = torch.device(device)
    budget = resolve_budget(configs, device, budget_gb)
    if budget is None:
        return None
    model = configs.model if vocab_size is None else dataclasses.replace(configs.model, vocab_size=vocab_size)
    run, layout = run_and_layout(configs, dp_size, "cuda" if device.type == "cuda" else "cpu")
    return Preflight(estimate(model, run, layout), *budget)


def preflight_warning(configs: Configs, dp_size: int, device: torch.device | str,
                      budget_gb: Optional[float] = None) -> Optional[str]:
    """fit_warning for this run on this device, None when it fits or there is no budget."""
    check = preflight(configs, dp_size, device, budget_gb)
    return None if check is None or check.fits else check.message()
