"""--bf16-residual: with --bf16 the residual stream, the LayerNorms and the linear layers' biases
work in bf16 (Megatron-LM's bf16 model), where autocast keeps the stream in fp32 and casts
it to bf16 before every GEMM and back in backward. The flow of dtypes, the casts that are
gone, the fp32 masters, the training it gives against the fp32 stream's, the compiled
epilogues and both families. Its layouts (DP=2 with the distributed optimizer, PP=2, TP=2
with sequence parallelism) are in tests/test_master_weights.py: the bf16 copies of the
biases and LayerNorm parameters give the casts' rounding to the bit."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megabert
from megabert.arguments import parse_args
from megabert.config import OptimConfig
from megabert.errors import ConfigError
from megabert.model.norm import LayerNorm
from megabert.optim import build_optimizer
from megabert.training.precision import MasterWeights, gemm_weights

VOCAB, SEQ, ROWS = 100, 16, 2


def _model(ps, bf16_residual: bool, family: str = "bert", **overrides):
    preset = megabert.modernbert_tiny if family == "modernbert" else megabert.bert_tiny
    extra = {"num_layers": 2, "hidden_size": 64} if family == "modernbert" else {}
    cfg = preset(**{"vocab_size": VOCAB, "hidden_dropout": 0.0, "attention_dropout": 0.0, **extra,
                    "bf16_residual": bf16_residual, **overrides})
    torch.manual_seed(0)
    cls = megabert.ModernBertForMaskedLM if family == "modernbert" else megabert.BertForPreTraining
    return cls(cfg, ps)


def _batch(step: int, family: str = "bert") -> dict:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "labels": torch.where(torch.rand(ROWS, SEQ, generator=gen) < 0.3, ids, -100)}
    if family == "bert":
        batch.update(token_type_ids=torch.zeros_like(ids), next_sentence_label=torch.tensor([0, 1]))
    return batch


def _losses(model, steps: int, family: str = "bert") -> list[float]:
    opt = build_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.01))
    MasterWeights(model).attach(opt)
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**_batch(0, family)).loss  # one batch, learnt by heart
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _output_dtypes(model, family: str = "bert") -> dict:
    seen = {}
    for name, module in model.named_modules():
        if isinstance(module, LayerNorm) or type(module).__name__ in ("TransformerLayer", "ModernBertLayer"):
            module.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, (i[0].dtype, o.dtype)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**_batch(0, family)).loss.backward()
    return seen


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_the_residual_stream_and_its_layernorms_are_bf16(family):
    ps = megabert.init_parallel()
    model = _model(ps, True, family)
    copies = MasterWeights(model).gemm_copies
    seen = _output_dtypes(model, family)
    embedding_norm = "bert.embeddings.layernorm" if family == "bert" else "bert.embeddings.norm"
    bf16 = torch.bfloat16
    # The embeddings sum and normalise in fp32 (their parameters are the fp32 masters) and
    # hand the stream over in bf16; from there every layer and LayerNorm reads and writes bf16.
    assert seen.pop(embedding_norm) == (torch.float32, torch.float32)
    assert len(seen) >= 5 and all(dtypes == (bf16, bf16) for dtypes in seen.values()), seen
    # The parameters stay fp32 masters; the LayerNorms' and biases' bf16 copies are made once a step.
    assert all(p.dtype == torch.float32 for p in model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    copied = {names[id(w)] for w in copies.masters}
    assert copied == {names[id(w)] for w in gemm_weights(model)}
    assert any(n.endswith("layernorm.weight") or n.endswith("norm.weight") for n in copied)
    if family == "bert":
        assert {"bert.encoder.layers.0.attention.dense.bias", "bert.encoder.layers.0.mlp.dense_4h_to_h.bias",
                "bert.encoder.layers.1.mlp_layernorm.bias"} <= copied
    for w, copy in zip(copies.masters, copies.copies):
        assert copy.dtype == bf16 and torch.equal(copy, w.bfloat16())
        assert w.grad is not None and w.grad.dtype == torch.float32  # the fp32 master's gradient


def test_without_the_flag_the_stream_stays_fp32_as_autocast_keeps_it():
    ps = megabert.init_parallel()
    model = _model(ps, False)
    MasterWeights(model)
    seen = _output_dtypes(model)
    layers = {n: d for n, d in seen.items() if n.startswith("bert.encoder")}
    assert layers and all(out == torch.float32 for _, out in layers.values())


class _ActivationCasts(TorchDispatchMode):
    """Dtype conversions (aten._to_copy) of [tokens, hidden]-sized tensors: activations or
    their gradients, forward and backward."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].numel() == self.numel:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["torch", "fused"])
