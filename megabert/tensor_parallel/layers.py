"""Column- and row-parallel linear layers and the vocab-parallel embedding.

Weights are created as the full matrix by `init_method` and then sliced, so a model
built at TP=1, 2 or 4 from one seed holds the same numbers, only distributed
differently. `init_method=None` defers that to the owning model, which initialises
every parameter from its real name once construction is complete (megabert.model.init).
Every parameter carries a ParamSpec (partition dim and stride, weight decay, ...) that
checkpoint sharding, resharding and the optimizer read.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megabert.parallel.param_spec import describe
from megabert.tensor_parallel.gemm_copies import GemmCopies, gemm_weight
from megabert.tensor_parallel.mappings import (Group, copy_to_tp, gather_from_sp, gather_from_tp, group_rank,
                                               group_size, reduce_from_tp, reduce_scatter_to_sp, scatter_to_tp)

InitMethod = Callable[[torch.Tensor], None]
LinearFn = Callable[..., torch.Tensor]
"""F.linear's signature: (input, weight, bias=None) -> input @ weight.T + bias."""


def default_init(tensor: torch.Tensor) -> None:
    nn.init.normal_(tensor, mean=0.0, std=0.02)


def shard(full: torch.Tensor, dim: int, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    """This rank's slice of `full` along `dim`.

    stride > 1 means `full` is `stride` matrices stacked along dim (e.g. [Q; K; V]) and
    each rank takes its slice of every one: rank r gets [Q_r; K_r; V_r], so its heads'
    query, key and value stay together.
    """
    if size == 1:
        return full.clone()
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in blocks], dim=dim).clone()


def unshard(parts: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every rank's slice, in rank order."""
    if len(parts) == 1:
        return parts[0].clone()
    per_rank = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([torch.cat([pr[s] for pr in per_rank], dim=dim) for s in range(stride)], dim=dim)


def _sharded_param(full_shape, dim, stride, init_method: Optional[InitMethod], group, dtype, device) -> nn.Parameter:
    if init_method is None:  # deferred: the model initialises it by name after construction
        local_shape = list(full_shape)
        local_shape[dim] //= group_size(group)
        local = torch.empty(local_shape, dtype=dtype, device=device)
    else:
        full = torch.empty(full_shape, dtype=torch.float32)
        init_method(full)
        local = shard(full, dim, group_rank(group), group_size(group), stride).to(device=device, dtype=dtype)
    return describe(nn.Parameter(local), partition_dim=dim, partition_stride=stride)


def _bias(size: int, dtype, device, **spec) -> nn.Parameter:
    # Biases start at zero (BERT) and take no weight decay.
    return describe(nn.Parameter(torch.zeros(size, dtype=dtype, device=device)), init="zeros",
                    weight_decay=False, **spec)


class ColumnParallelLinear(nn.Module):
    """Y = X A + b with A split by columns: rank r holds A[:, r] and computes Y[:, r].

    Input is replicated over the TP group (or, with sequence parallelism, sharded along
    the sequence and all-gathered here); output is split along its last dim unless
    `gather_output`.
    """

    def __init__(self, in_features: int, out_features: int, *, tp_group: Group, bias: bool = True,
                 gather_output: bool = False, init_method: Optional[InitMethod] = default_init, stride: int = 1,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None):
        super().__init__()
        tp = group_size(tp_group)
        if out_features % tp:
            raise ValueError(f"output size {out_features} is not divisible by tensor parallel size {tp}")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.gather_output, self.sequence_parallel = tp_group, gather_output, sequence_parallel
        self.linear: LinearFn = F.linear  # the GEMM; use_linear swaps it (ZeRO-3's)
        self.gemm_copies: Optional[GemmCopies] = None  # --bf16's weight copies (training.precision.MasterWeights)
        self.weight = _sharded_param((out_features, in_features), 0, stride, init_method, tp_group,
                                     params_dtype, device)
        if bias:
            # Sharded like the output columns.
            self.bias = _bias(out_features // tp, params_dtype, device, partition_dim=0, partition_stride=stride)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor,
                epilogue: Optional[Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]] = None
                ) -> torch.Tensor:
        """`epilogue(y, bias)`: applied to the GEMM's output without the bias, to add it fused
        with what follows (megabert.ops.epilogues' bias + GELU). The bias is read here, inside
        this module's forward, where ZeRO-3 has gathered it."""
        if self.sequence_parallel:
            x = gather_from_sp(x, self.tp_group)  # [s/tp, b, h] -> [s, b, h]
        else:
            x = copy_to_tp(x, self.tp_group)
        bias = None if self.bias is None else gemm_weight(self.bias, self.gemm_copies)
        if epilogue is not None:
            y = epilogue(self.linear(x, gemm_weight(self.weight, self.gemm_copies)), bias)
        else:
            y = self.linear(x, gemm_weight(self.weight, self.gemm_copies), bias)
        return gather_from_tp(y, self.tp_group) if self.gather_output else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={group_size(self.tp_group)}"


