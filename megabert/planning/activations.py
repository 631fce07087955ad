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

ModernBERT (megabert.model.modernbert) keeps no s^2 term: its global layers' core is a
flash/varlen kernel (q, k, v, the output and a log-sum-exp per head and token), and so is its
local layers' with the unpadded encoder (the kernel's sliding window: the CPU kernel's, or
FlashAttention's window_size); padded, a local core runs by blocks of the window
(local_attention.py: query blocks of B = w, key tiles of B + 2w, w = local_attention / 2).
Every layer is linear in s. Per token of one
layer (elements of e bytes unless said; t = TP, heads n, GeGLU width f):
  replicated    4h         attention and MLP norm inputs, Wqkv and Wi inputs (/t with SP),
                           + 16 bytes: the two norms' fp32 mean and rstd
  global core   4h/t       rotated q, k, v (3h) and the output, Wo's input (h) + 4n/t bytes
  local core    unpadded: the global core's; padded: (h + 2h(B+2w)/B + h)/t + n(B+2w)/t
                           q, the key and value tiles, Wo's input, the tiles' probabilities
                           + (B+2w) bytes of the window mask (one per row, shared by heads)
  GeGLU MLP     4f/t       Wi's output ([input; gate], 2f), GELU(input) (f), Wo's input (f);
                3f/t       with megabert's CPU kernel (ops.gated_activation, the CPU's default
                           epilogue backend): it keeps only Wi's output, not GELU(input)
