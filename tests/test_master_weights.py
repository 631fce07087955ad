"""--bf16's GEMM weights (megabert.training.precision.MasterWeights): the linear layers and
the tied MLM decoder multiply by bf16 copies made once per optimizer step from the fp32
masters, and a training step is autocast's over fp32 parameters to the bit (the same
rounding of the weights, the same fp32 accumulation of their gradients), with no cast of
those weights per use: with the local optimizer, with the distributed optimizer at DP=2
(its all-gathers remake the copies, overlapped with forward or not), at PP=2 (the last
stage's tied copy of the word embeddings) and at TP=2."""
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megabert
from megabert.arguments import parse_args
from megabert.config import OptimConfig
from megabert.optim import build_optimizer
from megabert.optim.clip import clipped_step
from megabert.tasks.pretraining.task import build_pretraining
from megabert.tensor_parallel.gemm_copies import GemmCopies, gemm_weight
from megabert.tensor_parallel.layers import ColumnParallelLinear
from megabert.training import build, distributed_optimizer_strategy
from megabert.training.precision import GEMM_LAYERS, MasterWeights, gemm_weights
from megabert.training.resolve import resolve_run

from tests.helpers.dist_utils import run_distributed
from tests.helpers.train_utils import TINY, VOCAB, batches, build_trainer, read_metrics, train_worker


# The models of the bitwise test: BERT (vocab 100: one rank holds it all, so the decoder
# multiplies by the padded word embeddings' first 100 rows), with full recompute (each
# layer's forward, its GEMM copies with it, run again in backward), and ModernBERT.
MODELS = {"bert": (megabert.bert_tiny, {}), "bert-recompute": (megabert.bert_tiny, {"recompute_granularity": "full"}),
          "modernbert": (megabert.modernbert_tiny, {"num_layers": 2, "hidden_size": 64})}


def _model(ps, family="bert"):
    preset, overrides = MODELS[family]
    cfg = preset(**{"vocab_size": 100, "hidden_dropout": 0.0, "attention_dropout": 0.0, **overrides})
    torch.manual_seed(0)
    model_class = megabert.ModernBertForMaskedLM if cfg.model_family == "modernbert" else megabert.BertForPreTraining
    return model_class(cfg, ps)


def _micro_batches(step, family="bert"):
    gen = torch.Generator().manual_seed(step)
    out = []
    for _ in range(2):
        ids = torch.randint(0, 100, (2, 16), generator=gen)
        labels = torch.where(torch.rand(2, 16, generator=gen) < 0.3, ids, -100)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
        if not family.startswith("modernbert"):
            batch.update(token_type_ids=torch.zeros_like(ids), next_sentence_label=torch.tensor([0, 1]))
        out.append(batch)
    return out


def _held(model) -> GemmCopies:
    """The copies MasterWeights handed `model`'s layers, checked to be one object for all."""
    copies = next(m.gemm_copies for m in model.modules() if isinstance(m, ColumnParallelLinear))
    assert all(m.gemm_copies is copies for m in model.modules() if isinstance(m, GEMM_LAYERS))
    return copies


def _assert_current(copies: GemmCopies) -> None:
    """Each copy is its master rounded to bf16, made since the master's last in-place write."""
    for w, copy, version in zip(copies.masters, copies.copies, copies.versions):
        assert copy.dtype == torch.bfloat16 and version == w._version and torch.equal(copy, w.bfloat16())


def _train(model, steps, master_weights: bool, family="bert"):
    opt = build_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.01))
    if master_weights:
        MasterWeights(model).attach(opt)
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for batch in _micro_batches(step, family):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**batch).loss
            (loss / 2).backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in params]))
        clipped_step(opt, params, 1.0, norm)
    return opt


@pytest.mark.parametrize("family", MODELS)
def test_bf16_step_is_autocasts_over_fp32_masters_to_the_bit(family):
    ps = megabert.init_parallel()
    ref, ours = _model(ps, family), _model(ps, family)
    _train(ref, 3, master_weights=False, family=family)
    _train(ours, 3, master_weights=True, family=family)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert a.dtype == torch.float32, name  # the parameters stay the fp32 masters
        assert torch.equal(a, b), name
    # Each GEMM weight's copy (the tied decoder's too) is its master rounded to bf16, current
    # after the last step.
    copies = _held(ours)
    assert [id(w) for w in copies.masters] == [id(w) for w in gemm_weights(ours)]
    assert any(w is ours.bert.word_embeddings for w in copies.masters)
    _assert_current(copies)


