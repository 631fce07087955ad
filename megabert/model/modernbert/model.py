"""ModernBERT (Warner et al. 2024) as a family of megabert's model tree: the backbone a
rank holds, the masked-LM head, ModernBertForMaskedLM and its initialisation.

The model class is BERT's (megabert.model.bert.BertPreTrainedModel): the same pipeline
interface, stage layout, parameter specs, loading and checkpoints; only the backbone and
the head differ. Activations are [s, b, h] (Megatron's layout) or, unpadded, [T, h] of the
real tokens; inputs and outputs are batch-first as in transformers.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megabert.config import ModelConfig
from megabert.model.bert import BertPreTrainedModel, attention_mask_to_bool
from megabert.model.context import BuildContext
from megabert.model.embeddings import word_embeddings
from megabert.model.heads import VocabParallelDecoder
from megabert.model.init import param_seed
from megabert.model.modernbert.layers import ACTIVATIONS, AttentionInputs, ModernBertEncoder
from megabert.model.modernbert.rope import RotaryTables, padded_positions, unpadded_positions
from megabert.model.norm import residual_stream
from megabert.model.outputs import ModelOutput
from megabert.model.packed import block_diagonal_mask, gather_flat, sample_positions, sample_segments
from megabert.model.registry import register_model
from megabert.model.unpad import TokenLayout
from megabert.ops.compile_hints import maybe_mark_dynamic
from megabert.parallel import ParallelState
from megabert.parallel.layout import StageLayout
from megabert.parallel.param_spec import describe, describe_module, set_hf_names, spec_of
from megabert.tensor_parallel import gather_from_sp_to_replicated, gather_from_tp, scatter_to_sp, vocab_parallel_argmax
from megabert.tensor_parallel.layers import shard

WORD_EMBEDDINGS_HF = "model.embeddings.tok_embeddings.weight"


def _norm_names(cfg: ModelConfig) -> tuple[str, ...]:
    return ("weight", "bias") if cfg.norm_bias else ("weight",)


class ModernBertEmbeddings(nn.Module):
    """dropout(norm(tok_embeddings(ids))) -> [s, b, h]: no positions (RoPE), no token types."""

    def __init__(self, ctx: BuildContext, padded_vocab_size: int):
        super().__init__()
        self.ctx = ctx
        self.word_embeddings = word_embeddings(ctx, padded_vocab_size)
        describe(self.word_embeddings.weight, hf_names=(WORD_EMBEDDINGS_HF,))
        # Before the sequence is scattered over sequence-parallel ranks: full-sequence parameters.
        self.norm = ctx.layer_norm(sequence_parallel=False, bias=ctx.config.norm_bias)
        describe_module(self.norm, placement="first")
        set_hf_names(self, {f"norm.{k}": f"model.embeddings.norm.{k}" for k in _norm_names(ctx.config)})
        self.dropout_p = ctx.config.embedding_dropout

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.word_embeddings(input_ids).transpose(0, 1).contiguous())  # [s, b, h]
        x = residual_stream(x, self.ctx.config.bf16_residual)
        if self.ctx.sequence_parallel:
            x = scatter_to_sp(x, self.ctx.tp_group)  # [s/tp, b, h]
            with self.ctx.rng.fork():  # each rank drops in its own slice
                return F.dropout(x, self.dropout_p, self.training)
        return F.dropout(x, self.dropout_p, self.training)


class ModernBertTiedEmbeddings(nn.Module):
    """The last pipeline stage's copy of the word embeddings (the decoder's weight), named
    like the first stage's so both save, load and initialise as one (see BERT's)."""

    def __init__(self, ctx: BuildContext, padded_vocab_size: int):
        super().__init__()
        self.word_embeddings = word_embeddings(ctx, padded_vocab_size)
        describe(self.word_embeddings.weight, hf_names=(WORD_EMBEDDINGS_HF,))


class ModernBertBackbone(nn.Module):
    """Embeddings -> layers -> final norm: the part of ModernBERT this rank holds. The
    constructor and `forward_chunk` are BertBackbone's, so BertPreTrainedModel drives it
    (`add_pooler` must be False: ModernBERT has no pooler)."""

    def __init__(self, ctx: BuildContext, stage: StageLayout, padded_vocab_size: int, *, add_pooler: bool,
                 output_embeddings: bool):
        super().__init__()
        if add_pooler:
            raise ValueError("ModernBERT has no pooler")
        self.ctx, self.stage = ctx, stage
        if stage.is_first_stage:
            self.embeddings = ModernBertEmbeddings(ctx, padded_vocab_size)
        elif stage.is_last_stage and output_embeddings:
            self.embeddings = ModernBertTiedEmbeddings(ctx, padded_vocab_size)
        else:
            self.embeddings = None
        self.encoder = ModernBertEncoder(ctx, stage.layer_ids, final_norm=stage.is_last_stage)
        self.pooler = None
        self.unpad = ctx.config.unpad_input

    def _inputs(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor], tokens: Optional[TokenLayout],
                packed_seqlens: Optional[torch.Tensor] = None) -> AttentionInputs:
        cfg = self.ctx.config
        if tokens is not None:
            # Each sequence of cu_seqlens (a row, or a packed row's sample) counts from 0.
            positions = unpadded_positions(tokens.cu_seqlens, tokens.num_tokens)  # [T]
            s = tokens.s
        else:
            s = hidden.size(0) * (self.ctx.tp_size if self.ctx.sequence_parallel else 1)
            if packed_seqlens is None:
                positions = padded_positions(s, hidden.size(1), hidden.device)  # [s, b]
            else:  # packed rows in the padded layout: each sample's positions from 0
                positions = sample_positions(packed_seqlens, s).t()
        rope = RotaryTables(positions, cfg.head_dim, cfg.global_rope_theta, cfg.local_rope_theta)
        # Packed rows: the padded cores (global layers off the varlen kernel, local ones on the
        # reference backend) see each sample alone; the local ones add their band to it. None
        # where no layer has a padded core (the varlen kernel and the blocked window take cu_seqlens).
        if packed_seqlens is None:
            mask = attention_mask_to_bool(attention_mask)
        elif tokens is not None and self.ctx.attention_backend == "varlen":
            mask = None
        else:
            mask = block_diagonal_mask(packed_seqlens, s)
        segments = sample_segments(packed_seqlens, s) if packed_seqlens is not None and tokens is None else None
        return AttentionInputs(mask, tokens, rope, s, cfg.local_attention // 2, hidden.device,
                               padded_segments=segments)

    def _token_layout(self, input_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
                      packed_seqlens: Optional[torch.Tensor],
                      token_positions: Optional[torch.Tensor] = None) -> Optional[TokenLayout]:
        """The unpadded layout (real tokens, a sequence per row or per packed sample), or None
        for the padded [s, b] one. Packed rows always take a layout: its cu_seqlens give RoPE
        each sample's own positions from 0 and the local layers each sample as a segment."""
        if self.unpad and attention_mask is not None and attention_mask.dim() == 2:
            return TokenLayout(attention_mask, packed_seqlens, token_positions)
        if packed_seqlens is None or self.ctx.sequence_parallel:
            # Sequence parallelism splits the padded [s, b] layout: packed rows stay in it, each
            # sample kept apart by its segment (the block-diagonal mask, the local layers' segments).
            return None
        # Every position, fixed shapes (no host sync): each row's padding is one more sequence.
        return TokenLayout.packed_rows(packed_seqlens, input_ids.size(1) if input_ids is not None
                                       else attention_mask.size(1))

    def forward_chunk(self, v: int, hidden: Optional[torch.Tensor], input_ids: Optional[torch.Tensor],
                      token_type_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
                      head_positions: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                      packed_seqlens: Optional[torch.Tensor] = None, token_positions: Optional[torch.Tensor] = None):
        """As BertBackbone.forward_chunk (token_type_ids are ignored: ModernBERT has none); the
        model's last chunk returns (sequence [s, b, h], None). Packed rows (megabert.model.packed):
        `packed_seqlens` [b, cap] decides everything; `position_ids` (each sample's from 0) are
        what RoPE derives from it, so they are not read."""
        if self.stage.is_first_chunk(v):
            hidden = self.embeddings(input_ids)
        last = self.stage.is_last_chunk(v)
        tokens = self._token_layout(input_ids, attention_mask, packed_seqlens, token_positions)
        inputs = self._inputs(hidden, attention_mask, tokens, packed_seqlens)
        if tokens is not None:
            hidden = tokens.unpad(hidden)  # [T, h]
            maybe_mark_dynamic(hidden, 0)
        layer_ids = self.stage.chunk_layers(v)
        rows = keep = None
        if last and tokens is not None and head_positions is not None and len(layer_ids) > 0:
            # bool [b, s], or int64 flat positions (the host's: TokenLayout.head_rows)
            rows, keep = tokens.head_rows(head_positions)
            maybe_mark_dynamic(rows, 0)
        x = self.encoder(hidden, inputs, layer_ids, apply_final_norm=last, rows=rows)
        if tokens is not None:
            x = tokens.pad(x) if rows is None else tokens.pad_rows(x, rows, keep)
        if not last:
            return x
        if self.ctx.sequence_parallel:
            x = gather_from_sp_to_replicated(x, self.ctx.tp_group)  # [s/tp, b, h] -> [s, b, h]
        return x, None

    @property
    def word_embeddings(self) -> torch.Tensor:
        return self.embeddings.word_embeddings.weight


