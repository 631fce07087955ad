"""ZeRO (Rajbhandari et al. 2020: the data-parallel group partitions optimizer states,
then gradients, then parameters) as megabert plans it, typed: the stage, what is
offloaded to the CPU, the buffer sizes scaled to the model, and where the plan came
from. The resolved run holds one ZeroPlan; the rules (megabert.rules), the layout
planner (megabert.planning) and the engine's config (built in the training strategy that
runs ZeRO) all read this one object, so none of them reads the engine's own config."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megabert.errors import ConfigError


@dataclass(frozen=True)
class ZeroBuckets:
    """ZeRO's buffer sizes (elements), scaled to the model as transformers fills an engine's
    "auto" values; the engine's own defaults (5e8-element buckets, 1e9 live parameters)
    would let ZeRO-3 gather all of BERT-large at once and save nothing.

    One transformer layer holds 12 h^2 weights (QKV 3h^2, output h^2, MLP 8h^2); ZeRO-3
    keeps at most two layers' worth gathered, parameters smaller than 10 h stay
    unpartitioned (LayerNorms, biases: gathering them costs more than it saves), and its
    optimizer step walks the partition two layers' worth at a time (sub_group_size): a
    default of 1e9 elements steps a BERT-large partition in one piece, and the fp32
    gradient copy it makes plus AdamW's temporaries (sqrt, then the denominator) were three
    partition-sized tensors at once (bench/memory.py: BERT-large ZeRO-3 DP=2 peaked at 8.2
    GB per rank, above one process's 7.0; 6.8 GB with sub-groups, same losses)."""

    reduce_bucket: int
    """Gradients reduced (scattered) at once, stages 1-3."""
    allgather_bucket: int
    """Updated parameters gathered at once after the step, stages 1-2."""
    prefetch_bucket: int
    """ZeRO-3: parameters fetched ahead of the layer that needs them."""
    param_persistence_threshold: int
    """ZeRO-3: parameters smaller than this stay whole on every rank."""
    max_live_parameters: int
    """ZeRO-3: gathered parameters held at once."""
    max_reuse_distance: int
    """ZeRO-3: a parameter reused within this many elements stays gathered."""
    sub_group_size: int
    """ZeRO-3: elements of the partition the optimizer steps at a time."""
    overlap_comm: bool = True
    """Reduce while backward runs (stages 2-3; stage 1 reduces after backward)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (stages 2-3)."""

    @classmethod
    def for_hidden_size(cls, hidden_size: int) -> "ZeroBuckets":
        h2 = hidden_size * hidden_size
        return cls(reduce_bucket=h2, allgather_bucket=h2, prefetch_bucket=int(0.9 * h2),
                   param_persistence_threshold=10 * hidden_size, max_live_parameters=2 * 12 * h2,
                   max_reuse_distance=2 * 12 * h2, sub_group_size=2 * 12 * h2)


ZERO_SOURCES = ("flag", "json")


@dataclass(frozen=True)
class ZeroPlan:
    """The ZeRO a run trains with. Stage 0: no partitioning (megabert's own trainer, or the
    engine without ZeRO). `buckets` None: sizes unknown until the model is (the engine's
    defaults). `source`: "flag" (--zero-stage and the offload flags) or "json" (the engine's
    config file chose the stage or an offload); `origin` and `offload_origin` say so in the
    rules' error messages (e.g. "--zero-stage 2", or the engine config file's path and key)."""

    stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    buckets: Optional[ZeroBuckets] = None
    source: str = "flag"
    origin: Optional[str] = None
    offload_origin: str = ""

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ConfigError(f"--zero-stage must be 0, 1, 2 or 3, got {self.stage}")
        if self.source not in ZERO_SOURCES:
            raise ValueError(f"ZeroPlan.source must be one of {ZERO_SOURCES}, got {self.source!r}")

    @property
    def stage_origin(self) -> str:
        """Where the stage came from, for messages: the flag unless `origin` says otherwise."""
        return self.origin or f"--zero-stage {self.stage}"