def test_the_copy_reaches_the_gemm_through_autocasts_cast_backward():
    weight = torch.nn.Parameter(torch.randn(4, 3))
    copies = GemmCopies([weight], torch.bfloat16)
    copies.refresh()  # as MasterWeights makes them
    copy = copies.copies[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        used = gemm_weight(weight, copies)
    # A view of the cached copy that carries the Function's node; the copy stays a plain tensor.
    assert used.data_ptr() == copy.data_ptr() and type(used.grad_fn).__name__ == "_GemmCopyBackward"
    assert copy.grad_fn is None and not copy.requires_grad
    grad = torch.randn(4, 3).bfloat16()
    used.backward(grad)
    assert weight.grad.dtype == torch.float32 and torch.equal(weight.grad, grad.float())


def test_a_copy_is_used_only_where_it_was_made_for():
    weight, other = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4, 3))
    copies = GemmCopies([weight], torch.bfloat16)
    copies.refresh()
    # No copies handed over, or no autocast: the weight itself (autocast casts it at use).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert gemm_weight(weight, None) is weight
    assert gemm_weight(weight, copies) is weight
    # A weight written in place since its copy was made: remade at its next use (eager).
    with torch.no_grad():
        weight.mul_(2)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert torch.equal(gemm_weight(weight, copies), weight.bfloat16())
    # A weight the copies do not hold, or another 16-bit dtype: one-line errors, no silent cast.
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="no bfloat16 GEMM copy"):
        gemm_weight(other, copies)
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(ValueError, match="autocast runs in float16"):
        gemm_weight(weight, copies)


def test_closed_master_weights_give_the_layers_their_weights_back():
    ps = megabert.init_parallel()
    model = _model(ps)
    master_weights = MasterWeights(model)
    assert _held(model) is master_weights.gemm_copies
    master_weights.close()
    assert all(m.gemm_copies is None for m in model.modules() if isinstance(m, GEMM_LAYERS))


def test_the_tied_word_embeddings_get_one_gradient_per_backward():
    # The lookup's fp32 gradient and the decoder's sum in autograd, then one AccumulateGrad:
    # a post-accumulate hook (the DP reducers') fires once per backward.
    ps = megabert.init_parallel()
    model = _model(ps)
    MasterWeights(model)
    fired = []
    model.bert.word_embeddings.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    for batch in _micro_batches(0):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
    assert len(fired) == 2 and not torch.equal(fired[0], fired[1])


class _WeightCasts(TorchDispatchMode):
    """The names of `model`'s parameters that a dtype conversion (aten._to_copy) took as its
    input (or a slice of one from its first element: the decoder's weight without the
    padding rows), and the number of multi-tensor copies (aten._foreach_copy_)."""

    def __init__(self, model):
        super().__init__()
        self.names = {p.data_ptr(): n for n, p in model.named_parameters()}
        self.cast: list[str] = []
        self.foreach_copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.names:
            self.cast.append(self.names[args[0].data_ptr()])
        if func.overloadpacket is torch.ops.aten._foreach_copy_:
            self.foreach_copies += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("master_weights", [False, True], ids=["autocast", "master-weights"])
def test_no_weight_is_cast_per_use(master_weights):
    ps = megabert.init_parallel()
    model = _model(ps)
    names = {id(p): n for n, p in model.named_parameters()}
    gemm = {names[id(w)] for w in gemm_weights(model)}
    assert "bert.embeddings.word_embeddings.weight" in gemm  # the tied decoder's weight
    opt = _train(model, 1, master_weights)  # the optimizer state is made
    counter = _WeightCasts(model)
    with counter:
        for batch in _micro_batches(1):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**batch).loss
            (loss / 2).backward()
        forward_backward_casts = list(counter.cast)
        opt.step()
    if master_weights:
        assert not gemm & set(forward_backward_casts)
        # What autocast still casts at each use: the biases and the replicated nn.Linear
        # heads' weights (the pooler, the MLM transform, the NSP head), all small.
        heads = {"bert.pooler.dense.weight", "lm_head.dense.weight", "binary_head.weight"}
        assert {n for n in forward_backward_casts if not n.endswith("bias")} == heads
        assert counter.foreach_copies == 1  # the step's one multi-tensor rounding of the masters
    else:
        # autocast: every GEMM weight cast at least once at each of the two micro-batches
        # (more where a library that patched F.linear earlier in the process casts again)
        assert all(forward_backward_casts.count(n) >= 2 for n in gemm)


def test_pretraining_with_bf16_uses_master_weights_and_saves_fp32(tmp_path):
    cfg = parse_args(TINY + ["--bf16", "--train-iters", "2", "--log-interval", "100", "--save", str(tmp_path)])
    ps = megabert.init_parallel()
    trainer = build_pretraining(resolve_run(cfg, ps), ps, VOCAB,
                                lambda consumed: batches(consumed, cfg.train.micro_batch_size, 0, 1))
    try:
        trainer.train()
        copies = _held(trainer.strategy.model)
        assert copies is trainer.strategy.master_weights.gemm_copies and copies.masters
        assert all(c.dtype == torch.bfloat16 for c in copies.copies)
        saved = trainer.checkpoint.parts.model.state_dict()
        assert all(v.dtype == torch.float32 for k, v in saved.items() if v.is_floating_point())
    finally:
        trainer.close()


def test_outside_autocast_the_model_computes_in_fp32():
    # Predictions or an export after a --bf16 run, without autocast: the fp32 masters
    # multiply, not their bf16 copies.
    ps = megabert.init_parallel()
    ref, ours = _model(ps), _model(ps)
    MasterWeights(ours)
    batch = _micro_batches(0)[0]
    with torch.no_grad():
        assert torch.equal(ours(**batch).loss, ref(**batch).loss)


