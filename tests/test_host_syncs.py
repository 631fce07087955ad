"""A training step that is not a logging step waits for the device not at all in bf16 and fp32
with the default fused AdamW, and once in fp16 (its overflow flag) or with our foreach Adam and
LAMB (the gradient norm, to skip a non-finite step): the host syncs that megabert's own code
issues (.item(), .tolist(), bool()/float()/int() of a tensor), the same for 2 and 6 layers, with
each attention and LayerNorm backend. The losses and the norm are read on logging steps only
(Trainer.flush_metrics). The optimizer steps themselves convert no
tensor to a Python value at all, whoever the caller.

On the CPU such calls cost nothing, which is why a counting shim is needed to see them; on
a GPU each one stalls the launch queue. torch.optim's own `.item()` on its CPU step
counters is not counted: those tensors live on the host even for GPU parameters.

Packed rows on the fixed-shape path (megabert.model.packed) go further: their forward, loss and
backward run no op whose output shape follows the data (nonzero, bool-mask indexing) and read no
value, so a GPU can capture them as a CUDA graph."""
import dataclasses
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
    assert small == large
    # Nothing with torch's fused AdamW (it skips a non-finite step on the device); fp16 reads its
    # overflow flag, our foreach Adam and LAMB the gradient norm (to skip a non-finite step).
    reads_one = precision and precision[0] in ("--fp16", "--optimizer", "--no-bias-correction")
    assert len(large) == (1 if reads_one else 0), large


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


# ------------------------------------------------------------------ packed rows, fixed shapes

aten = torch.ops.aten
# Ops whose output shape follows tensor values (the count of a mask) or that read a value into
# Python: on a GPU each waits for the device, and none can be captured in a CUDA graph.
DATA_DEPENDENT = {aten.nonzero.default, aten._local_scalar_dense.default, aten.masked_select.default,
                  aten.masked_scatter.default, aten._unique2.default, aten.unique_consecutive.default}