class ModernBertMLMHead(VocabParallelDecoder):
    """norm(act(dense(h))) -> logits against the (vocab-parallel) word embeddings plus the
    decoder bias. Logits stay split over the vocab ([..., V/tp]); padding columns take the
    dtype's minimum (no probability mass), as BERT's MLMHead."""

    def __init__(self, ctx: BuildContext, padded_vocab_size: int, tp_rank: int):
        super().__init__()
        cfg = ctx.config
        self.tp_group, self.tp_size = ctx.tp_group, ctx.tp_size
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias, dtype=ctx.params_dtype,
                               device=ctx.device)
        describe(self.dense.weight)
        if cfg.classifier_bias:
            describe(self.dense.bias, init="zeros", weight_decay=False)
        self.act = ACTIVATIONS[cfg.classifier_activation]
        self.norm = ctx.layer_norm(sequence_parallel=False, bias=cfg.norm_bias)
        per_rank = padded_vocab_size // ctx.tp_size
        if cfg.decoder_bias:
            self.bias = describe(nn.Parameter(torch.zeros(per_rank, dtype=ctx.params_dtype, device=ctx.device)),
                                 partition_dim=0, init="zeros", weight_decay=False, valid_rows=cfg.vocab_size)
            set_hf_names(self, {"bias": "decoder.bias"})
        else:  # no parameter (none to export); zeros keep one code path
            self.register_buffer("bias", torch.zeros(per_rank, dtype=ctx.params_dtype, device=ctx.device),
                                 persistent=False)
        set_hf_names(self, {f"dense.{k}": f"head.dense.{k}" for k in
                            (("weight", "bias") if cfg.classifier_bias else ("weight",))})
        set_hf_names(self, {f"norm.{k}": f"head.norm.{k}" for k in _norm_names(cfg)})
        describe_module(self, placement="last")
        first_pad = cfg.vocab_size - tp_rank * per_rank  # local index of the first padding column
        self.local_pad_start = first_pad if first_pad < per_rank else None

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(self.act(self.dense(hidden)))


