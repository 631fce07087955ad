"""A DeepSpeed JSON's optimizer and scheduler sections, translated into OptimConfig.

megabert hands DeepSpeed its own optimizer (a client optimizer: AdamW, or Adam without
bias correction) and applies its own LR schedule, so DeepSpeed and plain runs follow the
same update and the same curve. A JSON written for DeepSpeed (the BERT tutorial's, say)
still means what it says: its values become our OptimConfig's. A flag the user typed
that disagrees with the JSON is an error naming both; a flag left at its default takes
the JSON's value. What has no megabert equivalent stops the run with one line that
names the key and what to do.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Optional

from megabert.config import OptimConfig
from megabert.errors import ConfigError

# optimizer.params key -> OptimConfig field ("betas" is split in two below).
ADAM_PARAMS = {"lr": "lr", "eps": "adam_eps", "weight_decay": "weight_decay", "bias_correction": "bias_correction",
               "max_grad_norm": "clip_grad"}
LAMB_PARAMS = {**ADAM_PARAMS, "max_coeff": "lamb_max_coeff", "min_coeff": "lamb_min_coeff"}
# Adam switches DeepSpeed knows that ask for nothing megabert's Adam would do otherwise,
# as long as they hold these values (adam_w_mode false is checked against weight decay).
ADAM_SWITCHES = {"adam_w_mode": True, "amsgrad": False, "torch_adam": None}
SCHEDULES = ("WarmupLR", "WarmupDecayLR")
INT_FIELDS = {"lr_warmup_iters", "lr_decay_iters"}


def flag(field: str) -> str:
    """The CLI flag of OptimConfig field `field`."""
    f = next(f for f in dataclasses.fields(OptimConfig) if f.name == field)
    return f.metadata.get("flag") or "--" + field.replace("_", "-")


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


class OptimTranslation:
    """Collects JSON values for OptimConfig fields, checking each against the typed flags
    and against another JSON key that set the same field."""

    def __init__(self, optim: OptimConfig, explicit: frozenset, path: str):
        self.optim, self.explicit, self.path = optim, explicit, path
        self.values: dict[str, tuple[Any, str]] = {}  # field -> (value, JSON key)

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"--deepspeed_config {self.path} {message}")

    def take(self, field: str, value: Any, key: str, derived: Optional[str] = None) -> None:
        """Field `field` takes `value` from JSON key `key`. `derived`: the value is not the
        JSON's own but follows from what `derived` describes (no type check; messages
        quote `derived`)."""
        if value == "auto":  # transformers' placeholder: the value comes from the flags
            return
        current = getattr(self.optim, field)
        if derived is None:
            kind, what = ((bool, "true or false") if isinstance(current, bool) else
                          (int, "an integer") if field in INT_FIELDS else (numbers.Real, "a number"))
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise self.error(f"sets {key}={_show(value)}: expected {what}")
        shown = derived or f"{key}={_show(value)}"
        if field in self.values and self.values[field][0] != value:
            raise self.error(f"sets {self.values[field][1]} and {shown}, which DeepSpeed would apply differently; "
                             f"give one value")
        if f"optim.{field}" in self.explicit and value != current:
            raise self.error(f"sets {shown} but {flag(field)} is {_show(current)}; make them agree, or drop one of "
                             f"them")
        self.values[field] = (value, shown)

    def result(self) -> OptimConfig:
        try:
            return dataclasses.replace(self.optim, **{f: v for f, (v, _) in self.values.items()})
        except ConfigError as e:  # a cross-field check failed on the JSON's values
            keys = ", ".join(shown for _, shown in self.values.values())
            raise self.error(f"gives {keys}: {e}")


def _lamb_equivalent(t: OptimTranslation) -> str:
    """The flags that train the JSON's LAMB without --deepspeed."""
    flags = ["--optimizer lamb"]
    for field, (value, _) in t.values.items():
        if field == "bias_correction":
            flags.append("--bias-correction" if value else "--no-bias-correction")
        else:
            flags.append(f"{flag(field)} {value}")
    return " ".join(flags)


