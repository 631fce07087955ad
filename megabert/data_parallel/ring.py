"""Ring reduce-scatter and all-gather from point-to-point transfers, run in order by one
background thread: the distributed optimizer's gradient and parameter buckets on gloo.

Why not gloo's collectives (issue 32; figures in docs/performance.md): its reduce_scatter
and all_gather stage copies of every bucket in flight (more memory than the sharded moments
save), and its reduce runs a ring reduce-scatter of the chunk and then sends the root its
segments, so one reduce per shard, rooted at its owner, writes 1.5x a reduce-scatter's
bytes at two ranks. A ring moves exactly what the ledger counts: in each of n-1 steps every
rank sends one chunk to the next rank while it receives another from the previous one,
(n-1)/n of the buffer per rank and op, both directions of every link busy.

    reduce-scatter: step k sends chunk (r-k-1) mod n (the partial sum the step before
                    finished) and receives the previous rank's partial sum of chunk
                    (r-k-2) mod n into scratch, then adds it in place; after n-1 steps
                    chunk r holds the sum over every rank. The other chunks are left with
                    partial sums.
    all-gather:     step k sends chunk (r-k) mod n and receives chunk (r-k-1) mod n straight
                    into its place; after n-1 steps every chunk has arrived.

Each step moves its chunk as SLICES transfers, and DEPTH transfers are in flight at once,
across steps and across queued ops: measured across a 1 Gbit/s veth (bench/multinode.py's
link), exchanging 24 MB as 12 transfers took 0.41 s one at a time (send and receive posted
together, then both waited for) and 0.22 s two at a time, what one direction alone takes:
a link idles between lock-step transfers, and both directions do not fill. Slice j of step
k+1 sends what slice j of step k received, SLICES transfers later, so with DEPTH <= SLICES
it has arrived; a chunk too short to slice waits for it.

Why a thread: gloo's point-to-point transfers run by themselves, but a ring's steps chain
(each sends what the one before summed), and the caller that issues a bucket - a hook in
backward - cannot wait for them. One thread per communicator works through a FIFO queue, as
a CUDA stream runs NCCL's collectives in issue order: every rank issues the same buckets in
the same order, so the rings meet. Memory: one chunk of scratch (the largest any op will
submit) for the whole queue, split into DEPTH slots, not one per bucket; the all-gather
needs none.

The thread owns its communicator (ParallelState.new_dp_group): nothing else sends on it, so
its tags cannot meet another user's, and the main thread's collectives on the DP group run
beside it unchanged. Bytes are counted when an op is submitted, in the caller's thread, as
the collective it is (megabert.parallel.comm's unit), under the caller's label.

Errors: a transfer that fails in the thread (a peer that died: gloo's "Connection closed by
peer"; a peer that stopped: the communicator's timeout, the run's --distributed-timeout-minutes
given to new_dp_group) fails its op and every op after it (the ring is out of step), and
each one's wait() raises it in the waiting thread: a CommunicationError that names the
ring's group, the op and the neighbour (megabert.parallel.failures).
"""
from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megabert.parallel import comm
from megabert.parallel.failures import guarded

SLICES = 2  # transfers per chunk and ring step
DEPTH = 2  # transfers in flight (<= SLICES: see above)


class RingWork:
    """One submitted op; wait() returns once the thread has run it, or raises its error."""

    def __init__(self):
        self._done = threading.Event()
        self._error: Optional[BaseException] = None

    def _finish(self, error: Optional[BaseException]) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True


@dataclass
class _Transfer:
    """One slice of one ring step: `send` goes to the next rank while the previous rank's
    slice lands in `recv` (a scratch slot, added into `into` on arrival, for a
    reduce-scatter; the slice's own place for an all-gather)."""

    send: torch.Tensor
    recv: torch.Tensor
    into: Optional[torch.Tensor]
    sends: tuple[int, int]  # (chunk, slice) of the op's buffer it sends
    writes: tuple[int, int]  # and the one it writes
    op: int  # the op's number, counted from 0 on every rank alike
    index: int  # the transfer's, likewise
    last: bool  # the op's last transfer: its completion completes the op
    work: Optional[RingWork] = None
    handles: tuple = ()


