"""What the GPU training benches share (bench/gpu_bert_large.py, bench/gpu_modernbert.py):
the few device-specific calls, a side's step and figures, interleaved timing to the device's
synchronisation, the model FLOPs of a micro-batch's real tokens, the kernel breakdown of a
side's steps (bench/_kernel_breakdown.py) and torch.compile's counters."""
from __future__ import annotations

import itertools
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

import _kernel_breakdown as kb
from megabert.planning.flops import bert_flops_per_sample


class Device:
    """The few device-specific calls, in one place: on a CPU they do nothing or say None."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> Optional[int]:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def profiler_activities(self) -> list:
        from torch.profiler import ProfilerActivity
        # On CUDA the kernels alone: recording every host operator as well slows the host,
        # which is what paces the GPU in the idle time we want to see.
        return [ProfilerActivity.CUDA] if self.cuda else [ProfilerActivity.CPU]

    def count_host_syncs(self, step: Callable[[], object], steps: int) -> Optional[int]:
        """Synchronising CUDA calls over `steps` steps (sync debug mode "warn" raises one
        warning per call); None on a CPU, where nothing waits for a device."""
        if not self.cuda:
            return None
        self.sync()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(steps):
                    step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        self.sync()
        return sum("synchroniz" in str(w.message) for w in caught)


@dataclass
class Side:
    """A side's step (no synchronisation), the per-batch figures of the batches it cycles
    through, and what was measured."""
    name: str
    step: Callable[[], object]
    samples: list[int]
    real_tokens: list[int]
    flops: list[float]
    rows: int  # rows per micro-batch
    seq: int
    calls: int = 0
    times: list = field(default_factory=list)
    # The host's part of each timed step: from its start until the step returned, before the
    # device's synchronisation (all of it where the host paces the GPU, a little where not).
    issue_times: list = field(default_factory=list)
    done: list = field(default_factory=list)  # batch index of each timed step
    peak_bytes: Optional[int] = None

    def run(self) -> int:
        """One step; the index of the batch it consumed."""
        self.step()
        i = self.calls % len(self.samples)
        self.calls += 1
        return i

    def seconds(self) -> float:
        return sum(self.times)

    def per_s(self, values: list) -> float:
        return sum(values[i] for i in self.done) / self.seconds()

    def real_share(self) -> float:
        return sum(self.real_tokens) / (self.rows * self.seq * len(self.real_tokens))

    def samples_per_row(self) -> float:
        return sum(self.samples) / (self.rows * len(self.samples))


def hf_train_step(model: torch.nn.Module, batches: list[dict], device: torch.device) -> Callable[[], None]:
    """A transformers model's training step as its users run it: bf16 autocast, torch's fused
    AdamW, clipping at 1.0, over `batches` in turn."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=True)
    it = itertools.cycle(batches)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**next(it)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def warm_up(side: Side, dev: Device, steps: int, before: int) -> None:
    """`steps` untimed steps, then the side's peak memory above `before` (allocated before it
    was built)."""
    for _ in range(steps):
        side.run()
    dev.sync()
    peak = dev.peak()
    side.peak_bytes = None if peak is None else peak - before


def batch_flops(model_cfg, batch: dict) -> float:
    """Model FLOPs of a micro-batch's real tokens: each sample at its own length (attention
    within it; a ModernBERT local layer's within its window), the MLM head at the masked
    positions; padding counts nothing. megabert's own accounting (bert_flops_per_sample,
    what the trainer's TFLOP/s figure counts), for BERT and ModernBERT alike."""
    if "packed_seqlens" in batch:
        lengths = batch["packed_seqlens"][batch["packed_seqlens"] > 0]
    else:
        lengths = batch["attention_mask"].sum(1)
    masked = int((batch["labels"] != -100).sum())
    return (sum(bert_flops_per_sample(model_cfg, int(n), masked_tokens=0) for n in lengths)
            + bert_flops_per_sample(model_cfg, 0, masked_tokens=masked))


def time_interleaved(sides: list[Side], dev: Device, rounds: int) -> None:
    """`rounds` steps per side, in an order that rotates, each timed to its synchronisation."""
    for r in range(rounds):
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:
            dev.sync()
            t0 = time.perf_counter()
            i = side.run()
            side.issue_times.append(time.perf_counter() - t0)
            dev.sync()
            side.times.append(time.perf_counter() - t0)
            side.done.append(i)


def dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process (torch._dynamo's counters)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


def fmt(x: Optional[float], spec: str, none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def profile_side(side: Side, dev: Device, steps: int) -> kb.Breakdown:
    """The kernel breakdown of `steps` more steps of `side`, against its timed wall per step."""
    from torch.profiler import profile

    dev.sync()
    with profile(activities=dev.profiler_activities()) as prof:
        for _ in range(steps):
            side.run()
        dev.sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        return kb.from_trace_file(path, dev.device.type, steps, side.seconds() / len(side.times) * 1e3)
