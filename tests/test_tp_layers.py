"""Each tensor-parallel layer equals its single-device reference: outputs and the
gradients of input, weight and bias, at TP 1, 2 and 4 (spawned gloo processes)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import megabert
from megabert.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                      gather_from_sp, scatter_to_sp, shard, vocab_parallel_argmax,
                                      vocab_parallel_cross_entropy)

from tests.helpers.dist_utils import run_distributed


ATOL = 1e-5


def _full_init(seed):
    def init(t):
        gen = torch.Generator().manual_seed(seed)
        t.copy_(torch.randn(t.shape, generator=gen))
    return init


def _allclose(a, b, what):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert torch.allclose(a, b, atol=ATOL, rtol=1e-5), f"{what}: max diff {(a - b).abs().max().item()}"


def _check_linear(rank, world, kind, sequence_parallel):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    g = ps.tp_group
    torch.manual_seed(0)
    s, b, hin, hout = 8, 3, 12, 16
    x_full = torch.randn(s, b, hin, requires_grad=True)
    ref = torch.nn.Linear(hin, hout)
    _full_init(1)(ref.weight.data)
    torch.nn.init.normal_(ref.bias.data)
    y_ref = ref(x_full)
    grad_out = torch.randn_like(y_ref)
    y_ref.backward(grad_out)

    if kind == "column":
        layer = ColumnParallelLinear(hin, hout, tp_group=g, gather_output=not sequence_parallel,
                                     init_method=_full_init(1), sequence_parallel=sequence_parallel)
        layer.bias.data.copy_(shard(ref.bias.data, 0, ps.tp_rank, world))
        x = x_full.detach().clone()
        x = (x.chunk(world, 0)[ps.tp_rank] if sequence_parallel else x).requires_grad_()
        y = layer(x)
        if sequence_parallel:  # output is column-split: compare this rank's columns
            y.backward(grad_out.chunk(world, -1)[ps.tp_rank])
            _allclose(y, y_ref.chunk(world, -1)[ps.tp_rank], "column output")
            x_grad_ref = x_full.grad.chunk(world, 0)[ps.tp_rank]
        else:
            y.backward(grad_out)
            _allclose(y, y_ref, "column output")
            x_grad_ref = x_full.grad
        _allclose(x.grad, x_grad_ref, "column input grad")
        _allclose(layer.weight.grad, shard(ref.weight.grad, 0, ps.tp_rank, world), "column weight grad")
        _allclose(layer.bias.grad, shard(ref.bias.grad, 0, ps.tp_rank, world), "column bias grad")
    else:
        layer = RowParallelLinear(hin, hout, tp_group=g, input_is_parallel=sequence_parallel,
                                  init_method=_full_init(1), sequence_parallel=sequence_parallel)
        layer.bias.data.copy_(ref.bias.data)
        if sequence_parallel:  # input is split by features, output by sequence
            x = x_full.detach().chunk(world, -1)[ps.tp_rank].clone().requires_grad_()
            y = layer(x)
            y.backward(grad_out.chunk(world, 0)[ps.tp_rank])
            _allclose(y, y_ref.chunk(world, 0)[ps.tp_rank], "row output")
            _allclose(x.grad, x_full.grad.chunk(world, -1)[ps.tp_rank], "row input grad")
            bias_grad = layer.bias.grad.clone()
            dist.all_reduce(bias_grad, group=g)  # partial under sequence parallelism
        else:
            x = x_full.detach().clone().requires_grad_()
            y = layer(x)
            y.backward(grad_out)
            _allclose(y, y_ref, "row output")
            _allclose(x.grad, x_full.grad, "row input grad")
            bias_grad = layer.bias.grad
        _allclose(layer.weight.grad, shard(ref.weight.grad, 1, ps.tp_rank, world), "row weight grad")
        _allclose(bias_grad, ref.bias.grad, "row bias grad")


def _check_embedding_and_ce(rank, world):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    g = ps.tp_group
    torch.manual_seed(0)
    vocab, dim = 64, 8
    ids = torch.randint(0, vocab, (4, 7))
    ref = torch.nn.Embedding(vocab, dim)
    _full_init(2)(ref.weight.data)
    out_ref = ref(ids)
    grad_out = torch.randn_like(out_ref)
    out_ref.backward(grad_out)
    emb = VocabParallelEmbedding(vocab, dim, tp_group=g, init_method=_full_init(2))
    out = emb(ids)
    out.backward(grad_out)
    _allclose(out, out_ref, "embedding output")
    _allclose(emb.weight.grad, shard(ref.weight.grad, 0, ps.tp_rank, world), "embedding weight grad")

    logits_full = torch.randn(5, 6, vocab, requires_grad=True)
    target = torch.randint(0, vocab, (5, 6))
    target[0, :2] = -100  # ignored positions
    loss_ref = F.cross_entropy(logits_full.view(-1, vocab), target.view(-1), reduction="none").view(5, 6)
    w = torch.randn(5, 6)
    (loss_ref * w).sum().backward()
    local = logits_full.detach().chunk(world, -1)[ps.tp_rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, g)
    (loss * w).sum().backward()
    _allclose(loss, loss_ref, "cross entropy")
    _allclose(local.grad, logits_full.grad.chunk(world, -1)[ps.tp_rank], "cross entropy grad")


def _check_vocab_parallel_argmax(rank, world):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    g = ps.tp_group
    gen = torch.Generator().manual_seed(3)
    vocab, padded = 50, 64  # rank 0 holds ids 0..31, rank 1 ids 32..49 and 14 padding columns
    full = torch.randint(-4, 4, (6, 5, padded), generator=gen).float()  # small integers: many ties
    full[0, 0, :] = 1.0
    full[0, 0, [7, 40]] = 9.0  # a tie across ranks: the lower id wins
    full[0, 1, :] = 1.0
    full[0, 1, [35, 33]] = 9.0  # a tie on one rank
    full[0, 2, :] = 2.0  # everything ties: id 0
    full[1, :, vocab:] = 100.0  # padding larger than any real logit never wins
    full[2, :, :] = torch.finfo(torch.float32).min  # the model's own padding fill reached by real logits
    full[2, :, 45] = torch.finfo(torch.float32).min / 2
    full[3, :, vocab:] = torch.finfo(torch.float32).min
    expected = torch.argmax(full[..., :vocab], dim=-1)
    assert expected[0, 0] == 7 and expected[0, 1] == 33 and expected[0, 2] == 0 and (expected[2] == 45).all()
    local = full.chunk(world, -1)[ps.tp_rank]
    assert torch.equal(vocab_parallel_argmax(local, g, vocab), expected)
    # bf16 logits, as under autocast; the global index is the same
    half = full.to(torch.bfloat16)
    assert torch.equal(vocab_parallel_argmax(half.chunk(world, -1)[ps.tp_rank], g, vocab),
                       torch.argmax(half[..., :vocab], dim=-1))
    # without padding (vocab_size left out): the whole row counts
    assert torch.equal(vocab_parallel_argmax(local[3:], g), torch.argmax(full[3:], dim=-1))


def _check_sequence_mappings(rank, world):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    x = torch.arange(world * 2 * 3, dtype=torch.float32).view(world * 2, 3).requires_grad_()
    part = scatter_to_sp(x, ps.tp_group)
    _allclose(part, x.detach().chunk(world, 0)[ps.tp_rank], "scatter")
    back = gather_from_sp(part, ps.tp_group)
    _allclose(back, x.detach(), "gather")


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("kind", ["column", "row"])
def test_linear_layers(world, kind):
    run_distributed(_check_linear, world, kind, False)


@pytest.mark.parametrize("kind", ["column", "row"])
def test_linear_layers_sequence_parallel(kind):
    run_distributed(_check_linear, 2, kind, True)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_embedding_and_cross_entropy(world):
    run_distributed(_check_embedding_and_ce, world)


@pytest.mark.parametrize("world", [1, 2])
def test_vocab_parallel_argmax(world):
    """The argmax over vocab-parallel logits equals torch.argmax over the gathered ones,
    ties (lowest id) and padded vocab included."""
    run_distributed(_check_vocab_parallel_argmax, world)


def test_sequence_parallel_mappings():
    run_distributed(_check_sequence_mappings, 2)
