"""The layout planner's arithmetic: parameter counts equal the real modules' (TP=1, TP=2,
PP=2), activations follow Korthikanti et al.'s formulas on a hand-checked case, ZeRO-3
divides model states by DP, communication and ranking, the CLI's output and its errors."""
import datetime
import math
import os

import json

import pytest
import torch

from megabert.config import ModelConfig
from megabert.presets import bert_base, bert_large, bert_tiny
from megabert.errors import ConfigError
from megabert.planning import Layout, Workload, communication, estimate, fit_warning, plan
from megabert.planning.communication import _stage_comm
from megabert.planning.activations import layer_activation_bytes
from megabert.planning.memory import estimate_stage
from megabert.planning.params import stage_params, total_params

from tests.helpers.cli_utils import run_main
from tests.helpers.dist_utils import run_distributed


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_state(tp, pp, pp_rank):
    from megabert.parallel.state import ParallelState

    return ParallelState(rank=0, world_size=tp * pp, tp_size=tp, pp_size=pp, dp_size=1, tp_rank=0, pp_rank=pp_rank,
                         dp_rank=0, device=torch.device("cpu"), backend="gloo")


def _real_count(cfg, ps) -> int:
    from megabert.tasks.pretraining import BertForPreTraining

    model = BertForPreTraining(cfg, ps, device="meta")
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("cfg", [bert_tiny(), bert_base(), bert_tiny(layernorm_position="pre"),
                                 bert_tiny(bert_binary_head=False)], ids=["tiny", "base", "tiny-preln", "tiny-nohead"])
def test_param_count_equals_real_model_tp1(cfg):
    assert total_params(cfg) == _real_count(cfg, _fake_state(1, 1, 0))


@pytest.mark.parametrize("cfg", [bert_tiny(), bert_base(num_layers=2)], ids=["tiny", "base-2-layers"])
def test_pipeline_stage_counts_equal_real_stages(cfg):
    counts = [stage_params(cfg, 1, 2, k).total for k in range(2)]
    assert counts == [_real_count(cfg, _fake_state(1, 2, k)) for k in range(2)]
    # The last stage's tied copy of the word embeddings is counted there too.
    assert stage_params(cfg, 1, 2, 1).tied_embedding == cfg.padded_vocab_size(1) * cfg.hidden_size
    assert sum(counts) == total_params(cfg) + stage_params(cfg, 1, 2, 1).tied_embedding


def _count_worker(rank, world, tp, pp, shapes):
    from megabert.parallel.state import ParallelState

    ps = ParallelState.build(tp, pp, device=torch.device("cpu"), backend="gloo", timeout=datetime.timedelta(minutes=10))
    for shape in shapes:
        cfg = ModelConfig(**shape)
        assert _real_count(cfg, ps) == stage_params(cfg, tp, pp, ps.pp_rank).total, (shape, ps.pp_rank)


@pytest.mark.parametrize("tp,pp", [(2, 1), (2, 2)])
def test_sharded_counts_equal_real_per_rank_counts(tp, pp):
    # bert-tiny and a 2-layer bert-base; the vocab 30522 pads to 30592 at TP=1 and 30720 at TP=2.
    shapes = [dict(num_layers=2, hidden_size=128, num_attention_heads=2),
              dict(num_layers=2, hidden_size=768, num_attention_heads=12)]
    run_distributed(_count_worker, tp * pp, tp, pp, shapes)


def test_vocab_padding_grows_with_tp():
    cfg = bert_large()
    assert stage_params(cfg, 1, 1, 0).tensors[0] == 30592 * 1024
    assert stage_params(cfg, 2, 1, 0).tensors[0] == 30720 // 2 * 1024


