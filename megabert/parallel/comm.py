"""The one door for megabert's collectives and point-to-point transfers, and the ledger
that counts the bytes each rank sends through it.

Every collective megabert issues (the TP/SP mappings, pipeline p2p, the DP reduction and
its overlapped buckets, the tied-embedding and SP gradient sums, the grad-norm and loss
reductions) calls the functions below instead of torch.distributed. Each one adds to the
*active* ledger, if any, then calls torch.distributed (looked up at call time, so a test
that wraps `dist.all_reduce` still sees every call).

Unit: the algorithmic volume a rank sends under the ring algorithms the layout planner
assumes (megabert.planning.communication), not the bytes a backend puts on the wire:
    all-reduce      2(n-1)/n x buffer
    all-gather       (n-1)/n x gathered output
    reduce-scatter   (n-1)/n x input
    reduce           (n-1)/n x buffer (ZeRO issues one per partition, each rank the
                     root of its own: together a reduce-scatter)
    all-to-all       (n-1)/n x input
    broadcast        the buffer, on the source rank only
    send             the buffer; a receive sends nothing
so a measured step and a predicted step are in the same unit. gloo's own algorithms move
other amounts on the wire; and where megabert composes an op from others on gloo (the
sequence-parallel reduce-scatter as an all-reduce: `reduce_scatter_by_all_reduce`; the
distributed optimizer's reduce-scatter and all-gather as rings of send/recv:
megabert.data_parallel.ring, which counts through `count`) the op asked for is counted, so a
CPU step counts what the same step sends on NCCL (the ring sends exactly that).

Why an active ledger installed by a context manager, and not one passed to each call:
the TP mappings are autograd Functions whose layers take only their group (STYLE 2), and
on GPUs backward runs them on autograd's device threads, where a thread-local or a
ContextVar set by the training loop is not seen. The Trainer owns one CommLedger per run
(labels from its ParallelState) and installs it around each training step; outside a
step (evaluation, checkpoints, the Python API) nothing is counted, and the cost of the
door is one `is None` test. With --compile the collectives inside compiled layers run in
the graph, not through this Python, and are not counted (see _record). Counting reads sizes only: no sync, no extra collective.

A lost peer: every call (and every async op's wait) that fails because another rank stopped,
died or became unreachable raises megabert.errors.CommunicationError, one line naming the
group, the op and the peer (megabert.parallel.failures); other errors pass unchanged.
"""
from __future__ import annotations

import pickle
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megabert.parallel.failures import GuardedWork, guarded

ReduceOp = dist.ReduceOp

# Group labels, as the planner's breakdown names traffic. "sp": the sequence-parallel
# collectives and gradient sums, on the TP group; "mp": the grad norm over TP x PP; "world":
# the default group (fp16's overflow flag); "other": a group the ParallelState does not name.
LABELS = ("tp", "sp", "pp", "dp", "embedding", "mp", "zero", "world", "other")


def sent_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for `op` on a buffer of `nbytes` over `n` ranks (see above)."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    if op in ("all_gather", "reduce_scatter", "reduce", "all_to_all"):
        return (n - 1) / n * nbytes
    if op in ("broadcast", "send"):
        return float(nbytes)
    if op in ("recv", "barrier"):
        return 0.0
    raise ValueError(f"unknown collective {op!r}")


class CommLedger:
    """Bytes this rank sent, by group label, since the last `take()`."""

    def __init__(self, labels: Optional[dict] = None):
        self._labels = dict(labels or {})  # ProcessGroup -> label
        self.bytes: dict[str, float] = defaultdict(float)

    @classmethod
    def for_state(cls, ps) -> "CommLedger":
        """Labels for the groups of a ParallelState. NOTE: the embedding group may hold the
        same ranks as the pipeline group (PP=2) but is its own communicator, so it keeps
        its own label."""
        named = [(ps.tp_group, "tp"), (ps.dp_group, "dp"), (ps.pp_group, "pp"), (ps.pp_backward_group, "pp"),
                 (ps.mp_group, "mp"), (ps.embedding_group, "embedding")]
        return cls({g: name for g, name in named if g is not None})

    def label(self, group) -> str:
        return self._labels.get(group, "world" if group is None else "other")

    def add(self, label: str, op: str, nbytes: int, n: int) -> None:
        sent = sent_bytes(op, nbytes, n)
        if sent:
            self.bytes[label] += sent

    def take(self) -> dict[str, float]:
        """{label: bytes} since the last take, and starts again from zero."""
        out = dict(self.bytes)
        self.bytes.clear()
        return out

    @contextmanager
    def recording(self) -> Iterator["CommLedger"]:
        """Counts what megabert's door (and an outside engine's, where its strategy counts it) sends
        meanwhile."""
        global _active
        previous, _active = _active, self
        try:
            yield self
        finally:
            _active = previous


# The ledger of the training step in progress; set only by CommLedger.recording().
_active: Optional[CommLedger] = None


def active_ledger() -> Optional[CommLedger]:
    return _active


