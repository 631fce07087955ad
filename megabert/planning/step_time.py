"""Predicted step time of a layout: compute plus the communication the step cannot hide.

    step = compute + TP + exposed DP + exposed PP + tied-embedding sync

- compute: measured once per layout (e.g. on loopback, where the links cost next to
  nothing) or derived from a sustained FLOP rate (`compute_time`), with the pipeline
  bubble (pp - 1) / (v m + pp - 1) of the step.
- communication time of a group = its bytes per rank per step (`communication()`, the
  estimate bench/comm.py checked within 5%) / the bandwidth of the slowest link it
  crosses. Which groups cross a node boundary follows megabert's rank order
  (megabert.parallel.state: rank = tp_rank + tp (dp_rank + dp pp_rank)): TP ranks are
  adjacent, then DP, then PP; nodes are blocks of `gpus_per_node` consecutive ranks.
  Bandwidth only: no per-message latency (at the bench's sizes it is under 1% of a step).
- TP collectives sit on the critical path: all exposed.
- DP with the overlap (megabert.data_parallel.overlap): n buckets become ready evenly over the
  last micro-batch's backward (taken as 2/3 of its compute) and are reduced one after the
  other, so the reduction ends at max(W + c, W / n + D) for a window W, a bucket's time c
  and the whole reduction D: exposed = max(c, D - W (1 - 1/n)), never less than the last
  bucket and never more than D. Without the overlap all of D is exposed.
- PP (1F1B): a stage's sends overlap its next micro-batch, except on the fill and drain,
  where the critical path crosses each of the pp - 1 boundaries once forward and once
  backward: exposed = min(all sends, 2 (pp - 1) boundary transfers).
- The tied-embedding sync (first and last stage) runs after backward: exposed.
- ZeRO (DeepSpeed): its reduce-scatters and all-gathers are all exposed; DeepSpeed's own
  `overlap_comm` is not modelled, so ZeRO step times are upper bounds. Offload's host
  copies and CPU optimizer time are not counted.

Assumptions the bench does not test: one NIC per GPU at `inter_gbit` (no sharing of a
node's links between groups), collectives at the ring bound, compute that does not slow
down while communication runs (on the bench's 2 CPU cores gloo's threads do take cycles
from it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megabert.config import BUCKET_ELEMENTS, ModelConfig
from megabert.errors import ConfigError
from megabert.families import encoder_spec
from megabert.parallel.state import rank_of
from megabert.planning.communication import CommEstimate, communication
from megabert.planning.params import stage_params
from megabert.planning.flops import bert_flops_per_sample
from megabert.planning.spec import Layout, Workload

BACKWARD_SHARE = 2.0 / 3.0
"""Backward's share of a micro-batch's compute (it does twice forward's matmul FLOPs)."""


@dataclass(frozen=True, kw_only=True)
class Links:
    """The machines: ranks per node and the bandwidth within and between nodes."""

    gpus_per_node: int
    """Consecutive ranks per node (--nproc-per-node)."""
    intra_gbit: float
    """Gbit/s a rank reaches to a rank of its own node (NVLink, or loopback on the bench)."""
    inter_gbit: float
    """Gbit/s a rank reaches to another node (its NIC; one per GPU assumed)."""

    def __post_init__(self):
        if self.gpus_per_node < 1:
            raise ConfigError(f"--nproc-per-node must be >= 1, got {self.gpus_per_node}")
        if self.intra_gbit <= 0 or self.inter_gbit <= 0:
            raise ConfigError(f"bandwidths must be positive, got {self.intra_gbit} and {self.inter_gbit} Gbit/s")


def crosses_nodes(layout: Layout, gpus_per_node: int) -> dict[str, bool]:
    """Whether some group of each axis ("tp", "dp", "pp") spans two nodes, for megabert's
    rank order rank = tp_rank + tp (dp_rank + dp pp_rank)."""
    tp, dp, pp = layout.tp, layout.dp, layout.pp
    node = lambda t, d, p: rank_of(t, d, p, tp, dp) // gpus_per_node  # noqa: E731
    out = {"tp": False, "dp": False, "pp": False}
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                here = node(t, d, p)
                out["tp"] |= node(0, d, p) != here
                out["dp"] |= node(t, 0, p) != here
                out["pp"] |= node(t, d, 0) != here
    return out


@dataclass(frozen=True)
class StepTime:
    """A predicted step, in seconds; the *_s communication fields are what each kind costs
    alone, `exposed_s` what the step waits for."""

    layout: Layout
    compute_s: float
    tp_s: float
    dp_s: float
    pp_s: float
    embedding_s: float
    exposed_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.exposed_s

    @property
    def comm_s(self) -> float:
        return self.tp_s + self.dp_s + self.pp_s + self.embedding_s

    @property
    def hidden_s(self) -> float:
        return self.comm_s - self.exposed_s

    @property
    def comm_share(self) -> float:
        """Share of the step spent waiting on communication."""
        return self.exposed_s / self.total_s if self.total_s else 0.0


def dp_exposed(dp_s: float, window_s: float, buckets: int) -> float:
    """Exposed time of a bucketed reduction of `dp_s` seconds whose buckets become ready
    evenly over `window_s` of backward and go one after the other (module docstring)."""
    buckets = max(1, buckets)
    return max(dp_s / buckets, dp_s - window_s * (1.0 - 1.0 / buckets))


def _seconds(nbytes: float, gbit: float) -> float:
    return nbytes * 8.0 / (gbit * 1e9)


def step_time(model: ModelConfig, run: Workload, layout: Layout, links: Links, compute_s: float, *,
              bucket_elements: int = BUCKET_ELEMENTS, comm: CommEstimate | None = None) -> StepTime:
    """The predicted step of `layout` given its compute time (bubble included); the DP
    reduction overlaps backward when `run.overlap_grad_reduce` (--overlap-grad-reduce)."""
    if compute_s < 0:
        raise ConfigError(f"compute time must be >= 0 s, got {compute_s}")
    comm = comm or communication(model, run, layout)
    cross = crosses_nodes(layout, links.gpus_per_node)
    bw = {axis: links.inter_gbit if cross[axis] else links.intra_gbit for axis in cross}
    tp_s = _seconds(comm.tensor_parallel, bw["tp"])
    dp_s = _seconds(comm.data_parallel, bw["dp"])
    pp_s = _seconds(comm.pipeline_parallel, bw["pp"])
    emb_s = _seconds(comm.embedding_sync, bw["pp"])

    m = run.microbatches(layout.dp)
    exposed = tp_s + emb_s
    if layout.distributed_optimizer and layout.dp > 1:
        # Reduce-scatter (half the ring's bytes) in the last micro-batch's backward, the
        # parameters' all-gather (the other half) in the first micro-batch's forward.
        params = max(stage_params(model, layout.tp, layout.pp, k, len(layout.stage(model, k).layer_ids)).total
                     for k in range(layout.pp))
        per_micro = compute_s * (1.0 - bubble(layout, m)) / m
        buckets = math.ceil(params / bucket_elements)
        exposed += dp_exposed(dp_s / 2, BACKWARD_SHARE * per_micro, buckets)
        exposed += (dp_exposed(dp_s / 2, (1.0 - BACKWARD_SHARE) * per_micro, buckets) if run.overlap_param_gather
                    else dp_s / 2)
    elif run.overlap_grad_reduce and layout.zero_stage == 0 and layout.dp > 1:
        # The busiest stage's parameters, in buckets of bucket_elements; the window is the
        # last micro-batch's backward on that stage.
        params = max(stage_params(model, layout.tp, layout.pp, k, len(layout.stage(model, k).layer_ids)).total
                     for k in range(layout.pp))
        per_micro = compute_s * (1.0 - bubble(layout, m)) / m
        exposed += dp_exposed(dp_s, BACKWARD_SHARE * per_micro, math.ceil(params / bucket_elements))
    else:
        exposed += dp_s
    if layout.pp > 1:
        # The busiest stage's sends (communication.py): a middle stage sends both ways.
        sends = m * (2 * layout.virtual_stages - (1 if layout.pp == 2 else 0))
        exposed += min(pp_s, 2 * (layout.pp - 1) * pp_s / sends)
    return StepTime(layout=layout, compute_s=compute_s, tp_s=tp_s, dp_s=dp_s, pp_s=pp_s, embedding_s=emb_s,
                    exposed_s=exposed)


def bubble(layout: Layout, microbatches: int) -> float:
    """Share of a 1F1B step a stage idles: (pp - 1) / (v m + pp - 1) (Narayanan et al. 2021)."""
    pp, v = layout.pp, layout.virtual_stages
    return (pp - 1) / (v * microbatches + pp - 1) if pp > 1 else 0.0


def step_flops(model: ModelConfig, run: Workload, layout: Layout) -> float:
    """FLOPs of one rank's step, forward and backward, without recompute: Narayanan et
    al. 2021's 72 B s L h^2 (1 + s / 6h + V / 12hL) for the B samples of one DP rank,
    divided over tp x pp."""
    s, h, L, V = run.seq_length, model.hidden_size, model.num_layers, model.vocab_size
    B = run.micro_batch_size * run.microbatches(layout.dp)
    spec = encoder_spec(model)
    if spec.mlp.kind != "plain" or spec.attention.gqa or spec.attention.half_window or spec.mlm_head.width:
        # Outside the closed form's encoder (plain MLP, full attention over every head):
        # the per-sample count.
        return B * _sample_flops(model, run) / (layout.tp * layout.pp)
    flops = 72.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    return flops / (layout.tp * layout.pp)


def _sample_flops(model: ModelConfig, run: Workload) -> float:
    """One sample's FLOPs (megabert.planning.flops), the MLM head at the predicted
    tokens only on pretrain_bert.py's default path."""
    predicted = math.ceil(run.mask_prob * run.seq_length) if run.mlm_logits_at_masked_only else None
    return bert_flops_per_sample(model, run.seq_length, predicted)


def compute_time(model: ModelConfig, run: Workload, layout: Layout, flops_per_s: float) -> float:
    """Compute seconds of a step at a sustained `flops_per_s`, the pipeline bubble added.
    Full recompute runs every forward twice (4/3 of the FLOPs); selective recompute's
    attention core is left out (a few percent at seq 128-512)."""
    if flops_per_s <= 0:
        raise ConfigError(f"--tflops must be positive, got {flops_per_s / 1e12:g}")
    busy = step_flops(model, run, layout) / flops_per_s
    if run.recompute == "full":
        busy *= 4.0 / 3.0
    return busy / (1.0 - bubble(layout, run.microbatches(layout.dp)))
