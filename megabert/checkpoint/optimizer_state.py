"""Optimizer state keyed by parameter name instead of position.

torch's optimizer.state_dict() numbers parameters by their order in the param groups;
names survive a change of layout, so resharding can split and merge the moments
(exp_avg, exp_avg_sq have the parameter's shape and follow its sharding rule).
"""
from __future__ import annotations

from typing import Optional

import torch

from megabert.parallel.param_spec import ParamSpec
from megabert.tensor_parallel.layers import shard, unshard


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    sd = optimizer.state_dict()
    ordered = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    state = {ordered[i]: s for i, s in sd["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [ordered[i] for i in g["params"]]}
              for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_optimizer_state_by_name(optimizer: torch.optim.Optimizer, model: torch.nn.Module, saved: dict) -> None:
    names = {id(p): n for n, p in model.named_parameters()}
    ordered = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    index = {n: i for i, n in enumerate(ordered)}
    state = {index[n]: s for n, s in saved["state"].items() if n in index}
    groups = []
    for live, g in zip(optimizer.param_groups, saved["param_groups"]):
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [index[names[id(p)]] for p in live["params"]]})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


class OptimizerByName:
    """A torch optimizer as a checkpoint's stateful part: its state by parameter name."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module):
        self.optimizer, self.model = optimizer, model

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    def state_dict(self) -> dict:
        return optimizer_state_by_name(self.optimizer, self.model)

    def load_state_dict(self, saved: dict) -> None:
        load_optimizer_state_by_name(self.optimizer, self.model, saved)


def _copied(v):
    """Counters and unsplit moments leave the file they were read from (it may be mapped)."""
    return v.clone() if torch.is_tensor(v) else v


def _split(spec: ParamSpec, v) -> bool:
    """Moments have their parameter's shape and sharding; step counters are scalars."""
    return spec.is_tensor_parallel and torch.is_tensor(v) and v.dim() > 0


def shard_optimizer_state(full: dict, table: dict[str, ParamSpec], local_params: set, tp_rank: int,
                          tp_size: int) -> dict:
    """Full (unsharded) by-name optimizer state -> one rank's, keeping only its params."""
    state = {}
    for name, s in full["state"].items():
        if name not in local_params:
            continue
        spec = table[name]
        state[name] = {k: shard(v, spec.partition_dim, tp_rank, tp_size, spec.partition_stride)
                       if _split(spec, v) else v for k, v in s.items()}
    groups = [{**g, "params": [n for n in g["params"] if n in local_params]} for g in full["param_groups"]]
    return {"state": state, "param_groups": groups}


def unshard_optimizer_states(local: list[list[dict]], table: dict[str, ParamSpec], names: Optional[set] = None
                             ) -> dict:
    """local[pp][tp] by-name states -> one full by-name state (of `names` only, when given;
    the param groups are merged whole)."""
    state: dict = {}
    groups: list[dict] = []
    for stage in local:
        for name in stage[0]["state"]:
            if name in state or (names is not None and name not in names):
                continue
            spec = table[name]
            per_rank = [r["state"][name] for r in stage]
            state[name] = {k: unshard([r[k] for r in per_rank], spec.partition_dim, spec.partition_stride)
                           if _split(spec, v) else _copied(v) for k, v in per_rank[0].items()}
        for i, g in enumerate(stage[0]["param_groups"]):
            if i == len(groups):
                groups.append({**g, "params": []})
            groups[i]["params"] += [n for n in g["params"] if n not in groups[i]["params"]]
    return {"state": state, "param_groups": groups}
