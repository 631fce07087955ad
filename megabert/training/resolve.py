"""The run, resolved once: flags + the DeepSpeed JSON + the world + the disk -> one frozen,
checked description. Where the run starts (megabert.checkpoint.start) is decided here, once,
and logged once; the model family, the model's shape for fine-tuning and the trainer's
restore read it from `ResolvedRun.start`. The memory preflight, the trainer, fine-tuning and the logs read this object;
none of them re-reads a flag that the JSON may have overridden (a ZeRO stage or an offload
set only in --deepspeed_config is what runs, so it is what the planner predicts), and none
reads DeepSpeed's JSON: its ZeRO arrives typed, as `zero` (a ZeroPlan).

The rules between flags alone ran when they were parsed and the world-size rule when the
ParallelState was built (megabert.rules says where each rule runs); resolve_run applies the
rest, each once."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Optional

from megabert.checkpoint.external import pretrained_vocab
from megabert.checkpoint.reader import checkpoint_model_config, read_model_config
from megabert.checkpoint.start import RunStart, decide_start
from megabert.config import (Configs, DataConfig, FinetuneConfigs, ModelConfig, OptimConfig, ParallelConfig,
    TrainConfig)
from megabert.data_parallel.zero_plan import ZeroPlan
from megabert.families.run_family import resolve_model_family
from megabert.parallel.layout import BatchLayout
from megabert.rules import check_model_split, check_seq_length, check_zero, sentence_pairs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedRun:
    """What this run does. `optim` and `train` are the flags' configs with the DeepSpeed
    JSON's optimizer, scheduler and ZeRO stage applied; `model` is the architecture (for
    fine-tuning, the pre-trained checkpoint's as saved: the task's head comes on top);
    `start` is where the run starts."""

    model: Optional[ModelConfig]
    parallel: ParallelConfig
    optim: OptimConfig
    train: TrainConfig
    batch: BatchLayout
    world_size: int
    data: Optional[DataConfig] = None
    finetune: Any = None
    """The task's config dataclass when fine-tuning (it has max_seq_length), else None."""
    zero: ZeroPlan = ZeroPlan()
    """The ZeRO that runs, from the flags or the DeepSpeed JSON (stage 0 without DeepSpeed)."""
    deepspeed_config: Optional[dict] = None
    """DeepSpeed's final config (built from the flags, merged with --deepspeed_config), handed
    to the DeepSpeed strategy as it is; None without --deepspeed. Only megabert.training.deepspeed
    reads it."""
    explicit: frozenset = frozenset()
    start: RunStart = RunStart()
    """Where the run starts (megabert.checkpoint.start): the one decision, made in resolve_run."""

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage that runs: 0 without DeepSpeed or without ZeRO."""
        return self.zero.stage

    @property
    def offload_optimizer(self) -> bool:
        return self.zero.offload_optimizer

    @property
    def offload_params(self) -> bool:
        return self.zero.offload_params

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
    def tokenizer_files(self) -> tuple[str, Optional[str]]:
        """(--tokenizer-type, --vocab-file or --tokenizer-model): build_tokenizer's arguments.
        Fine-tuning's vocab is resolved already (beside --load when the flag is left out)."""
        section = self.data if self.data is not None else self.finetune
        return section.tokenizer_type, section.vocab_file

    @property
    def binary_head_task(self) -> Optional[str]:
        """"sop" or "nsp" when pre-training trains the sentence-pair head, else None."""
        if self.data is None or self.model is None or not self.model.bert_binary_head:
            return None
        return self.data.binary_head_task


def resolve_run(cfg: Configs | FinetuneConfigs, ps, model: Optional[ModelConfig] = None) -> ResolvedRun:
    """Decides the run's start (once, logged once: other ranks' loggers are quiet), takes a
    loaded ModernBERT's architecture, applies the rules that need the world, the disk or the
    DeepSpeed JSON (megabert.rules), each once, and merges the JSON (its conflicts with the
    flags are one-line errors). `ps`: the ParallelState (its DP and PP sizes and device; the
    world-size rule held when it was built). `model`: fine-tuning a model the caller built in
    code (the Python API, benchmarks): no --load is read and the run starts from the seed."""
    finetuning = isinstance(cfg, FinetuneConfigs)
    if finetuning and model is not None:
        start = RunStart()
    else:
        start = decide_start(cfg.train, finetuning=finetuning)
        (logger.warning if start.warn else logger.info)(start.describe())
    if not finetuning:
        # A --load / --pretrained-checkpoint that holds nothing stopped the run above, before
        # index mappings are built.
        loaded = checkpoint_model_config(start.source)
        cfg = resolve_model_family(cfg, loaded, start.source.directory if start.source is not None else None)
        model = cfg.model
    elif model is None:
        cfg = dataclasses.replace(cfg, finetune=pretrained_vocab(cfg.finetune, cfg.explicit, start.pretrained))
        model = ModelConfig(**read_model_config(start.pretrained))
    if not finetuning:  # --seq-length against the positions of the model as the start shaped it
        check_seq_length(cfg.data.seq_length, model)
    check_model_split(model, cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size,
                      cfg.parallel.num_layers_per_virtual_pipeline_stage, cfg.parallel.decoder_first_pipeline_num_layers,
                      cfg.parallel.decoder_last_pipeline_num_layers)
    batch = BatchLayout.of(cfg.train.micro_batch_size, cfg.train.global_batch_size, ps.dp_size)
    optim, train, ds_config, zero = cfg.optim, cfg.train, None, ZeroPlan()
    if cfg.train.deepspeed:
        from megabert.training.deepspeed.ds_config import resolve_deepspeed_config

        ds_config, optim, zero = resolve_deepspeed_config(cfg, ps, model.hidden_size)
        if cfg.train.deepspeed_config:  # the JSON may have chosen the stage or an offload: the plan that runs
            check_zero(zero, pp=ps.pp_size, compile=cfg.train.compile)
        train = dataclasses.replace(train, zero_stage=zero.stage)
    # Pre-training's Configs has a data section; FinetuneConfigs a task config instead.
    data = None if finetuning else sentence_pairs(cfg.data, model, cfg.explicit)
    return ResolvedRun(model=model, parallel=cfg.parallel, optim=optim, train=train, batch=batch,
                       world_size=ps.world_size, data=data,
                       finetune=cfg.finetune if finetuning else None, zero=zero, deepspeed_config=ds_config,
                       explicit=cfg.explicit, start=start)
