"""What each parameter is, carried by the parameter itself.

A `ParamSpec` says how a tensor is split over tensor-parallel ranks, which pipeline
stage holds it, how it is initialised, whether it takes weight decay, whether its
gradient is partial over the TP group, where padding rows are, and what Hugging Face
calls it. Layers attach it when they create a parameter; everything downstream
(initialisation, checkpoint sharding and resharding, optimizer groups, gradient
reductions, HF conversion) reads it instead of guessing from the parameter's name, so
renaming an attribute cannot silently change how a tensor is treated.

Checkpoints store the table {name: spec} of the model that wrote them, so offline tools
(resharding, conversion) work from the same descriptions without building a model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.nn as nn

from megabert.errors import ConfigError

ATTR = "megabert_spec"
PLACEMENTS = ("first", "last", "tied", "layer")
INITS = ("normal", "zeros", "ones")


@dataclass(frozen=True)
class ParamSpec:
    partition_dim: Optional[int] = None
    """Dim split over the tensor-parallel group; None: replicated on every TP rank."""
    partition_stride: int = 1
    """>1: the full tensor is `stride` matrices stacked along partition_dim ([Q; K; V]) and
    each rank holds its slice of every one (megabert.tensor_parallel.shard)."""
    init: str = "normal"
    """normal: N(0, init_method_std) drawn from (seed, parameter name); zeros; ones."""
    valid_rows: Optional[int] = None
    """Rows past this are vocab padding: zero, never a user-visible logit, cut on export."""
    weight_decay: bool = True
    """False for biases and LayerNorm parameters (BERT's rule)."""
    sequence_parallel: bool = False
    """Gradient is partial over the TP group (each rank saw a slice of the sequence)."""
    placement: str = "layer"
    """Pipeline stage: first (embeddings), last (final LayerNorm, pooler, heads), tied
    (word embeddings: first stage, and a copy on the last for the MLM projection), layer
    (the stage holding `layer`)."""
    layer: Optional[int] = None
    """Global transformer layer number, for placement 'layer'."""
    hf_names: tuple[str, ...] = ()
    """Hugging Face name(s). Several: the tensor is theirs concatenated along dim 0."""

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")
        if self.placement == "layer" and self.layer is None:
            raise ValueError("placement 'layer' needs the layer number")

    @property
    def is_tensor_parallel(self) -> bool:
        return self.partition_dim is not None

    def to_dict(self) -> dict:
        """Plain values only: checkpoints are read through safe_pickle (tensors and plain values)."""
        d = dataclasses.asdict(self)
        d["hf_names"] = list(self.hf_names)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ParamSpec":
        return cls(**{**d, "hf_names": tuple(d.get("hf_names", ()))})


def describe(param: nn.Parameter, **fields) -> nn.Parameter:
    """Attaches (or updates) `param`'s spec; returns the parameter."""
    current = getattr(param, ATTR, None)  # a torch Parameter: none until it is first described
    spec = dataclasses.replace(current, **fields) if current is not None else _new_spec(**fields)
    setattr(param, ATTR, spec)
    # Derived attributes under Megatron's names, which Megatron-style engines read: their
    # gradient norm counts a `tensor_model_parallel` parameter on every TP rank.
    param.tensor_model_parallel = spec.is_tensor_parallel
    param.partition_dim = spec.partition_dim if spec.is_tensor_parallel else -1
    param.partition_stride = spec.partition_stride
    return param


def _new_spec(**fields) -> ParamSpec:
    # A spec is created before the model knows the layer (the layer sets it right after),
    # so start as "last" and let the owner override.
    fields.setdefault("placement", "last" if fields.get("layer") is None else "layer")
    return ParamSpec(**fields)


def spec_of(param: torch.Tensor, name: str = "parameter") -> ParamSpec:
    spec = getattr(param, ATTR, None)  # a torch Parameter built outside megabert's layers has none
    if spec is None:
        raise ConfigError(f"{name} has no ParamSpec: build parameters with megabert's layers, or attach one with "
                          f"megabert.parallel.param_spec.describe(param, ...) so sharding, initialisation and "
                          f"export know what it is")
    return spec


def describe_module(module: nn.Module, **fields) -> None:
    """Sets `fields` on every parameter of `module` (e.g. its layer and placement)."""
    for name, p in module.named_parameters():
        spec_of(p, name)  # a parameter without a spec is a construction error, not a default
        describe(p, **fields)


def set_hf_names(module: nn.Module, names: dict[str, Iterable[str] | str]) -> None:
    """{local parameter path: HF name or names}. A path the module does not have is an
    error here, at construction, not a silent gap at export time."""
    own = dict(module.named_parameters())
    for local, hf in names.items():
        if local not in own:
            raise ConfigError(f"{type(module).__name__} has no parameter {local!r} to map to Hugging Face "
                              f"{hf!r}; a subclass renamed it: update its set_hf_names table")
        describe(own[local], hf_names=(hf,) if isinstance(hf, str) else tuple(hf))


def spec_table(model: nn.Module) -> dict[str, ParamSpec]:
    """{parameter name: spec} of a built model; every parameter must carry one."""
    return {name: spec_of(p, name) for name, p in model.named_parameters()}


def table_to_dict(table: dict[str, ParamSpec]) -> dict[str, dict]:
    return {name: spec.to_dict() for name, spec in table.items()}


def table_from_dict(d: dict[str, dict]) -> dict[str, ParamSpec]:
    return {name: ParamSpec.from_dict(s) for name, s in d.items()}