def test_bf16_resume_is_bitwise(tmp_path):
    # The checkpoint holds the fp32 masters as before; the resumed run remakes the bf16
    # copies from them, so it continues exactly (DP=2: the overlapped reduction's hooks
    # fire from the copies' gradients).
    full, part, ckpt = str(tmp_path / "full.jsonl"), str(tmp_path / "part.jsonl"), str(tmp_path / "ckpt")
    common = ["--bf16", "--train-iters", "4", "--hidden-dropout", "0.1"]
    run_distributed(train_worker, 2, common + ["--metrics-file", full])
    run_distributed(train_worker, 2, common + ["--exit-interval", "2", "--metrics-file", part, "--save", ckpt])
    run_distributed(train_worker, 2, common + ["--metrics-file", part, "--load", ckpt, "--save", ckpt])
    assert len(read_metrics(full)) == 4 and read_metrics(part) == read_metrics(full)


class _Autocast:
    """MasterWeights' stand-in for the reference runs: no copies, so autocast casts the fp32
    weights at each use, as before issue 41."""

    def __init__(self, model):
        pass

    def attach(self, optimizer):
        pass

    def attach_gathers(self, buffers):
        pass


def _layouts_worker(rank, world, runs, tp, out_dir):
    # Every run in one process group; the reference runs build the strategy with the
    # stand-in (restored after, the worker process is reused).
    for name, argv, master_weights in runs:
        with mock.patch.object(build, "MasterWeights", MasterWeights if master_weights else _Autocast), \
                mock.patch.object(distributed_optimizer_strategy, "MasterWeights",
                                  MasterWeights if master_weights else _Autocast):
            _, ps, trainer = build_trainer(argv + ["--metrics-file", f"{out_dir}/{name}.jsonl"], tp)
            try:
                trainer.train()
                model = trainer.strategy.model
                if model.lm_head is not None:  # the decoder's weight (at PP=2 the last stage's tied copy)
                    assert any(w is model.bert.word_embeddings for w in gemm_weights(model))
                trainer.strategy.settle()  # the last step's all-gathers (--overlap-param-gather) landed
                if master_weights:
                    _assert_current(_held(model))  # remade after the last step's update
                else:
                    assert all(m.gemm_copies is None for m in model.modules() if isinstance(m, GEMM_LAYERS))
                torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
                           f"{out_dir}/{name}-{rank}.pt")
            finally:
                trainer.close()


BF16 = ["--bf16", "--train-iters", "3", "--global-batch-size", "8"]
DISTRIBUTED_OPTIMIZER = ["--use-distributed-optimizer", "--ddp-bucket-size", "8000"]  # ~1/4 of the model a bucket


@pytest.mark.parametrize("layout,world,tp,variants", [
    # DP=2, the distributed optimizer's buckets gathered at the end of the step or waited
    # for by forward, bucket by bucket.
    # --bf16-residual (tests/test_bf16_residual.py) in each layout: the LayerNorms' and the
    # biases' copies against casts at each use.
    ("dp2", 2, 1, {"distributed-optimizer": DISTRIBUTED_OPTIMIZER,
                "no-overlap-param-gather": DISTRIBUTED_OPTIMIZER + ["--no-overlap-param-gather"],
                "bf16-residual": DISTRIBUTED_OPTIMIZER + ["--bf16-residual"]}),
    # PP=2 (1F1B): the last stage's tied copy of the word embeddings is the decoder's weight.
    ("pp2", 2, 1, {"tied": ["--pipeline-model-parallel-size", "2"],
                "tied-distributed-optimizer": ["--pipeline-model-parallel-size", "2"] + DISTRIBUTED_OPTIMIZER,
                "bf16-residual": ["--pipeline-model-parallel-size", "2", "--bf16-residual"]}),
    # TP=2: the decoder multiplies by this rank's vocab slice (the padding columns masked).
    ("tp2", 2, 2, {"sequence-parallel": ["--sequence-parallel"],
                "bf16-residual": ["--sequence-parallel", "--bf16-residual"]}),
])
def test_bf16_runs_equal_autocast_over_fp32_to_the_bit(tmp_path, layout, world, tp, variants):
    runs = [(f"{variant}-{mode}", BF16 + flags, mode == "master-weights")
            for variant, flags in variants.items() for mode in ("autocast", "master-weights")]
    run_distributed(_layouts_worker, world, runs, tp, str(tmp_path))
    for variant in variants:
        ours, ref = str(tmp_path / f"{variant}-master-weights"), str(tmp_path / f"{variant}-autocast")
        assert len(read_metrics(ours + ".jsonl")) == 3
        for key in ("lm_loss", "grad_norm"):
            assert read_metrics(ours + ".jsonl", key) == read_metrics(ref + ".jsonl", key), (variant, key)
        for rank in range(world):
            a, b = torch.load(f"{ours}-{rank}.pt"), torch.load(f"{ref}-{rank}.pt")
            assert a.keys() == b.keys()
            for name in a:
                assert torch.equal(a[name], b[name]), (variant, rank, name)
