"""--cuda-graphs (megabert.training.cuda_graphs): a packed micro-batch's forward, loss and
backward captured once as a CUDA graph and replayed.

On the CPU the graph itself cannot exist, so `EagerReplay` stands in for torch.cuda's graphs
with their semantics: the capture computes nothing (gradients and RNG as they were), a replay
reruns the captured function on the static buffers and writes its outputs into the captured
outputs' buffers. That proves the runner's part on the trainer's own path: static inputs,
gradient buffers that accumulate over micro-batches, outputs copied before the next replay,
the errors. The real graphs: the CUDA tests at the end, run on a GPU.
"""
import pytest
import torch

import megabert
from megabert.data.packing import PackingSpec, pack_window, packed_micro_batches
from megabert.errors import ConfigError
from megabert.tensor_parallel.random import RNGStatesTracker
from megabert.training.cuda_graphs import GraphedRunner

from tests.helpers.train_utils import step_loss
from tests.test_packing import CAP, SEQ, TINY, VOCAB, sample

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]


class EagerReplay:
    """torch.cuda's graphs' semantics on the CPU (see the module)."""

    def __init__(self, model=None, monkeypatch=None):
        self.model, self.captures = model, 0
        # With a monkeypatch: what the captured function ran that a real capture refuses (a read
        # into Python, an op whose output shape follows the data: tests/test_host_syncs.py).
        self.monkeypatch, self.refused = monkeypatch, None

    def stream(self):
        return None

    def capture(self, fn, stream, generators):
        self.captures += 1
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [p.grad.clone() for p in params]
        rng, streams = torch.get_rng_state(), self.model.rng.get_states()
        if self.monkeypatch is not None:
            from tests.test_host_syncs import DataDependentOps

            ops = DataDependentOps(self.monkeypatch)
            with ops:
                outputs = fn()  # "recorded": its effects are undone below, its outputs are the buffers
            self.monkeypatch.undo()
            self.refused = ops.seen
        else:
            outputs = fn()
        torch.set_rng_state(rng)
        self.model.rng.set_states(streams)
        for p, g in zip(params, grads):
            p.grad.copy_(g)

        def replay():
            for k, v in fn().items():
                outputs[k].copy_(v)

        return replay, outputs