def test_no_activation_is_cast_between_the_gemms(backend):
    ps = megabert.init_parallel()
    casts = {}
    for bf16_residual in (False, True):
        model = _model(ps, bf16_residual, dropout_add_backend=backend, layernorm_backend=backend,
                       hidden_dropout=0.1)
        MasterWeights(model)
        counter = _ActivationCasts(ROWS * SEQ * model.config.hidden_size)
        with counter, torch.autocast("cpu", dtype=torch.bfloat16):
            model(**_batch(0)).loss.backward()
        casts[bf16_residual] = counter.count
    # fp32 stream: per layer, the two LayerNorm outputs cast for the next GEMMs and the
    # row-parallel outputs promoted by their fp32 biases, each way back in backward.
    assert casts[False] >= 4 * 2
    # bf16 stream: the embeddings' one cast to bf16 and its backward, nothing per layer.
    assert casts[True] == 2


def test_bf16_residual_trains_as_the_fp32_stream_does_within_bf16s_rounding():
    ps = megabert.init_parallel()
    ours, ref = _losses(_model(ps, True), 8), _losses(_model(ps, False), 8)
    assert ours[-1] < ours[0] - 0.5  # it learns
    assert max(abs(a - b) for a, b in zip(ours, ref)) < 0.05, (ours, ref)
    assert ours != ref  # and it is another mode: the stream is rounded to bf16 at every layer


def test_compiled_epilogues_equal_the_chain_in_bf16():
    ps = megabert.init_parallel()
    outs = {}
    for backend in ("torch", "compiled"):
        model = _model(ps, True, dropout_add_backend=backend)
        MasterWeights(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**_batch(0)).loss
        loss.backward()
        outs[backend] = (loss.detach(), model.bert.encoder.layers["0"].attention_layernorm.weight.grad.clone())
    assert outs["compiled"][1].dtype == torch.float32
    torch.testing.assert_close(outs["compiled"][0], outs["torch"][0], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs["compiled"][1], outs["torch"][1], rtol=5e-2, atol=5e-2)


def test_outside_autocast_the_flag_changes_nothing():
    # Prediction or export in fp32 after a --bf16-residual run: fp32 all the way.
    ps = megabert.init_parallel()
    ref, ours = _model(ps, False), _model(ps, True)
    MasterWeights(ours)
    with torch.no_grad():
        assert torch.equal(ours(**_batch(0)).loss, ref(**_batch(0)).loss)


def test_bf16_residual_needs_bf16():
    with pytest.raises(ConfigError, match="--bf16-residual needs --bf16"):
        parse_args(["--bf16-residual", "--data-path", "x"])
    with pytest.raises(ConfigError, match="--bf16-residual needs --bf16"):
        parse_args(["--bf16-residual", "--fp16", "--data-path", "x"])
    assert parse_args(["--bf16-residual", "--bf16", "--data-path", "x"]).model.bf16_residual


def test_compiled_layers_keep_the_bf16_stream_in_one_graph_each():
    # --compile traces the LayerNorms' autocast-free region: no graph break, eager's losses.
    from tests.helpers.train_utils import TINY, build_trainer, step_loss

    def losses(extra):
        _, _, trainer = build_trainer(TINY + ["--bf16", "--bf16-residual", "--train-iters", "3",
                                              "--hidden-dropout", "0.1"] + extra)
        try:
            return [step_loss(trainer) for _ in range(3)]
        finally:
            trainer.close()

    torch._dynamo.utils.counters.clear()
    eager, compiled = losses([]), losses(["--compile"])
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert compiled == pytest.approx(eager, abs=2e-2, rel=0)