def test_layer_activations_hand_checked():
    """s=4, b=1, h=8, a=2, ffn=32, 16-bit: the paper's sbh(34 + 5as/h) and its variants."""
    cfg = ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2, vocab_size=100)
    run = Workload(seq_length=4, micro_batch_size=1, precision="bf16")
    sbh, as2b = 4 * 8, 2 * 16
    assert layer_activation_bytes(cfg, run, Layout(), "none") == 34 * sbh + 5 * as2b  # 1248
    assert layer_activation_bytes(cfg, run, Layout(tp=2), "none") == sbh * (10 + 24 / 2) + 5 * as2b / 2
    assert layer_activation_bytes(cfg, run, Layout(tp=2, sequence_parallel=True), "none") == (34 * sbh + 5 * as2b) / 2
    assert layer_activation_bytes(cfg, run, Layout(), "selective") == 34 * sbh
    assert layer_activation_bytes(cfg, run, Layout(), "full") == 2 * sbh
    # fp32 activations: 4-byte tensors, 1-byte masks.
    run32 = Workload(seq_length=4, micro_batch_size=1, precision="fp32")
    assert layer_activation_bytes(cfg, run32, Layout(), "none") == 66 * sbh + 9 * as2b


def test_pipeline_first_stage_holds_pp_microbatches():
    cfg, run = bert_large(), Workload(global_batch_size=64, micro_batch_size=2, precision="bf16")
    one = estimate(cfg, run, Layout(dp=1))
    stages = [estimate_stage(cfg, run, Layout(pp=4), k) for k in range(4)]
    # Stage 0 keeps 4 micro-batches of 6 layers: about the activations of all 24 layers;
    # stage k keeps 4 - k; the last adds the MLM head.
    assert stages[0].activations_gb == pytest.approx(one.activations_gb, rel=0.1)
    assert stages[0].activations_gb > stages[1].activations_gb > stages[2].activations_gb
    # Interleaving (2 chunks per rank) holds 1 + (pp - 1)/(pp V) = 1.375 times as much.
    inter = estimate_stage(cfg, run, Layout(pp=4, virtual_stages=2), 1)
    assert inter.activations_gb == pytest.approx(1.375 * stages[1].activations_gb, rel=0.01)


def test_zero3_divides_model_states_by_dp():
    cfg, run = bert_large(), Workload(precision="bf16")
    e2, e4 = (estimate(cfg, run, Layout(dp=d, zero_stage=3)) for d in (2, 4))
    assert e2.optimizer_gb == pytest.approx(2 * e4.optimizer_gb)
    assert e2.gradients_gb == pytest.approx(2 * e4.gradients_gb)
    persistent = stage_params(cfg, 1, 1, 0).below(10 * cfg.hidden_size) * 2 / 1e9
    assert e2.parameters_gb - persistent == pytest.approx(2 * (e4.parameters_gb - persistent))
    # fp32 master + moments = 12 bytes per element, partitioned.
    assert e4.optimizer_gb == pytest.approx(12 * total_params(cfg) / 4 / 1e9)
    # ZeRO-1 keeps whole parameters and gradients; only the optimizer is divided.
    z1 = estimate(cfg, run, Layout(dp=4, zero_stage=1))
    assert z1.parameters_gb == pytest.approx(2 * total_params(cfg) / 1e9)
    assert z1.optimizer_gb == pytest.approx(e4.optimizer_gb)


def test_offload_moves_states_to_the_host():
    cfg = bert_large()
    gpu = Workload(precision="bf16")
    plain, off = (estimate(cfg, gpu, Layout(dp=2, zero_stage=3, offload_optimizer=o, offload_params=o))
                  for o in (False, True))
    assert off.optimizer_gb == 0 and off.host_gb > 0 and off.total_gb < plain.total_gb
    cpu = Workload(precision="bf16", device="cpu", overhead_gb=0)
    assert estimate(cfg, cpu, off.layout).total_gb > off.total_gb - off.overhead_gb  # CPU: host memory counts


