"""Every layout of a device count that fits a memory budget, ranked by communication or,
given the machines (links and a sustained FLOP rate), by predicted step time.

Ranking: predicted step time when known, else bytes per rank per step (less first); ties
go to fewer model-parallel ranks (tp x pp: less that can go wrong, larger DP), then to
less memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Optional

from megabert.config import ModelConfig
from megabert.errors import ConfigError
from megabert.planning.communication import CommEstimate, communication
from megabert.planning.memory import MemoryEstimate, estimate
from megabert.planning.spec import Layout, Workload
from megabert.planning.step_time import Links, StepTime, compute_time, step_time


@dataclass(frozen=True)
class Candidate:
    """One layout that fits, with its predictions."""

    layout: Layout
    memory: MemoryEstimate
    comm: CommEstimate
    step: Optional[StepTime] = None
    """Predicted step time; None when plan() was given no machines."""


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(model: ModelConfig, run: Workload, devices: int, *, max_tp: int = 8,
                      allow_offload: bool = False, zero_stages: Iterable[int] = (0, 1, 2, 3),
                      distributed_optimizer: bool = True) -> list[Layout]:
    """Every layout of `devices` ranks the model and the batch allow. TP stays within
    `max_tp` (one node's fast interconnect); sequence parallelism is tried with TP > 1;
    interleaving with 2 and 4 chunks where the layers divide, an uneven last stage where they
    do not; megabert's own trainer with and without --use-distributed-optimizer at DP > 1."""
    if devices < 1:
        raise ConfigError(f"--devices must be >= 1, got {devices}")
    zero_stages = tuple(zero_stages)
    out = []
    for tp in _divisors(devices):
        if tp > max_tp or model.num_attention_heads % tp or model.ffn_hidden_size % tp:
            continue
        for pp in _divisors(devices // tp):
            last = None
            if model.num_layers % pp:
                # Uneven stages (--decoder-last-pipeline-num-layers): the first stages take
                # ceil(layers / pp) each, the last the rest (22 layers at PP=4: 6, 6, 6, 4).
                last = model.num_layers - (pp - 1) * math.ceil(model.num_layers / pp)
                if last < 1:
                    continue
            dp = devices // (tp * pp)
            if run.global_batch_size is not None and run.global_batch_size % (run.micro_batch_size * dp):
                continue
            vs = [1] + [v for v in (2, 4) if pp > 1 and last is None and (model.num_layers // pp) % v == 0]
            for v in vs:
                for sp in ((False, True) if tp > 1 else (False,)):
                    for z in zero_stages:
                        if dp == 1 and z > 0:
                            continue  # ZeRO partitions over DP: nothing to gain on one rank
                        offloads = [(False, False, False)]
                        if z == 0 and dp > 1 and distributed_optimizer:
                            offloads.append((False, False, True))  # --use-distributed-optimizer
                        if allow_offload and z >= 1:
                            offloads.append((True, False, False))
                            if z == 3:
                                offloads.append((True, True, False))
                        for oo, op, do in offloads:
                            try:  # megabert.rules decides what combines (ZeRO-2/3 with PP, SP with ZeRO)
                                out.append(Layout(tp=tp, pp=pp, dp=dp, virtual_stages=v, sequence_parallel=sp,
                                                  zero_stage=z, offload_optimizer=oo, offload_params=op,
                                                  distributed_optimizer=do, last_stage_layers=last))
                            except ConfigError:
                                continue
    return out


def plan(model: ModelConfig, run: Workload, devices: int, budget_gb: float, *, max_tp: int = 8,
         allow_offload: bool = False, links: Optional[Links] = None,
         flops_per_s: Optional[float] = None) -> list[Candidate]:
    """The layouts of `devices` ranks whose predicted peak fits `budget_gb` per device,
    best first: the shortest predicted step when `links` and `flops_per_s` (sustained per
    device) are given, else the least communication; then fewer model-parallel ranks; then
    less memory."""
    if budget_gb <= 0:
        raise ConfigError(f"--memory-gb must be positive, got {budget_gb}")
    if (links is None) != (flops_per_s is None):
        raise ConfigError("a step-time plan needs both the links and the FLOP rate (--tflops)")
    fits = []
    for layout in candidate_layouts(model, run, devices, max_tp=max_tp, allow_offload=allow_offload):
        mem = estimate(model, run, layout)
        if mem.total_gb <= budget_gb:
            comm = communication(model, run, layout)
            step = None
            if links is not None:
                step = step_time(model, run, layout, links, compute_time(model, run, layout, flops_per_s), comm=comm)
            fits.append(Candidate(layout, mem, comm, step))
    fits.sort(key=lambda c: (c.step.total_s if c.step else 0.0, c.comm.total, c.layout.model_parallel_size,
                             c.memory.total_gb, c.layout.pp))
    return fits


def _state_fixes(lay: Layout) -> list[tuple[str, Layout]]:
    """Layouts that may hold less model state than `lay`, with the flags that give them:
    more ZeRO on the same ranks (ZeRO-3 on two when there is one), ZeRO-3 with CPU offload
    (on one process too: ZeRO-Offload), twice the tensor or pipeline ranks. DeepSpeed does
    not combine with --sequence-parallel, so a layout that uses it gets no ZeRO change."""
    out = []
    zero_ok = not lay.sequence_parallel
    if lay.dp > 1 and lay.zero_stage == 0 and not lay.distributed_optimizer:
        out.append(("--use-distributed-optimizer", replace(lay, distributed_optimizer=True)))
    if zero_ok and lay.dp > 1 and lay.zero_stage < 3 and lay.pp == 1:
        out.append((f"--deepspeed --zero-stage {lay.zero_stage + 1}", replace(lay, zero_stage=lay.zero_stage + 1,
                                                                                 distributed_optimizer=False)))
    elif zero_ok and lay.dp > 1 and lay.zero_stage == 0:
        out.append(("--deepspeed --zero-stage 1", replace(lay, zero_stage=1, distributed_optimizer=False)))
    elif zero_ok and lay.dp == 1 and lay.pp == 1:
        out.append(("--deepspeed --zero-stage 3", replace(lay, dp=2, zero_stage=3)))
    if zero_ok and lay.pp == 1 and not lay.offload_params:
        out.append(("--deepspeed --zero-stage 3 --zero-offload-optimizer cpu --zero-offload-params cpu",
                    replace(lay, zero_stage=3, offload_optimizer=True, offload_params=True,
                                distributed_optimizer=False)))
    elif lay.zero_stage and not lay.offload_optimizer:
        out.append(("--zero-offload-optimizer cpu", replace(lay, offload_optimizer=True)))
    out.append((f"--tensor-model-parallel-size {2 * lay.tp}", replace(lay, tp=2 * lay.tp)))
    if lay.zero_stage <= 1:  # ZeRO-2/3 do not combine with pipelining
        out.append((f"--pipeline-model-parallel-size {2 * lay.pp}", replace(lay, pp=2 * lay.pp)))
    return out


def _smaller(est: MemoryEstimate, budget_gb: float) -> list[str]:
    """The state fixes predicted to lower the peak, lowest first, each as
    "flags (X GB[ on N ranks][, fits])"; ones the model does not divide for are left out."""
    found = []
    for flags, layout in _state_fixes(est.layout):
        try:
            total = estimate(est.model, est.run, layout).total_gb
        except ConfigError:
            continue
        if total < est.total_gb:
            ranks = f" on {layout.world_size} ranks" if layout.world_size != est.layout.world_size else ""
            found.append((total, f"{flags} ({total:.2f} GB{ranks}{', fits' if total <= budget_gb else ''})"))
    return [text for _, text in sorted(found)]


def fit_warning(est: MemoryEstimate, budget_gb: float) -> Optional[str]:
    """None when the estimate fits; else one line naming the largest parts and the flags
    that shrink them, each state fix with its predicted peak, lowest first (the trainer
    prints it before a run that would run out of memory)."""
    if est.total_gb <= budget_gb:
        return None
    lay = est.layout
    parts = sorted(((v, k) for k, v in est.breakdown().items() if k != "host (offloaded)"), reverse=True)
    largest = ", ".join(f"{k} {v:.2f}" for v, k in parts[:3])
    states = est.parameters_gb + est.gradients_gb + est.optimizer_gb
    if states >= est.activations_gb:
        fixes = _smaller(est, budget_gb) or ["more ranks: no layout change of this one is predicted to hold less"]
    else:
        fixes = ["--recompute-granularity selective or full"]
        if lay.tp > 1 and not lay.sequence_parallel:
            fixes.append("--sequence-parallel")
        fixes.append("a smaller --micro-batch-size")
    return (f"predicted peak {est.total_gb:.2f} GB per rank exceeds the {budget_gb:g} GB budget "
            f"({lay.short()}; largest: {largest} GB); try {'; or '.join(fixes)}")
