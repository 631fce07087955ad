"""Core attention, softmax(Q K^T / sqrt(d)) V, with a choice of backend made once.

torch: explicit scores, `scaled_masked_softmax`, dropout, matmul (the reference).
sdpa:  torch.nn.functional.scaled_dot_product_attention (flash / memory-efficient).
fused: explicit scores through megabert's fused softmax kernel.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F

from megabert.ops.dispatch import resolve_backend
from megabert.ops.reference import scaled_masked_softmax_reference
from megabert.ops.softmax import scaled_masked_softmax


def resolve_attention_backend(backend: str, device_type: str = "cpu") -> str:
    """'auto' -> 'fused' on the CPU when its kernels are built, else 'sdpa' (on CUDA
    always 'sdpa'; see dispatch.resolve_backend). Logged once per choice."""
    return resolve_backend("attention", "--attention-backend", backend, "sdpa", device_type)


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], *,
                   backend: str, dropout_p: float = 0.0, rng_fork=None) -> torch.Tensor:
    """q, k, v: [b, heads, s, head_dim]; mask: bool, True = masked, broadcastable to
    [b, heads, sq, sk]. `rng_fork()` is the context in which dropout draws (the
    per-TP-rank stream, since heads are split over TP ranks). Returns [b, heads, sq, head_dim]."""
    # No dropout, no draw: the stream stays as it is (a swap is a graph break under torch.compile).
    fork = rng_fork if rng_fork is not None and dropout_p > 0.0 else contextlib.nullcontext
    if backend == "sdpa":
        with fork():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else ~mask,
                                                  dropout_p=dropout_p)
    scale = 1.0 / math.sqrt(q.size(-1))
    scores = torch.matmul(q, k.transpose(-2, -1))  # [b, n, sq, sk]
    if backend == "fused":
        probs = scaled_masked_softmax(scores, mask, scale)
    elif backend == "torch":
        probs = scaled_masked_softmax_reference(scores, mask, scale)
    else:
        raise ValueError(f"unknown attention backend {backend!r}")
    if dropout_p > 0.0:
        with fork():
            probs = F.dropout(probs, p=dropout_p)
    return torch.matmul(probs, v)