def _trainer(argv, steps_data=64):
    from megabert.arguments import parse_args
    from megabert.tasks.pretraining.task import build_pretraining
    from megabert.training.resolve import resolve_run

    cfg = parse_args(TINY + ["--pack-sequences", "--no-unpad-input", "--micro-batch-size", "2",
                             "--global-batch-size", "4", "--lr", "1e-3", "--adam-eps", "1e-6", "--clip-grad", "1",
                             "--train-iters", "100"] + argv)
    ps = megabert.init_parallel()
    spec = PackingSpec(seq_length=SEQ, max_samples_per_row=CAP, window=steps_data, seed=5,
                       sample_fields=("next_sentence_label",))
    samples = [sample(i) for i in range(4 * steps_data)]

    def data(consumed):  # positioned at the run's consumed samples, as pretrain_bert.py's loader
        windows = [pack_window(samples, k, spec) for k in range(consumed // steps_data, 4)]
        return packed_micro_batches(windows, spec, consumed, 2, ps.dp_rank, ps.dp_size)

    return build_pretraining(resolve_run(cfg, ps), ps, VOCAB, data)


def _graphed(trainer, warmup_steps=2, monkeypatch=None):
    strategy = trainer.strategy
    graphs = EagerReplay(strategy.model, monkeypatch)
    strategy.runner = GraphedRunner(strategy.runner, strategy.params, graphs, warmup_steps=warmup_steps)
    return graphs


@pytest.mark.parametrize("argv", [[], ["--bf16"], ["--bf16", "--bf16-residual"], ["--bert-no-binary-head"]])
def test_graphed_training_equals_eager_bitwise(argv, monkeypatch):
    """6 steps of 2 micro-batches each (gradient accumulation), dropout on, clipping: warm-up
    steps, the capture and 4 replayed steps give eager mode's losses and weights, bitwise (fp32,
    bf16, and MLM alone). The captured function reads nothing into Python and runs no op whose
    output shape follows the data (either would break a real capture)."""
    argv = DROPOUT + argv
    runs = []
    for graphed in (False, True):
        trainer = _trainer(argv)
        graphs = _graphed(trainer, monkeypatch=monkeypatch) if graphed else None
        try:
            losses = [step_loss(trainer) for _ in range(6)]
            runs.append((losses, {n: p.detach().clone() for n, p in trainer.strategy.model.named_parameters()}))
            if graphs is not None:
                assert graphs.captures == 1 and trainer.strategy.runner.steps == 6
                assert graphs.refused == [], graphs.refused
        finally:
            trainer.close()
    (eager_losses, eager_weights), (graph_losses, graph_weights) = runs
    assert graph_losses == eager_losses
    for name, w in eager_weights.items():
        assert torch.equal(graph_weights[name], w), name


def test_graphed_training_resumes_bitwise(tmp_path):
    """--cuda-graphs (the stand-in graph), dropout on, through Trainer.train: 3 of 6 steps and a
    checkpoint (--exit-interval 3), then a new trainer that loads it (eager steps again, then its own capture) and
    trains to step 6 give the uninterrupted graphed run's losses and weights bitwise."""
    from tests.helpers.train_utils import read_metrics

    ckpt = str(tmp_path / "ckpt")

    def run(argv, name):
        metrics = str(tmp_path / f"{name}.jsonl")
        trainer = _trainer(DROPOUT + argv + ["--metrics-file", metrics])
        _graphed(trainer)
        try:
            trainer.train()
            return read_metrics(metrics), {n: p.detach().clone() for n, p in trainer.strategy.model.named_parameters()}
        finally:
            trainer.close()

    whole, whole_weights = run(["--train-iters", "6"], "whole")
    first, _ = run(["--train-iters", "6", "--exit-interval", "3", "--save", ckpt], "first")
    second, weights = run(["--train-iters", "6", "--save", ckpt, "--load", ckpt], "second")
    assert len(whole) == 6 and first + second == whole
    for name, w in whole_weights.items():
        assert torch.equal(weights[name], w), name


def test_gradients_stay_the_buffers_the_graph_writes():
    """The strategy zeroes the runner's .grad buffers in place; a .grad set to None or replaced
    after the capture is an error, not a replay into a freed buffer."""
    trainer = _trainer([])
    _graphed(trainer, warmup_steps=1)
    try:
        step_loss(trainer)
        buffers = [p.grad for p in trainer.strategy.params]
        step_loss(trainer)
        assert all(p.grad is g for p, g in zip(trainer.strategy.params, buffers))
        trainer.strategy.params[0].grad = None
        with pytest.raises(RuntimeError, match="set to None after the graph was captured"):
            trainer.train_step()
    finally:
        trainer.close()


def test_a_parameter_without_a_gradient_keeps_none():
    """As in eager mode, a parameter the step gives no gradient keeps .grad None (the optimizer
    skips it instead of decaying it); the used ones accumulate over micro-batches as eager's."""
    from megabert.training.strategy import SequentialRunner, TrainingTask

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
            self.rng = RNGStatesTracker("cpu")

        def forward(self, x):
            return (self.used(x) ** 2).mean()

    torch.manual_seed(0)
    toy = Toy()
    task = TrainingTask(inputs=("x",), output_loss=lambda out: (out, {"loss": out}))
    runner = GraphedRunner(SequentialRunner(toy, task), list(toy.parameters()), EagerReplay(toy), warmup_steps=1)
    eager = SequentialRunner(toy, task)
    batches = [[{"x": torch.randn(3, 4)} for _ in range(2)] for _ in range(4)]
    for step in batches:
        runner.zero_grads()
        runner.forward_backward(step)
        assert toy.unused.weight.grad is None and toy.unused.bias.grad is None
        got = [p.grad.clone() for p in toy.used.parameters()]
        grads = [p.grad for p in toy.used.parameters()]
        toy.zero_grad(set_to_none=True)
        eager.forward_backward(step)
        for g, p in zip(got, toy.used.parameters()):
            assert torch.equal(g, p.grad)
        for p, g in zip(toy.used.parameters(), grads):  # the run's buffers back, as the runner keeps them
            p.grad = g


def test_a_micro_batch_of_other_shapes_is_an_error():
    trainer = _trainer([])
    _graphed(trainer, warmup_steps=1)
    try:
        step_loss(trainer)
        step_loss(trainer)  # the capture
        runner = trainer.strategy.runner
        batch = {k: v.clone() for k, v in runner._static.items()}
        batch["input_ids"] = batch["input_ids"][:, :-1]
        with pytest.raises(ValueError, match="'input_ids' is torch.int64\\[2, 15\\], the captured one's"):
            runner.forward_backward([batch, batch])
        with pytest.raises(ValueError, match="must be the same tensors"):
            runner.forward_backward([{"input_ids": batch["input_ids"]}] * 2)
    finally:
        trainer.close()


def test_build_wires_the_graphed_runner(monkeypatch):
    """pretrain_bert.py --cuda-graphs: the strategy's runner replays graphs and the model's RNG
    streams become graph-safe (CudaGraphs and the graph-safe streams stubbed: no GPU here)."""
    import megabert.training.build as build

    made = []
    monkeypatch.setattr(build, "CudaGraphs", lambda device: made.append(device) or EagerReplay())
    monkeypatch.setattr(RNGStatesTracker, "make_graph_safe", lambda self: made.append("rng"))
    trainer = _trainer(["--cuda-graphs"])
    try:
        assert isinstance(trainer.strategy.runner, GraphedRunner)
        assert made == [torch.device("cpu"), "rng"]
    finally:
        trainer.close()


def _dp_worker(rank, world, graphed, out):
    """4 steps of 2 micro-batches at DP=2 through pretrain_bert.py's trainer; with `graphed`,
    --cuda-graphs with the stand-in graph (its data-parallel average runs after backward)."""
    import megabert.training.build as build
    from tests.helpers.dist_utils import patched

    with patched(build, "CudaGraphs", lambda device: EagerReplay()), \
            patched(RNGStatesTracker, "make_graph_safe", lambda self: None):
        trainer = _trainer(DROPOUT + (["--cuda-graphs"] if graphed else []) + ["--global-batch-size", "8"])
    try:
        if graphed:
            runner = trainer.strategy.runner
            assert isinstance(runner, GraphedRunner) and trainer.strategy.reducer is None
            runner.graphs.model, runner.warmup_steps = trainer.strategy.model, 1
        losses = [step_loss(trainer) for _ in range(4)]
        weights = {n: p.detach().clone() for n, p in trainer.strategy.model.named_parameters()}
    finally:
        trainer.close()
    torch.save({"losses": losses, "weights": weights}, f"{out}.{rank}")


def test_graphed_training_at_dp2_equals_eager(tmp_path):
    """DP=2 (gloo): --cuda-graphs averages the gradients after the replayed backward instead of
    overlapping it; losses and weights equal the eager run's (overlapped reduction) to fp32 rounding
    (the two reductions sum in other orders)."""
    from tests.helpers.dist_utils import run_distributed

    for graphed in (False, True):
        run_distributed(_dp_worker, 2, graphed, str(tmp_path / f"run{int(graphed)}"))
    for rank in range(2):
        eager, graphed = torch.load(tmp_path / f"run0.{rank}"), torch.load(tmp_path / f"run1.{rank}")
        assert graphed["losses"] == pytest.approx(eager["losses"], abs=1e-6, rel=0)
        for name, w in eager["weights"].items():
            torch.testing.assert_close(graphed["weights"][name], w, atol=1e-6, rtol=0, msg=name)


def test_cuda_graphs_on_the_cpu_is_a_clear_error():
    with pytest.raises(ConfigError, match="--cuda-graphs needs a GPU \\(CUDA\\); this run is on cpu"):
        _trainer(["--cuda-graphs"])


@pytest.mark.parametrize("argv,message", [
    ([], "needs --pack-sequences"),
    (["--pack-sequences", "--fp16"], "fp16's loss scale"),
    (["--pack-sequences", "--recompute-granularity", "full"], "--recompute-granularity"),
    (["--pack-sequences", "--use-distributed-optimizer"], "--use-distributed-optimizer"),
    (["--pack-sequences", "--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 1"),
    (["--pack-sequences", "--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 1"),
    (["--pack-sequences", "--deepspeed"], "--deepspeed"),
    (["--pack-sequences", "--model-family", "modernbert"], "is for BERT"),
])
def test_what_cuda_graphs_cannot_replay_is_refused_at_parsing(argv, message):
    from megabert.arguments import parse_args

    with pytest.raises(ConfigError, match=message):
        parse_args(TINY + ["--cuda-graphs"] + argv)


def test_graph_safe_streams_need_cuda():
    with pytest.raises(ValueError, match="for CUDA devices"):
        RNGStatesTracker("cpu").make_graph_safe()


# ------------------------------------------------------------------ on a GPU


@needs_cuda
def test_graph_safe_streams_draw_what_streams_by_value_draw():
    """The forked stream's dropout masks and the default stream after it are the same whether the
    tracker swaps states by value or graph-safe by reference; checkpoints read the same bytes."""
    device = torch.device("cuda")
    draws = []
    for graph_safe in (False, True):
        torch.cuda.manual_seed(11)
        tracker = RNGStatesTracker(device)
        tracker.add("tensor-parallel", 1234)
        if graph_safe:
            tracker.make_graph_safe()
        x = torch.ones(4096, device=device)
        out = []
        for _ in range(3):
            with tracker.fork():
                out.append(torch.nn.functional.dropout(x, 0.5))
            out.append(torch.nn.functional.dropout(x, 0.5))
        draws.append((out, tracker.get_states()["tensor-parallel"]))
    for a, b in zip(draws[0][0], draws[1][0]):
        assert torch.equal(a, b)
    assert torch.equal(draws[0][1], draws[1][1])


@needs_cuda
@pytest.mark.parametrize("bf16", [False, True])
def test_cuda_graphs_train_as_eager_on_a_gpu(bf16):
    """pretrain_bert.py --cuda-graphs on a GPU: 6 steps of 2 micro-batches, dropout on, equal to
    eager mode's losses (the same masks: the graph advances the generators as eager draws do)."""
    from megabert.arguments import parse_args
    from megabert.tasks.pretraining.task import build_pretraining
    from megabert.training.resolve import resolve_run

    argv = DROPOUT + (["--bf16"] if bf16 else [])
    losses = []
    for graphs in ([], ["--cuda-graphs"]):
        cfg = parse_args(TINY + ["--pack-sequences", "--micro-batch-size", "2", "--global-batch-size", "4",
                                 "--lr", "1e-3", "--adam-eps", "1e-6", "--train-iters", "100",
                                 "--attention-backend", "auto"] + argv + graphs)
        ps = megabert.init_parallel()
        spec = PackingSpec(seq_length=SEQ, max_samples_per_row=CAP, window=64, seed=5,
                           sample_fields=("next_sentence_label",))
        samples = [sample(i) for i in range(256)]
        windows = [pack_window(samples, k, spec) for k in range(4)]
        data = packed_micro_batches(windows, spec, 0, 2, 0, 1)
        trainer = build_pretraining(resolve_run(cfg, ps), ps, VOCAB, lambda consumed: data)
        try:
            losses.append([step_loss(trainer) for _ in range(6)])
            if graphs:
                assert isinstance(trainer.strategy.runner, GraphedRunner) and trainer.strategy.runner._replay
        finally:
            trainer.close()
    assert losses[1] == pytest.approx(losses[0], abs=1e-5 if not bf16 else 1e-3, rel=0)
