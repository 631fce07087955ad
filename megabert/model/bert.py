"""BERT: the backbone, and the task models built on it (BertModel, BertForPreTraining,
BertForQuestionAnswering).

One definition serves every layout. Given the parallel state, a model builds only the
layers of its pipeline rank (the first stage: embeddings; the last: final LayerNorm,
pooler and heads; layers keyed by their global number; interleaved chunks), so a
pipeline stage is the same class as the whole model. The pipeline schedule drives it
through `forward_chunk`; at PP=1 `forward` is the one chunk.

Reads like single-device BERT: the parallel layers are drop-in building blocks and the
process groups come from the ParallelState handed to the constructor. Activations are
[s, b, h] inside the encoder (Megatron's layout, so sequence parallelism splits dim 0);
inputs and outputs are batch-first as in transformers.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from megabert.config import ModelConfig
from megabert.errors import ConfigError
from megabert.model.context import BuildContext
from megabert.model.attention import AttentionInputs
from megabert.model.embeddings import Embeddings, TiedWordEmbeddings
from megabert.families import check_task_class, encoder_spec
from megabert.model.heads import Pooler
from megabert.model.init import initialize_parameters
from megabert.model.packed import block_diagonal_mask, fixed_shape_packing, sample_positions, sample_segments
from megabert.model.pretrained import PretrainedMixin
from megabert.model.rope import RotaryTables, padded_positions, unpadded_positions
from megabert.model.transformer import TransformerBlock
from megabert.model.unpad import TokenLayout
from megabert.ops import resolve_attention_backend, resolve_dropout_add_backend, resolve_layernorm_backend
from megabert.ops.compile_hints import maybe_mark_dynamic
from megabert.parallel import ParallelState, get_parallel_state
from megabert.parallel.layout import StageLayout
from megabert.parallel.param_spec import spec_table
from megabert.rules import check_model_split
from megabert.tensor_parallel import gather_from_sp_to_replicated
from megabert.tensor_parallel.random import TP_STREAM, RNGStatesTracker, tp_stream_seed


def attention_mask_to_bool(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """transformers' convention (1 = token, 0 = padding), [b, s] or [b, sq, sk], to the
    kernels' bool mask (True = masked out) broadcastable to [b, heads, sq, sk]."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        return (attention_mask == 0)[:, None, None, :]
    if attention_mask.dim() == 3:
        return (attention_mask == 0)[:, None, :, :]
    if attention_mask.dim() == 4:
        return attention_mask == 0
    raise ValueError(f"attention_mask must be [b, s], [b, sq, sk] or [b, 1, sq, sk], got {tuple(attention_mask.shape)}")


def build_context(config: ModelConfig, ps: ParallelState, seed: int, params_dtype: torch.dtype,
                  device: Optional[torch.device | str]) -> BuildContext:
    device = torch.device(device) if device is not None else ps.device
    rng = RNGStatesTracker(device, split_ranks=ps.tp_size > 1)
    rng.add(TP_STREAM, tp_stream_seed(seed, ps.tp_rank, ps.pp_rank))
    spec = encoder_spec(config)
    return BuildContext(config=config, spec=spec, tp_group=ps.tp_group, tp_size=ps.tp_size, tp_rank=ps.tp_rank, rng=rng,
                        attention_backend=resolve_attention_backend(config.attention_backend, device.type,
                                                                    spec.attention.head_dim),
                        layernorm_backend=resolve_layernorm_backend(config.layernorm_backend, device.type),
                        dropout_add_backend=resolve_dropout_add_backend(config.dropout_add_backend, device.type),
                        params_dtype=params_dtype, device=device)


