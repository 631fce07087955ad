"""Task heads: masked LM (tied to the word embeddings), sentence pair (NSP/SOP), QA, and
the pooler. All live on the last pipeline stage."""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from megabert.model.context import BuildContext
from megabert.model.mlp import ACTIVATIONS
from megabert.model.norm import norm_hf_names
from megabert.model.packed import gather_cls
from megabert.parallel.param_spec import describe, describe_module, set_hf_names
from megabert.ops.linear_cross_entropy import linear_cross_entropy, supports_linear_cross_entropy
from megabert.tensor_parallel import copy_to_tp, vocab_parallel_cross_entropy
from megabert.tensor_parallel.gemm_copies import GemmCopies, gemm_weight


def head_linear(ctx: BuildContext, out_features: int, hf_prefix: str) -> nn.Linear:
    """A replicated hidden -> out_features linear on the last stage."""
    lin = ctx.linear(ctx.spec.hidden_size, out_features)
    describe_module(lin, placement="last")
    set_hf_names(lin, {"weight": hf_prefix + "weight", "bias": hf_prefix + "bias"})
    return lin


class Pooler(nn.Module):
    """tanh(W h_[CLS] + b): the sentence representation the binary head reads."""

    def __init__(self, ctx: BuildContext):
        super().__init__()
        self.dense = head_linear(ctx, ctx.spec.hidden_size, ctx.spec.hf_names["pooler"][0] + ".")

    def forward(self, sequence: torch.Tensor, packed_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[s, b, h] -> [b, h]; packed rows ([b, cap] sample lengths): [b * cap, h], each
        sample's [CLS] (megabert.model.packed)."""
        cls = sequence[0] if packed_seqlens is None else gather_cls(sequence, packed_seqlens)
        return torch.tanh(self.dense(cls))


class VocabParallelDecoder(nn.Module):
    """The MLM decoder of every family: `transform(hidden)` (the subclass's dense -> activation
    -> norm), then logits against the tied (vocab-parallel) word embeddings plus `bias`. A
    subclass sets tp_group, tp_size, bias and local_pad_start (the local index of the first
    padding column, None when this rank holds none)."""

    # The decoder weight's 16-bit copy's keeper (training.precision.MasterWeights hands it
    # over); None: none is kept, autocast casts the weight at each use.
    gemm_copies: Optional[GemmCopies] = None

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        return self.logits(self.transform(hidden), word_embeddings)

    def logits_and_loss(self, hidden: torch.Tensor, word_embeddings: torch.Tensor,
                        target: torch.Tensor) -> tuple[Union[torch.Tensor, Callable[[], torch.Tensor]], torch.Tensor]:
        """(logits [..., V/tp], per-token cross entropy [...]) against full-vocab targets
        (-100: no loss). With the whole vocab on this rank, the projection and the loss are
        one op that needs no [tokens, vocab] buffer unless the logits are asked for
        (ops.linear_cross_entropy): the logits are then a function that makes them. Under
        torch.compile (the whole packed step compiled for CUDA graphs) the GEMM and the loss stay
        two ops for Inductor to fuse: the chunked op's CPU kernels are opaque to dynamo."""
        x = self.transform(hidden)
        if (self.tp_size == 1 and supports_linear_cross_entropy(x, word_embeddings)
                and not torch.compiler.is_compiling()):
            vocab = self.local_pad_start if self.local_pad_start is not None else word_embeddings.size(0)
            loss, logits = linear_cross_entropy(x, word_embeddings, self.bias, target, vocab)
            return logits.full, loss
        logits = self.logits(x, word_embeddings)
        return logits, vocab_parallel_cross_entropy(logits, target, self.tp_group)

    def logits(self, x: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        # The word embeddings' 16-bit copy under --bf16 (training.precision.MasterWeights).
        weight = gemm_weight(word_embeddings, self.gemm_copies)
        if self.tp_size == 1 and self.local_pad_start is not None:
            # One rank holds the whole vocab: leave the padding rows out of the GEMM
            # instead of computing and then masking their logits.
            end = self.local_pad_start
            return F.linear(x, weight[:end], self.bias[:end])
        logits = F.linear(copy_to_tp(x, self.tp_group), weight, self.bias)
        if self.local_pad_start is not None:
            pad = torch.zeros(logits.size(-1), dtype=torch.bool, device=logits.device)
            pad[max(self.local_pad_start, 0):] = True
            logits = logits.masked_fill(pad, torch.finfo(logits.dtype).min)
        return logits


class MLMHead(VocabParallelDecoder):
    """The spec's head transform (dense -> activation -> norm, any of it optional) -> logits
    against the (vocab-parallel) word embeddings plus the decoder bias.

    Logits stay split over the vocab ([..., V/tp]); the loss is computed without
    gathering them. Columns past the real vocab (padding) are filled with the dtype's
    minimum, so they take no probability mass: the loss equals the unpadded model's.
    """

    def __init__(self, ctx: BuildContext, padded_vocab_size: int, tp_rank: int):
        super().__init__()
        spec, head = ctx.spec, ctx.spec.mlm_head
        self.tp_group, self.tp_size = ctx.tp_group, ctx.tp_size
        self.dense = self.dense2 = self.act = None
        self.norm_name = spec.names.head_norm
        norm = None
        if head.transform:
            width = head.width or spec.hidden_size
            self.dense = self._linear(ctx, spec.hidden_size, width, "head_dense")
            if head.width:
                self.dense2 = self._linear(ctx, width, spec.hidden_size, "head_dense2")
            self.act = ACTIVATIONS[head.activation]
            norm = ctx.norm(sequence_parallel=False) if head.norm else None
        self.add_module(self.norm_name, norm)
        if norm is not None:
            set_hf_names(self, norm_hf_names(self.norm_name, norm, spec.hf("head_norm")))
        per_rank = padded_vocab_size // ctx.tp_size
        self.decoder = None
        if not head.tied:
            # A decoder of its own (EuroBERT's lm_head): vocab-parallel as the word embeddings.
            self.decoder = describe(nn.Parameter(torch.empty(per_rank, spec.hidden_size, dtype=ctx.params_dtype,
                                                             device=ctx.device)),
                                    partition_dim=0, valid_rows=ctx.config.vocab_size,
                                    hf_names=spec.hf("decoder", ("weight",)).get("weight", ()))
        if head.decoder_bias:
            self.bias = describe(nn.Parameter(torch.zeros(per_rank, dtype=ctx.params_dtype, device=ctx.device)),
                                 partition_dim=0, init="zeros", weight_decay=False, valid_rows=ctx.config.vocab_size)
            set_hf_names(self, {"bias": spec.hf("decoder_bias", ("bias",)).get("bias", ())})
        else:  # no parameter (none to export); zeros keep one code path
            self.register_buffer("bias", torch.zeros(per_rank, dtype=ctx.params_dtype, device=ctx.device),
                                 persistent=False)
        describe_module(self, placement="last")
        first_pad = ctx.config.vocab_size - tp_rank * per_rank  # local index of the first padding column
        self.local_pad_start = first_pad if first_pad < per_rank else None

    def _linear(self, ctx: BuildContext, n_in: int, n_out: int, part: str) -> nn.Linear:
        bias = ctx.spec.mlm_head.dense_bias
        linear = nn.Linear(n_in, n_out, bias=bias, dtype=ctx.params_dtype, device=ctx.device)
        describe(linear.weight)
        if bias:
            describe(linear.bias, init="zeros", weight_decay=False)
        set_hf_names(linear, {k: v for k, v in ctx.spec.hf(part).items() if k == "weight" or bias})
        return linear

    def decoder_weight(self, word_embeddings: Optional[torch.Tensor]) -> torch.Tensor:
        """The matrix the logits multiply by: the head's own decoder, else the word embeddings."""
        return self.decoder if self.decoder is not None else word_embeddings

    def transform(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.dense is None:
            return hidden
        x = self.act(self.dense(hidden))
        if self.dense2 is not None:
            x = self.act(self.dense2(x))
        norm = getattr(self, self.norm_name)
        return x if norm is None else norm(x)
