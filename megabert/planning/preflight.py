"""The planner from a run's own configs: what pretrain_bert.py can call before it builds
the model, to warn (one line, flags named) when the layout will not fit the device.

    warning = preflight_warning(configs, dp_size=ps.dp_size, device=ps.device)
    if warning: logger.warning(warning)
"""
from __future__ import annotations

from typing import Optional

import torch

from megabert.config import Configs
from megabert.planning.memory import estimate
from megabert.planning.search import fit_warning
from megabert.planning.spec import Layout, RunSpec


def run_and_layout(configs: Configs, dp_size: int, device: str = "cuda") -> tuple[RunSpec, Layout]:
    """The RunSpec and Layout that pretrain_bert.py's configs describe."""
    m, p, t = configs.model, configs.parallel, configs.train
    precision = "bf16" if t.bf16 else "fp16" if t.fp16 else "fp32"
    pp = p.pipeline_model_parallel_size
    per_chunk = p.num_layers_per_virtual_pipeline_stage
    virtual = m.num_layers // (pp * per_chunk) if per_chunk else 1
    run = RunSpec(seq_length=configs.data.seq_length, micro_batch_size=t.micro_batch_size,
                  global_batch_size=t.global_batch_size, precision=precision,
                  recompute=m.recompute_granularity or "none", mlm_logits_at_masked_only=True,
                  mask_prob=configs.data.mask_prob, device=device)
    zero_stage = t.zero_stage if t.deepspeed else 0
    # NOTE: --zero-offload-optimizer / --zero-offload-params come with another change; read
    # them when TrainConfig has them (field names as the flags), else no offload.
    offload_optimizer = zero_stage > 0 and getattr(t, "zero_offload_optimizer", None) == "cpu"
    offload_params = zero_stage == 3 and getattr(t, "zero_offload_params", None) == "cpu"
    layout = Layout(tp=p.tensor_model_parallel_size, pp=pp, dp=dp_size, virtual_stages=virtual,
                    sequence_parallel=m.sequence_parallel and p.tensor_model_parallel_size > 1,
                    zero_stage=zero_stage, offload_optimizer=offload_optimizer, offload_params=offload_params)
    return run, layout


def preflight_warning(configs: Configs, dp_size: int, device: torch.device | str,
                      budget_gb: Optional[float] = None) -> Optional[str]:
    """fit_warning for this run on this device: the GPU's total memory unless `budget_gb`
    says otherwise; None on the CPU without a budget (RSS has no fixed ceiling)."""
    device = torch.device(device)
    kind = "cuda" if device.type == "cuda" else "cpu"
    if budget_gb is None:
        if kind == "cpu":
            return None
        budget_gb = torch.cuda.get_device_properties(device).total_memory / 1e9
    run, layout = run_and_layout(configs, dp_size, kind)
    return fit_warning(estimate(configs.model, run, layout), budget_gb)
