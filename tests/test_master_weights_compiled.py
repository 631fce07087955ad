"""--bf16 --compile: the compiled layers read MasterWeights' bf16 copies as graph inputs and cast
no weight (autocast inside a compiled graph would cast every GEMM weight at every micro-batch),
and pretrain_bert.py's compiled bf16 run trains to its eager losses. A checkpoint loaded into the
masters reaches the compiled layers' copies (the strategy's refresh_stale before each step)."""
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import megabert
from megabert.config import OptimConfig
from megabert.model.transformer import TransformerLayer
from megabert.optim import build_optimizer
from megabert.training.precision import MasterWeights

from tests.helpers.train_utils import build_trainer, step_loss


def _weight_casts(gm: torch.fx.GraphModule, shapes: set) -> list[str]:
    """Nodes of a traced graph that cast an fp32 input of a weight's shape to 16 bits."""
    casts = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
            continue
        if node.target in (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default):
            source = node.args[0].meta.get("val")
            if source is not None and source.dtype == torch.float32 and tuple(source.shape) in shapes:
                casts.append(f"{node.target} of {tuple(source.shape)}")
    return casts


@pytest.mark.parametrize("master_weights", [False, True], ids=["autocast", "master-weights"])
def test_compiled_layer_casts_no_weight(master_weights):
    ps = megabert.init_parallel()
    model = megabert.BertForPreTraining(megabert.bert_tiny(vocab_size=100, hidden_dropout=0.0,
                                                           attention_dropout=0.0), ps)
    layer = next(m for m in model.modules() if isinstance(m, TransformerLayer))
    shapes = {tuple(p.shape) for n, p in layer.named_parameters() if n.endswith("weight") and p.dim() == 2}
    if master_weights:
        MasterWeights(model).attach(build_optimizer(model, OptimConfig()))
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    compiled = torch.compile(layer, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    h = model.config.hidden_size
    x = torch.randn(16, 2, h, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x, None)
    out.float().sum().backward()
    casts = [c for gm in graphs for c in _weight_casts(gm, shapes)]
    if master_weights:
        assert casts == []
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in layer.parameters())
    else:
        assert len(casts) >= len(shapes)  # autocast casts each GEMM weight inside the graph


ARGV = ["--train-iters", "4", "--bf16", "--attention-backend", "auto", "--layernorm-backend", "auto"]


def test_compiled_bf16_run_trains_to_the_eager_losses():
    def losses(argv):
        _, _, trainer = build_trainer(ARGV + argv)
        try:
            copies = trainer.strategy.master_weights.gemm_copies.copies
            # Compiled, the copies are graph inputs that CUDA graphs read in place.
            assert "--compile" not in argv or all(hasattr(c, "_dynamo_static_input_type") for c in copies)
            return [step_loss(trainer) for _ in range(4)]
        finally:
            trainer.close()

    eager = losses([])
    torch._dynamo.utils.counters.clear()
    compiled = losses(["--compile"])
    assert compiled == pytest.approx(eager, abs=1e-5, rel=0)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # the layers, the last layer
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0


def test_loaded_weights_reach_the_compiled_layers_copies():
    _, _, trainer = build_trainer(ARGV + ["--compile"])
    try:
        step_loss(trainer)
        strategy = trainer.strategy
        weight = next(m for m in strategy.model.modules() if isinstance(m, TransformerLayer)).mlp.dense_h_to_4h.weight
        with torch.no_grad():
            weight.mul_(0.5)  # as a checkpoint load writes the masters in place
        strategy.fresh_gemm_copies()
        copies = strategy.master_weights.gemm_copies
        copy = next(c for w, c in zip(copies.masters, copies.copies) if w is weight)
        assert torch.equal(copy, weight.detach().to(torch.bfloat16))
    finally:
        trainer.close()
