"""DeepSpeed's config: built from our flags, or the user's --deepspeed_config checked
against them and merged (its optimizer and scheduler sections translated into ours). The
only module that reads DeepSpeed's JSON dict: what the rest of megabert needs of it leaves
here typed, as the resolved run's ZeroPlan (megabert.data_parallel.zero_plan)."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from typing import Optional

from megabert.config import OptimConfig, TrainConfig
from megabert.data_parallel.zero_plan import ZeroBuckets, ZeroPlan
from megabert.errors import ConfigError
from megabert.parallel import ParallelState
from megabert.parallel.layout import BatchLayout
from megabert.say_once import say_once
from megabert.training.deepspeed.sections import translate_sections

logger = logging.getLogger(__name__)


# The DeepSpeed keys of ZeroBuckets' fields, and those each ZeRO stage reads. Stage 1 leaves overlap_comm off: its
# gradients are reduced after backward (by the pipeline schedule too, see
# reduce_gradients), and overlapping would register reduction hooks during it.
def bucket_keys(buckets: ZeroBuckets) -> dict:
    """ZeroBuckets under DeepSpeed's zero_optimization key names."""
    return {"reduce_bucket_size": buckets.reduce_bucket, "allgather_bucket_size": buckets.allgather_bucket,
            "stage3_prefetch_bucket_size": buckets.prefetch_bucket,
            "stage3_param_persistence_threshold": buckets.param_persistence_threshold,
            "stage3_max_live_parameters": buckets.max_live_parameters,
            "stage3_max_reuse_distance": buckets.max_reuse_distance, "sub_group_size": buckets.sub_group_size,
            "overlap_comm": buckets.overlap_comm, "contiguous_gradients": buckets.contiguous_gradients}


ZERO_STAGE_KEYS = {
    0: (),
    1: ("reduce_bucket_size", "allgather_bucket_size"),
    2: ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients"),
    3: ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size", "overlap_comm",
        "contiguous_gradients"),
}
OFFLOAD_KEYS = {"offload_optimizer": ("zero_offload_optimizer", "--zero-offload-optimizer"),
                "offload_param": ("zero_offload_params", "--zero-offload-params")}


def build_config(train: TrainConfig, optim: OptimConfig, ps: ParallelState, hidden_size: Optional[int] = None) -> dict:
    """DeepSpeed's JSON from our flags: batch sizes, precision, ZeRO stage sized to the model
    (`hidden_size`; DeepSpeed's defaults without it), offload, clipping. The optimizer stays
    ours (a client optimizer: AdamW or TP-aware LAMB), and so does the LR schedule, so
    DeepSpeed and plain runs follow the same curve."""
    return _config_of_flags(train, optim, ps, _buckets(hidden_size))


def _buckets(hidden_size: Optional[int]) -> Optional[ZeroBuckets]:
    return ZeroBuckets.for_hidden_size(hidden_size) if hidden_size is not None else None


def _config_of_flags(train: TrainConfig, optim: OptimConfig, ps: ParallelState, buckets: Optional[ZeroBuckets]
                     ) -> dict:
    """build_config's JSON, ZeRO's buffers sized as `buckets` say (DeepSpeed's defaults: None)."""
    batch = BatchLayout.of(train.micro_batch_size, train.global_batch_size, ps.dp_size)
    zero: dict = {"stage": train.zero_stage}
    if buckets is not None:
        sizing = bucket_keys(buckets)
        zero.update({key: sizing[key] for key in ZERO_STAGE_KEYS[train.zero_stage]})
    if train.zero_stage in (1, 2):
        zero.update(ring_volume_settings())
    for section, (field, _) in OFFLOAD_KEYS.items():
        if getattr(train, field) != "none":
            zero[section] = {"device": getattr(train, field), "pin_memory": True}
    cfg: dict = {
        "train_batch_size": batch.global_batch_size,
        "train_micro_batch_size_per_gpu": batch.micro_batch_size,
        "gradient_accumulation_steps": batch.num_micro_batches,
        "gradient_clipping": optim.clip_grad,
        "zero_optimization": zero,
        "steps_per_print": 10 ** 9,  # our logger reports; DeepSpeed's own lines would duplicate it
        "wall_clock_breakdown": False,
    }
    if not optim.bias_correction:
        # Our Adam (no bias correction) is elementwise, so ZeRO's flat partitions suit it;
        # DeepSpeed asks for this key for any optimizer not on its list.
        cfg["zero_allow_untested_optimizer"] = True
    if train.bf16:
        cfg["bf16"] = {"enabled": True}
    if train.fp16:
        fp16 = {"enabled": True, "loss_scale_window": optim.loss_scale_window, "hysteresis": optim.hysteresis,
                "min_loss_scale": optim.min_loss_scale}
        if optim.loss_scale is not None:
            fp16["loss_scale"] = optim.loss_scale
        else:
            fp16["loss_scale"] = 0  # dynamic
            fp16["initial_scale_power"] = int(math.log2(optim.initial_loss_scale))
        cfg["fp16"] = fp16
    return cfg


