"""DeepSpeed's `mpu=` protocol over our ParallelState: the getters DeepSpeed (and
Megatron-style code) call to find the model- and data-parallel groups, so ZeRO partitions
over our data-parallel group and gradient norms reduce over our model-parallel group
(tensor x pipeline ranks of one replica). The core ParallelState knows no engine; this
adapter is the only place that speaks DeepSpeed's names for its groups."""
from __future__ import annotations

import torch

from megabert.parallel import ParallelState


def mark_pipe_replicated(model: torch.nn.Module, table: dict, ps: ParallelState) -> None:
    """The last stage's copy of the tied word embeddings: DeepSpeed leaves parameters marked
    `ds_pipe_replicated` out of its gradient norm (the first stage counts them). `table`:
    the model's {name: ParamSpec} (megabert.parallel.param_spec.spec_table)."""
    if ps.pp_size == 1 or ps.is_first_stage:
        return
    for name, p in model.named_parameters():
        p.ds_pipe_replicated = table[name].placement == "tied"


def _reading(field: str):
    """A getter returning the ParallelState's `field` (DeepSpeed calls each with no argument)."""
    return lambda self: getattr(self.ps, field)


class DeepSpeedMpu:
    """The adapter DeepSpeed receives as `mpu`: every getter reads the ParallelState. DeepSpeed's
    "model parallel" is our tp x pp (one replica, the `mp` group); the rank within it counts
    tensor ranks fastest."""

    def __init__(self, ps: ParallelState):
        self.ps = ps

    def get_model_parallel_rank(self) -> int:
        return self.ps.pp_rank * self.ps.tp_size + self.ps.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ps.tp_size * self.ps.pp_size

    get_model_parallel_group = _reading("mp_group")

    get_tensor_model_parallel_rank = _reading("tp_rank")
    get_tensor_model_parallel_world_size = _reading("tp_size")
    get_tensor_model_parallel_group = _reading("tp_group")

    get_pipeline_model_parallel_rank = _reading("pp_rank")
    get_pipeline_model_parallel_world_size = _reading("pp_size")
    get_pipeline_model_parallel_group = _reading("pp_group")

    get_data_parallel_rank = _reading("dp_rank")
    get_data_parallel_world_size = _reading("dp_size")
    get_data_parallel_group = _reading("dp_group")