class RingCommunicator:
    """Ring reduce-scatters and all-gathers over `group` (which no one else uses), in
    submission order, by one daemon thread. `max_chunk_bytes`: the largest chunk (buffer /
    group size) any submitted reduce-scatter has; its scratch is allocated once. Ops queued
    together must not share memory (the transfers of consecutive ops overlap in time)."""

    def __init__(self, group: dist.ProcessGroup, max_chunk_bytes: int, *, device: torch.device,
                 label: Optional[str] = None):
        self.group, self.label = group, label
        self.size, self.rank = group.size(), group.rank()
        # The neighbours' global ranks, for a lost peer's error.
        self._next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self._prev = dist.get_global_rank(group, (self.rank - 1) % self.size)
        # DEPTH slots of a slice each (a slice is at most ceil(chunk / SLICES) elements: one
        # element more than chunk / SLICES), every slot aligned for any element size.
        self._slot_bytes = (-(-max_chunk_bytes // SLICES) + 16 + 15) // 16 * 16
        self._scratch = torch.empty(DEPTH * self._slot_bytes, dtype=torch.uint8, device=device)
        self._max_chunk_bytes = max_chunk_bytes
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: Optional[BaseException] = None  # the first failure; every later op fails with it
        self._last: Optional[RingWork] = None  # the op submitted last
        self._submitted = 0
        self._transfer_count = 0  # transfers issued; picks the scratch slot
        self._thread = threading.Thread(target=self._run, name="megabert-ring", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ submitting

    def reduce_scatter(self, x: torch.Tensor) -> RingWork:
        """Sums `x` over the group into chunk r of rank r's `x`, in place (the other chunks
        are left holding partial sums)."""
        self._check(x, scratch=True)
        comm.count(self.group, "reduce_scatter", x.numel() * x.element_size(), self.label)
        return self._submit(x, reduce=True)

    def all_gather(self, x: torch.Tensor) -> RingWork:
        """Chunk r of rank r's `x` lands in chunk r of every rank's `x`, in place."""
        self._check(x, scratch=False)
        comm.count(self.group, "all_gather", x.numel() * x.element_size(), self.label)
        return self._submit(x, reduce=False)

    def _check(self, x: torch.Tensor, scratch: bool) -> None:
        if x.dim() != 1 or not x.is_contiguous() or x.numel() % self.size:
            raise ValueError(f"a ring collective takes a contiguous 1-D tensor whose length divides by the group "
                             f"size {self.size}, got shape {tuple(x.shape)}")
        if scratch and x.numel() // self.size * x.element_size() > self._max_chunk_bytes:
            raise ValueError(f"a chunk of {x.numel() // self.size * x.element_size()} bytes is larger than the "
                             f"ring's scratch allows ({self._max_chunk_bytes} bytes)")

    def _submit(self, x: torch.Tensor, reduce: bool) -> RingWork:
        if not self._thread.is_alive():
            raise RuntimeError("the ring communicator is closed")
        work = self._last = RingWork()
        self._queue.put((x, reduce, work, self._submitted))
        self._submitted += 1
        return work

    def close(self) -> None:
        """Ends the thread once it has run what is queued. A thread still inside an op
        (only after a failure elsewhere left a peer waiting) is left to the process's
        end: it is a daemon."""
        if self._thread.is_alive():
            self._queue.put(None)
            if self._last is None or self._last.is_completed():  # idle: it takes the stop at once
                self._thread.join()

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        flight: deque[_Transfer] = deque()
        stopping = False
        while not stopping:
            work = None
            try:
                if flight:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:  # nothing new to start: finish what is on the wire
                        self._complete(flight)
                        continue
                else:
                    item = self._queue.get()
                if item is None:
                    stopping = True
                    while flight:
                        self._complete(flight)
                    return
                x, reduce, work, op = item
                if self._error is not None:
                    work._finish(self._error)
                else:
                    self._issue(x, reduce, work, op, flight)
            except BaseException as e:  # noqa: B902  (handed to the waiters, which raise it)
                self._error = e
                for t in flight:
                    if t.work is not None:
                        t.work._finish(e)
                flight.clear()
                if work is not None and not work.is_completed():
                    work._finish(e)

    def _issue(self, x: torch.Tensor, reduce: bool, work: RingWork, op: int, flight: deque) -> None:
        issued = False
        for t in self._transfers(x, reduce, op):
            # A full window, or a transfer that sends what one in flight still writes.
            while flight and (len(flight) >= DEPTH or any(f.op == op and f.writes == t.sends for f in flight)):
                self._complete(flight)
            # Transfer i meets transfer i of the neighbours: one tag per slot, so no two
            # transfers in flight share one and the match needs no ordering.
            tag = t.index % DEPTH
            kind = "reduce_scatter" if reduce else "all_gather"
            with guarded(self.group, f"ring {kind}'s send", self._next):
                send = dist.isend(t.send, group=self.group, group_dst=(self.rank + 1) % self.size, tag=tag)
            with guarded(self.group, f"ring {kind}'s recv", self._prev):
                recv = dist.irecv(t.recv, group=self.group, group_src=(self.rank - 1) % self.size, tag=tag)
            t.handles = (send, recv)
            t.work = work if t.last else None
            flight.append(t)
            issued = True
        if not issued:  # a group of one: nothing to send
            work._finish(None)

    def _complete(self, flight: deque) -> None:
        """Waits for the oldest transfer in flight, adds what it received, and completes its
        op if it was the op's last."""
        t = flight[0]
        kind = "reduce_scatter" if t.into is not None else "all_gather"
        for handle, what, peer in zip(t.handles, ("send", "recv"), (self._next, self._prev)):
            with guarded(self.group, f"ring {kind}'s {what}", peer):
                handle.wait()
        if t.into is not None:
            t.into.add_(t.recv)
        flight.popleft()
        if t.work is not None:
            t.work._finish(None)

    def _transfers(self, x: torch.Tensor, reduce: bool, op: int) -> Iterator[_Transfer]:
        """The op's transfers in ring order, step by step, slice by slice. Their count is
        the same on every rank (slices of equal chunks), so transfer i meets transfer i."""
        n, r = self.size, self.rank
        chunks = [c.tensor_split(SLICES) for c in x.chunk(n)]
        slices = [j for j in range(SLICES) if chunks[0][j].numel()]
        todo = [(k, j) for k in range(n - 1) for j in slices]
        for i, (k, j) in enumerate(todo):
            send, write = ((r - k - 1) % n, (r - k - 2) % n) if reduce else ((r - k) % n, (r - k - 1) % n)
            into = chunks[write][j]
            if reduce:
                at = (self._transfer_count % DEPTH) * self._slot_bytes
                recv = self._scratch[at:at + into.numel() * x.element_size()].view(x.dtype)
            else:
                recv, into = into, None
            yield _Transfer(chunks[send][j], recv, into, (send, j), (write, j), op, self._transfer_count,
                            i == len(todo) - 1)
            self._transfer_count += 1