# Indexing with a bool mask is a nonzero() inside.
INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class DataDependentOps(TorchDispatchMode):
    """Records every op of DATA_DEPENDENT, every bool-mask index and every .tolist() that runs
    under it (forward and backward alike: autograd's backward ops dispatch here too)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.seen: list[str] = []
        original = torch.Tensor.tolist
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: (self.seen.append("tolist"), original(t))[1])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        unsized = func is aten.repeat_interleave.Tensor and (kwargs or {}).get("output_size") is None
        if func in DATA_DEPENDENT or unsized:
            self.seen.append(str(func))
        elif func in INDEXED and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.seen.append(f"{func} with a bool mask")
        return func(*args, **(kwargs or {}))


def _packed_forward_backward(monkeypatch, backend: str, unpad_input: bool) -> list[str]:
    from tests.test_packed_fixed_shape import _config, _counts, _global_loss, _three_packings
    from megabert.tasks.pretraining import BertForPreTraining

    megabert.init_parallel()
    model = BertForPreTraining(_config(backend, unpad_input=unpad_input), seed=3)
    batch = _three_packings("cpu")[0]
    if unpad_input:
        batch.pop("mlm_positions")  # as pretraining_batches hands the CPU's default path its batches
    counts = _counts(batch)
    ops = DataDependentOps(monkeypatch)
    with ops:
        _global_loss(model(**batch), *counts).backward()
    monkeypatch.undo()
    return ops.seen


@pytest.mark.parametrize("backend", ["varlen", "sdpa"])
def test_fixed_shape_packed_step_has_no_data_dependent_op(monkeypatch, backend):
    """Forward, loss (over the global batch's counts, tensors) and backward of a packed micro-batch on
    the fixed-shape path: no nonzero(), no bool-mask indexing, no value read into Python. (The
    unpadded path, the CPU's default, has them: the detector sees them there.)"""
    assert _packed_forward_backward(monkeypatch, backend, unpad_input=False) == []
    assert any("nonzero" in op or "bool mask" in op for op in _packed_forward_backward(monkeypatch, backend, True))


def test_fixed_shape_packed_training_step_reads_nothing(monkeypatch):
    """pretrain_bert.py's step on packed rows (--pack-sequences --no-unpad-input: the fixed-shape
    path, the GPU's) in bf16 with the default fused AdamW, whole (forward, loss, backward,
    norm, clipped update, the metrics kept): no value read into Python, no op whose output shape
    follows the data. Then the logging step reads them."""
    from megabert.data.packing import pack_window, packed_micro_batches
    from tests.test_packed_fixed_shape import MASK_PROB
    from tests.test_packing import SEQ, SPEC, sample

    spec = dataclasses.replace(SPEC, window=64)
    rows = packed_micro_batches([pack_window([sample(i) for i in range(64)], 0, spec)], spec, 0, 2, 0, 1)
    cfg = parse_args(TINY + ["--seq-length", str(SEQ), "--pack-sequences", "--no-unpad-input", "--mask-prob",
                             str(MASK_PROB), "--attention-backend", "varlen", "--train-iters", "3",
                             "--log-interval", "100", "--bf16"])
    ps = megabert.init_parallel()
    trainer = build_pretraining(resolve_run(cfg, ps), ps, VOCAB, lambda consumed: rows)
    try:
        trainer.train_step()
        ops = DataDependentOps(monkeypatch)
        counter = SyncCounter(monkeypatch)
        with ops:
            trainer.train_step()
        monkeypatch.undo()
        assert ops.seen == [] and counter.calls == []
        metrics = trainer.flush_metrics()
    finally:
        trainer.close()
    assert metrics["lm_loss"] > 0 and metrics["grad_norm"] > 0 and "skipped" not in metrics


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_host_batches_reach_the_gpu_without_waiting(monkeypatch):
    """Batches built on the host after the DataLoader (packed rows, MLM slots: pageable memory)
    go to the GPU from pinned memory, without a synchronising copy."""
    from types import SimpleNamespace

    from megabert.training.trainer import Trainer

    holder = SimpleNamespace(ps=SimpleNamespace(device=torch.device("cuda")))
    batch = {"input_ids": torch.arange(64).reshape(4, 16), "mlm_positions": torch.zeros(4, 3, dtype=torch.long)}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Trainer._to_device(holder, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(v.is_cuda for v in out.values())
    assert all(torch.equal(out[k].cpu(), batch[k]) for k in batch)


def _layout_syncs(rank, world, argv, out):
    from tests.helpers.train_utils import build_trainer

    _, _, trainer = build_trainer(argv + ["--bf16", "--train-iters", "3", "--log-interval", "100"])
    try:
        trainer.train_step()
        with pytest.MonkeyPatch.context() as mp:
            counter = SyncCounter(mp)
            trainer.train_step()
        calls = counter.calls
        loss = trainer.flush_metrics()["lm_loss"]
    finally:
        trainer.close()
    torch.save({"calls": calls, "loss": loss}, f"{out}.{rank}")


@pytest.mark.parametrize("argv", [["--micro-batch-size", "1"],
                                  ["--micro-batch-size", "1", "--use-distributed-optimizer"],
                                  ["--pipeline-model-parallel-size", "2"],
                                  ["--tensor-model-parallel-size", "2", "--sequence-parallel"]],
                         ids=["dp2-overlapped", "dp2-distributed-optimizer", "pp2", "tp2-sp"])
def test_no_layout_reads_back_in_a_step(tmp_path, argv):
    """bf16 with fused AdamW at DP=2 (overlapped reduction; the distributed optimizer), PP=2
    (1F1B) and TP=2 with sequence parallelism: a step reads nothing on any rank."""
    from tests.helpers.dist_utils import run_distributed

    run_distributed(_layout_syncs, 2, argv, str(tmp_path / "r"))
    for rank in range(2):
        got = torch.load(tmp_path / f"r.{rank}")
        assert got["calls"] == [], (rank, got["calls"])
        assert got["loss"] > 0
