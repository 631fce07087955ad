"""Megatron-LM's Adam state, found per tensor name in either format.

`--ckpt-format torch` keeps `optimizer.state_dict()` in each rank file's `optimizer` entry:
torch's positional form (`state[i]` = {"step", "exp_avg", "exp_avg_sq"} of the i-th parameter
of the param groups laid end to end), wrapped as {"optimizer": ..., "fp32_from_fp16_params":
[[...] per group], "grad_scaler": ...} under fp16/bf16 (megatron/core/optimizer/optimizer.py).
The positions are named here by rebuilding Megatron's groups from the rank's own `model`
entry: its parameters in module order (the state dict's order, which is named_parameters'),
those with weight decay in the group(s) whose `wd_mult` is non-zero, biases and 1-D tensors
(LayerNorms) in the others (megatron.core.optimizer._get_param_groups; legacy Megatron-LM
put the decayed group first). Every moment must then have its parameter's shape, or the
state is refused.

`torch_dist` saves the same moments as tensors of the parameter's global shape under
`optimizer.state.exp_avg.<model key>` / `optimizer.state.exp_avg_sq.<model key>` (and
`optimizer.state.fp32_param.<model key>` for fp16/bf16 master weights), the step once in
common.pt (`optimizer.state.common_step`; `optimizer.optimizer.state.common_step` under fp16/bf16).

Whether megabert's optimizer may continue from them is `mismatch`'s call: the algorithm must
be the one megabert runs (Megatron's `adam` is AdamW, decoupled weight decay, bias-corrected,
the same update as megabert's --optimizer adam); its hyper-parameters (betas, eps, weight
decay, LR) are the run's flags, differences named by `hyperparameter_note`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import torch

from megabert.config import OptimConfig

MOMENTS = ("exp_avg", "exp_avg_sq")
DIST_PREFIX = "optimizer.state."


@dataclass
class RankMoments:
    """One rank file's Adam state by its local model keys, or `note` saying why there is none."""

    moments: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # key -> {exp_avg, exp_avg_sq}
    masters: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> fp32 master weight (fp16/bf16 runs)
    step: Optional[float] = None
    note: Optional[str] = None


def _refused(note: str) -> RankMoments:
    return RankMoments(note=note)


def rank_moments(payload: dict, model: dict[str, torch.Tensor]) -> RankMoments:
    """The Adam state of one `torch`-format rank file. `model`: its flattened `model` entry."""
    opt = payload.get("optimizer")
    if opt is None:
        return _refused("it holds no optimizer state (saved with --no-save-optim, or by Megatron's distributed "
                        "optimizer, whose distrib_optim.pt megabert does not read)")
    if isinstance(opt, list):
        return _refused("its optimizer is a chain of several (expert-parallel groups), which megabert does not read")
    masters_by_group = opt.get("fp32_from_fp16_params") if "optimizer" in opt else None
    inner = opt.get("optimizer", opt)
    if not isinstance(inner, dict) or "state" not in inner or "param_groups" not in inner:
        return _refused("its optimizer entry is not a torch optimizer state dict")
    params = [k for k, v in model.items() if torch.is_tensor(v) and not k.endswith("_extra_state")]
    pools = {True: [k for k in params if not (k.endswith(".bias") or model[k].dim() == 1)],
             False: [k for k in params if k.endswith(".bias") or model[k].dim() == 1]}
    order: list[tuple[int, str, int, int]] = []  # (state index, model key, group, position in group)
    for g, group in enumerate(inner["param_groups"]):
        decays = group["wd_mult"] != 0 if "wd_mult" in group else g == 0
        take = pools[decays][:len(group["params"])]
        del pools[decays][:len(take)]
        if len(take) != len(group["params"]):
            return _refused("its optimizer's param groups do not match its model's parameters")
        order += [(i, key, g, j) for j, (i, key) in enumerate(zip(group["params"], take))]
    if pools[True] or pools[False]:
        return _refused("its optimizer holds fewer parameters than its model")
    out = RankMoments()
    steps = set()
    for i, key, g, j in order:
        s = inner["state"].get(i)
        if not s or any(k not in s for k in MOMENTS):
            return _refused(f"its optimizer has no Adam moments for {key} (not Adam, or never stepped)")
        if any(tuple(s[k].shape) != tuple(model[key].shape) for k in MOMENTS):
            return _refused(f"its optimizer's moments of {key} do not have the parameter's shape: the param-group "
                            f"order is not Megatron's")
        out.moments[key] = {k: s[k] for k in MOMENTS}
        step = s.get("step", inner["param_groups"][g].get("step"))  # apex/TE FusedAdam count per group
        if step is None:
            return _refused(f"its optimizer keeps no step count for {key}")
        steps.add(float(step))
        if masters_by_group is not None:
            out.masters[key] = masters_by_group[g][j]
    if len(steps) > 1:
        return _refused(f"its parameters were stepped different numbers of times ({sorted(steps)})")
    out.step = steps.pop() if steps else None
    return out


def dist_keys(kind: str, model_key: str) -> str:
    """The torch_dist key of a moment (`exp_avg`, `exp_avg_sq`) or master weight (`fp32_param`)."""
    return f"{DIST_PREFIX}{kind}.{model_key}"


