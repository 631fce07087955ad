"""The run, resolved once: flags + the DeepSpeed JSON + the world size -> one frozen,
checked description. The memory preflight, the trainer, fine-tuning and the logs read
this object; none of them re-reads a flag that the JSON may have overridden (a ZeRO stage
or an offload set only in --deepspeed_config is what runs, so it is what the planner
predicts)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from megabert.config import Configs, DataConfig, FinetuneConfigs, ModelConfig, OptimConfig, ParallelConfig, \
    TrainConfig
from megabert.parallel.layout import BatchLayout
from megabert.rules import validate_layout
from megabert.checkpoint.run_state import resolve_start


@dataclass(frozen=True)
class ResolvedRun:
    """What this run does. `optim` and `train` are the flags' configs with the DeepSpeed
    JSON's optimizer, scheduler and ZeRO stage applied; `model` is None for fine-tuning
    until the model has been loaded (its shape comes from --load)."""

    model: Optional[ModelConfig]
    parallel: ParallelConfig
    optim: OptimConfig
    train: TrainConfig
    batch: BatchLayout
    world_size: int
    data: Optional[DataConfig] = None
    finetune: Any = None
    """The task's config dataclass when fine-tuning (it has max_seq_length), else None."""
    deepspeed_config: Optional[dict] = None
    """DeepSpeed's final config (built from the flags, merged with --deepspeed_config); None without --deepspeed."""
    explicit: frozenset = frozenset()

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage that runs: 0 without DeepSpeed or without ZeRO."""
        return (self.deepspeed_config or {}).get("zero_optimization", {}).get("stage", 0)

    @property
    def offload_optimizer(self) -> bool:
        return _offload_device(self.deepspeed_config, "offload_optimizer") == "cpu"

    @property
    def offload_params(self) -> bool:
        return _offload_device(self.deepspeed_config, "offload_param") == "cpu"

    @property
    def precision(self) -> str:
        return "bf16" if self.train.bf16 else "fp16" if self.train.fp16 else "fp32"

    @property
    def dp_size(self) -> int:
        return self.batch.dp_size

    @property
    def seq_length(self) -> int:
        return self.data.seq_length if self.data is not None else self.finetune.max_seq_length

    @property
    def binary_head_task(self) -> Optional[str]:
        """"sop" or "nsp" when pre-training trains the sentence-pair head, else None."""
        if self.data is None or self.model is None or not self.model.bert_binary_head:
            return None
        return self.data.binary_head_task


def _offload_device(ds_config: Optional[dict], section: str) -> Optional[str]:
    return ((ds_config or {}).get("zero_optimization", {}).get(section) or {}).get("device")


def resolve_run(cfg: Configs | FinetuneConfigs, ps, model: Optional[ModelConfig] = None) -> ResolvedRun:
    """Checks the configs against the world (megabert.rules) and merges the DeepSpeed JSON
    (its conflicts with the flags are one-line errors). `ps`: the ParallelState (its world,
    DP and PP sizes and device). `model`: the loaded model's config when fine-tuning."""
    model = model if model is not None else getattr(cfg, "model", None)
    if model is not None:
        validate_layout(model, cfg.parallel, ps.world_size, cfg.train)
    batch = BatchLayout.of(cfg.train.micro_batch_size, cfg.train.global_batch_size, ps.dp_size)
    optim, train, ds_config = cfg.optim, cfg.train, None
    if cfg.train.deepspeed:
        from megabert.training.deepspeed.config import resolve_deepspeed_config

        ds_config, optim = resolve_deepspeed_config(cfg, ps, model.hidden_size if model is not None else None)
        train = dataclasses.replace(train, zero_stage=ds_config["zero_optimization"].get("stage", 0))
    if getattr(cfg, "data", None) is not None:
        # A --load / --pretrained-checkpoint that holds nothing stops the run here, before
        # index mappings are built (fine-tuning reads --load when it builds its model).
        resolve_start(train)
    return ResolvedRun(model=model, parallel=cfg.parallel, optim=optim, train=train, batch=batch,
                       world_size=ps.world_size, data=getattr(cfg, "data", None),
                       finetune=getattr(cfg, "finetune", None), deepspeed_config=ds_config, explicit=cfg.explicit)