def ring_volume_settings() -> dict:
    """ZeRO-1/2 at a ring all-reduce's bytes: DeepSpeed's `reduce_scatter` path slices each
    gradient bucket by partition, and by default (`use_multi_rank_bucket_allreduce`) still
    all-reduces the whole bucket and keeps its slice: 2(n-1)/n of the bucket, then the
    parameters' all-gather on top (75 MB a step where a ring all-reduce sends 50, issue 32).
    Off, each partition's slice is reduced to its owner (one dist.reduce per rank, together
    a reduce-scatter: (n-1)/n). The key exists since DeepSpeed 0.14 (checked up to 0.19.8);
    an older DeepSpeed would reject it, so it is only set where its config model has it."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    if "use_multi_rank_bucket_allreduce" not in DeepSpeedZeroConfig.model_fields:
        _say_once("DeepSpeed %s has no use_multi_rank_bucket_allreduce: ZeRO-1/2 all-reduce their gradient "
                  "buckets (2(n-1)/n of the gradients, not a reduce-scatter's (n-1)/n)", _deepspeed_version())
        return {}
    return {"reduce_scatter": True, "use_multi_rank_bucket_allreduce": False}


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def _say_once(msg: str, *args) -> None:
    say_once(logger, logging.INFO, msg, *args)


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def load_user_config(path: str) -> dict:
    """--deepspeed_config's JSON object (one-line errors for a missing or broken file)."""
    try:
        with open(path) as f:
            user = json.load(f)
    except OSError as e:
        raise ConfigError(f"--deepspeed_config {path}: {e.strerror}")
    except json.JSONDecodeError as e:
        raise ConfigError(f"--deepspeed_config {path} is not valid JSON: {e}")
    if not isinstance(user, dict):
        raise ConfigError(f"--deepspeed_config {path} must hold a JSON object ({{...}}), not a {type(user).__name__}")
    return user


