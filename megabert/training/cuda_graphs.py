"""--cuda-graphs: each packed micro-batch's forward, loss and backward replayed as one CUDA graph.

Packed rows on CUDA are fixed-shape tensors and the step reads nothing back from the device
(megabert.model.packed), so a whole micro-batch can be captured once (torch.cuda.graph) and
replayed on every later one: one launch from the host instead of a few thousand kernels, so
the GPU no longer waits for Python. The optimizer step, clipping, the data-parallel average
and the logging stay eager around the replays (a few multi-tensor launches per step).

What a replay relies on, and how it holds:
- Inputs: the graph reads fixed buffers (`static`); each micro-batch is copied into them, and
  one whose keys, shapes or dtypes differ is an error, not a silent replay of other data.
- Gradients: the captured backward accumulates into `.grad` buffers that live for the whole
  run (those the first, eager, step made; zeroed in place before each global batch, never set
  to None), so gradient accumulation over micro-batches adds up as in eager mode; a parameter
  that step gave no gradient keeps none, as in eager mode. A graph that owned its gradients
  would overwrite micro-batch 1's with micro-batch 2's (what torch.compile's CUDA graph trees
  did on an H200: docs/performance.md).
- Outputs: the loss and metrics are the graph's buffers, copied after each replay before the
  next one overwrites them.
- Dropout: the default generator and the model's per-TP-rank stream (made graph-safe:
  megabert.tensor_parallel.random) are registered with the graph, which advances each at every
  replay by what the captured draws took: the masks eager mode would draw.
- Nothing Python does during the forward or backward reruns at a replay, so what needs Python
  per step is outside the graph or refused at parsing (megabert.rules.check_cuda_graphs): fp16's
  changing loss scale, the overlapped gradient reduction's hooks (the DP average runs after
  the replays), the distributed optimizer's gather hooks, pipeline schedules, recompute.

The first WARMUP_STEPS steps (at least one) run eagerly, on the stream the capture will use (lazy set-up of
libraries and torch.compile's compilation happen there, outside the capture).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Protocol

import torch

from megabert.errors import ConfigError
from megabert.training.strategy import Metrics, SequentialRunner, T

logger = logging.getLogger(__name__)

WARMUP_STEPS = 3


class Graphs(Protocol):
    """What GraphedRunner needs from CUDA: a stream to warm up and capture on, and capture."""

    def stream(self) -> Any: ...

    def capture(self, fn: Callable[[], Any], stream: Any, generators: list[torch.Generator]
                ) -> tuple[Callable[[], None], Any]:
        """Captures `fn` on `stream` with `generators` registered: (replay, fn's outputs: the
        buffers each replay rewrites)."""


class CudaGraphs:
    """torch.cuda's graphs."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ConfigError(f"--cuda-graphs needs a GPU (CUDA); this run is on {device.type}: drop --cuda-graphs")
        self.device = device

    def stream(self):
        return torch.cuda.Stream(self.device)

    def capture(self, fn, stream, generators):
        graph = torch.cuda.CUDAGraph()
        for gen in generators:
            graph.register_generator_state(gen)
        try:
            # thread_local: the DataLoader's pinning thread may call into CUDA during the capture.
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                out = fn()
        except RuntimeError as e:
            raise RuntimeError(f"--cuda-graphs: capturing a micro-batch's forward, loss and backward failed: {e}. "
                               f"Something in this step cannot be replayed from a CUDA graph; train without "
                               f"--cuda-graphs (and report the message)") from e
        return graph.replay, out


