"""Bytes each rank sends per optimizer step, by kind of traffic.

Ring collectives over n ranks move, per rank, 2(n-1)/n of the buffer for an all-reduce
and (n-1)/n for a reduce-scatter or an all-gather (the bandwidth-optimal bound NCCL and
gloo's ring reach). Per micro-batch and transformer layer, tensor parallelism makes four
collectives on [s, b, h] activations: the f/g pairs of the Megatron paper, an all-reduce
after attention and after the MLP in forward, and one before each in backward; with
sequence parallelism each all-reduce becomes a reduce-scatter plus an all-gather (same
volume). Full recompute repeats the forward's two. The first stage adds the vocab-parallel
embedding's all-reduce, the last the MLM head's backward all-reduce. Sequence parallelism
adds, per micro-batch, an all-gather of [s, b, h] on each end of the model (the split
embeddings' gradient on the first stage, the encoder's output gathered for the heads on the
last) and, per step, the sum over TP of the gradients of the parameters it splits the work
of (LayerNorms and row-parallel biases, 6h per layer). The planner had left both out:
13% of TP2+SP's traffic on the 2-layer model of tests/test_comm_ledger.py.

Pipeline stages send the activation forward and its gradient back for every micro-batch
and model chunk, except the model's output (last stage, last chunk: it goes to the loss)
and its input's gradient (first stage, first chunk: the embeddings); a receive sends
nothing. So with two stages each sends one [s, b, h] per micro-batch, not two (the
communication ledger, megabert.parallel.comm, measured half of what the planner had said:
it counted both directions on every stage). Stages exchange bf16 under bf16 and fp32
otherwise, fp16 included (megabert.pipeline_parallel.p2p).

Data parallelism all-reduces fp32 gradients once per step (megabert's trainer); the
distributed optimizer (--use-distributed-optimizer) reduce-scatters them and all-gathers
the parameters: the same bytes. DeepSpeed (0.19) by default reduces ZeRO-1/2 gradients
with an all-reduce of each bucket, not the reduce-scatter of the ZeRO paper (its
`use_multi_rank_bucket_allreduce`: one all-reduce instead of a reduce per owning rank),
which measured 1.5x (ZeRO-1) and 1.67x (ZeRO-2, two micro-batches) a reduce-scatter's
figures; megabert's DeepSpeed config turns it off where the version has the key
(megabert.training.deepspeed.ds_config.ring_volume_settings), so ZeRO-1 sends a ring
all-reduce's bytes (reduce-scatter once per step + the parameters' all-gather) and ZeRO-2
a reduce-scatter in each micro-batch's backward + the all-gather. ZeRO-3 reduce-scatters gradients in every
backward and all-gathers the partitioned parameters for every forward and again for every
backward, but for what backward does not read (the embedding tables and the MLM bias:
_not_read_by_backward), then all-gathers its unpartitioned small parameters after the
step. The planner had counted two full gathers per micro-batch (the ZeRO paper's 3 Psi):
1.37x the measured on a small BERT whose word embeddings are most of the model.

Offload adds host <-> device copies (PCIe, not network), reported apart and counted in the
total because they take step time too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megabert.config import ModelConfig
from megabert.data_parallel.zero_plan import ZeroBuckets
from megabert.families import encoder_spec
from megabert.planning.params import embedding_tables, embedding_tensors, stage_params
from megabert.planning.spec import Layout, Workload


def all_reduce_bytes(size: float, n: int) -> float:
    return 2.0 * (n - 1) / n * size if n > 1 else 0.0


def gather_bytes(size: float, n: int) -> float:
    """A reduce-scatter or an all-gather."""
    return (n - 1) / n * size if n > 1 else 0.0


@dataclass(frozen=True)
class CommEstimate:
    """Bytes one rank (the busiest pipeline stage) sends per optimizer step."""

    layout: Layout
    tensor_parallel: float
    pipeline_parallel: float
    data_parallel: float
    """Gradient all-reduce (ZeRO 0) or ZeRO's reduce-scatters and all-gathers."""
    embedding_sync: float
    """Tied word-embedding gradient all-reduce between the first and last stage."""
    offload: float
    """Host <-> device copies of offloaded states (PCIe)."""

    @property
    def total(self) -> float:
        return self.tensor_parallel + self.pipeline_parallel + self.data_parallel + self.embedding_sync + self.offload

    def breakdown(self) -> dict[str, float]:
        return {"tensor parallel": self.tensor_parallel, "pipeline": self.pipeline_parallel,
                "data parallel / ZeRO": self.data_parallel, "tied embeddings": self.embedding_sync,
                "offload (PCIe)": self.offload}


