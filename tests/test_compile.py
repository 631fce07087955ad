"""--compile: the fused kernels compile as custom ops without graph breaks, and training
with compiled transformer layers gives the eager losses (fp32) to 1e-5.

Inductor compiles C++ on the CPU, so each test keeps its compiled graphs few: one model
config per test, and dynamo's caches are reset around each test.
"""
import json
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo

import megabert.fused_kernels as fk
from megabert.arguments import parse_args
from megabert.errors import ConfigError
from megabert.model.rope import attention_input, cos_sin
from megabert.ops import dropout_add, gated_activation, kernel_ops, layer_norm, rms_norm, scaled_masked_softmax
from megabert.training.resolve import resolve_run

from tests.helpers.dist_utils import run_distributed
from tests.helpers.train_utils import build_trainer, step_loss


needs_kernels = pytest.mark.skipif(not fk.is_available(), reason=f"kernels not built: {fk.load_error()}")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Compiled code is cached on the code object every compiled module shares
    (nn.Module._call_impl), with a limit of recompilations: start and leave clean."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _fused_ops(scores, mask, x, weight, bias):
    y = layer_norm(x, weight, bias, 1e-5)
    u = rms_norm(x, weight, 1e-6).repeat(1, 1, 2)  # [..., 2f]
    cos, sin = (t.unsqueeze(-2) for t in cos_sin(torch.arange(4)[:, None].expand(4, 2), 4, 500.0, x.dtype))
    q, kv = x.view(4, 2, 4, 4), u.view(4, 2, 2, 4, 4)[:, :, :, :1]  # GQA: 4 query heads, 1 key/value head
    return (scaled_masked_softmax(scores, mask, 0.5), dropout_add(y, x, 0.3, True, backend="fused"),
            gated_activation(u, "silu", True), attention_input(q, kv, cos, sin, "fused"))


