"""What every encoder submodule needs to build itself, passed down explicitly."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megabert.config import ModelConfig
from megabert.model.norm import LayerNorm, RMSNorm
from megabert.families.spec import EncoderSpec
from megabert.parallel.param_spec import describe
from megabert.tensor_parallel.random import RNGStatesTracker


@dataclass
class BuildContext:
    config: ModelConfig  # how the layers compute (backends, recompute, sequence parallelism, ...)
    spec: EncoderSpec  # what the encoder is (megabert.families maps the config onto it)
    tp_group: Optional[dist.ProcessGroup]
    tp_size: int
    rng: RNGStatesTracker  # per-TP-rank dropout stream (attention probs, sequence-parallel regions)
    attention_backend: str  # resolved: torch | sdpa | fused
    layernorm_backend: str  # resolved: torch | fused
    dropout_add_backend: str = "torch"  # resolved: torch | fused
    params_dtype: torch.dtype = torch.float32
    device: Optional[torch.device] = None
    tp_rank: int = 0

    @property
    def sequence_parallel(self) -> bool:
        return self.config.sequence_parallel and self.tp_size > 1

    def tp_kwargs(self) -> dict:
        """Keyword arguments of the column/row-parallel layers. init_method=None: the model
        initialises every parameter by name once it is fully built (megabert.model.init)."""
        return dict(tp_group=self.tp_group, sequence_parallel=self.sequence_parallel, init_method=None,
                    params_dtype=self.params_dtype, device=self.device)

    def row_parallel_kwargs(self) -> dict:
        """tp_kwargs, and the bias added in the output's dtype with --bf16-residual."""
        return dict(self.tp_kwargs(), bias_in_output_dtype=self.config.bf16_residual)

    def norm(self, hidden_size: Optional[int] = None, *, sequence_parallel: Optional[bool] = None) -> nn.Module:
        """A norm of the spec's kind (LayerNorm with or without bias, or RMSNorm)."""
        sp = self.sequence_parallel if sequence_parallel is None else sequence_parallel
        norm = self.spec.norm
        cls = RMSNorm if norm.kind == "rmsnorm" else LayerNorm
        kwargs = {} if norm.kind == "rmsnorm" else {"bias": norm.bias}
        return cls(hidden_size or self.spec.hidden_size, norm.eps, backend=self.layernorm_backend, sequence_parallel=sp,
                   params_dtype=self.params_dtype, device=self.device, bf16_residual=self.config.bf16_residual,
                   **kwargs)

    def linear(self, in_features: int, out_features: int) -> nn.Linear:
        """A replicated nn.Linear (pooler, small heads): normal weight, zero bias."""
        lin = nn.Linear(in_features, out_features, dtype=self.params_dtype, device=self.device)
        describe(lin.weight)
        describe(lin.bias, init="zeros", weight_decay=False)
        return lin