class EncoderBackbone(nn.Module):
    """Embeddings -> transformer layers -> (final norm) -> (pooler): the part of the encoder
    this rank holds. `output_embeddings`: the last stage also needs the word embeddings (the
    MLM head's tied projection), as a copy when it is not also the first stage."""

    def __init__(self, ctx: BuildContext, stage: StageLayout, padded_vocab_size: int, *, add_pooler: bool,
                 output_embeddings: bool):
        super().__init__()
        self.ctx, self.stage = ctx, stage
        if stage.is_first_stage:
            self.embeddings = Embeddings(ctx, padded_vocab_size)
        elif stage.is_last_stage and output_embeddings:
            self.embeddings = TiedWordEmbeddings(ctx, padded_vocab_size)
        else:
            self.embeddings = None
        self.encoder = TransformerBlock(ctx, stage.layer_ids, final_layernorm=stage.is_last_stage)
        self.pooler = Pooler(ctx) if add_pooler and stage.is_last_stage else None
        self.unpad = ctx.config.unpad_input
        attn = ctx.spec.attention
        # RoPE and windows read each sample's positions and bounds from the token layout (its
        # cu_seqlens), so packed rows always take one; learned positions come with position_ids.
        self.layout_positions = attn.rope or bool(attn.half_window)

    def _token_layout(self, input_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
                      packed_seqlens: Optional[torch.Tensor], token_positions: Optional[torch.Tensor] = None
                      ) -> Optional[TokenLayout]:
        """The unpadded layout (real tokens, a sequence per row or per packed sample), or None
        for the padded [s, b] one."""
        seq_length = input_ids.size(1) if input_ids is not None else attention_mask.size(1)
        unpad = self.unpad and attention_mask is not None and attention_mask.dim() == 2
        if (packed_seqlens is not None and not self.layout_positions
                and fixed_shape_packing(packed_seqlens.device, self.unpad)):
            # Packed rows: every position, fixed shapes (megabert.model.packed; the varlen kernels
            # take each sample as a sequence, the other backends a block-diagonal mask).
            return (TokenLayout.packed_rows(packed_seqlens, seq_length)
                    if self.ctx.attention_backend == "varlen" and not self.ctx.sequence_parallel else None)
        if unpad:
            return TokenLayout(attention_mask, packed_seqlens, token_positions)
        if packed_seqlens is None or not self.layout_positions or self.ctx.sequence_parallel:
            # Sequence parallelism splits the padded [s, b] layout: packed rows stay in it, each
            # sample kept apart by its segment (the block-diagonal mask, the window layers' segments).
            return None
        # Every position, fixed shapes (no host sync): each row's padding is one more sequence.
        return TokenLayout.packed_rows(packed_seqlens, seq_length)

    def _inputs(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor], tokens: Optional[TokenLayout],
                packed_seqlens: Optional[torch.Tensor] = None) -> AttentionInputs:
        """What every layer of this micro-batch reads: masks, layout, RoPE tables."""
        if tokens is not None:
            s = tokens.s
        else:
            s = hidden.size(0) * (self.ctx.tp_size if self.ctx.sequence_parallel else 1)
        rope = None
        if self.ctx.spec.attention.rope:
            if tokens is not None:
                # Each sequence of cu_seqlens (a row, or a packed row's sample) counts from 0.
                positions = unpadded_positions(tokens.cu_seqlens, tokens.num_tokens)  # [T]
            elif packed_seqlens is None:
                positions = padded_positions(s, hidden.size(1), hidden.device)  # [s, b]
            else:  # packed rows in the padded layout: each sample's positions from 0
                positions = sample_positions(packed_seqlens, s).t()
            rope = RotaryTables(positions, self.ctx.spec.attention.head_dim)
        # Packed rows: the padded cores see each sample alone (window layers add their band to
        # it); None where the varlen kernel takes cu_seqlens instead.
        if packed_seqlens is None:
            mask = attention_mask_to_bool(attention_mask)
        elif tokens is not None and self.ctx.attention_backend == "varlen":
            mask = None
        else:
            mask = block_diagonal_mask(packed_seqlens, s)
        segments = (sample_segments(packed_seqlens, s) if packed_seqlens is not None and tokens is None
                    and self.layout_positions else None)
        return AttentionInputs(mask, tokens, rope, s, hidden.device, padded_segments=segments)

    def forward_chunk(self, v: int, hidden: Optional[torch.Tensor], input_ids: Optional[torch.Tensor],
                      token_type_ids: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor],
                      head_positions: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                      packed_seqlens: Optional[torch.Tensor] = None, token_positions: Optional[torch.Tensor] = None):
        """Chunk v of this rank: [s, b, h] -> [s, b, h]. Global chunk 0 starts from the
        embeddings of `input_ids`; the model's last chunk returns (sequence [s, b, h]
        gathered over sequence-parallel ranks, pooled [b, h] or None). `head_positions`
        ([b, s] bool, or None for all; or int64 positions: TokenLayout.head_rows): the positions
        the heads read; with the unpadded encoder the last layer computes only those, and the
        sequence is zero elsewhere.
        Packed rows (megabert.model.packed): `packed_seqlens` [b, cap] and `position_ids`
        [b, s] (each sample's from 0: learned positions read them, RoPE derives the same from
        packed_seqlens); attention stays inside each sample and pooled is [b * cap, h], one
        [CLS] per slot. `token_positions` (unpacked rows, the unpadded encoder): the real
        tokens' flat positions as the host found them (TokenLayout)."""
        if self.stage.is_first_chunk(v):
            hidden = self.embeddings(input_ids, token_type_ids, position_ids)
        last = self.stage.is_last_chunk(v)
        tokens = self._token_layout(input_ids, attention_mask, packed_seqlens, token_positions)
        inputs = self._inputs(hidden, attention_mask, tokens, packed_seqlens)
        # Unpadded: the chunk's layers see [T, h] of the real tokens; what leaves the chunk
        # (to the heads, or to the next pipeline stage) is [s, b, h] again.
        if tokens is not None:
            hidden = tokens.unpad(hidden)  # [T, h]
            if not tokens.fixed_shape:
                maybe_mark_dynamic(hidden, 0)  # T changes with every batch (see TokenLayout)
        # The heads of pre-training read [CLS] and the masked positions (~15% of tokens): the
        # last layer's projection, MLP, norms and dropout run on those rows alone.
        layer_ids = self.stage.chunk_layers(v)
        rows = keep = None
        if last and tokens is not None and head_positions is not None and len(layer_ids) > 0:
            rows, keep = tokens.head_rows(head_positions)
            if not tokens.fixed_shape:
                maybe_mark_dynamic(rows, 0)  # as T: a compiled last layer takes any number of rows
        x = self.encoder(hidden, inputs, layer_ids, apply_final_layernorm=last, rows=rows)
        if tokens is not None:
            x = tokens.pad(x) if rows is None else tokens.pad_rows(x, rows, keep)
        if not last:
            return x
        if self.ctx.sequence_parallel:
            x = gather_from_sp_to_replicated(x, self.ctx.tp_group)  # [s/tp, b, h] -> [s, b, h]
        return x, self.pooler(x, packed_seqlens) if self.pooler is not None else None

    @property
    def word_embeddings(self) -> torch.Tensor:
        return self.embeddings.word_embeddings.weight