def dist_step(common: dict) -> Optional[float]:
    """common.pt's step: `optimizer.state.common_step`, one level deeper
    (`optimizer.optimizer.state`) under the fp16/bf16 optimizer."""
    opt = common.get("optimizer") or {}
    opt = opt.get("optimizer", opt) if isinstance(opt, dict) else {}
    step = (opt.get("state") or {}).get("common_step")
    return float(step) if step is not None else None


def mismatch(args: dict, optim: OptimConfig) -> Optional[str]:
    """Why Megatron's optimizer state cannot continue under megabert's `optim`; None when it can."""
    theirs = args.get("optimizer") or "adam"  # Megatron's default
    if theirs != "adam":
        return f"its run used --optimizer {theirs}; megabert continues Adam moments only"
    if optim.optimizer != "adam":
        return f"--optimizer {optim.optimizer} here: Megatron's Adam moments are not {optim.optimizer}'s state"
    if not optim.bias_correction:
        return "--no-bias-correction here: Megatron's Adam corrects the bias of its moments"
    if args.get("decoupled_weight_decay") is False and args.get("weight_decay"):
        return ("its Adam added the weight decay to the gradient (--no-decoupled-weight-decay); megabert's AdamW "
                "decouples it")
    return None


def hyperparameter_note(args: dict, optim: OptimConfig) -> Optional[str]:
    """The Adam hyper-parameters of the Megatron run that this run's flags change, or None."""
    pairs = [("adam_beta1", optim.adam_beta1), ("adam_beta2", optim.adam_beta2), ("adam_eps", optim.adam_eps),
             ("weight_decay", optim.weight_decay)]
    changed = [f"--{name.replace('_', '-')} {ours:g} (Megatron's run: {args[name]:g})" for name, ours in pairs
               if args.get(name) is not None and float(args[name]) != float(ours)]
    return ", ".join(changed) if changed else None


# ---------------------------------------------------------------- writing (export)

# megatron-core's BertModel registers its parameters in this order (named_parameters, which its
# optimizer's groups follow): the positional `torch`-format state must be laid out in it.
_MCORE_LAYER_ORDER = ("input_layernorm", "self_attention.linear_proj", "self_attention.linear_qkv",
                      "pre_mlp_layernorm", "mlp.linear_fc1", "mlp.linear_fc2")
_MCORE_TOP_ORDER = ("embedding.word_embeddings", "embedding.position_embeddings", "embedding.tokentype_embeddings",
                    None, "encoder.final_layernorm", "lm_head.dense", "lm_head.layer_norm", "output_layer",
                    "binary_head", "pooler.dense")


@dataclass
class AdamExport:
    """A megabert run's Adam state for a Megatron directory: canonical full moments
    ({"exp_avg": {...}, "exp_avg_sq": {...}}, padded as their weights), the step count and
    the hyper-parameters Megatron's param groups carry (lr, betas, eps, weight_decay)."""

    moments: dict[str, dict[str, torch.Tensor]]
    step: float
    lr: float
    betas: tuple
    eps: float
    weight_decay: float

    def group(self, wd_mult: float) -> dict:
        """One of Megatron's two param groups (megatron.core.optimizer._get_param_groups' fields,
        torch AdamW's), without "params"."""
        return {"is_expert_parallel": False, "default_config": True, "wd_mult": wd_mult, "lr_mult": 1.0,
                "is_decoupled_lr": False, "max_lr": self.lr, "min_lr": self.lr, "lr": self.lr,
                "betas": tuple(self.betas), "eps": self.eps, "weight_decay": self.weight_decay * wd_mult,
                "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                "fused": None, "decoupled_weight_decay": True}


_KINDS = ("weight", "bias", "_extra_state")


def mcore_order(key: str) -> tuple:
    """Sort key: megatron-core's BertModel state-dict order of a (stage-local) key, which is its
    named_parameters order (the reader relies on it: rank_moments)."""
    m = re.match(r"^encoder\.layers\.(\d+)\.(.+)\.(weight|bias|_extra_state)$", key)
    if m:
        return (3, int(m.group(1)), _MCORE_LAYER_ORDER.index(m.group(2)), _KINDS.index(m.group(3)))
    module, kind = key.rsplit(".", 1)
    return (_MCORE_TOP_ORDER.index(module), 0, 0, _KINDS.index(kind))


def torch_optimizer_entry(stage: dict[str, dict[str, torch.Tensor]], export: AdamExport) -> dict:
    """One rank's `optimizer` entry (torch format, megatron-core names) from its local moments
    {"exp_avg": {key: t}, "exp_avg_sq": {key: t}}: decayed weights, then biases and 1-D
    tensors, each in megatron-core's parameter order."""
    keys = sorted(stage["exp_avg"], key=mcore_order)
    decayed = [k for k in keys if not (k.endswith(".bias") or stage["exp_avg"][k].dim() == 1)]
    order = decayed + [k for k in keys if k not in decayed]
    state = {i: {"step": torch.tensor(float(export.step)), **{m: stage[m][k].clone() for m in MOMENTS}}
             for i, k in enumerate(order)}
    groups = [{**export.group(1.0), "params": list(range(len(decayed)))},
              {**export.group(0.0), "params": list(range(len(decayed), len(order)))}]
    return {"state": state, "param_groups": groups}


def dist_common(export: AdamExport) -> dict:
    """common.pt's `optimizer` entry of a torch_dist directory (the moments are sharded tensors)."""
    return {"state": {"common_step": torch.tensor(float(export.step))},
            "param_groups": [export.group(1.0), export.group(0.0)]}