def test_communication_hand_checked():
    cfg, run = bert_base(), Workload(seq_length=128, micro_batch_size=2, precision="bf16")
    P = total_params(cfg)
    dp = communication(cfg, run, Layout(dp=4))
    assert dp.data_parallel == pytest.approx(2 * 3 / 4 * 4 * P)
    assert dp.tensor_parallel == dp.pipeline_parallel == 0
    tp = communication(cfg, run, Layout(tp=2))
    act = 128 * 2 * 768 * 2
    n = math.ceil(0.15 * 128) * 2
    assert tp.tensor_parallel == pytest.approx((12 * 4 + 1) * act * 2 * 1 / 2 + n * 768 * 2 * 2 * 1 / 2)
    sp = communication(cfg, run, Layout(tp=2, sequence_parallel=True))
    # Reduce-scatter + all-gather move what an all-reduce does; SP adds an all-gather at each
    # end of the model and the TP sum of its LayerNorm and row-parallel bias gradients (fp32).
    assert sp.tensor_parallel == pytest.approx(tp.tensor_parallel + 2 * act / 2 + 2 * 1 / 2 * 4 * 12 * 6 * 768)
    # Pipeline: per micro-batch each stage sends its output on and its input's gradient back,
    # but the model's output and the model's input's gradient; fp32 and fp16 exchange fp32.
    act32 = 128 * 2 * 768 * 4
    work = Workload(seq_length=128, micro_batch_size=2, global_batch_size=16, precision="fp16")  # 8 micro-batches
    assert communication(cfg, work, Layout(pp=2)).pipeline_parallel == pytest.approx(8 * act32)
    middle = _stage_comm(cfg, work, Layout(pp=4), 1)  # (the busiest by total is an end: it syncs the embeddings)
    assert middle.pipeline_parallel == pytest.approx(8 * 2 * act32)
    assert communication(cfg, work, Layout(pp=2, virtual_stages=2)).pipeline_parallel == pytest.approx(8 * 3 * act32)
    z3 = communication(cfg, run, Layout(dp=4, zero_stage=3))
    z1 = communication(cfg, run, Layout(dp=4, zero_stage=1))
    # ZeRO-1 as megabert configures DeepSpeed (use_multi_rank_bucket_allreduce off):
    # reduce-scatters bf16 gradients, then all-gathers the parameters: a ring all-reduce.
    assert z1.data_parallel == pytest.approx(3 / 4 * 2 * P + 3 / 4 * 2 * P)
    # ZeRO-3: reduce-scatter, gather for forward, again for backward but the embedding tables
    # and the MLM bias, the small unpartitioned parameters after the step.
    small = stage_params(cfg, 1, 1, 0).below(10 * 768)
    vocab = cfg.padded_vocab_size(1)
    unread = vocab * 768 + 512 * 768 + vocab  # word, position embeddings, MLM bias (token types are small)
    assert z3.data_parallel == pytest.approx(3 / 4 * 2 * (P + (P - small) + (P - small - unread) + small))


def test_plan_ranks_by_communication_then_model_parallel_size():
    cfg = bert_large()
    run = Workload(precision="bf16", global_batch_size=256, micro_batch_size=4)
    fits = plan(cfg, run, devices=8, budget_gb=80)
    keys = [(c.comm.total, c.layout.model_parallel_size) for c in fits]
    assert keys == sorted(keys)
    assert fits and all(c.memory.total_gb <= 80 for c in fits)
    assert {c.layout.world_size for c in fits} == {8}
    # A tight budget leaves only layouts that shard the model.
    tight = plan(cfg, run, devices=8, budget_gb=3.0)
    assert tight and all(c.layout.model_parallel_size > 1 or c.layout.zero_stage >= 1 for c in tight)
    assert plan(cfg, run, devices=8, budget_gb=0.5) == []


def test_fit_warning_names_flags():
    cfg, run = bert_large(), Workload(precision="bf16")
    est = estimate(cfg, run, Layout(dp=2))
    assert fit_warning(est, 100) is None
    msg = fit_warning(est, 4)
    assert "exceeds the 4 GB budget" in msg and "--deepspeed --zero-stage 1 (" in msg and "\n" not in msg
    act = estimate(cfg, Workload(seq_length=512, micro_batch_size=64, precision="bf16"), Layout(tp=2))
    assert "--recompute-granularity" in fit_warning(act, 10) and "--sequence-parallel" in fit_warning(act, 10)


