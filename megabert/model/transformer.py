"""The BERT transformer layer (post-LN as the original, pre-LN as an option) and stack."""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.nn as nn

from megabert import ops
from megabert.model.attention import SelfAttention
from megabert.model.context import BuildContext
from megabert.model.unpad import TokenLayout
from megabert.parallel.param_spec import describe_module, set_hf_names
from megabert.tensor_parallel import ColumnParallelLinear, RowParallelLinear, checkpoint


class MLP(nn.Module):
    """h -> ffn (column-parallel) -> GELU -> h (row-parallel): one all-reduce in total."""

    def __init__(self, ctx: BuildContext, hf_prefix: str):
        """`hf_prefix`: this layer's Hugging Face names start with it ("bert.encoder.layer.3.")."""
        super().__init__()
        cfg = ctx.config
        self.dense_h_to_4h = ColumnParallelLinear(cfg.hidden_size, cfg.ffn_hidden_size, **ctx.tp_kwargs())
        self.dense_4h_to_h = RowParallelLinear(cfg.ffn_hidden_size, cfg.hidden_size, input_is_parallel=True,
                                               **ctx.row_parallel_kwargs())
        self.epilogue_backend = ctx.dropout_add_backend
        set_hf_names(self, {f"dense_h_to_4h.{k}": f"{hf_prefix}intermediate.dense.{k}" for k in ("weight", "bias")})
        set_hf_names(self, {f"dense_4h_to_h.{k}": f"{hf_prefix}output.dense.{k}" for k in ("weight", "bias")})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Exact (erf) GELU, as BERT and transformers' "gelu". The 'compiled' epilogue backend
        # fuses the bias add into it (megabert.ops.epilogues); otherwise the GEMM adds it
        # (addmm), which costs no pass of its own.
        if self.epilogue_backend == "compiled":
            h = self.dense_h_to_4h(x, epilogue=_compiled_bias_gelu)
        else:
            h = ops.bias_gelu(self.dense_h_to_4h(x), None)
        return self.dense_4h_to_h(h)


def _compiled_bias_gelu(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return ops.bias_gelu(y, bias, backend="compiled")


class TransformerLayer(nn.Module):
    def __init__(self, ctx: BuildContext, layer_number: int):
        super().__init__()
        hf = f"bert.encoder.layer.{layer_number}."
        self.ctx = ctx
        self.pre_ln = ctx.config.layernorm_position == "pre"
        self.attention = SelfAttention(ctx, hf + "attention.")
        self.attention_layernorm = ctx.layer_norm()
        self.mlp = MLP(ctx, hf)
        self.mlp_layernorm = ctx.layer_norm()
        self.dropout_p = ctx.config.hidden_dropout
        # transformers names the LayerNorms by what follows them, post-LN's order.
        set_hf_names(self, {f"attention_layernorm.{k}": f"{hf}attention.output.LayerNorm.{k}" for k in ("weight", "bias")})
        set_hf_names(self, {f"mlp_layernorm.{k}": f"{hf}output.LayerNorm.{k}" for k in ("weight", "bias")})
        describe_module(self, placement="layer", layer=layer_number)

    def _epilogue(self, x: torch.Tensor, residual: torch.Tensor, layer_norm: Optional[nn.Module] = None
                  ) -> torch.Tensor:
        """layer_norm(residual + dropout(x)) (no LayerNorm when None): with the 'compiled'
        backend one fused function (inside the LayerNorm's forward when there is one), else
        the fused CPU kernel or PyTorch's dropout + add, then the LayerNorm, as
        ctx.dropout_add_backend says."""
        # Replicated activations: the default stream, identical on TP ranks. Sequence-
        # parallel slices: the per-rank stream, so slices get independent masks. The fused
        # kernel draws its Philox key from the default generator, which the fork swaps (the
        # compiled epilogue draws with ATen's dropout from it too).
        p = self.dropout_p if self.training else 0.0
        # No draw, so no stream to swap in (a swap is a graph break under torch.compile).
        fork = self.ctx.rng.fork() if self.ctx.sequence_parallel and p else contextlib.nullcontext()
        with fork:
            if layer_norm is not None and self.ctx.dropout_add_backend == "compiled":
                return layer_norm(x, residual=residual, dropout_p=p)
            return ops.bias_dropout_add_layer_norm(x, None, residual, p, p > 0.0, layer_norm,
                                                   backend=self.ctx.dropout_add_backend)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor], tokens: Optional[TokenLayout] = None,
                rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: [s, b, h], or [T, h] of the real tokens that `tokens` places (unpadded). `rows`
        (unpadded only): the rows of [T, h] whose output is wanted -> [n, h]. Attention still
        reads every token's keys and values; all that follows it is token-wise, so it runs on
        those rows alone."""
        residual = x if rows is None else x.index_select(0, rows)
        if self.pre_ln:
            x = self._epilogue(self.attention(self.attention_layernorm(x), mask, tokens, rows), residual)
            return self._epilogue(self.mlp(self.mlp_layernorm(x)), x)
        x = self._epilogue(self.attention(x, mask, tokens, rows), residual, self.attention_layernorm)
        return self._epilogue(self.mlp(x), x, self.mlp_layernorm)


class TransformerBlock(nn.Module):
    """A stack of transformer layers keyed by their global number ("layers.5.") so that a
    pipeline stage's layers initialise, and save, exactly like the same layers at PP=1."""

    def __init__(self, ctx: BuildContext, layer_ids: Optional[Sequence[int]] = None, final_layernorm: bool = True):
        super().__init__()
        layer_ids = range(ctx.config.num_layers) if layer_ids is None else layer_ids
        self.ctx = ctx
        self.layers = nn.ModuleDict({str(i): TransformerLayer(ctx, i) for i in layer_ids})
        # Pre-LN stacks end with a LayerNorm (the last layer's output is un-normalised).
        self.final_layernorm = ctx.layer_norm() if ctx.config.layernorm_position == "pre" and final_layernorm \
            else None
        if self.final_layernorm is not None:
            describe_module(self.final_layernorm, placement="last")
        self.full_recompute = ctx.config.recompute_granularity == "full"

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor], layer_ids: Optional[Sequence[int]] = None,
                apply_final_layernorm: bool = True, tokens: Optional[TokenLayout] = None,
                rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Runs `layer_ids` (default: all held layers, in order), then the final LayerNorm.
        With `tokens`, x is [T, h] of the real tokens (see megabert.model.unpad); `rows`: the
        last layer computes its output at these rows of [T, h] alone -> [n, h]."""
        layers = list(self.layers.values() if layer_ids is None else (self.layers[str(i)] for i in layer_ids))
        for i, layer in enumerate(layers):
            layer_rows = rows if i == len(layers) - 1 else None
            if self.full_recompute and self.training:
                x = checkpoint(layer, self.ctx.rng, x, mask, tokens, layer_rows)
            else:
                x = layer(x, mask, tokens, layer_rows)
        if apply_final_layernorm and self.final_layernorm is not None:
            x = self.final_layernorm(x)
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
    # Another family's layer says it is one (ModernBertLayer) by `compiled_as_layer`.
    layers = [m for m in model.modules() if isinstance(m, TransformerLayer) or getattr(m, "compiled_as_layer", False)]
    # mode="reduce-overhead" is options={"triton.cudagraphs": True} (torch._inductor.list_mode_options);
    # torch.compile takes a mode or options, not both.
    options = {"fallback_random": True, **({"triton.cudagraphs": True} if cuda_graphs else {})}
    for layer in layers:
        layer.compile(options=options, dynamic=False if cuda_graphs else None)
    return len(layers)
