"""Model FLOPs of a BERT-family sample, counted once: the trainer's tflops and MFU figures
(megabert.training.metrics), the step-time planner (step_time.py) and the GPU benchmarks read
them from here."""
from __future__ import annotations

from typing import Optional

from megabert.config import ModelConfig


def bert_flops_per_sample(cfg: ModelConfig, seq_len: int, masked_tokens: Optional[int] = None) -> float:
    """Model FLOPs for forward + backward of one sample (Megatron's accounting: 2 FLOPs per
    multiply-add, backward = 2 x forward, activation recompute not counted).
    Per layer and token: 24h^2 (QKV, projection, MLP at ffn = 4h) + 4sh (attention); the LM
    head adds 2hV per predicted token (all tokens, or only masked ones). ModernBERT: its
    GeGLU's three ffn x h matrices, and local layers' attention over their window."""
    h, s, ffn = cfg.hidden_size, seq_len, cfg.ffn_hidden_size
    if cfg.model_family == "modernbert":
        # GeGLU: Wi is 2 x ffn wide, then Wo; a local layer's token attends to at most its
        # window (local_attention + 1 keys).
        local = min(s, cfg.local_attention + 1)
        layers = sum(2 * (4 * h * h + 3 * h * ffn) + 4 * (s if cfg.is_global_layer(i) else local) * h
                     for i in range(cfg.num_layers))
    else:
        layers = cfg.num_layers * (2 * (4 * h * h + 2 * h * ffn) + 4 * s * h)
    predicted = s if masked_tokens is None else masked_tokens
    head = predicted * (2 * h * h + 2 * h * cfg.vocab_size)
    forward = s * layers + head
    return 3.0 * forward