def _fixes(msg: str) -> dict[str, float]:
    """{flags: predicted GB} of a fit_warning's "try A (X GB ...); or B (Y GB ...)"."""
    out = {}
    for part in msg.split("; try ", 1)[1].split("; or "):
        flags, rest = part.split(" (", 1)
        out[flags] = float(rest.split(" GB", 1)[0])
    return out


def test_one_process_warning_names_zero_offload_tp_pp_with_their_predictions():
    cfg = bert_large()
    one = estimate(cfg, Workload(precision="bf16"), Layout())
    fixes = _fixes(fit_warning(one, 4))
    # On a GPU: ZeRO-3 + offload on the same (one) rank, ZeRO-3 on two, TP or PP on two; lowest first.
    assert set(fixes) == {"--deepspeed --zero-stage 3 --zero-offload-optimizer cpu --zero-offload-params cpu",
                          "--deepspeed --zero-stage 3", "--tensor-model-parallel-size 2",
                          "--pipeline-model-parallel-size 2"}
    assert list(fixes.values()) == sorted(fixes.values()) and max(fixes.values()) < one.total_gb
    offload = estimate(cfg, Workload(precision="bf16"), Layout(zero_stage=3, offload_optimizer=True,
                                                                offload_params=True))
    assert fixes["--deepspeed --zero-stage 3 --zero-offload-optimizer cpu --zero-offload-params cpu"] == \
        pytest.approx(offload.total_gb, abs=0.005)
    assert "GB on 2 ranks" in fit_warning(one, 4) and "fits)" in fit_warning(one, 4)
    # On the CPU offloading moves states into the same memory: never suggested there.
    cpu = estimate(cfg, Workload(device="cpu"), Layout())
    cpu_fixes = _fixes(fit_warning(cpu, 4))
    assert "--tensor-model-parallel-size 2" in cpu_fixes and not any("offload" in f for f in cpu_fixes)
    assert max(cpu_fixes.values()) < cpu.total_gb


def test_zero3_step_works_one_sub_group_at_a_time():
    """ZeRO-3's step holds one sub-group's fp32 gradients (4 bytes x sub_group_size; the
    fused AdamW makes no temporaries), not the partition's; offloaded, none on the device.
    Backward holds the gathered parameters and the reduce bucket instead; the peak is the
    larger phase."""
    from megabert.planning.memory import _model_states
    from megabert.data_parallel.zero_plan import ZeroBuckets

    cfg, run = bert_large(), Workload(precision="bf16")
    sizing = ZeroBuckets.for_hidden_size(cfg.hidden_size)
    sp = stage_params(cfg, 1, 1, 0)
    states = _model_states(sp, cfg, run, Layout(dp=2, zero_stage=3))
    grads = 2 * sp.total / 2
    live = sizing.max_live_parameters + sizing.prefetch_bucket
    assert sizing.sub_group_size < total_params(cfg) / 2
    assert states.step == pytest.approx(grads + 4 * sizing.sub_group_size)
    assert states.backward == pytest.approx(grads + 2 * (live + sizing.reduce_bucket))
    off = _model_states(sp, cfg, run, Layout(dp=2, zero_stage=3, offload_optimizer=True))
    assert off.step == pytest.approx(grads)
    est = estimate(cfg, run, Layout(dp=2, zero_stage=3))
    transient = max(est.activations_gb * 1e9 + states.backward, states.step)
    assert est.total_gb == pytest.approx((states.parameters + states.optimizer + transient) / 1e9 + est.overhead_gb)


