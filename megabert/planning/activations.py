"""Activation memory per rank, after Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models" (arXiv:2205.05198), adapted to BERT.

Per transformer layer and micro-batch the paper counts, with 16-bit activations and
1-byte dropout masks, s*b*h*(34 + 5*a*s/h) bytes:
  attention  11 sbh + 5 a s^2 b  (QKV input 2, Q and K 4, V 2, projection input 2,
                                  dropout mask 1; softmax 2, its dropout mask 1 and output 2 per a s^2 b)
  MLP        19 sbh              (input 2, GEMM output 8, GeLU output 8, dropout mask 1; ffn = 4h)
  LayerNorms  4 sbh              (two inputs of 2 each)
We keep the element counts and the element size apart (fp32 activations on a CPU run
are 4 bytes, masks stay 1) and keep ffn free (ffn != 4h is allowed). Tensor parallelism
splits all but the LayerNorm inputs, the two GEMM inputs and the two hidden-size
dropout masks: sbh(10 + 24/t + 5as/(ht)); sequence parallelism splits those too:
sbh(34 + 5as/h)/t. Selective recompute drops the attention-core term (5as^2b);
full recompute keeps only each layer's input (2sbh, /t with SP), and one layer's
activations are rebuilt at a time in backward.

Pipelining: with 1F1B, stage k holds min(pp - k, m) micro-batches in flight (m per
step), so stage 0 holds activations of as many layers as the whole model; the
interleaved schedule multiplies this by 1 + (pp - 1)/(pp V) (Megatron-LM's
theoretical_memory_usage.py uses the same factors). A stage's output is not counted on the
stage that made it: the schedule frees it once sent (schedules.release_storage), and it is
the receiving stage's first layer's input, counted there.
"""
from __future__ import annotations

import math

from megabert.config import ModelConfig
from megabert.planning.spec import Layout, Workload

MASK_BYTES = 1  # torch keeps dropout masks as bool


def layer_activation_bytes(model: ModelConfig, run: Workload, layout: Layout, recompute: str) -> float:
    """Bytes one transformer layer keeps for backward, per micro-batch, on one TP rank."""
    s, b, h, f, a = run.seq_length, run.micro_batch_size, model.hidden_size, model.ffn_hidden_size, \
        model.num_attention_heads
    e, t = run.activation_bytes, layout.tp
    sbh = s * b * h
    replicated_div = t if layout.sequence_parallel else 1
    if recompute == "full":
        return sbh * e / replicated_div
    # LayerNorm inputs (2), QKV and MLP GEMM inputs (2), two hidden-size dropout masks.
    replicated = sbh * (4 * e + 2 * MASK_BYTES) / replicated_div
    # Q, K, V and the projection input (4 sbh), the MLP GEMM output and GeLU output (2 sbf).
    split = (4 * sbh + 2 * s * b * f) * e / t
    core = a * s * s * b * (2 * e + MASK_BYTES) / t  # softmax output, its dropout mask and output
    if recompute == "selective":
        core = 0.0
    return replicated + split + core


def embedding_activation_bytes(model: ModelConfig, run: Workload, layout: Layout) -> float:
    """First stage, per micro-batch: three int64 id tensors, the summed embeddings and the
    LayerNorm output, and the embedding dropout mask (Megatron counts 8sb + sbh in 16 bits)."""
    s, b, h = run.seq_length, run.micro_batch_size, model.hidden_size
    sp = layout.tp if layout.sequence_parallel else 1
    return 3 * 8 * s * b + s * b * h * (2 * run.activation_bytes + MASK_BYTES / sp)


def head_activation_bytes(model: ModelConfig, run: Workload, layout: Layout) -> float:
    """Last stage, one micro-batch: the MLM head's inputs (dense, GeLU, LayerNorm, projection:
    4 n h) and its logits over the vocab slice with the fp32 copies the cross entropy keeps
    (about two), for n predicted tokens (masked ones only on the default fast path)."""
    s, b, h = run.seq_length, run.micro_batch_size, model.hidden_size
    n = math.ceil(run.mask_prob * s) * b if run.mlm_logits_at_masked_only else s * b
    vocab_slice = model.padded_vocab_size(layout.tp) // layout.tp
    gathered = s * b * h * run.activation_bytes if layout.sequence_parallel else 0
    return gathered + 4 * n * h * run.activation_bytes + n * vocab_slice * (run.activation_bytes + 2 * 4)


def in_flight_microbatches(layout: Layout, stage: int, microbatches: int) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak (1F1B warm-up depth),
    times the interleaved schedule's penalty."""
    if layout.pp == 1:
        return 1.0
    depth = min(layout.pp - stage, microbatches)
    if layout.virtual_stages > 1:
        return depth * (1 + (layout.pp - 1) / (layout.pp * layout.virtual_stages))
    return float(depth)


def stage_activation_bytes(model: ModelConfig, run: Workload, layout: Layout, stage: int) -> float:
    """Peak activation bytes of one rank of pipeline stage `stage`."""
    m = run.microbatches(layout.dp)
    flight = in_flight_microbatches(layout, stage, m)
    layers = model.num_layers // layout.pp
    total = layers * flight * layer_activation_bytes(model, run, layout, run.recompute)
    if run.recompute == "full":
        # Backward rebuilds one layer at a time: that layer's whole activations live again.
        total += layer_activation_bytes(model, run, layout, "none")
    if stage == 0:
        total += flight * embedding_activation_bytes(model, run, layout)
    if stage == layout.pp - 1:
        total += head_activation_bytes(model, run, layout)
    return total
