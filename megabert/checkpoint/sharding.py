"""Which slice of each full tensor a (tp, pp) rank holds, read from ParamSpecs.

A spec table {name: ParamSpec} says how each tensor splits over TP ranks and which
pipeline stage holds it, so checkpoints are split and merged in one process without
building a model on every rank (conversion, resharding). A checkpoint carries the table
of the model that wrote it; one written before tables existed gets the table of a
shape-only ("meta") model of its class.
"""
from __future__ import annotations

from typing import Optional

import torch

from megabert.config import ModelConfig
from megabert.errors import CheckpointError
from megabert.parallel.layout import StageLayout
from megabert.model_classes import reference_table
from megabert.parallel.param_spec import ParamSpec, table_from_dict
from megabert.tensor_parallel.layers import shard, unshard


def checkpoint_table(payloads: list[dict], cfg: ModelConfig) -> dict[str, ParamSpec]:
    """The spec table of a checkpoint: the union of its rank files' tables."""
    table: dict[str, ParamSpec] = {}
    for payload in payloads:
        if payload.get("param_specs") is None:
            return reference_table(cfg, payload.get("model_class", "BertForPreTraining"))
        table.update(table_from_dict(payload["param_specs"]))
    return table


def _spec(table: dict[str, ParamSpec], name: str) -> ParamSpec:
    if name not in table:
        raise CheckpointError(f"{name} has no ParamSpec in the checkpoint's table: the tensor does not belong to "
                              f"this model class")
    return table[name]


def shard_state(full: dict, table: dict[str, ParamSpec], *, tp_rank: int, tp_size: int,
                stage: Optional[StageLayout] = None) -> dict:
    """The local state dict of rank (tp_rank, stage.pp_rank) from a full state dict."""
    out = {}
    for name, t in full.items():
        spec = _spec(table, name)
        if stage is not None and not stage.holds(spec):
            continue
        out[name] = (shard(t, spec.partition_dim, tp_rank, tp_size, spec.partition_stride)
                     if spec.is_tensor_parallel else t.clone())
    return out


def unshard_states(local: list[list[dict]], table: dict[str, ParamSpec], names: Optional[set] = None) -> dict:
    """local[pp_rank][tp_rank] -> the full state dict (of `names` only, when given)."""
    full: dict[str, torch.Tensor] = {}
    for stage in local:
        for name in stage[0]:
            if name in full or (names is not None and name not in names):
                continue  # the tied word embeddings come from the first stage
            spec = _spec(table, name)
            parts = [shard_dict[name] for shard_dict in stage]
            full[name] = (unshard(parts, spec.partition_dim, spec.partition_stride) if spec.is_tensor_parallel
                          else parts[0].clone())
    return full


def repad_vocab(full: dict, table: dict[str, ParamSpec], padded_vocab_size: int) -> dict:
    """Tensors with vocab rows (padded for one TP size, or not at all) padded for another;
    padding rows are zeros. `full` maps names to tensors, or to dicts of tensors
    (optimizer moments, which share their parameter's shape)."""
    def repad(t, valid_rows: int):
        if not torch.is_tensor(t) or t.dim() == 0 or t.size(0) == padded_vocab_size:
            return t
        t = t[:valid_rows]
        return torch.cat([t, t.new_zeros((padded_vocab_size - valid_rows,) + tuple(t.shape[1:]))])

    out = dict(full)
    for name, value in full.items():
        spec = table.get(name)
        if spec is None or spec.valid_rows is None:
            continue
        out[name] = ({k: repad(v, spec.valid_rows) for k, v in value.items()} if isinstance(value, dict)
                     else repad(value, spec.valid_rows))
    return out
