"""Where a training step's time goes: the kernels torch.profiler saw, by kind, and the idle
time between them (bench/gpu_bert_large.py).

The profiler's Chrome trace (its stable export format) gives every device event with its
start and duration: kernels, memcpy and memset on CUDA. Each is classified by name (CATEGORIES,
first match wins); per step, a category's time is the sum of its events' durations, and the
idle time is the step's wall time less the union of all events' busy intervals (two streams
running at once count once). On a CPU the same code reads the profiler's operators instead,
each with its self time (its duration less the operators nested in it), so that time counts
once; GEMMs, LayerNorm and the optimizer's ops match the same patterns, most pointwise ops land
in "other", and "idle" is the host time outside any operator (Python, the framework).

Plain Python on the trace's JSON, so that it is tested without a GPU.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Iterable, Optional

# Order matters: FlashAttention's and xformers' kernels are built with CUTLASS (fmha_cutlassF...),
# and an optimizer's multi_tensor_apply kernels are elementwise. "lamb" must not match "lambda":
# most of PyTorch's elementwise kernels are named after a lambda (`...direct_copy_kernel_cuda(...)
# ::{lambda(float)#1}...`), and until 2026-11-27 they all counted as the optimizer.
OPTIMIZER = re.compile(r"multi_tensor|adam|lamb(?!da)|foreach|lpnorm", re.I)
CATEGORIES: tuple[tuple[str, re.Pattern], ...] = (
    ("optimizer", OPTIMIZER),
    # cuDNN's fused attention backward names its helpers after the tensors (dO.O, dQ).
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|varlen|megabert::.*softmax|dot_do_o|convert_dq", re.I)),
    ("gemm", re.compile(r"cutlass|cublas|gemm|gemv|xmma|nvjet|triton_tem\w*mm|\baten::(_?addmm|mm|bmm|baddbmm)\b",
                        re.I)),
    # "reduce_kernel", not "reduce": NCCL's AllReduce kernels are communication ("other").
    # GammaBetaBackward: LayerNorm's weight and bias gradients.
    ("norm/elementwise", re.compile(r"layer_?norm|GammaBeta|elementwise|vectorized|reduce_kernel|triton_(poi|red|per)_|"
                                    r"dropout|softmax|gelu", re.I)),
)
OTHER = "other"
# Issue 41's kernel tail, item by item, across the categories above (a kernel may count in
# several or none): the bf16 casts and copies (weights cast per use under autocast land here),
# the LayerNorm kernels, the unfused epilogue ops (bias add, GELU, dropout) and the
# torch.compile'd epilogues' Triton kernels (--dropout-add-backend compiled), the optimizer.
ITEMS: tuple[tuple[str, re.Pattern], ...] = (
    ("casts/copies", re.compile(r"copy|convert(?!_dq)", re.I)),  # not cuDNN attention's dQ
    ("layernorm", re.compile(r"layer_?norm|GammaBeta", re.I)),
    ("gelu", re.compile(r"gelu", re.I)),
    ("dropout", re.compile(r"dropout|bernoulli", re.I)),
    ("triton fused", re.compile(r"triton_(poi|red|per)_", re.I)),
    ("optimizer", OPTIMIZER),
)
NAMES = ("gemm", "attention", "norm/elementwise", "optimizer", OTHER)  # the table's order
# Chrome-trace categories of device activity (kineto's names).
DEVICE_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


def classify(name: str) -> str:
    """The category of a kernel (or CPU operator) name."""
    for category, pattern in CATEGORIES:
        if pattern.search(name):
            return category
    return OTHER


@dataclass(frozen=True)
class Event:
    name: str
    start_us: float
    dur_us: float


def device_events(trace: dict) -> list[Event]:
    """Kernels, memcpys and memsets of a Chrome trace (torch.profiler.export_chrome_trace)."""
    return [Event(e["name"], float(e["ts"]), float(e["dur"])) for e in trace.get("traceEvents", [])
            if e.get("ph", "X") == "X" and e.get("cat") in DEVICE_CATS]


def cpu_ops(trace: dict) -> tuple[list[Event], list[Event]]:
    """(each CPU operator with its self time: its duration less that of the operators inside
    it on its thread; the outermost operators, whole): the first for the categories, so that
    nested operators count once, the second for the busy time."""
    by_thread: dict = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph", "X") == "X" and e.get("cat") == "cpu_op":
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(
                Event(e["name"], float(e["ts"]), float(e["dur"])))
    own, outer = [], []
    for events in by_thread.values():
        events.sort(key=lambda e: (e.start_us, -e.dur_us))  # a parent before the children it starts with
        stack: list[list] = []  # [event, self time]
        for e in events:
            while stack and stack[-1][0].start_us + stack[-1][0].dur_us <= e.start_us:
                own.append(_self(*stack.pop()))
            if stack:
                stack[-1][1] -= e.dur_us
            else:
                outer.append(e)
            stack.append([e, e.dur_us])
        own.extend(_self(*entry) for entry in reversed(stack))
    return own, outer


def _self(e: Event, self_us: float) -> Event:
    return Event(e.name, e.start_us, max(self_us, 0.0))


def busy_union_us(events: Iterable[Event]) -> float:
    """Length of the union of the events' [start, start + dur) intervals."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e.start_us):
        lo, hi = max(e.start_us, end), e.start_us + e.dur_us
        if hi > lo:
            total += hi - lo
        end = max(end, hi)
    return total