@needs_kernels
def test_fused_kernels_compile_in_one_graph():
    """fullgraph=True fails on any graph break: the pybind11 kernels are opaque to dynamo,
    the custom ops are not. Forward and gradients (softmax, LayerNorm, dropout + residual
    add, RMSNorm, gated activation, RoPE with grouped-query heads) equal eager's."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 8, 8, generator=g).requires_grad_()
    mask = (torch.rand(2, 1, 1, 8, generator=g) < 0.3).expand(2, 1, 8, 8)
    x = torch.randn(4, 2, 16, generator=g).requires_grad_()
    weight = (1 + 0.1 * torch.randn(16, generator=g)).requires_grad_()
    bias = torch.randn(16, generator=g).requires_grad_()
    leaves = (scores, x, weight, bias)
    grads_out = (torch.randn(scores.shape, generator=g), torch.randn(x.shape, generator=g),
                 torch.randn(x.shape, generator=g), torch.randn(4, 2, 3, 4, 4, generator=g))

    def run(fn):
        torch.manual_seed(0)  # the dropout's Philox key is drawn from the default generator
        outs = fn(scores, mask, x, weight, bias)
        return outs, torch.autograd.grad(outs, leaves, grads_out)

    compiled = torch.compile(_fused_ops, fullgraph=True, backend="aot_eager")
    for got, want in zip(run(compiled), run(_fused_ops)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("op,args", [
    ("scaled_masked_softmax_forward", lambda: (torch.randn(2, 2, 3, 5), torch.rand(2, 1, 1, 5).expand(2, 2, 3, 5) < 0.3,
                                               0.5)),
    ("layer_norm_forward", lambda: (torch.randn(3, 2, 8), torch.rand(8), torch.randn(8), 1e-5)),
    ("layer_norm_backward", lambda: (torch.randn(6, 8), torch.randn(6, 8), torch.rand(8), torch.randn(6),
                                     torch.rand(6) + 0.5)),
    ("scaled_masked_softmax_backward", lambda: (torch.randn(2, 2, 3, 5), torch.rand(2, 2, 3, 5), 0.5)),
    ("rms_norm_forward", lambda: (torch.randn(3, 2, 9), torch.rand(9), 1e-5)),
    ("rms_norm_backward", lambda: (torch.randn(6, 9), torch.randn(6, 9), torch.rand(9), torch.rand(6) + 0.5)),
    ("gated_activation_forward", lambda: (torch.randn(3, 2, 14), "gelu", True)),
    ("gated_activation_backward", lambda: (torch.randn(3, 7), torch.randn(3, 14), "silu", False)),
    ("rope_qkv_forward", lambda: (torch.randn(5, 4, 6), torch.randn(5, 2, 3, 6)[:, :, 1:2], torch.rand(5, 3),
                                  torch.rand(5, 3))),
    ("rope_qkv_backward", lambda: (torch.randn(5, 3, 4, 6), torch.rand(5, 3), torch.rand(5, 3), 2)),
    ("dropout_add_forward", lambda: (torch.randn(3, 8), torch.randn(3, 8), 0.3, torch.tensor([7]))),
    ("dropout_backward", lambda: (torch.randn(3, 8), torch.rand(3, 8) < 0.7, 0.3)),
    ("varlen_attention_forward", lambda: (*torch.randn(5, 3, 2, 4).unbind(1), torch.tensor([0, 2, 5]), 0.5, 0.2,
                                          torch.tensor([7]))),
    ("varlen_attention_backward", lambda: (torch.randn(5, 2, 4), *torch.randn(5, 3, 2, 4).unbind(1),
                                           torch.randn(5, 2, 4), torch.randn(2, 5), torch.tensor([0, 2, 5]), 0.5,
                                           0.0, None)),
])
def test_custom_ops_pass_opcheck(op, args):
    """torch.library's checks: schema, fake (meta) implementation against the real one."""
    torch.library.opcheck(getattr(kernel_ops, f"_{op}_op"), args(),
                          test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------- training with --compile

TRAIN = ["--train-iters", "4", "--attention-backend", "auto", "--layernorm-backend", "auto"]


def _losses(argv, tp=1) -> list[float]:
    """lm_loss of each of 4 steps through the trainer pretrain_bert.py builds (dropout 0)."""
    _, _, trainer = build_trainer(TRAIN + argv, tp)
    try:
        return [step_loss(trainer) for _ in range(4)]
    finally:
        trainer.close()


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def test_compile_trains_to_the_eager_losses():
    """The default backends (the fused kernels where they are built) through compiled
    layers: the losses of eager mode, no graph break, one graph for the layers and one for
    the last (at the heads' positions), whatever the batch's token counts. Hidden dropout
    on: the compiled layers draw the same masks as eager mode (ATen's random kernels)."""
    torch._dynamo.utils.counters.clear()
    dropout = ["--hidden-dropout", "0.1"]  # attention dropout stays 0: its per-TP-rank stream breaks the graph
    eager = _losses(dropout)
    compiled = _losses(dropout + ["--compile"])
    assert compiled == pytest.approx(eager, abs=1e-5, rel=0)
    # One graph for the layers, one for the last layer, which computes its output at the
    # heads' positions alone (masked-only logits, unpadded); any batch's token counts.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2 and _graph_breaks() == 0


def _tp2_eager_and_compiled(rank, world, argv):
    eager = _losses(argv, tp=2)
    compiled = _losses(argv + ["--compile"], tp=2)
    assert compiled == pytest.approx(eager, abs=1e-5, rel=0), (eager, compiled)
    # The collectives and the recompute's checkpoint stay in the graph; the unpadded
    # token count, which changes with every batch, is one dynamic dimension of it. Two
    # graphs: the layers, and the last layer at the heads' positions alone.
    assert _graph_breaks() == 0 and torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_compile_with_tensor_parallelism_and_recompute():
    """TP=2 (all-reduces inside the layer) with full activation recompute (the compiled
    layer inside torch.utils.checkpoint), on pretrain_bert.py's unpadded encoder."""
    run_distributed(_tp2_eager_and_compiled, 2, ["--recompute-granularity", "full"])


def test_compile_with_zero3_is_one_line_naming_both_flags(tmp_path):
    """Tried: ZeRO-3's parameter hooks in every submodule cut the layers into fragments
    and run past dynamo's recompile limit (eager again), so the flags refuse it; a
    DeepSpeed JSON that chooses stage 3 likewise."""
    with pytest.raises(ConfigError) as e:
        parse_args(["--deepspeed", "--zero-stage", "3", "--compile"])
    assert "\n" not in str(e.value) and "--compile" in str(e.value) and "--zero-stage 3" in str(e.value)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    cfg = parse_args(["--deepspeed", "--deepspeed_config", str(path), "--compile"])
    with pytest.raises(ConfigError) as e:
        resolve_run(cfg, SimpleNamespace(world_size=2, dp_size=2, pp_size=1, device=torch.device("cpu")))
    assert "\n" not in str(e.value) and "--compile" in str(e.value) and "zero_optimization.stage=3" in str(e.value)


def test_compile_hints_set_what_torchs_decorator_sets():
    """megabert marks use_fused_kernel itself (compile_hints) so that eager runs never import
    dynamo; the mark must stay the one torch's own decorator sets."""
    from megabert.ops import compile_hints, dispatch

    def ours():
        pass

    def theirs():
        pass

    compile_hints.assume_constant_result(ours)
    torch.compiler.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) == vars(dispatch.use_fused_kernel)