def translate_optimizer(section: Any, t: OptimTranslation) -> None:
    """`optimizer` {"type": "Adam"|"AdamW"|"Lamb", "params": {...}} -> t."""
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        raise t.error('has an "optimizer" section without a "type"; give {"type": "Adam", "params": {...}} or drop it')
    kind = section["type"]
    params = section.get("params", {})
    if not isinstance(params, dict):
        raise t.error("sets optimizer.params to something other than an object of parameters")
    if kind.lower() not in ("adam", "adamw", "lamb"):
        raise t.error(f'sets optimizer.type={kind}: megabert trains with its own Adam (or LAMB without --deepspeed); '
                      f'set "type": "Adam" or drop the optimizer section and use --optimizer')
    known = LAMB_PARAMS if kind.lower() == "lamb" else {**ADAM_PARAMS, **ADAM_SWITCHES}
    for key, value in params.items():
        if key == "betas":
            if not (isinstance(value, (list, tuple)) and len(value) == 2):
                raise t.error(f"sets optimizer.params.betas={value}: expected two numbers, [beta1, beta2]")
            t.take("adam_beta1", value[0], "optimizer.params.betas[0]")
            t.take("adam_beta2", value[1], "optimizer.params.betas[1]")
        elif key in ADAM_SWITCHES and key in known:
            _check_switch(key, value, params, t)
        elif key in known:
            t.take(known[key], value, f"optimizer.params.{key}")
        else:
            names = ", ".join(["betas", *known])
            raise t.error(f"sets optimizer.params.{key}, which megabert's {kind} does not take (it takes {names}); "
                          f"remove the key")
    if kind.lower() == "lamb":
        # NOTE: refused at any ZeRO stage, as --optimizer lamb with --deepspeed is.
        raise t.error(f"sets optimizer.type={kind}, which --deepspeed cannot train: ZeRO and DeepSpeed's precision "
                      f"wrappers hand the optimizer flattened buffers, so LAMB's per-tensor trust ratio would be "
                      f'wrong; set "type": "Adam", or train LAMB without --deepspeed: {_lamb_equivalent(t)}')
    t.take("optimizer", "adam", "optimizer.type", derived=f"optimizer.type={kind}")


def _check_switch(key: str, value: Any, params: dict, t: OptimTranslation) -> None:
    if not isinstance(value, bool):
        raise t.error(f"sets optimizer.params.{key}={_show(value)}: expected true or false")
    if key == "amsgrad" and value:
        raise t.error("sets optimizer.params.amsgrad=true: megabert's Adam has no AMSGrad; remove the key")
    if key == "adam_w_mode" and not value and params.get("weight_decay", t.optim.weight_decay):
        raise t.error("sets optimizer.params.adam_w_mode=false (Adam with L2-coupled weight decay): megabert's Adam "
                      "decays weights decoupled (AdamW, as BERT); remove the key")


