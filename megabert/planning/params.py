"""Parameter counts per rank, tensor by tensor, mirroring how megabert.model builds them.

Counting tensors (not only totals) matters for ZeRO-3: DeepSpeed leaves parameters
smaller than `stage3_param_persistence_threshold` unpartitioned on every rank.
The unit tests hold these counts equal to `sum(p.numel())` of the real modules.
"""
from __future__ import annotations

from dataclasses import dataclass

from megabert.config import ModelConfig


@dataclass(frozen=True)
class StageParams:
    """The parameter tensors one rank of pipeline stage `stage` holds (numel each)."""

    stage: int
    tensors: tuple[int, ...]
    """Element counts, one per parameter tensor."""
    tied_embedding: int
    """Elements of the last stage's copy of the word embeddings (0 elsewhere); included in `tensors`."""

    @property
    def total(self) -> int:
        return sum(self.tensors)

    def below(self, threshold: int) -> int:
        """Elements in tensors smaller than `threshold` (ZeRO-3 keeps those whole)."""
        return sum(n for n in self.tensors if n < threshold)


def layer_tensors(model: ModelConfig, tp: int) -> list[int]:
    """One transformer layer on one TP rank: QKV and the MLP's first GEMM are column-parallel
    (weight and bias split), the projections row-parallel (weight split, bias whole), the
    two LayerNorms replicated."""
    h, f = model.hidden_size, model.ffn_hidden_size
    return [3 * h * h // tp, 3 * h // tp,  # QKV
            h * h // tp, h,  # attention output projection
            h, h,  # attention LayerNorm
            f * h // tp, f // tp,  # h -> ffn
            h * f // tp, h,  # ffn -> h
            h, h]  # MLP LayerNorm


def embedding_tensors(model: ModelConfig, tp: int) -> list[int]:
    """Word (vocab-parallel, padded vocab), position and token-type embeddings, LayerNorm."""
    h = model.hidden_size
    layernorm = [h, h] if model.embedding_layernorm else []
    return [model.padded_vocab_size(tp) // tp * h, model.max_position_embeddings * h, model.type_vocab_size * h,
            *layernorm]


def head_tensors(model: ModelConfig, tp: int) -> list[int]:
    """Last stage: final LayerNorm (pre-LN), pooler and binary head, MLM head (dense,
    LayerNorm, vocab-parallel bias); the MLM projection reuses the word embeddings."""
    h = model.hidden_size
    out = [h, h] if model.layernorm_position == "pre" else []
    if model.bert_binary_head:
        out += [h * h, h, 2 * h, 2]
    out += [h * h, h, h, h, model.padded_vocab_size(tp) // tp]
    return out


def stage_params(model: ModelConfig, tp: int, pp: int, stage: int) -> StageParams:
    """What one TP rank of pipeline stage `stage` holds. Layers split evenly over stages (with
    interleaving a rank holds several chunks, but the same number of layers)."""
    tensors = layer_tensors(model, tp) * (model.num_layers // pp)
    tied = 0
    if stage == 0:
        tensors = embedding_tensors(model, tp) + tensors
    if stage == pp - 1:
        tensors = tensors + head_tensors(model, tp)
        if pp > 1:
            # NOTE: the last stage holds its own copy of the word embeddings for the tied MLM
            # projection (Megatron's layout); their gradients are summed with the first stage's.
            tied = model.padded_vocab_size(tp) // tp * model.hidden_size
            tensors.append(tied)
    return StageParams(stage=stage, tensors=tuple(tensors), tied_embedding=tied)


def total_params(model: ModelConfig) -> int:
    """Parameters of the whole model at TP=1, PP=1 (padding rows included, as built)."""
    return stage_params(model, 1, 1, 0).total
