"""Rotary position embeddings (Su et al. 2021) as ModernBERT applies them.

Global and local layers rotate with different bases (config.global_rope_theta /
local_rope_theta). In the padded [s, b] layout a token's position is its slot in the row, as
transformers counts; in the unpadded [T] one it is the token's offset from its sequence's
start in cu_seqlens, so that once samples are packed into a row each sample starts at 0.
NOTE: with right padding (what ModernBERT's tokenizer does) the two agree; with left padding
the unpadded layout counts from the first real token and transformers from the row's start.

The numbers follow transformers' ModernBertRotaryEmbedding and apply_rotary_pos_emb: the
angles in fp32, cos/sin cast to the activations' dtype, the rotation in fp32, the result
cast back.
"""
from __future__ import annotations


import torch


def inverse_frequencies(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """[d/2]: 1 / theta^(2i/d)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """positions [...] (int) -> cos, sin [..., d] in `dtype` (each half of d repeats the angles)."""
    freqs = positions[..., None].float() * inverse_frequencies(head_dim, theta, positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d] rotated by angles whose cos/sin broadcast to it; fp32 math, x's dtype out."""
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


def unpadded_positions(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T]: each token's offset within its sequence (sequence i is tokens cu_seqlens[i] ..
    cu_seqlens[i + 1])."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=num_tokens)
    return torch.arange(num_tokens, device=cu_seqlens.device) - starts


def padded_positions(s: int, b: int, device) -> torch.Tensor:
    """[s, b]: each slot's index in its row, as transformers counts (padding slots too)."""
    return torch.arange(s, device=device)[:, None].expand(s, b)


class RotaryTables:
    """cos/sin of one micro-batch for both layer types, made on first use and read by every
    layer (O(tokens x d) once, not per layer). `positions`: [T] unpadded or [s, b] padded."""

    def __init__(self, positions: torch.Tensor, head_dim: int, global_theta: float, local_theta: float):
        self.positions, self.head_dim = positions, head_dim
        self._theta = {True: global_theta, False: local_theta}
        self._tables: dict = {}

    def get(self, is_global: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [..., 1, d] in `dtype` (the activations'): broadcast over [..., heads, d]."""
        key = (is_global, dtype)
        if key not in self._tables:
            cos, sin = cos_sin(self.positions, self.head_dim, self._theta[is_global], dtype)
            self._tables[key] = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return self._tables[key]