def merge_user_config(path: str, built: dict, train: TrainConfig, explicit: frozenset = frozenset(),
                      user: Optional[dict] = None) -> dict:
    """The user's JSON, checked against the flags: a value both set differently is an error.
    Its optimizer, scheduler and gradient_clipping are translated into our OptimConfig
    (megabert.training.deepspeed.sections, through resolve_deepspeed_config), so they are not merged here:
    the built config already carries their values."""
    user = load_user_config(path) if user is None else user
    # "auto" (transformers' placeholder) takes the flags' value. gradient_clipping was
    # translated into --clip-grad already; checked again for a direct caller.
    checks = [("train_batch_size", "--global-batch-size"), ("train_micro_batch_size_per_gpu", "--micro-batch-size"),
              ("gradient_accumulation_steps", "--global-batch-size / (--micro-batch-size x DP)"),
              ("gradient_clipping", "--clip-grad")]
    for key, flag in checks:
        if key in user and user[key] != "auto" and user[key] != built[key]:
            raise ConfigError(f"--deepspeed_config {path} sets {key}={user[key]} but the flags give {built[key]} "
                              f"({flag}); make them agree or drop the key from the JSON")
    for prec, flag in (("bf16", "--bf16"), ("fp16", "--fp16")):
        user_on = bool(_get(user, f"{prec}.enabled"))
        if prec in user and _get(user, f"{prec}.enabled") != "auto" and user_on != getattr(train, prec):
            todo = f"pass {flag}" if user_on else f"drop {flag}"
            raise ConfigError(f"--deepspeed_config {path} has {prec}.enabled={str(user_on).lower()} but {flag} is "
                              f"{'set' if getattr(train, prec) else 'not set'}; {todo} or change the JSON")
    user_zero = user.get("zero_optimization", {})
    user_stage = _get(user, "zero_optimization.stage")
    if train.zero_stage and user_stage is not None and user_stage != train.zero_stage:
        raise ConfigError(f"--deepspeed_config {path} has zero_optimization.stage={user_stage} but --zero-stage "
                          f"is {train.zero_stage}; make them agree")
    for legacy, modern in (("cpu_offload", "--zero-offload-optimizer cpu"), ("cpu_offload_param",
                                                                              "--zero-offload-params cpu")):
        if legacy in user_zero:
            raise ConfigError(f"--deepspeed_config {path} sets zero_optimization.{legacy}, DeepSpeed's deprecated "
                              f"key; use {modern} (or zero_optimization.offload_* {{\"device\": \"cpu\"}})")
    for section, (field, flag) in OFFLOAD_KEYS.items():
        user_device = _get(user_zero, f"{section}.device") or ("none" if section in user_zero else None)
        typed = getattr(train, field) != "none" or f"train.{field}" in explicit
        if user_device is not None and typed and user_device != getattr(train, field):
            raise ConfigError(f"--deepspeed_config {path} sets zero_optimization.{section}.device={user_device} but "
                              f"{flag} is {getattr(train, field)}; make them agree, or drop one of them")
    merged = {**built, **{k: v for k, v in user.items() if k not in TRANSLATED_KEYS and v != "auto"}}
    for prec in ("bf16", "fp16"):
        if _get(user, f"{prec}.enabled") == "auto":
            merged[prec] = {**user[prec], "enabled": getattr(train, prec)}
    merged["zero_optimization"] = {**built["zero_optimization"], **user_zero}
    return merged


# Sections translated into our OptimConfig; merged configs never carry them, so DeepSpeed
# keeps our client optimizer and schedule.
TRANSLATED_KEYS = ("optimizer", "scheduler", "gradient_clipping")


def check_offload(config: dict, path: Optional[str]) -> None:
    """Offload goes to the CPU only; which stage it needs is megabert.rules.check_zero's, on the
    ZeroPlan (zero_plan)."""
    zero = config["zero_optimization"]
    where = f" (--deepspeed_config {path})" if path else ""
    for section, (_, flag) in OFFLOAD_KEYS.items():
        device = _get(zero, f"{section}.device")
        if device not in (None, "none", "cpu"):
            raise ConfigError(f"zero_optimization.{section}.device={device}{where}: megabert offloads to the CPU "
                              f"only; use {flag} cpu")


def offloads_optimizer(config: dict) -> bool:
    """True when DeepSpeed's config keeps the optimizer on the CPU (ZeRO-Offload)."""
    return _get(config, "zero_optimization.offload_optimizer.device") == "cpu"


def keep_our_cpu_optimizer(config: dict, path: Optional[str]) -> None:
    """ZeRO-Offload steps with our optimizer (torch's fused AdamW on the CPU partitions, as
    fast as DeepSpeedCPUAdam and nothing to compile); DeepSpeed refuses a client optimizer
    under offload unless zero_force_ds_cpu_optimizer is false, so that key is set here, and a
    JSON that forces DeepSpeed's own is one line."""
    if not offloads_optimizer(config):
        return
    if config.get("zero_force_ds_cpu_optimizer") is True:
        raise ConfigError(f"--deepspeed_config {path} sets zero_force_ds_cpu_optimizer=true, but megabert's "
                          f"ZeRO-Offload steps with torch's fused AdamW on the CPU (as fast as DeepSpeedCPUAdam, "
                          f"with no op to compile); drop the key")
    config["zero_force_ds_cpu_optimizer"] = False