class MaskedLMOutput(ModelOutput):
    """loss; logits [b, s, vocab] (or [n_masked, vocab] with logits at masked positions only):
    the full vocab gathered over TP on first access, padding columns removed;
    logits_parallel [..., padded V / tp]; predictions: the argmax without gathering; labels:
    the targets the loss was computed against."""

    def __init__(self, *, loss, logits_parallel, tp_group, vocab_size, labels=None, loss_sum=None):
        # mlm_loss_sum: the numerator the trainer divides by the global batch's masked tokens
        # (pretraining_task); an entry, not an attribute, as BertPreTrainingOutput's.
        super().__init__(loss=loss, mlm_loss=loss, mlm_loss_sum=loss_sum, nsp_loss_sum=None)
        self._make = logits_parallel if callable(logits_parallel) else None
        if self._make is None:
            self["logits_parallel"] = logits_parallel
        self._tp_group, self._vocab_size, self._labels = tp_group, vocab_size, labels
        self._logits: Optional[torch.Tensor] = None

    @property
    def logits_parallel(self) -> torch.Tensor:
        if "logits_parallel" not in self:
            self["logits_parallel"] = self._make()
        return self["logits_parallel"]

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            self._logits = gather_from_tp(self.logits_parallel, self._tp_group)[..., : self._vocab_size]
        return self._logits

    # The names BERT's pre-training output has, so the pre-training task reads either model.
    mlm_logits_parallel = logits_parallel
    mlm_logits = logits

    @property
    def predictions(self) -> torch.Tensor:
        return vocab_parallel_argmax(self.logits_parallel, self._tp_group, self._vocab_size)

    mlm_predictions = predictions

    @property
    def labels(self) -> Optional[torch.Tensor]:
        return self._labels

    mlm_labels = labels
    nsp_loss = None
    nsp_logits = None
    nsp_labels = None


def _init_std(cfg: ModelConfig, name: str) -> float:
    """transformers' ModernBertPreTrainedModel._init_weights: "in" projections at the
    initializer range, "out" projections (each sublayer's Wo, the head's dense) at
    range / sqrt(2 x layers), the embeddings at the range, a classifier at hidden ** -0.5."""
    out = cfg.init_method_std / math.sqrt(2.0 * cfg.num_layers)
    if name.endswith(("Wo.weight", "head.dense.weight")):  # lm_head's, a classifier's prediction_head's
        return out
    if name == "classifier.weight":
        return cfg.hidden_size ** -0.5  # transformers' "final_out"
    return cfg.init_method_std