Dropout masks only where ModernBERT's dropouts are set (none by default). Selective
recompute keeps the core's input (the rotated q, k, v) and its output: 4h/t either kind.
Measured against the saved tensors of megabert's layers in tests/test_planning_modernbert.py.
"""
from __future__ import annotations

import math
from typing import Optional

from megabert.config import ModelConfig
from megabert.families import encoder_spec
from megabert.ops.gated_activation import runs_fused
from megabert.planning.spec import Layout, Workload

MASK_BYTES = 1  # torch keeps dropout masks as bool
NORM_STATS_BYTES = 8  # a LayerNorm keeps its fp32 mean and rstd per token


def _kernel_accounting(model: ModelConfig) -> bool:
    """Whether the layers are counted as ModernBERT's (linear in s, a gated MLP; measured in
    tests/test_planning_modernbert.py): the RoPE families, which run megabert's attention on
    the varlen and windowed kernels. The learned-position families keep Korthikanti's count
    (a dense core; measured against BERT's)."""
    return encoder_spec(model).attention.rope


def modernbert_layer_bytes(model: ModelConfig, run: Workload, layout: Layout, recompute: str,
                           is_global: bool, rows: Optional[int] = None) -> float:
    """Bytes one layer of a RoPE family (global, or within the spec's sliding window) keeps for
    backward, per micro-batch, on one TP rank, for rows with no padding (see the module
    docstring). `rows`: tokens the layer computes past its attention core (the model's last
    layer, on pretrain_bert.py's fast path, only the masked ones); None: all."""
    spec = encoder_spec(model)
    s, b, h, f, n = (run.seq_length, run.micro_batch_size, model.hidden_size, model.ffn_hidden_size,
                     model.num_attention_heads)
    e, t = run.activation_bytes, layout.tp
    tokens = s * b
    rows = tokens if rows is None else rows
    replicated_div = t if layout.sequence_parallel else 1
    if recompute == "full":
        return tokens * h * e / replicated_div
    # Before the core, every token: the attention norm's input and Wqkv's (+ the norm's fp32
    # mean and rstd); after it, each row: the MLP norm's and Wi's inputs, the GeGLU's 4f (3f
    # with the CPU kernel).
    glu = 3 if runs_fused(spec.mlp.activation, model.dropout_add_backend, run.device) else 4
    before = tokens * (2 * h * e + NORM_STATS_BYTES) / replicated_div
    after = rows * (2 * h * e + NORM_STATS_BYTES) / replicated_div + rows * glu * f * e / t
    if spec.residual_dropout[0] > 0:  # the attention output's dropout (replicated)
        after += rows * h * MASK_BYTES / replicated_div
    if spec.mlp.dropout > 0:
        after += rows * f * MASK_BYTES / t
    # Wo's input: the core's output, kept by the kernel anyway unless only some rows go on.
    wo_input = rows * h * e / t
    if recompute == "selective":  # the core's input (rotated q, k, v) stays for the replay
        return before + tokens * 3 * h * e / t + wo_input + after
    if is_global or model.unpad_input:
        # q, k, v and the output, the kernel's fp32 log-sum-exp per head; its dropout is
        # redrawn in backward (no mask). A local layer of the unpadded encoder runs the same
        # kernel with its window.
        core = tokens * (4 * h * e + 4 * n) / t + (wo_input if rows < tokens else 0.0)
        return before + core + after
    w = max(spec.attention.half_window.values())
    block = max(w, 8)  # megabert.model.local_attention.block_size
    span = block + 2 * w
    core = tokens * ((h + 2 * h * span / block) * e + n * span * e) / t + tokens * span * MASK_BYTES
    if spec.attention.dropout > 0:
        core += tokens * n * span * MASK_BYTES / t
    return before + core + wo_input + after


def stage_layer_ids(model: ModelConfig, layout: Layout, stage: int) -> list[int]:
    """The layers one rank of pipeline stage `stage` holds (interleaved: chunk c holds the
    (c x pp + stage)-th run of layers/(pp x V) layers, as megabert.parallel.layout splits them)."""
    return layout.stage(model, stage).layer_ids


def stage_layers_bytes(model: ModelConfig, run: Workload, layout: Layout, stage: int, recompute: str) -> float:
    """Bytes the layers of stage `stage` keep for one micro-batch (ModernBERT: each layer as
    global or local)."""
    layers = stage_layer_ids(model, layout, stage)
    if not _kernel_accounting(model):
        return len(layers) * layer_activation_bytes(model, run, layout, recompute)
    # The model's last layer goes on past its core at the predicted rows only (the unpadded
    # encoder's head_positions, pretrain_bert.py's default).
    last = model.num_layers - 1
    rows = (math.ceil(run.mask_prob * run.seq_length) * run.micro_batch_size
            if run.mlm_logits_at_masked_only and not layout.sequence_parallel else None)
    attention = encoder_spec(model).attention
    return sum(modernbert_layer_bytes(model, run, layout, recompute, attention.window(i) is None,
                                      rows if i == last else None) for i in layers)


def layer_activation_bytes(model: ModelConfig, run: Workload, layout: Layout, recompute: str) -> float:
    """Bytes one transformer layer keeps for backward, per micro-batch, on one TP rank
    (ModernBERT: its larger kind, the local layers' with their window tiles)."""
    if _kernel_accounting(model):
        attention = encoder_spec(model).attention
        kinds = {attention.window(i) is None for i in range(model.num_layers)}
        return max(modernbert_layer_bytes(model, run, layout, recompute, g) for g in kinds)
    s, b, h, f, a = (run.seq_length, run.micro_batch_size, model.hidden_size, model.ffn_hidden_size,
                     model.num_attention_heads)
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
    LayerNorm output, and the embedding dropout mask (Megatron counts 8sb + sbh in 16 bits).
    ModernBERT: the ids; its norm's input stands in for layer 0's attention-norm input, which
    layer 0 lacks but modernbert_layer_bytes counts."""
    s, b, h = run.seq_length, run.micro_batch_size, model.hidden_size
    if _kernel_accounting(model):
        return 8 * s * b
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
    total = flight * stage_layers_bytes(model, run, layout, stage, run.recompute)
    bases = len(set(encoder_spec(model).attention.rope_theta.values()))
    if bases:
        # Each chunk's RoPE tables (cos and sin of each base, [s, b, head_dim]) live while its
        # micro-batch's activations do.
        total += (flight * layout.virtual_stages * 2 * bases * run.seq_length * run.micro_batch_size
                  * model.head_dim * run.activation_bytes)
    if run.recompute == "full":
        # Backward rebuilds one layer at a time: that layer's whole activations live again.
        total += layer_activation_bytes(model, run, layout, "none")
    if stage == 0:
        total += flight * embedding_activation_bytes(model, run, layout)
    if stage == layout.pp - 1:
        total += head_activation_bytes(model, run, layout)
    return total
