"""Parameter counts per rank, tensor by tensor, mirroring how megabert.model builds them.

Counting tensors (not only totals) matters for ZeRO-3: DeepSpeed leaves parameters
smaller than `stage3_param_persistence_threshold` unpartitioned on every rank.
The unit tests hold these counts equal to `sum(p.numel())` of the real modules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

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


def _norm(model: ModelConfig) -> list[int]:
    """A ModernBERT LayerNorm: weight, and a bias with norm_bias."""
    h = model.hidden_size
    return [h, h] if model.norm_bias else [h]


def modernbert_layer_tensors(model: ModelConfig, tp: int, layer: int) -> list[int]:
    """One ModernBERT layer on one TP rank (megabert.model.modernbert.layers): Wqkv [3h, h] and
    the GeGLU's Wi [2f, h] ([input; gate]) column-parallel, both Wo row-parallel, biases only
    with attention_bias / mlp_bias (none in ModernBERT-base and -large), the norms replicated;
    layer 0 has no attention norm (its input is the embedding norm's output)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    attn_bias, mlp_bias = model.attention_bias, model.mlp_bias
    out = _norm(model) if layer > 0 else []
    out += [3 * h * h // tp] + ([3 * h // tp] if attn_bias else [])  # Wqkv
    out += [h * h // tp] + ([h] if attn_bias else [])  # attention Wo
    out += _norm(model)  # mlp_norm
    out += [2 * f * h // tp] + ([2 * f // tp] if mlp_bias else [])  # Wi
    out += [h * f // tp] + ([h] if mlp_bias else [])  # MLP Wo
    return out


def layer_tensors(model: ModelConfig, tp: int, layer: int = 1) -> list[int]:
    """One transformer layer on one TP rank: QKV and the MLP's first GEMM are column-parallel
    (weight and bias split), the projections row-parallel (weight split, bias whole), the
    two LayerNorms replicated. `layer`: its number (ModernBERT's layer 0 differs)."""
    if model.model_family == "modernbert":
        return modernbert_layer_tensors(model, tp, layer)
    h, f = model.hidden_size, model.ffn_hidden_size
    return [3 * h * h // tp, 3 * h // tp,  # QKV
            h * h // tp, h,  # attention output projection
            h, h,  # attention LayerNorm
            f * h // tp, f // tp,  # h -> ffn
            h * f // tp, h,  # ffn -> h
            h, h]  # MLP LayerNorm


def embedding_tensors(model: ModelConfig, tp: int) -> list[int]:
    """Word (vocab-parallel, padded vocab), position and token-type embeddings, LayerNorm.
    ModernBERT: the word embeddings and their norm (RoPE: no position table, no token types)."""
    h = model.hidden_size
    if model.model_family == "modernbert":
        return [model.padded_vocab_size(tp) // tp * h, *_norm(model)]
    layernorm = [h, h] if model.embedding_layernorm else []
    return [model.padded_vocab_size(tp) // tp * h, model.max_position_embeddings * h, model.type_vocab_size * h,
            *layernorm]


def head_tensors(model: ModelConfig, tp: int) -> list[int]:
    """Last stage: final LayerNorm (pre-LN), pooler and binary head, MLM head (dense,
    LayerNorm, vocab-parallel bias); the MLM projection reuses the word embeddings.
    ModernBERT: the final norm, the head's dense (bias with classifier_bias) and norm, the
    decoder bias (with decoder_bias); no pooler."""
    h = model.hidden_size
    if model.model_family == "modernbert":
        return [*_norm(model), h * h, *([h] if model.classifier_bias else []), *_norm(model),
                *([model.padded_vocab_size(tp) // tp] if model.decoder_bias else [])]
    out = [h, h] if model.layernorm_position == "pre" else []
    if model.bert_binary_head:
        out += [h * h, h, 2 * h, 2]
    out += [h * h, h, h, h, model.padded_vocab_size(tp) // tp]
    return out


def stage_params(model: ModelConfig, tp: int, pp: int, stage: int, layers: Optional[int] = None) -> StageParams:
    """What one TP rank of pipeline stage `stage` holds: `layers` layers (default an even share;
    with interleaving a rank holds several chunks, but the same number of layers; uneven stages
    pass their own, Layout.stage)."""
    per_stage = model.num_layers // pp if layers is None else layers
    # Which layers a rank holds does not change their count; only ModernBERT's layer 0
    # (on stage 0, in its first chunk when interleaved) differs from the others.
    tensors = [n for i in range(per_stage) for n in layer_tensors(model, tp, i if stage == 0 else 1)]
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
