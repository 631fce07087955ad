"""Core attention, softmax(Q K^T / sqrt(d)) V, with a choice of backend made once.

torch:  explicit scores, `scaled_masked_softmax`, dropout, matmul (the reference).
sdpa:   torch.nn.functional.scaled_dot_product_attention (flash / memory-efficient).
fused:  explicit scores through megabert's fused softmax kernel.
varlen: attention over real tokens only (megabert.ops.varlen_attention) when the encoder is
        unpadded; a padded batch (no --unpad-input) runs `padded_fallback`'s backend.
"""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Optional

import torch
import torch.nn.functional as F

from megabert import fused_kernels
from megabert.errors import ConfigError
from megabert.ops.compile_hints import assume_constant_result
from megabert.ops.dispatch import resolve_backend, say_once
from megabert.ops.reference import scaled_masked_softmax_reference
from megabert.ops.softmax import scaled_masked_softmax
from megabert.ops.varlen_attention import choose_varlen_impl, flash_varlen_available


def resolve_attention_backend(backend: str, device_type: str = "cpu", head_dim: Optional[int] = None) -> str:
    """'auto' -> 'varlen' on the CPU when its kernels are built for AVX2 or AVX-512, and on
    CUDA when this torch and GPU run FlashAttention and it takes `head_dim` (a multiple of 8
    up to 256); else as dispatch.resolve_backend ('fused' on the CPU when built, else
    'sdpa'). The dtype is known per call: on CUDA, varlen runs FlashAttention in fp16/bf16
    (autocast) and one padded SDPA call otherwise (ops.varlen_attention). 'fused' as
    dispatch.resolve_backend. Logged once per choice."""
    # The varlen kernel is measured to beat the padded paths with AVX2 (docs/performance.md);
    # compiled for the baseline ISA it loses to PyTorch's GEMMs at seq 512, so there `auto`
    # keeps the padded fused softmax (`--attention-backend varlen` still selects it). On an
    # H100, BERT-large bf16 seq 512 steps 1.09-1.12x faster with FlashAttention's varlen
    # kernel than with SDPA and a padding mask, on padded and on full batches alike
    # (`make bench-gpu`).
    if backend == "auto" and device_type == "cpu" and fused_kernels.cpu_isa() in ("avx2", "avx512"):
        backend = "varlen"
    if (backend == "auto" and device_type == "cuda" and head_dim is not None
            and choose_varlen_impl("cuda", torch.bfloat16, head_dim, None, flash_varlen_available())[0] == "flash"):
        backend = "varlen"
    if backend == "varlen":
        if device_type not in ("cpu", "cuda"):
            raise ConfigError(f"--attention-backend varlen: no varlen attention for {device_type}; "
                              f"use --attention-backend sdpa")
        say_once(("attention", backend), logging.INFO, "attention backend: %s", backend)
        return backend
    return resolve_backend("attention", "--attention-backend", backend, "sdpa", device_type)


@assume_constant_result  # as dispatch.use_fused_kernel: said for real, a constant of a compiled graph
def padded_fallback(backend: str, device_type: str) -> str:
    """The backend a padded batch runs under `backend`: varlen needs the unpadded encoder
    (--unpad-input, pretrain_bert.py's default), so padded batches take the fused softmax
    on the CPU (when built) and SDPA elsewhere, said once."""
    if backend != "varlen":
        return backend
    fallback = "fused" if device_type == "cpu" and fused_kernels.is_available("cpu") else "sdpa"
    say_once(("attention", "padded", fallback), logging.INFO,
             "attention backend varlen: padded batches (no --unpad-input) run %s", fallback)
    return fallback


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], *,
                   backend: str, dropout_p: float = 0.0, rng_fork=None) -> torch.Tensor:
    """q, k, v: [b, heads, s, head_dim]; mask: bool, True = masked, broadcastable to
    [b, heads, sq, sk]. `rng_fork()` is the context in which dropout draws (the
    per-TP-rank stream, since heads are split over TP ranks). Returns [b, heads, sq, head_dim]."""
    # No dropout, no draw: the stream stays as it is (a swap is a graph break under torch.compile).
    fork = rng_fork if rng_fork is not None and dropout_p > 0.0 else contextlib.nullcontext
    backend = padded_fallback(backend, q.device.type)
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
