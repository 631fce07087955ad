"""megabert.data_parallel's bucket component on its own, in one process: the layout
arithmetic (buckets, padding, shards, pieces) and GradBuckets' contract (gradients
accumulate in the buffer, buckets issued in order as backward completes them, the kept
part averaged, parameters without a gradient left at None). The reducers built on it are
tested across processes in test_overlap.py and test_distributed_optimizer.py."""
import math

import pytest
import torch

from megabert.data_parallel.bucket_layout import BUCKET_ALIGNMENT, layout_buffers, pieces
from megabert.data_parallel.grad_buckets import GradBuckets


def _params(*sizes, dtype=torch.float32):
    return [torch.nn.Parameter(torch.randn(n, dtype=dtype)) for n in sizes]


def test_unsharded_layout_is_contiguous_and_cut_by_size():
    params = _params(300, 200, 500, 50, 700)
    (layout,) = layout_buffers(params, 600)
    assert layout.size == sum(p.numel() for p in params)  # no padding
    assert [[p.numel() for p in b.params] for b in layout.buckets] == [[300, 200], [500, 50], [700]]
    assert all((b.shard_start, b.shard_end) == (b.start, b.end) for b in layout.buckets)
    assert [layout.offsets[p] for p in params] == [0, 300, 500, 1000, 1050]


@pytest.mark.parametrize("dp", [1, 2, 3, 5])
def test_sharded_layout_pads_and_its_pieces_cover_every_element_once(dp):
    params = _params(300, 7, 1000, 129, 50) + _params(40, 9, dtype=torch.bfloat16)
    tied = params[2]
    covered = {p: torch.zeros(p.numel(), dtype=torch.int64) for p in params}
    for rank in range(dp):
        layouts = layout_buffers(params, 400, shards=dp, shard=rank, isolate=lambda p: p is tied)
        assert [lay.dtype for lay in layouts] == [torch.float32, torch.bfloat16]
        for lay in layouts:
            for b in lay.buckets:
                assert (b.end - b.start) % math.lcm(dp, BUCKET_ALIGNMENT) == 0
                assert b.shard_end - b.shard_start == (b.end - b.start) // dp
                assert b.shard_start == b.start + rank * (b.end - b.start) // dp
            assert any(b.params == [tied] for b in lay.buckets) or tied.dtype != lay.dtype
            for s in pieces(lay):
                assert s.at == lay.offsets[s.param] + s.lo
                covered[s.param][s.lo:s.hi] += 1
    assert all(bool((c == 1).all()) for c in covered.values())


class _Done:
    def wait(self):
        return True


def test_grad_buckets_issue_in_order_during_the_last_backward_and_average():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    unused = torch.nn.Parameter(torch.ones(3))
    params = [unused] + list(model.parameters())  # the last in backward order
    reference = torch.nn.Sequential(*[torch.nn.Linear(m.in_features, m.out_features) for m in model])
    reference.load_state_dict(model.state_dict())
    issued = []

    def reduce(bucket):  # "two replicas" with equal gradients: the sum is twice this rank's
        issued.append((len(calls), bucket.start))
        bucket.kept.mul_(2)
        return _Done()

    calls = []
    grads = GradBuckets(params, layout_buffers(list(reversed(params)), 40), 2, reduce)
    assert len(grads.buckets) > 2
    x = [torch.randn(5, 4), torch.randn(5, 4)]
    grads.start(len(x))
    for xi in x:
        calls.append(xi)
        model(xi).square().sum().backward()
        if len(calls) == 1:
            assert issued == []  # nothing is complete after the first micro-batch
    assert [start for _, start in issued] == sorted(start for _, start in issued)  # bucket order
    in_backward = len(issued)
    grads.finish()
    # Backward issued every bucket before the unused parameter's, which waited for finish.
    assert in_backward == grads.index_of(unused) > 1
    assert len(issued) == len(grads.buckets)
    for xi in x:
        reference(xi).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)  # the sum of two equal replicas, averaged
        assert grads.received(p)
    assert unused.grad is None and not grads.received(unused)
    grads.close()


def test_grad_buckets_want_every_parameter_in_the_layout():
    a, b = _params(3, 4)
    with pytest.raises(ValueError, match="every parameter"):
        GradBuckets([a, b], layout_buffers([a], 10), 1, lambda bucket: _Done())
