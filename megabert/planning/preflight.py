"""The planner from a run's own configs: what pretrain_bert.py calls after parsing and
before it builds the model, so a layout that will not fit is named (one line, with the
flags that would make it fit) instead of running out of memory minutes later.

    run = resolve_run(configs, ps)   # megabert.training.resolve: flags + DeepSpeed JSON, checked
    log_preflight(run, ps.device, vocab_size=tokenizer.vocab_size)   # on the logging rank
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from megabert.config import DataConfig, ModelConfig, ParallelConfig, TrainConfig
from megabert.data_parallel.zero_plan import ZeroPlan
from megabert.parallel.layout import BatchLayout
from megabert.planning.memory import MemoryEstimate, estimate
from megabert.planning.search import fit_warning
from megabert.planning.spec import Layout, Workload


class ResolvedRun(Protocol):
    """What the planner reads of a resolved run (megabert.training.resolve.ResolvedRun has
    it): described here, so the planner never imports training, not even for a type."""

    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    data: DataConfig
    batch: BatchLayout
    zero: ZeroPlan

    @property
    def seq_length(self) -> int: ...

    @property
    def precision(self) -> str: ...

    @property
    def dp_size(self) -> int: ...


def run_and_layout(run: "ResolvedRun", device: str = "cuda") -> tuple[Workload, Layout]:
    """The Workload and Layout of a resolved pre-training run: the ZeRO stage and offload
    that will run (from the flags or the DeepSpeed JSON), not the flags alone."""
    m, p, t = run.model, run.parallel, run.train
    pp = p.pipeline_model_parallel_size
    per_chunk = p.num_layers_per_virtual_pipeline_stage
    virtual = m.num_layers // (pp * per_chunk) if per_chunk else 1
    work = Workload(seq_length=run.seq_length, micro_batch_size=t.micro_batch_size,
                    global_batch_size=run.batch.global_batch_size, precision=run.precision,
                    recompute=m.recompute_granularity or "none", mlm_logits_at_masked_only=True,
                    mask_prob=run.data.mask_prob, device=device, overlap_grad_reduce=p.overlap_grad_reduce,
                    overlap_param_gather=p.overlap_param_gather)
    layout = Layout(tp=p.tensor_model_parallel_size, pp=pp, dp=run.dp_size, virtual_stages=virtual,
                    sequence_parallel=m.sequence_parallel and p.tensor_model_parallel_size > 1,
                    zero_stage=run.zero.stage, offload_optimizer=run.zero.offload_optimizer,
                    offload_params=run.zero.offload_params, distributed_optimizer=p.use_distributed_optimizer,
                    first_stage_layers=p.decoder_first_pipeline_num_layers,
                    last_stage_layers=p.decoder_last_pipeline_num_layers)
    return work, layout


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


def resolve_budget(run: "ResolvedRun", device: torch.device, budget_gb: Optional[float]) -> Optional[tuple[float, str]]:
    """(budget in GB, where it came from): `budget_gb`, else --memory-budget-gb, else the
    GPU's total memory; None on the CPU without one (RSS has no fixed ceiling)."""
    if budget_gb is not None:
        return budget_gb, "the caller"
    if run.train.memory_budget_gb is not None:
        return run.train.memory_budget_gb, "--memory-budget-gb"
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 1e9, "the GPU's memory"
    return None


def preflight(run: "ResolvedRun", device: torch.device | str, budget_gb: Optional[float] = None,
              vocab_size: Optional[int] = None) -> Optional[Preflight]:
    """The prediction for this run against its budget, or None when there is no budget.

    `vocab_size`: the tokenizer's, which the model is built with (ModelConfig's default
    otherwise). On the CPU the prediction is peak RSS, offloaded states included."""
    device = torch.device(device)
    budget = resolve_budget(run, device, budget_gb)
    if budget is None:
        return None
    model = run.model if vocab_size is None else dataclasses.replace(run.model, vocab_size=vocab_size)
    work, layout = run_and_layout(run, "cuda" if device.type == "cuda" else "cpu")
    return Preflight(estimate(model, work, layout), *budget)


def log_preflight(run: "ResolvedRun", device: torch.device | str, vocab_size: Optional[int] = None) -> None:
    """Before any model tensor is allocated: the predicted per-rank peak against
    --memory-budget-gb (default the GPU's memory; no check on CPU without the flag). A layout
    that will not fit is named in a warning with the flags that would make it fit, instead of
    an out-of-memory error minutes later; one that fits gets one info line."""
    check = preflight(run, device, vocab_size=vocab_size)
    if check is not None:
        logging.getLogger("megabert").log(logging.INFO if check.fits else logging.WARNING, check.message())


def preflight_warning(run: "ResolvedRun", device: torch.device | str, budget_gb: Optional[float] = None
                      ) -> Optional[str]:
    """fit_warning for this run on this device, None when it fits or there is no budget."""
    check = preflight(run, device, budget_gb)
    return None if check is None or check.fits else check.message()