class GraphedRunner:
    """A SequentialRunner whose training micro-batches replay one captured CUDA graph (see the
    module). Evaluation (`forward_only`) runs eagerly. `graphs`: CudaGraphs on a GPU."""

    keeps_grads = True  # LocalStrategy zeroes .grad through zero_grads(), never to None

    def __init__(self, runner: SequentialRunner, params: list[torch.nn.Parameter], graphs: Graphs,
                 generators: Callable[[], list[torch.Generator]] = list, warmup_steps: int = WARMUP_STEPS):
        if warmup_steps < 1:
            raise ValueError("GraphedRunner: warmup_steps must be >= 1 (the first step finds the gradients' buffers)")
        self.runner, self.params, self.graphs = runner, params, graphs
        self.generators, self.warmup_steps = generators, warmup_steps
        self.steps = 0
        self._stream = None
        self._replay: Optional[Callable[[], None]] = None
        self._static: dict = {}
        self._outputs: Metrics = {}
        # The parameters that get gradients and their .grad buffers, from the first (eager) step on.
        self._params: list[torch.nn.Parameter] = []
        self._grads: Optional[list[torch.Tensor]] = None
        self._micro_batches = 0

    @property
    def task(self):
        return self.runner.task

    @property
    def module(self):
        return self.runner.module

    def forward_only(self, batches: list[dict], output_fn: Callable[[Any], T]) -> list[T]:
        return self.runner.forward_only(batches, output_fn)

    # ------------------------------------------------------------------ gradients

    @torch.no_grad()
    def zero_grads(self) -> None:
        """Before the first step, no gradients (autograd makes them, as in eager mode); from then
        on the run's .grad buffers zeroed in place: the graph writes into them."""
        if self._grads is None:
            for p in self.params:
                p.grad = None
            return
        self._check_grads()
        torch._foreach_zero_(self._grads)

    def _check_grads(self) -> None:
        for p, g in zip(self._params, self._grads):
            if p.grad is not g:
                raise RuntimeError("--cuda-graphs: a parameter's .grad was replaced or set to None after the graph "
                                   "was captured; the graph writes into the old buffer (zero gradients with "
                                   "zero_grads(), not zero_grad(set_to_none=True))")

    # ------------------------------------------------------------------ steps

    def forward_backward(self, batches: list[dict], loss_scale: float = 1.0) -> list[Metrics]:
        if loss_scale != 1.0:
            raise ConfigError("--cuda-graphs cannot replay a changing loss scale (fp16): use --bf16")
        if self._grads is None:
            # The first step, eager: the parameters it gives a gradient keep theirs as the run's
            # buffers; the others (unused by this task) keep none, as eager mode leaves them, so
            # the optimizer skips them rather than decaying them.
            metrics = self._eager(batches)
            self._params = [p for p in self.params if p.grad is not None]
            self._grads = [p.grad for p in self._params]
            self.steps += 1
            return metrics
        self._check_grads()
        if self._replay is None and self.steps < self.warmup_steps:
            self.steps += 1
            return self._eager(batches)
        if self._replay is None:
            self._capture(batches[0], len(batches))
        elif len(batches) != self._micro_batches:
            raise RuntimeError(f"--cuda-graphs: the graph divides each loss by {self._micro_batches} micro-batches; "
                               f"this step has {len(batches)}")
        self.steps += 1
        metrics = []
        for batch in batches:
            self._load(batch)
            self._replay()
            metrics.append({k: v.clone() for k, v in self._outputs.items()})
        return metrics

    def _eager(self, batches: list[dict]) -> list[Metrics]:
        """A warm-up step: eager mode on the capture's stream."""
        if self._stream is None:
            self._stream = self.graphs.stream()
        current = _current_stream(self._stream)
        if current is not None:
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                metrics = self.runner.forward_backward(batches)
            current.wait_stream(self._stream)
            return metrics
        return self.runner.forward_backward(batches)

    def _capture(self, batch: dict, micro_batches: int) -> None:
        self._static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        self._micro_batches = micro_batches
        if self._stream is None:
            self._stream = self.graphs.stream()
        runner, static = self.runner, self._static

        def micro_batch() -> Metrics:
            with runner.autocast():
                loss, metrics = runner.task.loss(runner.module, static)
            # SequentialRunner's arithmetic: the accumulated gradient is the global batch's mean.
            (loss * (1.0 / micro_batches)).backward()
            return {k: v.detach() for k, v in metrics.items()}

        self._replay, self._outputs = self.graphs.capture(micro_batch, self._stream, self.generators())
        logger.info("--cuda-graphs: captured a micro-batch's forward, loss and backward as one CUDA graph after %d "
                    "eager steps; every later micro-batch replays it", self.steps)

    def _load(self, batch: dict) -> None:
        static = self._static
        if batch.keys() != static.keys():
            raise ValueError(f"--cuda-graphs: a micro-batch holds {sorted(batch)}, the captured one "
                             f"{sorted(static)}: every micro-batch must be the same tensors (--pack-sequences)")
        for k, v in batch.items():
            s = static[k]
            if not isinstance(v, torch.Tensor):
                if v != s:
                    raise ValueError(f"--cuda-graphs: a micro-batch's {k!r} is {v!r}, the captured one's {s!r}")
                continue
            if v.shape != s.shape or v.dtype != s.dtype:
                raise ValueError(f"--cuda-graphs: a micro-batch's {k!r} is {v.dtype}{list(v.shape)}, the captured "
                                 f"one's {s.dtype}{list(s.shape)}: every micro-batch must have the same shapes "
                                 f"(--pack-sequences)")
            if v.data_ptr() != s.data_ptr():
                s.copy_(v, non_blocking=True)


def _current_stream(side) -> Optional[Any]:
    """The current CUDA stream where `side` is a CUDA stream (on other devices no streams)."""
    return torch.cuda.current_stream(side.device) if isinstance(side, torch.cuda.Stream) else None
