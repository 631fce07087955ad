"""The MLP of every family, as the spec says: plain (up -> activation -> down, BERT's GELU) or
gated (one up-projection [input; gate] -> act(input) * gate -> down: GeGLU, SwiGLU; the halves
in the order the family's checkpoints keep them, MLPSpec.gate_first).

Tensor parallelism: the up-projection is column-parallel, the down-projection row-parallel,
one all-reduce in total. A gated up-projection [input; gate] (2f x h) is split with stride 2,
so rank r holds [input_r; gate_r], matching columns of both halves, and the product is
rank-local.

The activation after the up-projection is a GEMM epilogue, so --dropout-add-backend (the
layers' epilogue backend) picks how it runs: bias + GELU fused by torch.compile ('compiled'),
the gated act(input) * gate as one CPU kernel each way ('fused', the CPU's auto).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megabert import ops
from megabert.model.context import BuildContext
from megabert.ops.reference import ACTIVATIONS
from megabert.parallel.param_spec import set_hf_names
from megabert.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, ctx: BuildContext, hf_prefix: str):
        """`hf_prefix`: this layer's Hugging Face names start with it ("bert.encoder.layer.3.")."""
        super().__init__()
        spec, mlp = ctx.spec, ctx.spec.mlp
        self.ctx = ctx
        self.gated = mlp.kind == "glu"
        self.gate_first = mlp.gate_first
        self.in_name, self.out_name = spec.names.mlp_in, spec.names.mlp_out
        width = 2 * mlp.ffn_size if self.gated else mlp.ffn_size
        self.add_module(self.in_name, ColumnParallelLinear(spec.hidden_size, width, stride=2 if self.gated else 1,
                                                           bias=mlp.in_bias, **ctx.tp_kwargs()))
        self.add_module(self.out_name, RowParallelLinear(mlp.ffn_size, spec.hidden_size, input_is_parallel=True,
                                                         bias=mlp.out_bias, **ctx.row_parallel_kwargs()))
        set_hf_names(self, {f"{self.in_name}.{k}": v for k, v in spec.hf_layer("mlp_in", hf_prefix).items()
                            if k == "weight" or mlp.in_bias})
        set_hf_names(self, {f"{self.out_name}.{k}": v for k, v in spec.hf_layer("mlp_out", hf_prefix).items()
                            if k == "weight" or mlp.out_bias})
        self.activation = mlp.activation
        self.act = ACTIVATIONS[mlp.activation]
        # Exact GELU on a plain MLP: the bias-GELU epilogue (fused when 'compiled').
        self.bias_gelu = not self.gated and mlp.activation == "gelu"
        self.epilogue_backend = ctx.dropout_add_backend
        self.dropout_p = mlp.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = getattr(self, self.in_name)
        if self.bias_gelu:
            # Exact (erf) GELU, as BERT and transformers' "gelu". The 'compiled' epilogue backend
            # fuses the bias add into it (megabert.ops.epilogues); otherwise the GEMM adds it
            # (addmm), which costs no pass of its own.
            if self.epilogue_backend == "compiled":
                h = up(x, epilogue=_compiled_bias_gelu)
            else:
                h = ops.bias_gelu(up(x), None)
        elif self.gated:
            # u holds this rank's matching columns of both halves; one fused kernel each way on
            # the CPU with the 'fused' epilogue backend, else PyTorch's chunk, act and product.
            h = ops.gated_activation(up(x), self.activation, self.gate_first, backend=self.epilogue_backend)
        else:
            h = self.act(up(x))
        if self.dropout_p > 0.0 and self.training:
            with self.ctx.rng.fork():  # columns differ per TP rank: the per-rank stream
                h = F.dropout(h, self.dropout_p, True)
        return getattr(self, self.out_name)(h)


def _compiled_bias_gelu(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return ops.bias_gelu(y, bias, backend="compiled")