@dataclass(frozen=True)
class Breakdown:
    """Milliseconds per step by category, the union of busy time, the step's wall time and the
    idle time (wall - busy, never below 0); `top_other`: the heaviest unclassified names."""
    ms: dict
    busy_ms: float
    wall_ms: float
    idle_ms: float
    top_other: list
    items: dict = field(default_factory=dict)  # ITEMS' ms per step


def breakdown(events: list[Event], steps: int, wall_ms: float, busy: Optional[list[Event]] = None,
              top: int = 5) -> Breakdown:
    """Per-step figures of `events` recorded over `steps` steps of `wall_ms` each; the busy
    time is the union of `busy` (default: the events themselves)."""
    ms = {name: 0.0 for name in NAMES}
    items = {name: 0.0 for name, _ in ITEMS}
    other: dict[str, float] = {}
    for e in events:
        category = classify(e.name)
        ms[category] += e.dur_us / 1e3 / steps
        for item, pattern in ITEMS:
            if pattern.search(e.name):
                items[item] += e.dur_us / 1e3 / steps
        if category == OTHER:
            other[e.name] = other.get(e.name, 0.0) + e.dur_us / 1e3 / steps
    busy_ms = busy_union_us(events if busy is None else busy) / 1e3 / steps
    heaviest = sorted(other.items(), key=lambda kv: kv[1], reverse=True)[:top]
    return Breakdown(ms=ms, busy_ms=busy_ms, wall_ms=wall_ms, idle_ms=max(wall_ms - busy_ms, 0.0),
                     top_other=heaviest, items=items)


def from_trace_file(path: str, device_type: str, steps: int, wall_ms: float) -> Breakdown:
    """The breakdown of a profiler's exported Chrome trace: device events on CUDA, leaf
    operators on the CPU."""
    with open(path) as f:
        trace = json.load(f)
    if device_type == "cuda":
        return breakdown(device_events(trace), steps, wall_ms)
    own, outer = cpu_ops(trace)
    return breakdown(own, steps, wall_ms, busy=outer)


HEADER_LABELS = {"gemm": "GEMM", "attention": "attention", "norm/elementwise": "norm/elem", "optimizer": "optimizer",
                 "other": "other"}


def header() -> str:
    cells = "".join(f"{HEADER_LABELS[n]:>16}" for n in NAMES)
    return f"{'phase':6} {'side':26} {'wall ms':>8}{cells}{'idle':>16}"


def row(phase: str, side: str, b: Breakdown) -> str:
    """`phase side wall` then `ms share%` per category and for idle (shares of the wall)."""
    def cell(ms: float) -> str:
        share = ms / b.wall_ms if b.wall_ms else 0.0
        return f"{ms:9.2f} {share:5.1%}"
    cells = "".join(f" {cell(b.ms[n]):>15}" for n in NAMES)
    return f"{phase:6} {side:26} {b.wall_ms:8.2f}{cells} {cell(b.idle_ms):>15}"


def other_line(b: Breakdown, width: int = 70) -> Optional[str]:
    if not b.top_other:
        return None
    return "        other: " + "; ".join(f"{name[:width]} {ms:.2f}" for name, ms in b.top_other)


def items_line(b: Breakdown) -> str:
    """Issue 41's tail items, ms per step (ITEMS)."""
    return "        tail: " + "; ".join(f"{name} {b.items.get(name, 0.0):.2f}" for name, _ in ITEMS)