def zero_plan(config: dict, path: Optional[str], user: dict, buckets: Optional[ZeroBuckets]) -> ZeroPlan:
    """The ZeRO that `config` (built, or merged with the user's JSON `user` read from `path`)
    runs, typed: source "json" when the JSON chose the stage or an offload."""
    zero = config["zero_optimization"]
    stage = zero.get("stage", 0)
    stage_from_json = path is not None and _get(user, "zero_optimization.stage") is not None
    offload_from_json = path is not None and any(section in user.get("zero_optimization", {})
                                                 for section in OFFLOAD_KEYS)
    return ZeroPlan(stage=stage, offload_optimizer=offloads_optimizer(config),
                    offload_params=_get(zero, "offload_param.device") == "cpu",
                    buckets=buckets,
                    source="json" if stage_from_json or offload_from_json else "flag",
                    origin=f"--deepspeed_config {path} sets zero_optimization.stage={stage}" if stage_from_json else None,
                    offload_origin=f" (--deepspeed_config {path})" if path else "")


def takes_memory_efficient_linear(config: dict) -> bool:
    """Whether ZeRO-3's tensor-parallel layers multiply through DeepSpeed's memory-efficient
    linear: zero_optimization.memory_efficient_linear, DeepSpeed's default true. DeepSpeed
    itself gets false (engine_config): it would replace torch.nn.functional.linear for the
    whole process; the strategy hands the function to our layers instead (use_linear)."""
    return _get(config, "zero_optimization.memory_efficient_linear") is not False


def engine_config(config: dict) -> dict:
    """`config` as deepspeed.initialize takes it: memory_efficient_linear off, so DeepSpeed
    leaves torch.nn.functional.linear alone (takes_memory_efficient_linear)."""
    if _get(config, "zero_optimization.memory_efficient_linear") is True:
        _say_once("zero_optimization.memory_efficient_linear=true: megabert's tensor-parallel layers multiply "
                  "through DeepSpeed's memory-efficient linear themselves; torch.nn.functional.linear is left as it is")
    return {**config, "zero_optimization": {**config["zero_optimization"], "memory_efficient_linear": False}}


def resolve_deepspeed_config(cfg, ps: ParallelState, hidden_size: Optional[int]
                             ) -> tuple[dict, OptimConfig, ZeroPlan]:
    """DeepSpeed's config, the OptimConfig to build our optimizer and LR schedule from, and
    the ZeRO plan that runs (checked against the other flags by megabert.rules.check_zero,
    in resolve_run).

    `cfg` is a Configs or FinetuneConfigs (its .optim, .train and .explicit are read);
    `hidden_size` sizes ZeRO's buffers. --deepspeed_config's optimizer, scheduler and
    gradient_clipping become OptimConfig values (flags the user typed must agree with
    them); its other keys are checked against the flags and merged. Raises ConfigError
    with one line naming the key and what to do."""
    buckets = _buckets(hidden_size)  # sizes the built JSON and the plan alike
    path = cfg.train.deepspeed_config
    user = load_user_config(path) if path else {}
    optim = translate_sections(user, cfg.optim, cfg.explicit, path) if user else cfg.optim
    fp16_key = "fp16.enabled=true" if _get(user, "fp16.enabled") is True else None
    if (cfg.train.fp16 or fp16_key) and ps.device.type != "cuda":
        source = f"--deepspeed_config {path} sets {fp16_key}" if fp16_key else "--fp16 with --deepspeed"
        raise ConfigError(f"{source}, but fp16 needs a CUDA device (DeepSpeed's fp16 optimizer and loss scaling run "
                          f"on GPUs) and this run is on {ps.device.type}; use --bf16 on CPU"
                          + (" and set fp16.enabled to false" if fp16_key else ""))
    train = cfg.train
    user_stage = _get(user, "zero_optimization.stage")
    if user_stage is not None and user_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--deepspeed_config {path} sets zero_optimization.stage={user_stage}; use 0, 1, 2 or 3")
    if user_stage is not None and not train.zero_stage:
        train = dataclasses.replace(train, zero_stage=user_stage)  # the JSON chose the stage: size for it
    built = _config_of_flags(train, optim, ps, buckets)
    config = merge_user_config(path, built, cfg.train, cfg.explicit, user) if path else built
    check_offload(config, path)
    keep_our_cpu_optimizer(config, path)
    return config, optim, zero_plan(config, path, user, buckets)
