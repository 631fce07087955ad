"""megabert.data_parallel.ring: the distributed optimizer's reduce-scatter and all-gather on gloo,
rings of send/recv run by one thread. Against dist.all_reduce at 2 and 3 ranks, odd chunk
lengths, fp32 and bf16, many ops queued at once; the ledger counts a ring's bytes and the
sockets carry exactly those; a peer that stops makes wait() raise a CommunicationError that
names the op and the peer, never hang."""
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tests.helpers.dist_utils import run_distributed

from megabert.data_parallel.ring import RingCommunicator
from megabert.errors import CommunicationError
from megabert.parallel.comm import CommLedger

CHUNKS = (1, 37, 1001)  # elements per rank's chunk: odd, and one
WIRE_CHUNK = 256 * 1024  # elements per chunk where the sockets' bytes are compared: 1 MB in fp32


def _socket_bytes_written() -> int:
    """Bytes this process (every thread) wrote through write-like system calls: gloo's sockets."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def _equal_worker(rank, world):
    group = dist.new_group(list(range(world)))
    ring = RingCommunicator(group, WIRE_CHUNK * 4, device=torch.device("cpu"), label="dp")
    gen = torch.Generator().manual_seed(rank)
    try:
        cases = []
        for dtype in (torch.float32, torch.bfloat16):
            for chunk in CHUNKS:
                # Small integers: every sum is exact in bf16 too, so the ring's order of
                # additions must give all_reduce's result bit for bit.
                x = torch.randint(-8, 9, (chunk * world,), generator=gen).to(dtype)
                reference = x.clone()
                dist.all_reduce(reference)
                gathered = torch.zeros_like(x)
                gathered.chunk(world)[rank].copy_(reference.chunk(world)[rank])
                cases.append((x, reference, gathered))
        ledger = CommLedger()
        with ledger.recording():
            # Everything queued before anything is waited for: the thread keeps the order.
            works = [ring.reduce_scatter(x) for x, _, _ in cases] + [ring.all_gather(g) for _, _, g in cases]
        for work in works:
            assert work.wait()
        with pytest.raises(ValueError, match="divides by the group size"):  # refused where it is submitted
            ring.reduce_scatter(torch.ones(world * 5 + 1))
        for x, reference, gathered in cases:
            assert torch.equal(x.chunk(world)[rank], reference.chunk(world)[rank]), (x.dtype, x.numel())
            assert torch.equal(gathered, reference), (x.dtype, x.numel())
        # The ledger: (n-1)/n of each buffer per op, under the caller's label.
        nbytes = sum(x.numel() * x.element_size() for x, _, _ in cases)
        assert ledger.take() == {"dp": pytest.approx(2 * (world - 1) / world * nbytes)}

        # On the wire: each rank writes to its sockets what the ledger counts (plus gloo's
        # message headers: under 1% at this size).
        x = torch.ones(world * WIRE_CHUNK)
        dist.barrier()
        before = _socket_bytes_written()
        ring.reduce_scatter(x).wait()
        ring.all_gather(x).wait()
        written = _socket_bytes_written() - before
        assert written == pytest.approx(2 * (world - 1) / world * x.numel() * 4, rel=0.01)
        dist.barrier()
    finally:
        ring.close()


@pytest.mark.parametrize("world", [2, 3])
def test_ring_reduce_scatter_and_all_gather_equal_all_reduce(world):
    run_distributed(_equal_worker, world)


def _stopped_peer_worker(rank, world):
    # A communicator that gives up after 2 s; rank 1 never joins the ring.
    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    if rank == 0:
        ring = RingCommunicator(group, 64, device=torch.device("cpu"))
        with pytest.raises(CommunicationError, match="ring reduce_scatter's send on .*: no word from rank 1 for 2 s"):
            ring.reduce_scatter(torch.ones(16)).wait()
        # The ring is out of step: what comes after the failure fails with it. (Submitted
        # after the first failed, so the thread had stopped waiting for new work first: a
        # thread that left its loop there would leave this wait hanging.)
        with pytest.raises(CommunicationError, match="ring reduce_scatter's send on .*: no word from rank 1"):
            ring.all_gather(torch.ones(16)).wait()
        ring.close()
        with pytest.raises(RuntimeError, match="closed"):
            ring.all_gather(torch.ones(16))
    dist.barrier()


def test_a_stopped_peer_raises_at_wait():
    run_distributed(_stopped_peer_worker, 2)
