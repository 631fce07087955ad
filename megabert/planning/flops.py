"""Model FLOPs of a BERT-family sample, counted once: the trainer's tflops and MFU figures
(megabert.training.metrics), the step-time planner (step_time.py) and the GPU benchmarks read
them from here."""
from __future__ import annotations

from typing import Optional

from megabert.config import ModelConfig
from megabert.families import encoder_spec


def bert_flops_per_sample(cfg: ModelConfig, seq_len: int, masked_tokens: Optional[int] = None) -> float:
    """Model FLOPs for forward + backward of one sample (Megatron's accounting: 2 FLOPs per
    multiply-add, backward = 2 x forward, activation recompute not counted), from the
    EncoderSpec. Per layer and token: the Q/K/V and output projections (2h(n + 2k)d + 2nd h with
    k key/value heads), the MLP (2hf per matrix: two, or three when gated) and the attention
    core, 4 x keys x nd, where a window layer's token sees at most 2w + 1 keys. BERT (f = 4h,
    k = n) is 24h^2 + 4sh. The LM head adds its transform and 2hV per predicted token (all
    tokens, or only masked ones)."""
    spec = encoder_spec(cfg)
    a, m, h, s = spec.attention, spec.mlp, spec.hidden_size, seq_len
    inner, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    projections = 2 * (h * (inner + 2 * kv) + inner * h) + 2 * h * m.ffn_size * (3 if m.kind == "glu" else 2)
    layers = 0
    for i in range(spec.num_layers):
        w = a.window(i)
        layers += projections + 4 * (s if w is None else min(s, 2 * w + 1)) * inner
    head = spec.mlm_head
    width = head.width or h
    transform = (2 * h * width + (2 * width * h if head.width else 0)) if head.transform else 0
    predicted = s if masked_tokens is None else masked_tokens
    forward = s * layers + predicted * (transform + 2 * h * cfg.vocab_size)
    return 3.0 * forward
