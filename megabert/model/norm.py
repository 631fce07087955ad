"""The norms: LayerNorm over `megabert.ops.layer_norm` and RMSNorm over `megabert.ops.rms_norm`
(each the fused kernel or PyTorch, as the resolved --layernorm-backend says)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn as nn

from megabert import ops
from megabert.ops.reference import rms_norm_reference
from megabert.parallel.param_spec import describe
from megabert.tensor_parallel.gemm_copies import GemmCopies, gemm_weight


class LayerNorm(nn.Module):
    """LayerNorm over the last dim. With `sequence_parallel` each TP rank normalises its
    own slice of the sequence, so the parameters' gradients are partial and are summed
    over the TP group before the optimizer step (their spec says so)."""

    def __init__(self, hidden_size: int, eps: float, *, backend: str = "torch", sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None, bias: bool = True,
                 bf16_residual: bool = False):
        """`bias=False`: no bias parameter (ModernBERT's norm_bias false). `bf16_residual`
        (--bf16-residual): a bf16 input under bf16 autocast is normalised in bf16 (affine)."""
        super().__init__()
        self.eps, self.backend, self.bf16_residual = eps, backend, bf16_residual
        self.gemm_copies: Optional[GemmCopies] = None  # the parameters' bf16 copies (MasterWeights')
        common = dict(weight_decay=False, sequence_parallel=sequence_parallel)
        self.weight = describe(nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device)),
                               init="ones", **common)
        if bias:
            self.bias = describe(nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device)),
                                 init="zeros", **common)
        else:
            self.register_parameter("bias", None)
            # The fused kernel takes a bias: zeros add nothing (its gradient is computed and dropped).
            self.register_buffer("_zero_bias", torch.zeros(hidden_size, dtype=params_dtype, device=device),
                                 persistent=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, dropout_p: float = 0.0) -> torch.Tensor:
        """With `residual`: layer_norm(residual + dropout(x, dropout_p)) as one torch.compile'd
        epilogue (megabert.ops.epilogues; the transformer layer's 'compiled' backend), this
        module's parameters read inside its own forward (where ZeRO-3 has gathered them)."""
        if residual is not None:
            return ops.bias_dropout_add_layer_norm(x, None, residual, dropout_p, dropout_p > 0.0, self,
                                                   backend="compiled")
        weight, bias, precision = self.affine(x)
        with precision:
            if self.backend == "fused":
                return ops.layer_norm(x, weight, bias, self.eps)
            return torch.nn.functional.layer_norm(x, (x.size(-1),), weight, bias, self.eps)

    def affine(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor], contextlib.AbstractContextManager]:
        """(weight, bias, the context to normalise in) for input `x`. Autocast runs LayerNorm
        in fp32 and returns fp32, so the residual stream it feeds stays fp32 and every GEMM
        after it casts its input to bf16. With --bf16-residual a bf16 `x` under bf16 autocast
        is normalised outside autocast with bf16 parameters (MasterWeights' copies, made
        once per step; cast here without them): PyTorch's kernel computes in fp32 inside and
        writes bf16, the stream stays bf16 (Megatron-LM's bf16 model)."""
        bias = self.bias if self.bias is not None or self.backend != "fused" else self._zero_bias
        device = x.device.type
        if not (self.bf16_residual and x.dtype == torch.bfloat16 and _bf16_autocast(device)):
            return self.weight, bias, contextlib.nullcontext()
        weight = gemm_weight(self.weight, self.gemm_copies).to(x.dtype)
        if self.bias is not None:
            bias = gemm_weight(self.bias, self.gemm_copies).to(x.dtype)
        elif bias is not None:  # the fused kernel's zeros, a buffer with no copy
            bias = bias.to(x.dtype)
        return weight, bias, torch.autocast(device, enabled=False)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}, backend={self.backend}"


def norm_hf_names(name: str, norm: nn.Module, table: dict[str, str]) -> dict[str, str]:
    """`table`'s Hugging Face names ({parameter: HF name}) of the parameters `norm` holds, under
    its module name `name`: a LayerNorm without bias and an RMSNorm hold no bias."""
    held = dict(norm.named_parameters(recurse=False))
    return {f"{name}.{k}": v for k, v in table.items() if k in held}


def _bf16_autocast(device: str) -> bool:
    return torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.bfloat16


def residual_stream(x: torch.Tensor, bf16_residual: bool) -> torch.Tensor:
    """The embeddings' output as the residual stream starts: with --bf16-residual under bf16
    autocast in bf16 (one cast per micro-batch: the embeddings sum and normalise in fp32), else
    as it is."""
    return x.to(torch.bfloat16) if bf16_residual and _bf16_autocast(x.device.type) else x


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim (Zhang & Sennrich 2019), as
    transformers' Llama-family RMSNorm computes it: in fp32, cast back to the input's dtype
    before the weight multiplies it. With `sequence_parallel` the weight's gradient is partial
    over the TP group, as LayerNorm's."""

    def __init__(self, hidden_size: int, eps: float, *, backend: str = "torch", sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32, device=None, bf16_residual: bool = False):
        super().__init__()
        self.eps, self.backend, self.bf16_residual = eps, backend, bf16_residual
        self.weight = describe(nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device)),
                               init="ones", weight_decay=False, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, dropout_p: float = 0.0) -> torch.Tensor:
        """With `residual`: rms_norm(residual + dropout(x, dropout_p)) (a post-LN epilogue; the
        add stays in PyTorch, the norm is the kernel's with backend 'fused')."""
        if residual is not None:
            x = residual + torch.nn.functional.dropout(x, dropout_p, dropout_p > 0.0)
        # NOTE: MasterWeights keeps no copy of an RMSNorm's weight: with --bf16-residual it is
        # cast here at each use (a vector of the hidden size).
        weight = self.weight.to(x.dtype) if self.bf16_residual and x.dtype == torch.bfloat16 else self.weight
        if self.backend == "fused":
            return ops.rms_norm(x, weight, self.eps)
        return rms_norm_reference(x, weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}, rms, backend={self.backend}"
