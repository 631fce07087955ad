"""The arithmetic of a run's layout, computed once and passed on: how many data-parallel
replicas a world holds, how a global batch splits into micro-batches over them, and which
layers (and interleaved chunks) each pipeline rank holds. Each holds its rule (the world
size, the batch) once; megabert.rules and the ParallelState call these."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

from megabert.errors import ConfigError
from megabert.parallel.param_spec import ParamSpec


def data_parallel_size(world_size: int, tp_size: int, pp_size: int) -> int:
    """The replicas of a TP x PP model in `world_size` ranks: the world-size rule."""
    if world_size % (tp_size * pp_size):
        raise ConfigError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp_size} x "
                          f"--pipeline-model-parallel-size {pp_size}; launch a multiple of {tp_size * pp_size} "
                          f"processes")
    return world_size // (tp_size * pp_size)


@dataclass(frozen=True)
class BatchLayout:
    """One optimizer step consumes `global_batch_size` samples: each of `dp_size` replicas
    runs `num_micro_batches` micro-batches of `micro_batch_size` and accumulates."""

    micro_batch_size: int
    global_batch_size: int
    dp_size: int

    def __post_init__(self):
        if self.micro_batch_size < 1 or self.dp_size < 1:
            raise ConfigError("--micro-batch-size and the data-parallel size must be >= 1")
        if self.global_batch_size % (self.micro_batch_size * self.dp_size):
            raise ConfigError(f"--global-batch-size {self.global_batch_size} is not divisible by "
                              f"--micro-batch-size {self.micro_batch_size} x data-parallel size {self.dp_size}")

    @classmethod
    def of(cls, micro_batch_size: int, global_batch_size: Optional[int], dp_size: int) -> "BatchLayout":
        """--global-batch-size defaults to one micro-batch per replica (no accumulation)."""
        return cls(micro_batch_size, global_batch_size or micro_batch_size * dp_size, dp_size)

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)


class PipelinePosition:
    """Where a rank sits in its pipeline, read from its `pp_rank` and `pp_size`: the
    ParallelState (megabert.parallel.state) and a StageLayout are both one, so the rule
    is written once."""

    pp_rank: int
    pp_size: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


UNEVEN_FLAGS = "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers"


def stage_layer_counts(num_layers: int, pp_size: int, first: Optional[int] = None,
                       last: Optional[int] = None) -> list[int]:
    """Layers of each pipeline stage: `first` on the first stage and `last` on the last when
    given (Megatron's --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers),
    the other stages an even share of the rest. A split that cannot be made is one line."""
    if (first is not None or last is not None) and pp_size == 1:
        raise ConfigError(f"{UNEVEN_FLAGS} need --pipeline-model-parallel-size > 1")
    for flag, value in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if value is not None and not 1 <= value < num_layers:
            raise ConfigError(f"{flag} {value} must be between 1 and --num-layers {num_layers} - 1")
    if first is None and last is None:
        if num_layers % pp_size:
            raise ConfigError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size "
                              f"{pp_size}; or give the first or last stage its own number of layers with "
                              f"{UNEVEN_FLAGS}")
        return [num_layers // pp_size] * pp_size
    middle = pp_size - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    given = " and ".join(f"{flag} {v}" for flag, v in (("--decoder-first-pipeline-num-layers", first),
                                                       ("--decoder-last-pipeline-num-layers", last)) if v is not None)
    if middle == 0 and rest != 0:
        raise ConfigError(f"{given} add up to {first + last} layers, not --num-layers {num_layers}: with "
                          f"--pipeline-model-parallel-size 2 the two stages hold every layer")
    if middle > 0 and (rest < middle or rest % middle):
        raise ConfigError(f"--num-layers {num_layers} with {given} leaves {rest} layers for the other {middle} "
                          f"stage(s) of --pipeline-model-parallel-size {pp_size}, which cannot share them evenly; "
                          f"choose counts that leave a multiple of {middle}")
    each = rest // middle if middle else 0
    return [first if first is not None else each] + [each] * (pp_size - 2) + [last if last is not None else each]


@dataclass(frozen=True)
class StageLayout(PipelinePosition):
    """Layers of one pipeline rank. Even stages are cut into pp_size x V chunks of
    `layers_per_chunk`; rank r holds global chunks r, r + pp, r + 2 pp, ... (V = 1 unless
    the schedule is interleaved). Uneven stages (`first_stage_layers`, `last_stage_layers`:
    stage_layer_counts) hold one chunk each, of their own size. Global chunk 0 starts with the
    embeddings; the last ends with the final LayerNorm, the pooler and the heads."""

    num_layers: int
    pp_size: int = 1
    pp_rank: int = 0
    layers_per_chunk: Optional[int] = None
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None

    def __post_init__(self):
        counts = stage_layer_counts(self.num_layers, self.pp_size, self.first_stage_layers, self.last_stage_layers)
        uneven = self.first_stage_layers is not None or self.last_stage_layers is not None
        if uneven and self.layers_per_chunk is not None:
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage (the interleaved schedule) cannot combine "
                              f"with {UNEVEN_FLAGS}: its chunks are equal; drop one or the other")
        per_chunk = self.layers_per_chunk or counts[0]
        if not uneven and counts[0] % per_chunk:
            raise ConfigError(f"--num-layers {self.num_layers} does not split into --pipeline-model-parallel-size "
                              f"{self.pp_size} stages of chunks of {per_chunk} layers")
        object.__setattr__(self, "layers_per_chunk", None if uneven else per_chunk)
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        object.__setattr__(self, "_stage_starts", tuple(starts))

    @property
    def stage_layer_counts(self) -> list[int]:
        s = self._stage_starts
        return [b - a for a, b in zip(s, s[1:])]

    @property
    def num_chunks(self) -> int:
        if self.layers_per_chunk is None:
            return 1
        return self.num_layers // (self.pp_size * self.layers_per_chunk)

    @property
    def virtual_stage_layers(self) -> Optional[int]:
        """The interleaved chunk size, or None for the plain one-chunk-per-rank layout."""
        return self.layers_per_chunk if self.num_chunks > 1 else None

    def global_chunk(self, v: int) -> int:
        return v * self.pp_size + self.pp_rank

    def chunk_layers(self, v: int) -> list[int]:
        if self.layers_per_chunk is None:
            return list(range(self._stage_starts[self.pp_rank], self._stage_starts[self.pp_rank + 1]))
        g = self.global_chunk(v)
        return list(range(g * self.layers_per_chunk, (g + 1) * self.layers_per_chunk))

    @property
    def layer_ids(self) -> list[int]:
        return [i for v in range(self.num_chunks) for i in self.chunk_layers(v)]

    def is_first_chunk(self, v: int) -> bool:
        return self.global_chunk(v) == 0

    def is_last_chunk(self, v: int) -> bool:
        return self.global_chunk(v) == self.num_chunks * self.pp_size - 1

    def stage_of_layer(self, layer: int) -> int:
        if self.layers_per_chunk is None:
            return bisect.bisect_right(self._stage_starts, layer) - 1
        return (layer // self.layers_per_chunk) % self.pp_size

    def holds(self, spec: ParamSpec) -> bool:
        """Whether this rank holds the parameter `spec` describes."""
        if spec.placement == "layer":
            return self.stage_of_layer(spec.layer) == self.pp_rank
        if spec.placement == "first":
            return self.is_first_stage
        if spec.placement == "last":
            return self.is_last_stage
        return self.is_first_stage or self.is_last_stage  # tied word embeddings