def test_fp32_zero_master_shares_the_parameters_unless_offloaded():
    """fp32 ZeRO keeps no separate fp32 master (training.deepspeed.zero_masters): 8 bytes of moments per
    element and rank; bf16 and an offloaded optimizer keep it (12, the offloaded in host memory)."""
    cfg = bert_large()
    P = total_params(cfg)
    for stage in (1, 2, 3):
        fp32 = estimate(cfg, Workload(), Layout(dp=2, zero_stage=stage))
        bf16 = estimate(cfg, Workload(precision="bf16"), Layout(dp=2, zero_stage=stage))
        assert fp32.optimizer_gb == pytest.approx(8 * P / 2 / 1e9)
        assert bf16.optimizer_gb == pytest.approx(12 * P / 2 / 1e9)
    off = estimate(cfg, Workload(), Layout(dp=2, zero_stage=3, offload_optimizer=True))
    assert off.optimizer_gb == 0 and off.host_gb == pytest.approx((12 + 4) * P / 2 / 1e9, rel=0.01)


@pytest.mark.parametrize("kwargs,flag", [
    (dict(tp=0), "--tensor-model-parallel-size"),
    (dict(pp=2, dp=2, zero_stage=3), "--zero-stage 3"),
    (dict(offload_params=True, zero_stage=2, dp=2), "--zero-offload-params"),
    (dict(virtual_stages=2), "--num-layers-per-virtual-pipeline-stage"),
])
def test_layout_validation_names_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        Layout(**kwargs)


def test_layout_must_divide_the_model():
    with pytest.raises(ConfigError, match="--num-attention-heads 16 is not divisible by "
                                          "--tensor-model-parallel-size 3"):
        estimate(bert_large(), Workload(), Layout(tp=3))
    with pytest.raises(ConfigError, match="--recompute-granularity"):
        Workload(recompute="some")


def _cli(*args):
    return run_main("tools/plan_layout.py", *args)


def test_cli_plan_table():
    r = _cli("--preset", "bert-large", "--devices", "8", "--memory-gb", "80", "--global-batch-size", "256", "--bf16",
             "--top", "3")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("model: 24 layers, hidden 1024, 16 heads, ffn 4096, vocab 30522 (padded 30592)")
    assert "8 devices x 80 GB:" in lines[2] and "predicted, not measured" in lines[2]
    assert lines[3].split()[:7] == ["#", "layout", "mem", "GB", "comm", "GB", "TP"]
    rows = lines[4:7]
    assert [row.split()[0] for row in rows] == ["1", "2", "3"]
    assert all("--tensor-model-parallel-size" in row for row in rows)
    assert lines[7].startswith("... ") and "--top 0" in lines[7]


def test_cli_one_layout_with_warning():
    r = _cli("--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
             "--tensor-model-parallel-size", "2", "--device", "cpu", "--memory-gb", "2")
    assert r.returncode == 0, r.stderr
    assert "layout: tp2.pp1.dp1.z0 (world 2)" in r.stdout
    assert "predicted peak memory of the fullest rank" in r.stdout
    assert "warning: predicted peak" in r.stdout and "--tensor-model-parallel-size 4" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["--hidden-size", "1024"], "give --preset or the model's --num-layers, --num-attention-heads"),
    (["--preset", "bert-large", "--tensor-model-parallel-size", "3"],
     "not divisible by --tensor-model-parallel-size 3"),
    (["--preset", "bert-large", "--devices", "8"], "--devices needs --memory-gb"),
    (["--preset", "bert-large", "--devices", "8", "--memory-gb", "-1"], "--memory-gb must be positive"),
    (["--preset", "bert-large", "--recompute-granularity", "half"], "--recompute-granularity must be one of"),
])
def test_cli_bad_input_is_a_clear_error(args, message):
    r = _cli(*args)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: ") and message in r.stderr and "Traceback" not in r.stderr


def _resolved(argv, dp=1):
    """The resolved run of pretrain_bert.py's flags on a world of tp x pp x dp ranks."""
    from types import SimpleNamespace

    from megabert.arguments import parse_args
    from megabert.training.resolve import resolve_run

    cfg = parse_args(argv)
    pp = cfg.parallel.pipeline_model_parallel_size
    world = cfg.parallel.tensor_model_parallel_size * pp * dp
    return resolve_run(cfg, SimpleNamespace(world_size=world, dp_size=dp, pp_size=pp, device=torch.device("cpu")))