BertBackbone = EncoderBackbone  # the name earlier code imported


class _InitAfterConstruction(type):
    """Runs `_finish_construction()` once the most-derived `__init__` has returned, so
    parameters are checked and initialised under their final names: a subclass that
    renames or adds modules in its own `__init__` is seen as it really is."""

    def __call__(cls, *args, **kwargs):
        model = super().__call__(*args, **kwargs)
        model._finish_construction()
        return model


class BertPreTrainedModel(PretrainedMixin, nn.Module, metaclass=_InitAfterConstruction):
    """This rank's slice of a BERT task model and the interface the pipeline schedule
    drives (`stage`, its StageLayout, and `forward_chunk`). Subclasses
    add their heads and `head(sequence, pooled, batch)`; a model family sets `backbone_class`
    (a class with BertBackbone's constructor and `forward_chunk`)."""

    backbone_class = BertBackbone

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, *, seed: int = 1234,
                 params_dtype: torch.dtype = torch.float32, device=None,
                 num_layers_per_virtual_stage: Optional[int] = None, first_stage_layers: Optional[int] = None,
                 last_stage_layers: Optional[int] = None, add_pooler: bool, output_embeddings: bool):
        super().__init__()
        # No state given: the last init_parallel()'s (an error when none was made; nothing is
        # initialised here, below the Python API's doors).
        ps = parallel_state or get_parallel_state()
        check_task_class(config, type(self).__name__)
        # The model's own door (the Python API builds it without a resolved run): its shape
        # must split over this rank grid.
        check_model_split(config, ps.tp_size, ps.pp_size, num_layers_per_virtual_stage, first_stage_layers,
                          last_stage_layers)
        self.config, self.parallel_state, self.seed = config, ps, seed
        self.stage = StageLayout(config.num_layers, ps.pp_size, ps.pp_rank, num_layers_per_virtual_stage,
                                 first_stage_layers, last_stage_layers)
        self.padded_vocab_size = config.padded_vocab_size(ps.tp_size)
        self.ctx = build_context(config, ps, seed, params_dtype, device)
        self.bert = self.backbone_class(self.ctx, self.stage, self.padded_vocab_size, add_pooler=add_pooler,
                                        output_embeddings=output_embeddings)

    def _finish_construction(self) -> None:
        table = spec_table(self)  # a parameter without a ParamSpec stops here, by name
        misplaced = [name for name, spec in table.items() if not self.stage.holds(spec)]
        if misplaced:
            raise ConfigError(f"{type(self).__name__} built {misplaced[0]} on pipeline stage {self.stage.pp_rank}, "
                              f"but its ParamSpec places it elsewhere ({table[misplaced[0]].placement}); build it "
                              f"only where its spec says, or fix the spec")
        self.initialize_parameters()

    def initialize_parameters(self) -> None:
        """Every parameter from its ParamSpec, name, the seed and the EncoderSpec's initialisation."""
        ps = self.parallel_state
        initialize_parameters(self, self.seed, self.ctx.spec, ps.tp_rank, ps.tp_size)

    # ------------------------------------------------------------ pipeline interface

    @property
    def rng(self) -> RNGStatesTracker:
        return self.ctx.rng

    @property
    def virtual_stage_layers(self) -> Optional[int]:
        return self.stage.virtual_stage_layers

    def activation_shape(self, seq_length: int, micro_batch_size: int) -> tuple[int, int, int]:
        """What travels between stages: [s (/tp with sequence parallelism), b, h]."""
        s = seq_length // self.parallel_state.tp_size if self.ctx.sequence_parallel else seq_length
        return s, micro_batch_size, self.config.hidden_size

    def forward_chunk(self, v: int, hidden: Optional[torch.Tensor], batch: dict):
        """Chunk v on one micro-batch: hidden [s, b, h] (None for global chunk 0) -> [s, b, h],
        or the task's output from the model's last chunk."""
        last = self.stage.is_last_chunk(v)
        out = self.bert.forward_chunk(v, hidden, batch.get("input_ids"), batch.get("token_type_ids"),
                                      batch.get("attention_mask"), self.head_positions(batch) if last else None,
                                      batch.get("position_ids"), batch.get("packed_seqlens"),
                                      batch.get("token_positions"))
        if not last:
            return out
        sequence, pooled = out
        return self.head(sequence, pooled, batch)

    def head(self, sequence: torch.Tensor, pooled: Optional[torch.Tensor], batch: dict):
        raise NotImplementedError

    def head_positions(self, batch: dict) -> Optional[torch.Tensor]:
        """[b, s] bool (or int64 positions: [b, k] of each row on packed rows' fixed-shape path, [n]
        of row x s + column otherwise, -1 for none: TokenLayout.head_rows): the only positions of
        the sequence output that `head` reads, or None (it reads them all)."""
        return None

    def _whole_model_forward(self, batch: dict):
        if self.parallel_state.pp_size > 1:
            raise RuntimeError("with --pipeline-model-parallel-size > 1 this rank holds one pipeline stage: run it "
                               "through megabert.pipeline_parallel.PipelineSchedule (the Trainer does)")
        return self.forward_chunk(0, None, batch)


class BertModel(BertPreTrainedModel):
    """The encoder alone: forward -> (sequence [s, b, h], pooled [b, h] or None)."""

    def __init__(self, config: ModelConfig, parallel_state: Optional[ParallelState] = None, *, add_pooler: bool = True,
                 **kwargs):
        super().__init__(config, parallel_state, add_pooler=add_pooler, output_embeddings=False, **kwargs)

    def head(self, sequence, pooled, batch):
        return sequence, pooled

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None):
        return self._whole_model_forward(dict(input_ids=input_ids, token_type_ids=token_type_ids,
                                              attention_mask=attention_mask))


# The task models live in their own files and are re-exported by megabert.model.