def count(group, op: str, nbytes: int, label: Optional[str] = None) -> None:
    """Counts `op` on `nbytes` over `group` as if sent now, for a collective composed
    outside this module from transfers it does not count (megabert.data_parallel.ring)."""
    _record(group, op, nbytes, label)


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def _record(group, op: str, nbytes: int, label: Optional[str]) -> None:
    ledger = _active
    # NOTE: under torch.compile this Python runs once, while dynamo traces the call, and
    # the collective then runs inside the compiled graph: counting here would count the
    # trace, not the steps (and dynamo cannot trace the ledger's dict of floats). So the
    # collectives inside --compile'd layers (TP/SP's) are not in the ledger.
    if ledger is not None and not torch.compiler.is_compiling():
        ledger.add(label or ledger.label(group), op, nbytes, _size(group))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _run(group, what: str, call, /, *args, peer: Optional[int] = None, **kwargs):
    """call(*args, **kwargs), the op `what` on `group`, with a lost peer worded
    (megabert.parallel.failures); an async op's handle words its wait() alike. Under
    torch.compile's trace: the bare call (the collective becomes part of the graph; see
    _record), so a lost peer inside a compiled layer ends in the backend's own error."""
    if torch.compiler.is_compiling():
        return call(*args, **kwargs)
    with guarded(group, what, peer):
        work = call(*args, **kwargs)
    return GuardedWork(work, group, what, peer) if isinstance(work, dist.Work) else work


def all_reduce(tensor: torch.Tensor, group=None, op=ReduceOp.SUM, async_op: bool = False,
               label: Optional[str] = None):
    _record(group, "all_reduce", _nbytes(tensor), label)
    return _run(group, "all_reduce", dist.all_reduce, tensor, op=op, group=group, async_op=async_op)


def all_gather(parts: list[torch.Tensor], tensor: torch.Tensor, group=None, label: Optional[str] = None):
    _record(group, "all_gather", _nbytes(tensor) * len(parts), label)
    return _run(group, "all_gather", dist.all_gather, parts, tensor, group=group)


def reduce_scatter(out: torch.Tensor, chunks: list[torch.Tensor], group=None, label: Optional[str] = None):
    _record(group, "reduce_scatter", sum(_nbytes(c) for c in chunks), label)
    return _run(group, "reduce_scatter", dist.reduce_scatter, out, chunks, group=group)


# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single and deprecated
# the old names; releases before it (a GPU image's torch 2.11) have only the old ones.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter_tensor(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False,
                          label: Optional[str] = None):
    """Sums `x` over the group; rank r keeps chunk r in `out` (which may be that chunk of `x`:
    the distributed optimizer reduce-scatters its gradient buckets in place)."""
    _record(group, "reduce_scatter", _nbytes(x), label)
    return _run(group, "reduce_scatter", _reduce_scatter_single, out, x, group=group, async_op=async_op)


def all_gather_into_tensor(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False,
                           label: Optional[str] = None):
    """Rank r's `x` lands in chunk r of `out` (`x` may be that chunk of `out`)."""
    _record(group, "all_gather", _nbytes(out), label)
    return _run(group, "all_gather", _all_gather_single, out, x, group=group, async_op=async_op)


def reduce_scatter_by_all_reduce(x: torch.Tensor, group=None, label: Optional[str] = None) -> torch.Tensor:
    """All-reduces `x` in place for a backend without reduce-scatter (gloo); the caller
    keeps its slice. Counted as the reduce-scatter it stands in for (see above)."""
    _record(group, "reduce_scatter", _nbytes(x), label)
    _run(group, "all_reduce", dist.all_reduce, x, group=group)
    return x


def gather(tensor: torch.Tensor, parts: Optional[list[torch.Tensor]], group=None, group_dst: int = 0):
    """Group rank `group_dst` receives every rank's `tensor` into `parts` (None on the other
    ranks). Counted as a send of `tensor` on the other ranks."""
    if _active is not None and dist.get_rank(group) != group_dst:
        _record(group, "send", _nbytes(tensor), None)
    return _run(group, "gather", dist.gather, tensor, gather_list=parts, group=group, group_dst=group_dst)


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    _record(group, "send", _nbytes(tensor), None)
    return _run(group, "send", dist.isend, tensor, dst, group=group, tag=tag, peer=dst)


def irecv(tensor: torch.Tensor, src: int, group=None, tag: int = 0):
    return _run(group, "recv", dist.irecv, tensor, src, group=group, tag=tag, peer=src)  # a receive sends nothing


def barrier(group=None):
    return _run(group, "barrier", dist.barrier, group=group)


def broadcast_object_list(objects: list, src: int, group=None):
    """Counted on the source rank as the pickled size (what torch sends, less its size header)."""
    if _active is not None and dist.get_rank() == src:
        _record(group, "broadcast", len(pickle.dumps(objects)), None)
    return _run(group, "broadcast", dist.broadcast_object_list, objects, src=src, group=group)


def all_gather_object(out: list, obj, group=None):
    if _active is not None:
        _record(group, "all_gather", len(pickle.dumps(obj)) * len(out), None)
    return _run(group, "all_gather", dist.all_gather_object, out, obj, group=group)
