"""Parameter counts per rank, tensor by tensor, mirroring how megabert.model builds them.

Counting tensors (not only totals) matters for ZeRO-3: DeepSpeed leaves parameters
smaller than `stage3_param_persistence_threshold` unpartitioned on every rank.
The unit tests hold these counts equal to `sum(p.numel())` of the real modules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megabert.config import ModelConfig
from megabert.families import encoder_spec, recipe
from megabert.families.spec import EncoderSpec


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


def _norm(spec: EncoderSpec) -> list[int]:
    """One norm: weight, and a bias for a LayerNorm with one."""
    h = spec.hidden_size
    return [h, h] if spec.norm.kind == "layernorm" and spec.norm.bias else [h]


def _linear(n_out: int, n_in: int, bias: bool, split: int = 1, bias_split: int = 1) -> list[int]:
    """A linear layer's weight (n_out x n_in / split) and bias (n_out / bias_split, if any)."""
    return [n_out * n_in // split] + ([n_out // bias_split] if bias else [])


def layer_tensors(model: ModelConfig, tp: int, layer: int = 1) -> list[int]:
    """One transformer layer on one TP rank, as the EncoderSpec builds it (megabert.model):
    Q/K/V (fused, or with grouped key/value heads a query GEMM and a [K; V] one: split over TP
    when it divides the key/value heads, else replicated) and the MLP's up-projection (2f wide
    when gated) column-parallel (weight and bias split), the output projections row-parallel
    (weight split, bias whole), the norms replicated. `layer`: its number (a pre-LN family may
    give layer 0 no attention norm)."""
    spec = encoder_spec(model)
    a, m, h = spec.attention, spec.mlp, spec.hidden_size
    inner, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    if a.gqa:
        kv_split = tp if a.num_kv_heads % tp == 0 else 1
        qkv = _linear(inner, h, a.qkv_bias, tp, tp) + _linear(2 * kv, h, a.qkv_bias, kv_split, kv_split)
    else:
        qkv = _linear(3 * inner, h, a.qkv_bias, tp, tp)
    width = 2 * m.ffn_size if m.kind == "glu" else m.ffn_size
    attn_norm = _norm(spec) if spec.first_layer_attn_norm or layer > 0 else []
    return (attn_norm + qkv + _linear(h, inner, a.out_bias, tp) + _norm(spec)
            + _linear(width, h, m.in_bias, tp, tp) + _linear(h, m.ffn_size, m.out_bias, tp))


def embedding_tensors(model: ModelConfig, tp: int) -> list[int]:
    """The embedding tables first (word: vocab-parallel, padded vocab; learned positions and
    token types where the spec has them), then the embedding norm if any."""
    spec = encoder_spec(model)
    emb, h = spec.embeddings, spec.hidden_size
    tables = [model.padded_vocab_size(tp) // tp * h] + [n * h for n in (emb.max_positions, emb.type_vocab_size) if n]
    return tables + (_norm(spec) if emb.norm else [])


def embedding_tables(model: ModelConfig) -> int:
    """How many embedding tables embedding_tensors lists first."""
    emb = encoder_spec(model).embeddings
    return 1 + bool(emb.max_positions) + bool(emb.type_vocab_size)


def head_tensors(model: ModelConfig, tp: int) -> list[int]:
    """Last stage: the final norm (pre-LN), the pooler and binary head (with a binary head),
    the MLM head's transform (dense, or a bottleneck of two; its norm), an untied decoder
    (vocab-parallel) and the decoder bias; a tied decoder reuses the word embeddings."""
    spec = encoder_spec(model)
    head, h = spec.mlm_head, spec.hidden_size
    vocab = model.padded_vocab_size(tp) // tp
    out = _norm(spec) if spec.pre_norm else []
    if model.bert_binary_head and recipe(model).binary_head:  # the family's pre-training model has one
        out += [h * h, h, 2 * h, 2]
    if head.transform:
        width = head.width or h
        out += _linear(width, h, head.dense_bias) + (_linear(h, width, head.dense_bias) if head.width else [])
        out += _norm(spec) if head.norm else []
    out += [] if head.tied else [vocab * h]
    return out + ([vocab] if head.decoder_bias else [])


def stage_params(model: ModelConfig, tp: int, pp: int, stage: int, layers: Optional[int] = None) -> StageParams:
    """What one TP rank of pipeline stage `stage` holds: `layers` layers (default an even share;
    with interleaving a rank holds several chunks, but the same number of layers; uneven stages
    pass their own, Layout.stage)."""
    per_stage = model.num_layers // pp if layers is None else layers
    # Which layers a rank holds does not change their count; only a layer 0 without an
    # attention norm (on stage 0, in its first chunk when interleaved) differs from the others.
    tensors = [n for i in range(per_stage) for n in layer_tensors(model, tp, i if stage == 0 else 1)]
    tied = 0
    if stage == 0:
        tensors = embedding_tensors(model, tp) + tensors
    if stage == pp - 1:
        tensors = tensors + head_tensors(model, tp)
        if pp > 1 and encoder_spec(model).mlm_head.tied:
            # NOTE: the last stage holds its own copy of the word embeddings for the tied MLM
            # projection (Megatron's layout); their gradients are summed with the first stage's.
            tied = model.padded_vocab_size(tp) // tp * model.hidden_size
            tensors.append(tied)
    return StageParams(stage=stage, tensors=tuple(tensors), tied_embedding=tied)


def total_params(model: ModelConfig) -> int:
    """Parameters of the whole model at TP=1, PP=1 (padding rows included, as built)."""
    return stage_params(model, 1, 1, 0).total
