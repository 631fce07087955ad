"""A training step waits for the device O(1) times, not once per parameter: the count of
host syncs that megabert's own step code issues (.item(), .tolist(), bool()/float()/int()
of a tensor) is the same for 2 and 6 layers, in fp32, bf16 and fp16 with loss scaling, with each
attention and LayerNorm backend and each optimizer. The optimizer steps themselves convert no
tensor to a Python value at all, whoever the caller.

On the CPU such calls cost nothing, which is why a counting shim is needed to see them; on
a GPU each one stalls the launch queue. torch.optim's own `.item()` on its CPU step
counters is not counted: those tensors live on the host even for GPU parameters."""
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megabert
from megabert.arguments import parse_args
from megabert.config import OptimConfig
from megabert.optim import Adam, build_optimizer
from megabert.tasks.pretraining.task import build_pretraining
from megabert.training.resolve import resolve_run  # noqa: E402

from tests.helpers.train_utils import TINY, VOCAB, batches


SYNCS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


class SyncCounter:
    """Counts tensor->host conversions whose caller is megabert code."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in SYNCS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def counted(tensor, *args, **kwargs):
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "")
            if module.startswith("megabert"):
                self.calls.append(f"{module}:{caller.f_lineno} {name}")
            return original(tensor, *args, **kwargs)
        return counted


def _step_syncs(monkeypatch, num_layers: int, precision: list[str]) -> list[str]:
    cfg = parse_args(TINY + ["--num-layers", str(num_layers), "--train-iters", "3", "--log-interval", "100",
                             *precision])
    ps = megabert.init_parallel()
    trainer = build_pretraining(resolve_run(cfg, ps), ps, VOCAB,
                                lambda consumed: batches(consumed, cfg.train.micro_batch_size, 0, 1))
    try:
        trainer.train_step()  # first step: lazy state (optimizer moments) is created
        counter = SyncCounter(monkeypatch)
        trainer.train_step()
        monkeypatch.undo()
        return counter.calls
    finally:
        trainer.close()


@pytest.mark.parametrize("precision", [[], ["--bf16"], ["--fp16", "--loss-scale", "1024"],
                                       ["--attention-backend", "sdpa"],
                                       ["--attention-backend", "auto", "--layernorm-backend", "auto"],
                                       ["--optimizer", "lamb"], ["--no-bias-correction"]],
                         ids=["fp32", "bf16", "fp16", "sdpa", "fused-kernels", "lamb", "adam-no-bias-correction"])
def test_host_syncs_per_step_do_not_grow_with_layers(monkeypatch, precision):
    if precision and precision[0] == "--fp16" and not _cpu_fp16_autocast():
        pytest.skip("this torch has no float16 autocast on the CPU")
    small, large = (_step_syncs(monkeypatch, n, precision) for n in (2, 6))
    assert len(small) == len(large), (small, large)
    assert len(large) <= 3, large  # the gradient norm, the logged losses, the fp16 overflow flag


def _cpu_fp16_autocast() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.ones(2, 2) @ torch.ones(2, 2)
        return True
    except RuntimeError:
        return False


class ScalarReads(TorchDispatchMode):
    """Every read of a tensor's value into Python (.item(), bool(), float(), int()) goes
    through aten._local_scalar_dense, from Python or C++ alike; .tolist() is counted by hand."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.count = 0
        original = torch.Tensor.tolist
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: (self._add(), original(t))[1])

    def _add(self):
        self.count += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self._add()
        return func(*args, **(kwargs or {}))


OPTIMIZERS = {
    "adamw-fused": lambda model: build_optimizer(model, OptimConfig()),
    "lamb": lambda model: build_optimizer(model, OptimConfig(optimizer="lamb")),
    "lamb-no-bias-correction": lambda model: build_optimizer(model, OptimConfig(optimizer="lamb",
                                                                                bias_correction=False)),
    "adam-no-bias-correction": lambda model: build_optimizer(model, OptimConfig(bias_correction=False)),
    "adam-bias-correction": lambda model: Adam(model.parameters(), bias_correction=True),
}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_optimizer_step_reads_no_tensor_value(monkeypatch, optimizer):
    ps = megabert.init_parallel()
    model = megabert.BertForPreTraining(megabert.bert_tiny(vocab_size=100), ps)
    opt = OPTIMIZERS[optimizer](model)
    counts = []
    for _ in range(2):  # the first creates the state
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        reads = ScalarReads(monkeypatch)
        with reads:
            opt.step()
        monkeypatch.undo()
        counts.append(reads.count)
    assert counts == [0, 0]


def test_scalar_reads_are_counted(monkeypatch):
    # The per-tensor AdamW reads its step counter once per parameter.
    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(4)]
    opt = torch.optim.AdamW(params, foreach=False)
    for p in params:
        p.grad = torch.ones(3)
    reads = ScalarReads(monkeypatch)
    with reads:
        opt.step()
    assert reads.count == 4