class RowParallelLinear(nn.Module):
    """Y = X A + b with A split by rows: rank r holds A[r, :] and X[:, r]; the partial
    products are summed over the TP group (or reduce-scattered along the sequence with
    sequence parallelism). The bias is replicated and added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, *, tp_group: Group, bias: bool = True,
                 input_is_parallel: bool = True, init_method: Optional[InitMethod] = default_init,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None, bias_in_output_dtype: bool = False):
        """`bias_in_output_dtype` (--bf16-residual): the bias is added in the GEMM output's dtype
        (bf16 under autocast), not promoted with it to the fp32 master's."""
        super().__init__()
        self.bias_in_output_dtype = bias_in_output_dtype
        tp = group_size(tp_group)
        if in_features % tp:
            raise ValueError(f"input size {in_features} is not divisible by tensor parallel size {tp}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence parallelism needs input_is_parallel=True")
        self.in_features, self.out_features = in_features, out_features
        self.tp_group, self.input_is_parallel, self.sequence_parallel = tp_group, input_is_parallel, sequence_parallel
        self.linear: LinearFn = F.linear  # the GEMM; use_linear swaps it (ZeRO-3's)
        self.gemm_copies: Optional[GemmCopies] = None  # --bf16's weight copies (training.precision.MasterWeights)
        self.weight = _sharded_param((out_features, in_features), 1, 1, init_method, tp_group, params_dtype, device)
        if bias:
            # With sequence parallelism each rank sees only its slice of the sequence, so
            # this bias's gradient is partial and must be summed over the TP group.
            self.bias = _bias(out_features, params_dtype, device, sequence_parallel=sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp_group)
        y = self.linear(x, gemm_weight(self.weight, self.gemm_copies))
        y = reduce_scatter_to_sp(y, self.tp_group) if self.sequence_parallel else reduce_from_tp(y, self.tp_group)
        if self.bias is None:
            return y
        # Under autocast the bf16 output plus the fp32 bias is fp32 (type promotion): the
        # residual stream after it is fp32 unless the bias joins the output's dtype.
        if self.bias_in_output_dtype:
            return y + gemm_weight(self.bias, self.gemm_copies).to(y.dtype)
        return y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={group_size(self.tp_group)}"


def use_linear(model: nn.Module, linear: LinearFn) -> int:
    """Has every column- and row-parallel layer in `model` multiply through `linear` (F.linear
    by default) and returns how many. For ZeRO-3, set by the strategy that runs it: its
    memory-efficient linear saves the Parameter itself for backward and gathers it again
    there, where F.linear's autograd saves weight.t(), a view of the gathered storage that
    keeps every gathered weight alive through forward. Per layer, so torch's F.linear stays
    what it is for the rest of the process."""
    layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    for layer in layers:
        layer.linear = linear
    return len(layers)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocab rows: rank r holds rows [r*V/tp, (r+1)*V/tp).

    Each rank looks up the ids in its range and writes zeros elsewhere; the sum over
    the TP group is then the full lookup. `num_embeddings` must be the padded vocab.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group: Group,
                 init_method: Optional[InitMethod] = default_init, params_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None):
        super().__init__()
        tp, rank = group_size(tp_group), group_rank(tp_group)
        if num_embeddings % tp:
            raise ValueError(f"vocab size {num_embeddings} is not divisible by tensor parallel size {tp}; "
                             f"pad it (ModelConfig.padded_vocab_size)")
        self.num_embeddings, self.embedding_dim, self.tp_group = num_embeddings, embedding_dim, tp_group
        per_rank = num_embeddings // tp
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.weight = _sharded_param((num_embeddings, embedding_dim), 0, 1, init_method, tp_group,
                                     params_dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp_group)

    def extra_repr(self) -> str:
        return f"vocab={self.num_embeddings}, dim={self.embedding_dim}, tp={group_size(self.tp_group)}"
