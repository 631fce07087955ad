"""Named RNG streams and activation checkpointing that replays them.

Dropout on activations that are split over the TP group (attention probabilities,
split by heads) must differ between TP ranks, or every rank would drop the same
pattern in its own heads; dropout on replicated activations must be identical on all
TP ranks. So the default generator is seeded the same on every TP rank, and a second,
per-TP-rank "tensor-parallel" stream is swapped in with `tracker.fork()` (Megatron's
CudaRNGStatesTracker, here for CPU and CUDA alike).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.utils.checkpoint

TP_STREAM = "tensor-parallel"
# Megatron's offset between the default and the tensor-parallel seed: keeps the two
# streams apart for any seed a user picks.
TP_SEED_OFFSET = 2718


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Keeps named generator states and swaps them into the device's default generator.

    By value (the default): fork() copies a stream's state into the default generator and
    back. Graph-safe (`make_graph_safe()`, CUDA only, for --cuda-graphs): each stream is a
    generator of its own and fork() points the default generator at that generator's state
    object (Generator.graphsafe_set_state), which a CUDA graph capture allows where setting a
    state by value is refused; the graph advances each registered state (`generators()`) at
    every replay by what the captured draws took, as eager mode would. Both draw the same
    numbers from the same seeds; checkpoints hold the same bytes either way."""

    def __init__(self, device: torch.device | str = "cpu", split_ranks: bool = True):
        self.device = torch.device(device)
        # Several TP ranks hold slices of the activations fork() drops in, so each draws its
        # own masks. With one rank there is nothing to tell apart: fork() then draws from the
        # default stream, which torch.compile traces (a state swap breaks a compiled layer's
        # graph in two) and a CUDA graph captures without swapping states.
        self.split_ranks = split_ranks
        self.states: dict[str, torch.Tensor] = {}
        self._generators: Optional[dict[str, torch.Generator]] = None  # graph-safe mode

    def add(self, name: str, seed: int) -> None:
        if name in self.states or (self._generators is not None and name in self._generators):
            raise ValueError(f"RNG stream {name!r} already exists")
        if self._generators is not None:
            self._generators[name] = torch.Generator(device=self.device).manual_seed(seed)
            return
        saved = _get_state(self.device)
        gen = torch.cuda if self.device.type == "cuda" else torch
        gen.manual_seed(seed)
        self.states[name] = _get_state(self.device)
        _set_state(saved, self.device)

    def make_graph_safe(self) -> None:
        """Switches to graph-safe mode (see the class): the streams keep their states."""
        if self.device.type != "cuda":
            raise ValueError(f"graph-safe RNG streams are for CUDA devices, not {self.device}")
        if self._generators is None:
            self._generators = {}
            for name, state in self.states.items():
                gen = torch.Generator(device=self.device)
                gen.set_state(state)
                self._generators[name] = gen
            self.states = {}

    def generators(self) -> list[torch.Generator]:
        """Graph-safe mode: the streams' generators, for CUDAGraph.register_generator_state."""
        return list(self._generators.values()) if self._generators is not None else []

    def _default_generator(self) -> torch.Generator:
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]

    @contextlib.contextmanager
    def fork(self, name: str = TP_STREAM):
        """Runs the block on stream `name`; the default stream is untouched by it (with one
        rank, `split_ranks` False: on the default stream)."""
        if not self.split_ranks:
            if name not in self.states and (self._generators is None or name not in self._generators):
                raise KeyError(f"RNG stream {name!r} was never added")
            yield
            return
        if self._generators is not None:
            if name not in self._generators:
                raise KeyError(f"RNG stream {name!r} was never added")
            default = self._default_generator()
            saved = default.graphsafe_get_state()
            default.graphsafe_set_state(self._generators[name].graphsafe_get_state())
            try:
                yield
            finally:
                default.graphsafe_set_state(saved)
            return
        if name not in self.states:
            raise KeyError(f"RNG stream {name!r} was never added")
        saved = _get_state(self.device)
        _set_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_state(self.device)
            _set_state(saved, self.device)

    def get_states(self) -> dict[str, torch.Tensor]:
        if self._generators is not None:
            return {k: g.get_state() for k, g in self._generators.items()}
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        if self._generators is not None:
            # In place: a captured graph holds these generators' state objects.
            unknown = set(states) - set(self._generators)
            for k in unknown:
                self._generators[k] = torch.Generator(device=self.device)
            for k, v in states.items():
                self._generators[k].set_state(v)
            return
        self.states = {k: v.clone() for k, v in states.items()}


def stage_seed(seed: int, pp_rank: int) -> int:
    """The default stream's seed: the same on every TP rank (replicated dropout must agree)
    and distinct per pipeline stage (stages hold different layers, which should not share
    dropout masks)."""
    return seed + 100 * pp_rank


def tp_stream_seed(seed: int, tp_rank: int, pp_rank: int) -> int:
    """The per-TP-rank stream's seed (Megatron's model_parallel_cuda_manual_seed)."""
    return stage_seed(seed, pp_rank) + TP_SEED_OFFSET + tp_rank


def seed_default_stream(seed: int, pp_rank: int, device: torch.device | str = "cpu") -> None:
    """Seeds the default CPU (and CUDA) generator of this rank; the model's tracker holds
    the per-TP-rank stream."""
    torch.manual_seed(stage_seed(seed, pp_rank))
    if torch.device(device).type == "cuda":
        torch.cuda.manual_seed(stage_seed(seed, pp_rank))


def checkpoint(fn: Callable, tracker: Optional[RNGStatesTracker], *args):
    """Activation checkpointing that reproduces dropout exactly in the recompute.

    torch.utils.checkpoint restores the default CPU/CUDA generators; the tracker's
    streams are restored here, since the recompute would otherwise draw from streams
    that the first forward has already advanced.
    """
    snapshot = tracker.get_states() if tracker is not None else None
    calls = 0

    def run(*a):
        nonlocal calls
        calls += 1
        if calls == 1 or tracker is None:
            return fn(*a)
        current = tracker.get_states()
        tracker.set_states(snapshot)
        try:
            return fn(*a)
        finally:
            tracker.set_states(current)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)