@register_model
class ModernBertForMaskedLM(BertPreTrainedModel):
    """ModernBERT with its masked-LM head, as transformers' ModernBertForMaskedLM.

    forward(input_ids, attention_mask, labels) -> MaskedLMOutput: `logits` [b, s, vocab]
    (the config's vocab_size), and with labels (token ids at masked positions, -100
    elsewhere) the mean cross entropy `loss`. With `mlm_logits_at_masked_only` and labels,
    logits are computed at the masked positions alone ([n_masked, vocab])."""

    backbone_class = ModernBertBackbone

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, **kwargs):
        if config.model_family != "modernbert":
            raise ValueError(f"ModernBertForMaskedLM needs a ModernBERT config (model_family 'modernbert'), got "
                             f"{config.model_family!r}")
        super().__init__(config, parallel_state, add_pooler=False, output_embeddings=True, **kwargs)
        if self.bert.embeddings is not None:
            describe(self.bert.word_embeddings, placement="tied")  # the decoder's weight too
        self.lm_head = ModernBertMLMHead(self.ctx, self.padded_vocab_size, self.parallel_state.tp_rank) \
            if self.stage.is_last_stage else None

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, token_type_ids: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, packed_seqlens: Optional[torch.Tensor] = None,
                mlm_flat_positions: Optional[torch.Tensor] = None,
                token_positions: Optional[torch.Tensor] = None) -> MaskedLMOutput:
        """Packed rows (megabert.data.packing): packed_seqlens [b, cap] (and position_ids [b, s],
        each sample's from 0); labels stay per token. Unpacked rows may carry, from the host, the
        masked positions (`mlm_flat_positions` [n], row x s + column) and the real tokens'
        (`token_positions` [T]): the head and the unpadded encoder then select by index, with no
        nonzero() on the device (megabert.tasks.pretraining.task.pretraining_batches)."""
        return self._whole_model_forward(dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                                              token_type_ids=token_type_ids, position_ids=position_ids,
                                              packed_seqlens=packed_seqlens, mlm_flat_positions=mlm_flat_positions,
                                              token_positions=token_positions))

    def head_positions(self, batch: dict) -> Optional[torch.Tensor]:
        labels = batch.get("labels")
        if not self.config.mlm_logits_at_masked_only or labels is None:
            return None
        given = batch.get("mlm_flat_positions")
        return given if given is not None and batch.get("packed_seqlens") is None else labels != -100

    def head(self, sequence: torch.Tensor, pooled, batch: dict) -> MaskedLMOutput:
        labels, given = batch.get("labels"), batch.get("mlm_flat_positions")
        hidden, target = sequence.transpose(0, 1), labels  # [b, s, h]
        if self.config.mlm_logits_at_masked_only and labels is not None:
            if given is not None and batch.get("packed_seqlens") is None:
                hidden, target = gather_flat(sequence, labels, given)  # [n, h], [n] by index
            else:
                selected = labels != -100
                hidden, target = hidden[selected], labels[selected]  # [n, h], [n]
        loss = loss_sum = None
        if target is not None:
            logits, per_token = self.lm_head.logits_and_loss(hidden, self.bert.word_embeddings, target)
            loss_sum = per_token.sum()
            loss = loss_sum / (target != -100).sum().clamp(min=1)
        else:
            logits = self.lm_head.logits(self.lm_head.transform(hidden), self.bert.word_embeddings)
        return MaskedLMOutput(loss=loss, logits_parallel=logits, tp_group=self.ctx.tp_group,
                              vocab_size=self.config.vocab_size, labels=target, loss_sum=loss_sum)

    @torch.no_grad()
    def initialize_parameters(self) -> None:
        """transformers' ModernBERT initialisation: each weight from a normal truncated at
        +-initializer_cutoff_factor standard deviations (std per _init_std), biases zero, norms
        one. As BERT's, each full matrix is drawn from (seed, parameter name) and sliced, so
        every TP/PP layout starts from the same model."""
        cfg, ps = self.config, self.parallel_state
        for name, p in self.named_parameters():
            spec = spec_of(p, name)
            if p.device.type == "meta":
                continue
            if spec.init == "zeros":
                p.zero_()
                continue
            if spec.init == "ones":
                p.fill_(1.0)
                continue
            shape = list(p.shape)
            if spec.is_tensor_parallel:
                shape[spec.partition_dim] *= ps.tp_size
            std = _init_std(cfg, name)
            cutoff = cfg.initializer_cutoff_factor * std
            full = torch.empty(shape, dtype=torch.float32)
            nn.init.trunc_normal_(full, 0.0, std, -cutoff, cutoff,
                                  generator=torch.Generator().manual_seed(param_seed(self.seed, name)))
            if spec.valid_rows is not None:
                full[spec.valid_rows:] = 0.0  # vocab padding rows stay zero (see megabert.model.init)
            if spec.is_tensor_parallel:
                full = shard(full, spec.partition_dim, ps.tp_rank, ps.tp_size, spec.partition_stride)
            p.copy_(full)
