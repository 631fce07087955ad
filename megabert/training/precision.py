"""Mixed precision: autocast contexts and bf16 GEMM weights with fp32 masters (fp16's dynamic
loss scaling is the optimizer step's: megabert.optim.grad_scaler).

Parameters and optimizer state stay fp32 (the master copy); matmuls run in bf16 or
fp16 under autocast. Autocast casts each fp32 weight to 16 bits at every use (every
micro-batch, and again in a recomputed forward): with --bf16, MasterWeights keeps the
linear layers' and the tied MLM decoder's weights in bf16 once per step, so their GEMMs
take them as they are (below).
bf16 has fp32's range and needs no scaling.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterable, Optional

import torch

from megabert.model.heads import VocabParallelDecoder
from megabert.model.norm import LayerNorm
from megabert.ops.compile_hints import mark_static_address
from megabert.tensor_parallel.gemm_copies import GemmCopies
from megabert.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

if TYPE_CHECKING:
    from megabert.data_parallel.sharded_buffers import ShardedBuffers


def autocast(device: torch.device, bf16: bool, fp16: bool):
    if not (bf16 or fp16):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if bf16 else torch.float16)


def gemm_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters `model` reads in bf16 through tensor_parallel.gemm_copies.gemm_weight:
    the column- and row-parallel linear layers' weights, the column-parallel layers' biases
    (autocast would cast them for the GEMM's epilogue), the word embeddings where an MLM
    decoder multiplies by them (VocabParallelDecoder: tied to the word embeddings in every
    family; at PP > 1 the last stage's tied copy, which only the decoder reads), and with
    --bf16-residual the row-parallel layers' biases and the LayerNorms' parameters, which
    then work in bf16 too."""
    weights = []
    for m in model.modules():
        if isinstance(m, ColumnParallelLinear):
            weights += [m.weight, m.bias]
        elif isinstance(m, RowParallelLinear):
            weights += [m.weight, m.bias if m.bias_in_output_dtype else None]
        elif isinstance(m, LayerNorm) and m.bf16_residual:
            weights += [m.weight, m.bias]
    if any(isinstance(m, VocabParallelDecoder) for m in model.modules()):
        weights += [m.weight for m in model.modules() if isinstance(m, VocabParallelEmbedding)]
        weights += [m.decoder for m in model.modules() if isinstance(m, VocabParallelDecoder)
                    and m.decoder is not None]  # an untied decoder (EuroBERT's)
    # Frozen weights too: a layer given copies finds one for each weight it multiplies by.
    unique = {id(w): w for w in weights if w is not None}
    return list(unique.values())


# The modules that multiply by a weight gemm_weights lists: MasterWeights hands them its copies.
GEMM_LAYERS = (ColumnParallelLinear, RowParallelLinear, LayerNorm, VocabParallelDecoder)


class MasterWeights:
    """bf16 weights for `model`'s GEMMs (gemm_weights: the column- and row-parallel linear
    layers and the tied MLM decoder), made once per optimizer step instead of once per use.

    Design (issue 41). The registered parameters stay the fp32 masters: the optimizer, its
    state, the gradient reductions, the clipping and the checkpoints see exactly what they
    saw before (checkpoints keep their format, fp32 weights, and resume bitwise). Each
    weight gets a bf16 tensor, its GEMM copy (no requires_grad), kept in one GemmCopies that
    this object owns and hands to the layers (their `gemm_copies`); a layer multiplies by its
    copy through tensor_parallel.gemm_copies.gemm_weight: a tiny autograd Function (_GemmCopy) that
    hands the copy to the GEMM and, in backward, converts the GEMM's bf16 weight gradient
    to fp32 for the master. The master's gradient then takes autograd's ordinary path
    (summed with its other uses, as the word embeddings' lookup, then AccumulateGrad into
    its fp32 `.grad`, over micro-batches: Megatron's main_grad), so the DP reducers' hooks
    and the distributed optimizer's gradient-buffer views see it as any parameter's.

    The maths is autocast's over fp32 parameters, to the bit: autocast's per-use cast
    rounds the fp32 weight to bf16 exactly as the copy does, and its backward (aten's
    _to_copy's) is the Function's. What changes is that the cast is made once per step, not
    at every forward of every micro-batch (and recompute), and that the bf16 copies are
    kept. Memory: 2 bytes per weight more for the step (autocast's copies lived for the
    forward and backward of one micro-batch). The replicated nn.Linear heads (pooler, MLM
    transform, task heads) are still cast by autocast at each use. With --bf16-residual the
    row-parallel biases and the LayerNorms' parameters get copies too; that mode is no longer
    autocast's maths (its residual stream is bf16), the copies' rounding is the same.

    When the copies are remade: `attach(optimizer)`, after each optimizer step (one
    multi-tensor copy); with the distributed optimizer, `attach_gathers(buffers)`, per bucket
    as its parameter all-gather lands (its optimizer steps views of a flat buffer and the
    all-gather writes it, neither of which bumps the parameters' version counters; with
    --overlap-param-gather that is in the forward pre-hook that waits for the bucket). Any
    other in-place write to a parameter itself (a checkpoint load) bumps its version, which
    gemm_weight checks at each use in eager mode; compiled layers cannot read it, so the
    strategies call `refresh_stale` before each step and each forward-only pass (a look at
    each master's version, ~100 for BERT-large, no device work unless one is stale).

    With --compile the compiled layers trace gemm_weight: the copies enter their graphs as
    inputs (marked static, so that the CUDA graphs of --compile --pack-sequences read them
    where they are instead of copying them in at each replay) and the graphs cast no
    weight. DeepSpeed needs none of this: its bf16 mode casts the module's parameters to
    bf16 (the engine's _configure_distributed_model) and keeps the fp32 masters in its own
    optimizer, so its GEMMs take bf16 weights with no per-use cast either.
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16):
        self.gemm_copies = GemmCopies(gemm_weights(model), dtype)
        for c in self.gemm_copies.copies:
            mark_static_address(c)
        # Handed to the layers once: each reads its weights' copies through its `gemm_copies`.
        self._layers = [m for m in model.modules() if isinstance(m, GEMM_LAYERS)]
        for m in self._layers:
            m.gemm_copies = self.gemm_copies
        self._handles: list = []
        self.refresh()

    def refresh(self, params: Optional[Iterable[torch.nn.Parameter]] = None) -> None:
        """Rounds the masters (those among `params`; None: all) into their GEMM copies: one
        multi-tensor copy (the step's cast)."""
        self.gemm_copies.refresh(params)

    def refresh_stale(self) -> None:
        """Remakes the copies of masters written in place since their copy was made."""
        self.gemm_copies.refresh_stale()

    def attach(self, optimizer: torch.optim.Optimizer) -> "MasterWeights":
        """Refresh after each step of `optimizer`."""
        self._handles.append(optimizer.register_step_post_hook(lambda *_: self.refresh()))
        return self

    def attach_gathers(self, buffers: ShardedBuffers) -> "MasterWeights":
        """Refresh each bucket's copies as the distributed optimizer's all-gather of it lands
        (ShardedBuffers.register_gather_hook)."""
        self._handles.append(buffers.register_gather_hook(self.refresh))
        return self

    def close(self) -> None:
        """Detaches from the optimizer and takes the copies back from the layers: the model
        multiplies by its fp32 parameters again (autocast casts them at use)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for m in self._layers:
            m.gemm_copies = None
