"""Pipeline parallelism: 1F1B and interleaved 1F1B give the losses and gradient norms of
one process (fp32, dropout 0), alone and combined with TP, sequence parallelism and DP;
a pipelined run resumes bitwise and its checkpoint continues at another layout."""
import os
from types import SimpleNamespace

import pytest
import torch

from megabert.checkpoint.layout import load_file, resolve_checkpoint_dir, saved_layout
from megabert.errors import ConfigError
from megabert.parallel.layout import StageLayout
from megabert.pipeline_parallel import check_interleaving

from tests.helpers.dist_utils import patched, run_distributed
from tests.helpers.train_utils import read_metrics, train_worker


# Four layers so that two stages can each hold two chunks; micro-batch 1 and global
# batch 4 give four micro-batches per step: warm-up, steady state and cool-down.
COMMON = ["--train-iters", "6", "--num-layers", "4", "--micro-batch-size", "1", "--global-batch-size", "4"]
PP2 = ["--pipeline-model-parallel-size", "2"]
INTERLEAVED = PP2 + ["--num-layers-per-virtual-pipeline-stage", "1"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ref") / "m.jsonl")
    run_distributed(train_worker, 1, COMMON + ["--metrics-file", path])
    return {k: read_metrics(path, k) for k in ("lm_loss", "sop_loss", "grad_norm")}


@pytest.mark.parametrize("name,world,tp,extra", [
    ("pp2-1f1b", 2, 1, PP2),
    ("pp2-interleaved", 2, 1, INTERLEAVED),
    ("pp4-1f1b", 4, 1, ["--pipeline-model-parallel-size", "4"]),  # middle stages hold no embeddings
    ("tp2-pp2-sequence-parallel", 4, 2, PP2 + ["--sequence-parallel"]),
    ("dp2-pp2-interleaved", 4, 1, INTERLEAVED),  # two micro-batches per DP rank: all forwards first
    ("dp2-pp2-zero1", 4, 1, PP2 + ["--deepspeed", "--zero-stage", "1"]),
])
def test_pipeline_matches_single_process(tmp_path, reference, name, world, tp, extra):
    path = str(tmp_path / "m.jsonl")
    run_distributed(train_worker, world, COMMON + ["--metrics-file", path] + extra, tp)
    for key, expected in reference.items():
        assert read_metrics(path, key) == pytest.approx(expected, abs=1e-4), key


def test_pipeline_resume_is_bitwise_and_reshards(tmp_path, reference):
    full, part = str(tmp_path / "full.jsonl"), str(tmp_path / "part.jsonl")
    ckpt = str(tmp_path / "ckpt")
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    run_distributed(train_worker, 2, COMMON + INTERLEAVED + dropout + ["--metrics-file", full])
    run_distributed(train_worker, 2, COMMON + INTERLEAVED + dropout + ["--exit-interval", "3", "--save", ckpt,
                                                                       "--metrics-file", part])
    run_distributed(train_worker, 2, COMMON + INTERLEAVED + dropout + ["--load", ckpt, "--metrics-file", part])
    assert read_metrics(part) == read_metrics(full)  # bitwise, RNG streams included

    # The interleaved stage files hold their round-robin layers under global names ...
    files = saved_layout(resolve_checkpoint_dir(ckpt)).files
    assert sorted(files) == [(0, 0), (0, 1)]
    stage0 = load_file(files[(0, 0)])
    assert stage0["parallel"]["num_layers_per_virtual_pipeline_stage"] == 1
    layers0 = {k.split(".")[3] for k in stage0["model"] if ".encoder.layers." in k}
    assert layers0 == {"0", "2"}
    assert "bert.embeddings.word_embeddings.weight" in load_file(files[(0, 1)])["model"]  # the tied copy

    # ... and a single process continues that run where it stopped (no dropout: compare to
    # the uninterrupted reference, which had none either).
    nodrop, again = str(tmp_path / "ckpt-nodrop"), str(tmp_path / "again.jsonl")
    run_distributed(train_worker, 2, COMMON + INTERLEAVED + ["--exit-interval", "3", "--save", nodrop])
    run_distributed(train_worker, 1, COMMON + ["--load", nodrop, "--metrics-file", again])
    assert read_metrics(again) == pytest.approx(reference["lm_loss"][3:], abs=1e-4)
    assert not os.path.exists(os.path.join(nodrop, "iter_0000006"))  # --load without --save writes nothing


def chunk_layers(num_layers, pp_size, pp_rank, per_chunk):
    stage = StageLayout(num_layers, pp_size, pp_rank, per_chunk)
    return [stage.chunk_layers(v) for v in range(stage.num_chunks)]


def test_chunks_are_dealt_round_robin():
    assert chunk_layers(8, 2, 0, None) == [[0, 1, 2, 3]]
    assert chunk_layers(8, 2, 1, 2) == [[2, 3], [6, 7]]
    assert chunk_layers(8, 4, 3, 1) == [[3], [7]]


def test_interleaving_needs_whole_groups_of_micro_batches():
    with pytest.raises(ConfigError, match="multiple of --pipeline-model-parallel-size 2"):
        check_interleaving(3, SimpleNamespace(pp_size=2), num_chunks=2)
    check_interleaving(3, SimpleNamespace(pp_size=2), num_chunks=1)  # plain 1F1B takes any count


def _fp16_overflow_on_first_stage(rank, world, metrics):
    """An inf appears in the first stage's gradients only; every stage must skip the step."""
    import torch

    import megabert.training.trainer as trainer_mod

    real_step = trainer_mod.Trainer.train_step

    def step(self):
        if self.state.iteration != 2:
            return real_step(self)
        handle = self.strategy.params[0].register_hook(lambda g: g * float("inf")) if self.ps.pp_rank == 0 else None
        before = [p.detach().clone() for p in self.strategy.params]
        out = real_step(self)
        if handle is not None:
            handle.remove()
        assert before and len(before) == len(self.strategy.params)
        assert all(torch.equal(a, p) for a, p in zip(before, self.strategy.params)), f"stage {self.ps.pp_rank} stepped"
        return out

    with patched(trainer_mod.Trainer, "train_step", step):
        train_worker(rank, world, COMMON + PP2 + ["--fp16", "--metrics-file", metrics, "--hysteresis", "1",
                                                 "--initial-loss-scale", "1024"])


def test_fp16_overflow_on_one_stage_skips_on_all(tmp_path):
    path = str(tmp_path / "m.jsonl")
    run_distributed(_fp16_overflow_on_first_stage, 2, path)
    assert read_metrics(path, "loss_scale")[2:4] == [1024.0, 512.0]
    assert read_metrics(path, "skipped") == [1]


def test_zero1_pipeline_resumes_bitwise(tmp_path):
    """DeepSpeed ZeRO-1 over DP=2 with two pipeline stages: DeepSpeed's own checkpoint
    (one optimizer partition per DP rank and stage) resumes the exact curve."""
    zero1 = COMMON + PP2 + ["--deepspeed", "--zero-stage", "1"]
    full, part, ckpt = str(tmp_path / "full.jsonl"), str(tmp_path / "part.jsonl"), str(tmp_path / "ckpt")
    run_distributed(train_worker, 4, zero1 + ["--metrics-file", full])
    run_distributed(train_worker, 4, zero1 + ["--metrics-file", part, "--exit-interval", "3", "--save", ckpt])
    run_distributed(train_worker, 4, zero1 + ["--metrics-file", part, "--load", ckpt])
    assert read_metrics(part) == read_metrics(full)
    assert os.path.isfile(os.path.join(ckpt, "deepspeed", "iter_0000003",
                                       "zero_pp_rank_1_mp_rank_01_optim_states.pt"))


def test_bf16_stages_exchange_bf16_and_follow_one_process(tmp_path):
    """Under --bf16 activations and their gradients cross stages as bf16 (half the bytes);
    the losses stay those of one bf16 process up to that rounding."""
    import megabert.pipeline_parallel as pp_mod

    assert pp_mod.pipeline_dtype(True) == torch.bfloat16 and pp_mod.pipeline_dtype(False) == torch.float32
    one, two = str(tmp_path / "one.jsonl"), str(tmp_path / "two.jsonl")
    run_distributed(train_worker, 1, COMMON + ["--bf16", "--metrics-file", one])
    run_distributed(_bf16_worker, 2, COMMON + PP2 + ["--bf16", "--metrics-file", two])
    assert read_metrics(two) == pytest.approx(read_metrics(one), abs=2e-2)


def _bf16_worker(rank, world, argv):
    import megabert.pipeline_parallel.p2p as p2p

    sent = []
    real_send = p2p.PipeComm._send

    def send(self, tensor, dst, group, tag):
        sent.append(self.dtype)
        return real_send(self, tensor, dst, group, tag)

    p2p.PipeComm._send = send
    train_worker(rank, world, argv)
    assert sent and set(sent) == {torch.bfloat16}


def test_a_released_stage_output_still_roots_backward():
    """release_storage frees a sent output's buffer; backward from it with the received
    gradient gives the gradients of the untouched output (what the node saved for itself,
    here LayerNorm's input, stays)."""
    from megabert.pipeline_parallel.schedules import release_storage

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, 16, generator=g)
    grad = torch.randn(8, 2, 16, generator=g)
    layer = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
    grads = []
    for release in (False, True):
        layer.zero_grad()
        inp = x.clone().requires_grad_()
        out = layer(inp)
        if release:
            release_storage(out)
            assert out.shape == (8, 2, 16) and out.untyped_storage().nbytes() == out.element_size()
        torch.autograd.backward(out, grad)
        grads.append([inp.grad] + [p.grad.clone() for p in layer.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
