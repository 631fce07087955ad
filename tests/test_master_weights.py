"""--bf16's GEMM weights (megabert.training.precision.MasterWeights): the linear layers
multiply by bf16 copies made once per optimizer step from the fp32 masters, and a training
step is autocast's over fp32 parameters to the bit (the same rounding of the weights, the
same fp32 accumulation of their gradients), with no cast of a weight per use."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megabert
from megabert.arguments import parse_args
from megabert.config import OptimConfig
from megabert.optim import build_optimizer
from megabert.optim.clip import clipped_step
from megabert.tasks.pretraining.task import build_pretraining
from megabert.tensor_parallel.layers import GEMM_COPY, ColumnParallelLinear, RowParallelLinear
from megabert.training.precision import MasterWeights
from megabert.training.resolve import resolve_run

from tests.helpers.dist_utils import run_distributed
from tests.helpers.train_utils import TINY, VOCAB, batches, read_metrics, train_worker


def _model(ps):
    cfg = megabert.bert_tiny(vocab_size=128)
    cfg = type(cfg)(**{**cfg.__dict__, "hidden_dropout": 0.0, "attention_dropout": 0.0})
    torch.manual_seed(0)
    return megabert.BertForPreTraining(cfg, ps)


def _micro_batches(step):
    gen = torch.Generator().manual_seed(step)
    out = []
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 16), generator=gen)
        labels = torch.where(torch.rand(2, 16, generator=gen) < 0.3, ids, -100)
        out.append((ids, torch.zeros_like(ids), torch.ones_like(ids), labels, torch.tensor([0, 1])))
    return out


def _linear_weights(model):
    return [m.weight for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def _train(model, steps, master_weights: bool):
    opt = build_optimizer(model, OptimConfig(lr=1e-3, weight_decay=0.01))
    if master_weights:
        MasterWeights(model).attach(opt)
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for batch in _micro_batches(step):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(*batch).loss
            (loss / 2).backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in params]))
        clipped_step(opt, params, 1.0, norm)
    return opt


def test_bf16_step_is_autocasts_over_fp32_masters_to_the_bit():
    ps = megabert.init_parallel()
    ref, ours = _model(ps), _model(ps)
    _train(ref, 3, master_weights=False)
    _train(ours, 3, master_weights=True)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        assert a.dtype == torch.float32, name  # the parameters stay the fp32 masters
        assert torch.equal(a, b), name
    # Each linear weight's GEMM copy is its master rounded to bf16, current after the last step.
    for w in _linear_weights(ours):
        copy, version = getattr(w, GEMM_COPY)
        assert copy.dtype == torch.bfloat16 and version == w._version and torch.equal(copy, w.bfloat16())


class _WeightCasts(TorchDispatchMode):
    """Counts dtype conversions (aten._to_copy) whose input is one of `weights`, and the
    multi-tensor copies (aten._foreach_copy_)."""

    def __init__(self, weights):
        super().__init__()
        self.ptrs = {w.data_ptr() for w in weights}
        self.casts = self.foreach_copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.ptrs:
            self.casts += 1
        if func.overloadpacket is torch.ops.aten._foreach_copy_:
            self.foreach_copies += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("master_weights", [False, True], ids=["autocast", "master-weights"])
def test_no_weight_is_cast_per_use(master_weights):
    ps = megabert.init_parallel()
    model = _model(ps)
    weights = _linear_weights(model)
    opt = _train(model, 1, master_weights)  # the optimizer state is made
    counter = _WeightCasts(weights)
    counter.__enter__()
    try:
        for batch in _micro_batches(1):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(*batch).loss
            (loss / 2).backward()
        forward_backward_casts = counter.casts
        opt.step()
    finally:
        counter.__exit__(None, None, None)
    if master_weights:
        assert forward_backward_casts == 0
        assert counter.foreach_copies == 1  # the step's one multi-tensor rounding of the masters
    else:
        # autocast: every linear weight cast at least once at each of the two micro-batches
        # (more where a library that patched F.linear earlier in the process casts again)
        assert forward_backward_casts >= 2 * len(weights)


def test_pretraining_with_bf16_uses_master_weights_and_saves_fp32(tmp_path):
    cfg = parse_args(TINY + ["--bf16", "--train-iters", "2", "--log-interval", "100", "--save", str(tmp_path)])
    ps = megabert.init_parallel()
    trainer = build_pretraining(resolve_run(cfg, ps), ps, VOCAB,
                                lambda consumed: batches(consumed, cfg.train.micro_batch_size, 0, 1))
    try:
        trainer.train()
        model = trainer.strategy.model
        weights = _linear_weights(model)
        assert weights and all(getattr(w, GEMM_COPY)[0].dtype == torch.bfloat16 for w in weights)
        saved = trainer.strategy.cpu_state_dict(keep=True)
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
        assert torch.equal(ours(*batch).loss, ref(*batch).loss)


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
