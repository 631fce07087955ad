"""A run's model and optimizer as the checkpoint manager's stateful parts
(megabert.checkpoint.manager): the weights, our optimizer by parameter name, the loss scaler,
the RNG streams. The distributed optimizer is a part itself; DeepSpeed's parts are its
door's (megabert.training.deepspeed.checkpoint). A run's start loads through them too."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from megabert.checkpoint.manager import CheckpointManager, CheckpointParts
from megabert.checkpoint.optimizer_state import OptimizerByName
from megabert.checkpoint.reader import RankCheckpoint
from megabert.checkpoint.run_state import LoadedCheckpoint, RNGStreams
from megabert.checkpoint.start import Source
from megabert.config import ModelConfig
from megabert.parallel import ParallelState
from megabert.parallel.param_spec import spec_table, table_to_dict

if TYPE_CHECKING:
    from megabert.training.resolve import ResolvedRun
    from megabert.training.strategy import LocalStrategy


class ModelWeights:
    """The model's TP-local weights. `before_read`: what must land before they are read
    (the distributed optimizer's parameter all-gathers)."""

    def __init__(self, model: torch.nn.Module, ps: ParallelState, before_read: Optional[Callable[[], None]] = None):
        self.model, self.ps, self.before_read = model, ps, before_read

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def model_class(self) -> str:
        return type(self.model).__name__

    @property
    def param_specs(self) -> dict:
        return table_to_dict(spec_table(self.model))

    @property
    def layers_per_virtual_stage(self) -> Optional[int]:
        return self.model.virtual_stage_layers

    def state_dict(self, keep: bool = True) -> dict:
        """The whole (TP-local) weights on the CPU where `keep`, else {}. Every rank calls it
        (a part whose parameters are partitioned gathers them here)."""
        if self.before_read is not None:
            self.before_read()
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()} if keep else {}

    def load_state_dict(self, weights: dict, source: str = "state dict") -> None:
        self.model.load_local_state_dict(weights, source=source)

    def read(self, source: Source, optimizer: bool) -> RankCheckpoint:
        return self.model.read_checkpoint(source, optimizer=optimizer)


def model_parts(model: torch.nn.Module, ps: ParallelState) -> CheckpointParts:
    """The weights and RNG streams only: a predictor, or weights loaded before a strategy exists."""
    return CheckpointParts(model=ModelWeights(model, ps), rng=RNGStreams(model.rng))


def local_parts(strategy: "LocalStrategy") -> CheckpointParts:
    """LocalStrategy's (megabert.training.strategy): our optimizer, by parameter name."""
    model = strategy.model
    return CheckpointParts(model=ModelWeights(model, strategy.ps), rng=RNGStreams(model.rng),
                           optimizer=OptimizerByName(strategy.optimizer, model), scaler=strategy.scaler)


def preload_weights(run: "ResolvedRun", model: torch.nn.Module, ps: ParallelState) -> Optional[LoadedCheckpoint]:
    """Weights go into the whole model before an engine wraps it (ZeRO-3 then partitions them
    and ZeRO-1/2 copy them into their fp32 masters), and a weights-only start is done here
    (fresh optimizer and loss scale). None: nothing loaded yet (the seed, or a plain resume,
    which reads its rank file once, in CheckpointManager.resume)."""
    start = run.start
    if start.source is None or not (start.weights_only or run.deepspeed_config is not None):
        return None
    parts = model_parts(model, ps)
    return CheckpointManager(parts, ps).restore(start.source, load_optimizer=False)