def communication(model: ModelConfig, run: Workload, layout: Layout) -> CommEstimate:
    """Per-step bytes sent by one rank of the busiest stage (the maximum over stages)."""
    layout.check_model(model)
    return max((_stage_comm(model, run, layout, k) for k in range(layout.pp)), key=lambda c: c.total)


def _not_read_by_backward(model: ModelConfig, tp: int, pp: int, stage: int) -> list[int]:
    """Partitionable tensors that ZeRO-3 does not gather again for backward: the embedding
    tables (an embedding's gradient is a scatter-add of its output's; the table is not read)
    and the MLM output bias (a bias's gradient is a sum; the only vocab-sized one)."""
    out = embedding_tensors(model, tp)[:embedding_tables(model)] if stage == 0 else []
    if stage == pp - 1 and encoder_spec(model).mlm_head.decoder_bias:
        out.append(model.padded_vocab_size(tp) // tp)
    return out


def _stage_comm(model: ModelConfig, run: Workload, layout: Layout, stage: int) -> CommEstimate:
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    m = run.microbatches(dp)
    e = run.activation_bytes
    s, b, h = run.seq_length, run.micro_batch_size, model.hidden_size
    act = s * b * h * e  # one [s, b, h] activation

    layers = len(layout.stage(model, stage).layer_ids)
    per_layer = 4 + (2 if run.recompute == "full" else 0)
    collectives = layers * per_layer
    if stage == 0:
        collectives += 1  # vocab-parallel embedding: forward all-reduce
    tp_bytes = m * collectives * all_reduce_bytes(act, tp)
    if stage == pp - 1:
        n = math.ceil(run.mask_prob * s) * b if run.mlm_logits_at_masked_only else s * b
        tp_bytes += m * all_reduce_bytes(n * h * e, tp)  # MLM head input's gradient (copy_to_tp backward)
    if layout.sequence_parallel:
        ends = (stage == 0) + (stage == pp - 1)
        tp_bytes += m * ends * gather_bytes(act, tp)
        sp_params = layers * 6 * h + (2 * h if stage == pp - 1 and model.layernorm_position == "pre" else 0)
        tp_bytes += all_reduce_bytes(4.0 * sp_params, tp)  # fp32 gradients, once per step (training.grads)

    pp_bytes = 0.0
    if pp > 1:
        p2p_bytes = 2 if run.precision == "bf16" else 4  # megabert.pipeline_parallel.pipeline_dtype
        boundary = s * b * h * p2p_bytes / (tp if layout.sequence_parallel else 1)
        # Every chunk sends its output forward and its input gradient back, but for the
        # model's last output (last stage) and the model's input (first stage).
        v = layout.virtual_stages
        sends = 2 * v - (stage == 0) - (stage == pp - 1)
        pp_bytes = m * sends * boundary

    sp = stage_params(model, tp, pp, stage, layers)
    P = sp.total
    p = 2.0 if (layout.zero_stage and run.precision != "fp32") else 4.0  # DeepSpeed's 16-bit params/grads
    if layout.zero_stage == 0:
        dp_bytes = all_reduce_bytes(4.0 * P, dp)
    elif layout.zero_stage == 1:  # reduce-scatter once per step + all-gather (see the docstring)
        dp_bytes = gather_bytes(p * P, dp) + gather_bytes(p * P, dp)
    elif layout.zero_stage == 2:
        dp_bytes = m * gather_bytes(p * P, dp) + gather_bytes(p * P, dp)
    else:
        threshold = ZeroBuckets.for_hidden_size(h).param_persistence_threshold
        persistent = sp.below(threshold)
        partitioned = P - persistent
        unread = sum(n for n in _not_read_by_backward(model, tp, pp, stage) if n >= threshold)
        dp_bytes = m * (gather_bytes(p * P, dp) + gather_bytes(p * partitioned, dp)
                        + gather_bytes(p * (partitioned - unread), dp)) + gather_bytes(p * persistent, dp)

    emb = all_reduce_bytes(4.0 * sp.tied_embedding, 2) if sp.tied_embedding else 0.0
    if pp > 1 and stage == 0:
        emb = all_reduce_bytes(4.0 * model.padded_vocab_size(tp) // tp * h, 2)

    offload = 0.0
    shard = P / dp
    if layout.offload_optimizer:
        offload += 4.0 * shard + p * shard  # fp32 gradient partition down, updated params back up
    if layout.offload_params:
        offload += m * 2 * p * shard  # partitions fetched for forward and for backward
    return CommEstimate(layout=layout, tensor_parallel=tp_bytes, pipeline_parallel=pp_bytes, data_parallel=dp_bytes,
                        embedding_sync=emb, offload=offload)