def test_the_model_forward_and_backward_do_not_import_dynamo():
    """`import torch._dynamo` costs about as much as `import torch`: a process that only
    builds and runs the model (the Python API, prediction, the conversion tools) does not
    pay it (an optimizer still imports it: torch.optim's own @_disable_dynamo)."""
    import subprocess
    import sys

    code = ("import sys, torch, megabert; from megabert.config import ModelConfig; "
            "from megabert.tasks.pretraining import BertForPreTraining\n"
            "ps = megabert.init_parallel()\n"
            "for unpad in (False, True):\n"
            "  m = BertForPreTraining(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, "
            "max_position_embeddings=16, unpad_input=unpad), ps); ids = torch.randint(5, 64, (2, 8)); "
            "am = torch.ones(2, 8, dtype=torch.long); am[0, 5:] = 0\n"
            "  m(ids, attention_mask=am, labels=ids, next_sentence_label=torch.tensor([0, 1])).loss.backward()\n"
            "print(sorted(k for k in sys.modules if k.startswith('torch._dynamo'))[:1])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]", r.stdout


def test_packed_fixed_shape_step_compiles_once_in_one_graph():
    """torch.compile(fullgraph=True, dynamic=False) of the packed model's forward and loss (over the
    global batch's counts, tensors), backward through it, over three micro-batches whose rows hold
    different numbers of samples: one frame compiled, no graph break, no recompilation (an error if
    one happens), the eager losses. The varlen and LayerNorm CPU kernels enter as custom ops."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import megabert
    from megabert.tasks.pretraining import BertForPreTraining
    from tests.test_packed_fixed_shape import _config, _counts, _global_loss, _three_packings

    megabert.init_parallel()
    model = BertForPreTraining(_config("varlen"), seed=3)
    batches = _three_packings("cpu")
    assert len({tuple((b["packed_seqlens"] > 0).sum(1).tolist()) for b in batches}) == 3

    def step(batch, masked, samples):
        return _global_loss(model(**batch), masked, samples)

    torch._dynamo.utils.counters.clear()
    counter = CompileCounterWithBackend("aot_eager")  # dynamo's graphs and AOTAutograd's backward, no codegen
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=counter)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in batches:
            loss = compiled(batch, *_counts(batch))
            loss.backward()
            assert float(loss.detach()) == pytest.approx(float(step(batch, *_counts(batch)).detach()), abs=1e-5, rel=0)
    assert counter.frame_count == 1 and _graph_breaks() == 0


@pytest.mark.parametrize("device,pp,fixed,recompute,micro_batches,want", [
    ("cuda", 1, True, None, 1, True),  # packed rows on a GPU: reduce-overhead (CUDA graphs)
    ("cuda", 1, False, None, 1, False),  # unpacked: the token count changes with every batch
    ("cpu", 1, True, None, 1, False),
    ("cuda", 2, True, None, 1, False),  # untried with a pipeline schedule: said in one info line
    ("cuda", 1, True, "full", 1, False),
    ("cuda", 1, True, "selective", 1, True),
    ("cuda", 1, True, None, 2, False),  # gradient accumulation: failed on an H200
])
def test_compile_uses_cuda_graphs_for_packed_rows_on_cuda(monkeypatch, device, pp, fixed, recompute, micro_batches,
                                                           want):
    import megabert.training.build as build

    chosen = []
    monkeypatch.setattr(build, "compile_layers", lambda model, cuda_graphs=False: chosen.append(cuda_graphs) or 0)
    ps = SimpleNamespace(device=torch.device(device), pp_size=pp, dp_size=1, is_logging_rank=True)
    model = SimpleNamespace(config=SimpleNamespace(recompute_granularity=recompute))
    train = SimpleNamespace(compile=True, cuda_graphs=False, micro_batch_size=2, global_batch_size=2 * micro_batches)
    build.apply_compile(model, ps, train, fixed_shapes=fixed)
    assert chosen == [want]


def test_compile_inside_cuda_graphs_compiles_plain_layers(monkeypatch):
    """--compile --cuda-graphs: the whole micro-batch is captured (megabert.training.cuda_graphs),
    so the layers compile without graph trees of their own, which cannot nest in a capture."""
    import megabert.training.build as build

    chosen = []
    monkeypatch.setattr(build, "compile_layers", lambda model, cuda_graphs=False: chosen.append(cuda_graphs) or 0)
    ps = SimpleNamespace(device=torch.device("cuda"), pp_size=1, dp_size=1, is_logging_rank=True)
    model = SimpleNamespace(config=SimpleNamespace(recompute_granularity=None))
    train = SimpleNamespace(compile=True, cuda_graphs=True, micro_batch_size=2, global_batch_size=4)
    build.apply_compile(model, ps, train, fixed_shapes=True)
    assert chosen == [False]