def translate_scheduler(section: Any, t: OptimTranslation) -> None:
    """`scheduler` {"type": "WarmupLR"|"WarmupDecayLR", "params": {...}} -> t. Both warm up
    linearly from warmup_min_lr to warmup_max_lr over warmup_num_steps; WarmupLR then holds
    (--lr-decay-style constant), WarmupDecayLR decays linearly back to warmup_min_lr at
    total_num_steps (--lr-decay-style linear, --min-lr, --lr-decay-iters).

    NOTE: the curve follows our iteration count (Megatron's: iteration 1 runs at
    warmup_min_lr + delta / warmup_num_steps); DeepSpeed's own scheduler lags it by a step
    or two, as it applies the LR for step k after optimizer step k. Our decay reaches
    warmup_min_lr one step after total_num_steps, so no step runs at it (megabert.optim.lr_schedules)."""
    if not isinstance(section, dict) or not isinstance(section.get("type"), str):
        raise t.error('has a "scheduler" section without a "type"; give {"type": "WarmupLR", "params": {...}} '
                      'or drop it')
    kind, params = section["type"], section.get("params", {})
    if kind == "warmup_exp_decay_exp":
        raise t.error("sets scheduler.type=warmup_exp_decay_exp, bing_bert's own schedule rather than a DeepSpeed "
                      "one: drop the section and use --lr-decay-style warmup_exp_decay_exp --lr-warmup-fraction "
                      "--lr-exp-decay-rate --lr-exp-decay-iters, with --lr-warmup-init for bing_bert's --lr_offset")
    if kind not in SCHEDULES:
        raise t.error(f"sets scheduler.type={kind}, which has no megabert equivalent (it translates "
                      f"{' and '.join(SCHEDULES)}); drop the scheduler section and use --lr-warmup-iters, "
                      f"--lr-decay-style (linear, cosine, polynomial, constant, warmup_exp_decay_exp) and --min-lr")
    known = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"}
    if kind == "WarmupDecayLR":
        known.add("total_num_steps")
    for key in params:
        if key not in known:
            raise t.error(f"sets scheduler.params.{key}, which {kind} does not take (it takes "
                          f"{', '.join(sorted(known))}); remove the key")
    warmup_type = params.get("warmup_type", "log")
    if warmup_type != "linear":
        default = "" if "warmup_type" in params else " (DeepSpeed's default)"
        raise t.error(f'sets scheduler.params.warmup_type={_show(warmup_type)}{default}: megabert warms up linearly '
                      f'only; set "warmup_type": "linear"')
    if params.get("last_batch_iteration", -1) != -1:
        raise t.error("sets scheduler.params.last_batch_iteration: the schedule follows the iteration of the run "
                      "(--load resumes it); remove the key")
    key = "scheduler.params."
    # DeepSpeed's own defaults stand for keys the JSON leaves out, so the JSON means what
    # it means to DeepSpeed; WarmupLR without warmup_max_lr keeps the optimizer's lr.
    t.take("lr_warmup_init", params.get("warmup_min_lr", 0.0), key + "warmup_min_lr")
    if "warmup_max_lr" in params or kind == "WarmupDecayLR":
        t.take("lr", params.get("warmup_max_lr", 0.001), key + "warmup_max_lr")
    t.take("lr_warmup_iters", params.get("warmup_num_steps", 1000), key + "warmup_num_steps")
    t.take("lr_warmup_fraction", None, key + "warmup_num_steps",
           derived=f"scheduler.type={kind} (a warmup counted in scheduler.params.warmup_num_steps)")
    if kind == "WarmupLR":
        t.take("lr_decay_style", "constant", "scheduler.type",
               derived="scheduler.type=WarmupLR (constant after warmup)")
    else:
        if "total_num_steps" not in params:
            raise t.error("sets scheduler.type=WarmupDecayLR without scheduler.params.total_num_steps; add it "
                          "(the iteration the LR reaches warmup_min_lr)")
        t.take("lr_decay_style", "linear", "scheduler.type", derived="scheduler.type=WarmupDecayLR (linear decay)")
        t.take("lr_decay_iters", params["total_num_steps"], key + "total_num_steps")
        t.take("min_lr", params.get("warmup_min_lr", 0.0), key + "warmup_min_lr")


def translate_sections(user: dict, optim: OptimConfig, explicit: frozenset, path: str) -> OptimConfig:
    """The OptimConfig to train with: `optim` updated by the JSON's optimizer and scheduler
    sections and its gradient_clipping."""
    t = OptimTranslation(optim, explicit, path)
    if "optimizer" in user:
        translate_optimizer(user["optimizer"], t)
    if "gradient_clipping" in user:
        t.take("clip_grad", user["gradient_clipping"], "gradient_clipping")
    if "scheduler" in user:
        translate_scheduler(user["scheduler"], t)
    return t.result()