def test_preflight_from_pretrain_flags():
    from megabert.planning.preflight import preflight_warning, run_and_layout

    run = _resolved(["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16",
                     "--seq-length", "128", "--micro-batch-size", "2", "--tensor-model-parallel-size", "2",
                     "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "6",
                     "--global-batch-size", "8", "--bf16", "--recompute-granularity", "selective"], dp=2)
    work, layout = run_and_layout(run, device="cpu")
    assert (layout.tp, layout.pp, layout.dp, layout.virtual_stages, layout.zero_stage) == (2, 2, 2, 2, 0)
    assert (work.precision, work.recompute, work.microbatches(2), work.seq_length) == ("bf16", "selective", 2, 128)
    assert preflight_warning(run, "cpu") is None  # no ceiling for RSS unless a budget is given
    assert "exceeds the 1 GB budget" in preflight_warning(run, "cpu", budget_gb=1)


def test_preflight_reads_the_zero_stage_and_offload_that_run_from_the_deepspeed_json(tmp_path):
    """A stage or offload set only in --deepspeed_config is what runs, so it is what the
    preflight predicts (it used to read --zero-stage from the flags: 0 here)."""
    from megabert.planning.preflight import run_and_layout

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                      "offload_param": {"device": "cpu"}}}))
    run = _resolved(["--preset", "bert-base", "--deepspeed", "--deepspeed-config", str(path)], dp=2)
    _, layout = run_and_layout(run, device="cpu")
    assert (layout.zero_stage, layout.offload_optimizer, layout.offload_params) == (3, True, True)
    assert run.train.zero_stage == 3 and run.zero_stage == 3
    _, flags_only = run_and_layout(_resolved(["--preset", "bert-base", "--deepspeed", "--zero-stage", "1"], dp=2),
                                   device="cpu")
    assert (flags_only.zero_stage, flags_only.offload_optimizer) == (1, False)


def test_preflight_reads_the_budget_flag():
    from megabert.planning import preflight

    flags = ["--preset", "bert-large", "--seq-length", "128", "--micro-batch-size", "2"]
    assert preflight(_resolved(flags), "cpu") is None  # CPU, no flag: no check
    over = preflight(_resolved([*flags, "--memory-budget-gb", "5"]), "cpu")
    assert not over.fits and over.budget_gb == 5
    assert over.message().startswith(f"predicted peak {over.estimate.total_gb:.2f} GB per rank exceeds the 5 GB")
    assert over.message().endswith("(budget from --memory-budget-gb)") and "--tensor-model-parallel-size 2" in \
        over.message()
    fits = preflight(_resolved([*flags, "--tensor-model-parallel-size", "2", "--memory-budget-gb", "5"]), "cpu")
    assert fits.fits and fits.message() == (f"predicted peak {fits.estimate.total_gb:.2f} GB per rank "
                                            f"(tp2.pp1.dp1.z0) fits the 5 GB budget from --memory-budget-gb")
    # The tokenizer's vocab sizes the embeddings, not ModelConfig's default.
    small = preflight(_resolved([*flags, "--memory-budget-gb", "5"]), "cpu", vocab_size=1000)
    assert small.estimate.total_gb < over.estimate.total_gb - 0.4


@pytest.mark.parametrize("value", ["0", "-2"])
def test_budget_flag_must_be_positive(value):
    from megabert.config import TrainConfig

    with pytest.raises(ConfigError, match=f"--memory-budget-gb must be a positive number of GB per rank, got "
                                          f"{float(value)}"):
        TrainConfig(memory_budget_gb=float(value))


def test_finetuning_has_no_budget_flag():
    """finetune_squad.py learns the model's shape only by loading it, and the planner models
    pre-training's heads: the flag is not offered there rather than silently ignored."""
    from megabert.arguments import parse_finetune_args
    from megabert.tasks.squad.config import SquadConfig

    with pytest.raises(SystemExit):
        parse_finetune_args(["--load", "x", "--train-file", "t.json", "--memory-budget-gb", "4"],
                            task_config=SquadConfig)
