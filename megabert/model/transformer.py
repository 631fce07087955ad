"""The encoder layer of every family (post-LN or pre-LN, as the spec says) and the stack."""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.nn as nn

from megabert import ops
from megabert.model.attention import AttentionInputs, SelfAttention
from megabert.model.context import BuildContext
from megabert.model.mlp import MLP
from megabert.model.norm import norm_hf_names
from megabert.parallel.param_spec import describe_module, set_hf_names
from megabert.tensor_parallel import checkpoint


class TransformerLayer(nn.Module):
    """One encoder layer as the spec says. Post-LN (BERT, GTE, NomicBERT):
    x = norm(x + attn(x)), then norm(x + mlp(x)). Pre-LN (ModernBERT, EuroBERT):
    x = x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)); a family may leave layer 0's
    attn_norm out (ModernBERT: its input is the embedding norm's output)."""

    def __init__(self, ctx: BuildContext, layer_number: int):
        super().__init__()
        spec, names = ctx.spec, ctx.spec.names
        hf = spec.hf_layer_prefix.format(i=layer_number)
        self.ctx = ctx
        self.pre_ln = spec.pre_norm
        self.attn_name, self.attn_norm_name, self.mlp_norm_name = names.attention, names.attn_norm, names.mlp_norm
        self.add_module(names.attention, SelfAttention(ctx, layer_number, hf))
        has_attn_norm = spec.first_layer_attn_norm or layer_number > 0
        self.add_module(names.attn_norm, ctx.norm() if has_attn_norm else None)
        self.mlp = MLP(ctx, hf)
        self.add_module(names.mlp_norm, ctx.norm())
        for ours, part in ((names.attn_norm, "attn_norm"), (names.mlp_norm, "mlp_norm")):
            if getattr(self, ours) is not None:
                set_hf_names(self, {f"{ours}.{k}": v for k, v in spec.hf_layer(part, hf).items()
                                    if hasattr(getattr(self, ours), k) and getattr(getattr(self, ours), k) is not None})
        self.attn_dropout_p, self.mlp_dropout_p = spec.residual_dropout
        describe_module(self, placement="layer", layer=layer_number)

    def _epilogue(self, x: torch.Tensor, residual: torch.Tensor, layer_norm: Optional[nn.Module] = None,
                  p: Optional[float] = None) -> torch.Tensor:
        """layer_norm(residual + dropout(x, p)) (no norm when None; p None: the attention's
        residual dropout): with the 'compiled'
        backend one fused function (inside the LayerNorm's forward when there is one), else
        the fused CPU kernel or PyTorch's dropout + add, then the norm, as
        ctx.dropout_add_backend says."""
        # Replicated activations: the default stream, identical on TP ranks. Sequence-
        # parallel slices: the per-rank stream, so slices get independent masks. The fused
        # kernel draws its Philox key from the default generator, which the fork swaps (the
        # compiled epilogue draws with ATen's dropout from it too).
        p = (self.attn_dropout_p if p is None else p) if self.training else 0.0
        # No draw, so no stream to swap in (a swap is a graph break under torch.compile).
        fork = self.ctx.rng.fork() if self.ctx.sequence_parallel and p else contextlib.nullcontext()
        with fork:
            if layer_norm is not None and self.ctx.dropout_add_backend == "compiled":
                return layer_norm(x, residual=residual, dropout_p=p)
            return ops.bias_dropout_add_layer_norm(x, None, residual, p, p > 0.0, layer_norm,
                                                   backend=self.ctx.dropout_add_backend)

    def forward(self, x: torch.Tensor, inputs: Optional[AttentionInputs], rows: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """x: [s, b, h], or [T, h] of the real tokens that inputs.tokens places (unpadded);
        inputs None: [s, b, h] rows without padding.
        `rows` (unpadded only): the rows of [T, h] whose output is wanted -> [n, h]. Attention
        still reads every token's keys and values; all that follows it is token-wise, so it
        runs on those rows alone."""
        residual = x if rows is None else x.index_select(0, rows)
        attention, attn_norm, mlp_norm = (getattr(self, n) for n in (self.attn_name, self.attn_norm_name,
                                                                       self.mlp_norm_name))
        if self.pre_ln:
            h = attn_norm(x) if attn_norm is not None else x
            x = self._epilogue(attention(h, inputs, rows), residual)
            return self._epilogue(self.mlp(mlp_norm(x)), x, p=self.mlp_dropout_p)
        x = self._epilogue(attention(x, inputs, rows), residual, attn_norm)
        return self._epilogue(self.mlp(x), x, mlp_norm, p=self.mlp_dropout_p)


class TransformerBlock(nn.Module):
    """A stack of transformer layers keyed by their global number ("layers.5.") so that a
    pipeline stage's layers initialise, and save, exactly like the same layers at PP=1; and
    the final norm of a pre-LN stack on the last stage."""

    def __init__(self, ctx: BuildContext, layer_ids: Optional[Sequence[int]] = None, final_layernorm: bool = True):
        super().__init__()
        spec = ctx.spec
        layer_ids = range(spec.num_layers) if layer_ids is None else layer_ids
        self.ctx = ctx
        self.layers = nn.ModuleDict({str(i): TransformerLayer(ctx, i) for i in layer_ids})
        # Pre-LN stacks end with a norm (the last layer's output is un-normalised).
        self.final_norm_name = spec.names.final_norm
        final = ctx.norm() if spec.pre_norm and final_layernorm else None
        self.add_module(self.final_norm_name, final)
        if final is not None:
            describe_module(final, placement="last")
            set_hf_names(self, norm_hf_names(self.final_norm_name, final, spec.hf("final_norm")))
        self.full_recompute = ctx.config.recompute_granularity == "full"

    def forward(self, x: torch.Tensor, inputs: AttentionInputs, layer_ids: Optional[Sequence[int]] = None,
                apply_final_layernorm: bool = True, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Runs `layer_ids` (default: all held layers, in order), then the final norm. With
        inputs.tokens, x is [T, h] of the real tokens (see megabert.model.unpad); `rows`: the
        last layer computes its output at these rows of [T, h] alone -> [n, h]."""
        layers = list(self.layers.values() if layer_ids is None else (self.layers[str(i)] for i in layer_ids))
        for i, layer in enumerate(layers):
            layer_rows = rows if i == len(layers) - 1 else None
            if self.full_recompute and self.training:
                x = checkpoint(layer, self.ctx.rng, x, inputs, layer_rows)
            else:
                x = layer(x, inputs, layer_rows)
        final = getattr(self, self.final_norm_name)
        if apply_final_layernorm and final is not None:
            x = final(x)
        return x


def compile_layers(model: nn.Module, cuda_graphs: bool = False) -> int:
    """torch.compile every TransformerLayer of `model` in place; returns how many.

    Layers rather than the whole model: the pipeline schedule, activation recompute
    (`checkpoint` around a layer) and the embeddings and heads stay eager Python around
    them, and every layer runs the same compiled graph (one compilation per mode, train
    and eval, whatever the depth; a second one for a last layer computed at the heads'
    positions alone, see BertBackbone.forward_chunk). `nn.Module.compile` keeps parameter names and state
    dicts as they are, so checkpoints do not change.

    fallback_random: dropout draws from the default generator through ATen's kernels, as
    in eager mode, instead of Inductor's own random numbers. So the compiled layers drop
    exactly what eager mode drops (the losses agree with dropout on too), replicated
    activations get the same mask on every TP rank, and activation recompute replays the
    masks by restoring the generator, as in eager mode.

    cuda_graphs: the layers' inputs have the same shapes at every call (packed rows,
    megabert.model.packed): torch.compile's "reduce-overhead" (Inductor's CUDA graph trees:
    each compiled graph, forward and backward, replayed as one CUDA graph) with static shapes.
    """
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer)]
    # mode="reduce-overhead" is options={"triton.cudagraphs": True} (torch._inductor.list_mode_options);
    # torch.compile takes a mode or options, not both.
    options = {"fallback_random": True, **({"triton.cudagraphs": True} if cuda_graphs else {})}
    for layer in layers:
        layer.compile(options=options, dynamic=False if cuda_graphs else None)
    return len(layers)
