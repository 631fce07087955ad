"""DeepSpeed's config: a JSON's optimizer and scheduler become our OptimConfig (typed flags
must agree), ZeRO is sized to the model per stage, offload flags map onto DeepSpeed's keys,
and what cannot run is one line naming the key and what to do."""
import json
from types import SimpleNamespace

import pytest
import torch

from megabert.arguments import parse_args
from megabert.config import FinetuneConfigs, OptimConfig, ParallelConfig, TrainConfig
from megabert.data_parallel.zero_plan import ZeroBuckets
from megabert.tasks.squad.config import SquadConfig
from megabert.errors import ConfigError
from megabert.training.deepspeed.ds_config import (bucket_keys, build_config, engine_config, offloads_optimizer,
                                                  resolve_deepspeed_config, takes_memory_efficient_linear)
from megabert.training.resolve import resolve_run

CPU = SimpleNamespace(world_size=2, dp_size=2, pp_size=1, device=torch.device("cpu"))
GPU = SimpleNamespace(world_size=2, dp_size=2, pp_size=1, device=torch.device("cuda", 0))  # only read for its type here
BATCH = ["--micro-batch-size", "2", "--global-batch-size", "4"]
# DeepSpeed's BERT tutorial (bing_bert), batch sizes cut to this test's.
TUTORIAL = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 100,
            "optimizer": {"type": "Adam", "params": {"lr": 2e-4, "max_grad_norm": 1.0, "weight_decay": 0.01,
                                                     "bias_correction": False}},
            "fp16": {"enabled": True}}


def tutorial(**changes):
    cfg = json.loads(json.dumps(TUTORIAL))
    for key, value in changes.items():
        if value is None:
            cfg.pop(key)
        else:
            cfg[key] = value
    return cfg


def resolve(tmp_path, ds: dict, *flags, ps=CPU, hidden=64):
    """(DeepSpeed's config, the OptimConfig) of the resolved run: the JSON merged, every rule applied."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    cfg = parse_args(["--deepspeed", "--deepspeed_config", str(path), *BATCH, *flags, "--hidden-size", str(hidden),
                      "--num-attention-heads", "2"])
    run = resolve_run(cfg, ps)
    return run.deepspeed_config, run.optim


def error(tmp_path, ds, *flags, ps=CPU) -> str:
    with pytest.raises(ConfigError) as e:
        resolve(tmp_path, ds, *flags, ps=ps)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_tutorial_json_runs_with_its_own_values(tmp_path):
    ds, optim = resolve(tmp_path, tutorial(fp16=None))
    assert (optim.lr, optim.clip_grad, optim.weight_decay, optim.bias_correction, optim.optimizer) == \
        (2e-4, 1.0, 0.01, False, "adam")
    assert "optimizer" not in ds and "scheduler" not in ds  # our client optimizer and schedule train
    assert ds["gradient_clipping"] == 1.0 and ds["steps_per_print"] == 100
    assert ds["zero_allow_untested_optimizer"]  # our Adam without bias correction, under ZeRO


def test_typed_flag_that_disagrees_is_one_line_naming_both(tmp_path):
    message = error(tmp_path, tutorial(fp16=None), "--lr", "0.5")
    assert message.startswith(f"--deepspeed_config {tmp_path / 'ds.json'} sets optimizer.params.lr=0.0002 but --lr "
                              f"is 0.5; ")
    assert "max_grad_norm=1.0 but --clip-grad is 2.0" in error(tmp_path, tutorial(fp16=None), "--clip-grad", "2")
    # A typed flag that agrees is fine; an untyped one takes the JSON's value.
    assert resolve(tmp_path, tutorial(fp16=None), "--lr", "2e-4")[1].lr == 2e-4
    assert resolve(tmp_path, tutorial(fp16=None), "--weight-decay", "0.01")[1].weight_decay == 0.01


def test_adam_params_map_onto_optim_config(tmp_path):
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.98], "eps": 1e-8,
                                                    "weight_decay": 0.1, "torch_adam": True, "adam_w_mode": True}},
          "gradient_clipping": 0.5}
    optim = resolve(tmp_path, ds)[1]
    assert (optim.lr, optim.adam_beta1, optim.adam_beta2, optim.adam_eps, optim.weight_decay, optim.clip_grad,
            optim.bias_correction) == (3e-4, 0.8, 0.98, 1e-8, 0.1, 0.5, True)
    # transformers' "auto" keeps the flags' values.
    optim = resolve(tmp_path, {"optimizer": {"type": "Adam", "params": {"lr": "auto"}}, "gradient_clipping": "auto",
                               "train_batch_size": "auto"}, "--lr", "0.3")[1]
    assert optim.lr == 0.3 and optim.clip_grad == 1.0


@pytest.mark.parametrize("ds,expected", [
    (tutorial(fp16=None, optimizer={"type": "Adam", "params": {"lr": 2e-4, "foo": 1}}),
     "sets optimizer.params.foo, which megabert's Adam does not take"),
    (tutorial(fp16=None, optimizer={"type": "Adam", "params": {"amsgrad": True}}),
     "sets optimizer.params.amsgrad=true: megabert's Adam has no AMSGrad; remove the key"),
    (tutorial(fp16=None, optimizer={"type": "Adam", "params": {"adam_w_mode": False}}),
     "adam_w_mode=false (Adam with L2-coupled weight decay)"),
    (tutorial(fp16=None, optimizer={"type": "OneBitAdam", "params": {}}),
     'sets optimizer.type=OneBitAdam: megabert trains with its own Adam'),
    (tutorial(fp16=None, optimizer={"type": "Adam", "params": {"lr": "fast"}}),
     "sets optimizer.params.lr='fast': expected a number"),
    (tutorial(fp16=None, gradient_clipping=2.0), "sets optimizer.params.max_grad_norm=1.0 and gradient_clipping=2.0"),
    (tutorial(fp16=None, train_batch_size=65536), "sets train_batch_size=65536 but the flags give 4"),
])
def test_what_cannot_run_names_the_key(tmp_path, ds, expected):
    assert expected in error(tmp_path, ds)


def test_lamb_in_the_json_is_refused_with_the_flags_that_train_it(tmp_path):
    ds = tutorial(fp16=None, optimizer={"type": "Lamb", "params": {"lr": 11e-3, "weight_decay": 0.01,
                                                                   "bias_correction": False, "max_coeff": 0.3,
                                                                   "min_coeff": 0.01}})
    message = error(tmp_path, ds)
    assert "sets optimizer.type=Lamb, which --deepspeed cannot train" in message
    assert message.endswith("train LAMB without --deepspeed: --optimizer lamb --lr 0.011 --weight-decay 0.01 "
                            "--no-bias-correction --lamb-max-coeff 0.3 --lamb-min-coeff 0.01")


def test_fp16_on_cpu_is_one_line(tmp_path):
    message = error(tmp_path, tutorial())
    assert "sets fp16.enabled=true, but fp16 needs a CUDA device" in message and "use --bf16 on CPU" in message
    assert "--fp16 with --deepspeed, but fp16 needs a CUDA device" in error(tmp_path, tutorial(fp16=None), "--fp16")
    # On a GPU the JSON's fp16 needs the flag (our autocast), and says so.
    assert "has fp16.enabled=true but --fp16 is not set; pass --fp16" in error(tmp_path, tutorial(), ps=GPU)
    assert resolve(tmp_path, tutorial(), "--fp16", ps=GPU)[0]["fp16"] == {"enabled": True}


def test_warmup_schedulers_translate(tmp_path):
    params = {"warmup_min_lr": 1e-5, "warmup_max_lr": 2e-4, "warmup_num_steps": 10, "warmup_type": "linear"}
    optim = resolve(tmp_path, {"scheduler": {"type": "WarmupLR", "params": params}})[1]
    assert (optim.lr_warmup_init, optim.lr, optim.lr_warmup_iters, optim.lr_decay_style) == \
        (1e-5, 2e-4, 10, "constant")
    optim = resolve(tmp_path, {"scheduler": {"type": "WarmupDecayLR",
                                             "params": {**params, "total_num_steps": 100}}})[1]
    assert (optim.lr_decay_style, optim.lr_decay_iters, optim.min_lr) == ("linear", 100, 1e-5)
    # WarmupLR without warmup_max_lr keeps the optimizer's lr (DeepSpeed's rule).
    optim = resolve(tmp_path, {"optimizer": {"type": "Adam", "params": {"lr": 3e-4}},
                               "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "linear"}}})[1]
    assert (optim.lr, optim.lr_warmup_iters) == (3e-4, 1000)


@pytest.mark.parametrize("scheduler,flags,expected", [
    ({"type": "WarmupLR", "params": {}}, [], 'warmup_type=\'log\' (DeepSpeed\'s default): megabert warms up linearly'),
    ({"type": "OneCycle", "params": {}}, [], "sets scheduler.type=OneCycle, which has no megabert equivalent"),
    ({"type": "warmup_exp_decay_exp"}, [], "use --lr-decay-style warmup_exp_decay_exp"),
    ({"type": "WarmupLR", "params": {"warmup_type": "linear", "warmup_num_steps": 10}},
     ["--lr-decay-style", "cosine"],
     "sets scheduler.type=WarmupLR (constant after warmup) but --lr-decay-style is 'cosine'; make them agree"),
    ({"type": "WarmupLR", "params": {"warmup_type": "linear"}}, ["--lr-warmup-fraction", "0.1"],
     "sets scheduler.type=WarmupLR (a warmup counted in scheduler.params.warmup_num_steps) but "
     "--lr-warmup-fraction is 0.1"),
    ({"type": "WarmupDecayLR", "params": {"warmup_type": "linear"}}, [], "without scheduler.params.total_num_steps"),
])
def test_schedulers_that_do_not_map_stop(tmp_path, scheduler, flags, expected):
    assert expected in error(tmp_path, {"scheduler": scheduler}, *flags)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_sized_to_the_model_with_only_the_stage_keys(stage):
    cfg = parse_args(["--deepspeed", "--zero-stage", str(stage), *BATCH])
    zero = build_config(cfg.train, cfg.optim, CPU, hidden_size=1024)["zero_optimization"]
    sizing = bucket_keys(ZeroBuckets.for_hidden_size(1024))
    expected = {0: set(), 1: {"reduce_bucket_size", "allgather_bucket_size"},
                2: {"reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients"},
                3: {"reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                    "stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size", "overlap_comm",
                    "contiguous_gradients"}}[stage]
    # ZeRO-1/2: each gradient bucket reduce-scattered, not all-reduced (the DeepSpeed here has the key).
    ring = {"reduce_scatter": True, "use_multi_rank_bucket_allreduce": False} if stage in (1, 2) else {}
    assert set(zero) == {"stage"} | expected | set(ring)
    assert all(zero[k] == sizing[k] for k in expected)
    assert {k: zero[k] for k in ring} == ring


@pytest.mark.parametrize("value", [None, True, False])
def test_deepspeed_never_swaps_f_linear_and_the_json_says_whether_the_layers_take_its_linear(tmp_path, value):
    zero = {"stage": 3} if value is None else {"stage": 3, "memory_efficient_linear": value}
    ds, _ = resolve(tmp_path, {"zero_optimization": zero})
    assert takes_memory_efficient_linear(ds) is (value is not False)  # DeepSpeed's default: true
    assert engine_config(ds)["zero_optimization"]["memory_efficient_linear"] is False


def test_offload_flags_map_onto_deepspeed_keys(tmp_path):
    cfg = parse_args(["--deepspeed", "--zero-stage", "3", "--zero-offload-optimizer", "cpu",
                      "--zero-offload-params", "cpu", *BATCH])
    ds, _, plan = resolve_deepspeed_config(cfg, CPU, 64)
    assert (plan.stage, plan.offload_optimizer, plan.offload_params, plan.source) == (3, True, True, "flag")
    assert plan.buckets == ZeroBuckets.for_hidden_size(64)
    assert ds["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ds["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert offloads_optimizer(ds)
    # Our optimizer steps on the CPU partitions: DeepSpeed is told to take it.
    assert ds["zero_force_ds_cpu_optimizer"] is False
    # From the JSON too, where no flag was typed.
    ds, _ = resolve(tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert offloads_optimizer(ds) and ds["zero_optimization"]["stage"] == 2
    assert "allgather_bucket_size" in ds["zero_optimization"] and ds["zero_force_ds_cpu_optimizer"] is False
    # Without offload DeepSpeed's default stays.
    ds, _ = resolve(tmp_path, {"zero_optimization": {"stage": 2}})
    assert "zero_force_ds_cpu_optimizer" not in ds


@pytest.mark.parametrize("flags,message", [
    (["--zero-offload-params", "cpu", "--zero-stage", "2"], "--zero-offload-params cpu needs --zero-stage 3"),
    (["--zero-offload-optimizer", "cpu"], "--zero-offload-optimizer cpu needs --zero-stage 1, 2 or 3"),
])
def test_offload_needs_its_stage(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(["--deepspeed", *flags])


def test_offload_in_the_json_checked_against_stage_and_typed_flags(tmp_path):
    assert "--zero-offload-params cpu (--deepspeed_config" in error(
        tmp_path, {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert "offload_optimizer.device=cpu but --zero-offload-optimizer is none" in error(
        tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        "--zero-offload-optimizer", "none")
    assert "megabert offloads to the CPU only" in error(
        tmp_path, {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})
    assert "zero_optimization.cpu_offload, DeepSpeed's deprecated key" in error(
        tmp_path, {"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert "sets zero_force_ds_cpu_optimizer=true, but megabert's ZeRO-Offload steps with torch's fused AdamW" in error(
        tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                   "zero_force_ds_cpu_optimizer": True})


def test_finetune_configs_resolve_too(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(tutorial(fp16=None)))
    cfg = FinetuneConfigs(parallel=ParallelConfig(), optim=OptimConfig(lr=3e-5),
                          train=TrainConfig(deepspeed=True, deepspeed_config=str(path), micro_batch_size=2,
                                            global_batch_size=4, zero_stage=2),
                          finetune=SquadConfig(train_file="t.json"), explicit=frozenset())
    ds, optim, plan = resolve_deepspeed_config(cfg, CPU, 128)
    assert plan.stage == 2 and plan.source == "flag"  # the JSON chose neither the stage nor an offload
    assert optim.lr == 2e-4 and not optim.bias_correction
    assert ds["zero_optimization"]["reduce_bucket_size"] == 128 * 128


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_json_zero_stage_other_than_1_with_pipeline_is_refused(tmp_path, stage):
    pipelined = SimpleNamespace(world_size=4, dp_size=2, pp_size=2, device=torch.device("cpu"))
    message = error(tmp_path, tutorial(fp16=None, zero_optimization={"stage": stage}), ps=pipelined)
    assert f"zero_optimization.stage={stage}" in message and "--pipeline-model-parallel-size 2" in message
    ds, _ = resolve(tmp_path, tutorial(fp16=None, zero_optimization={"stage": 1}), ps=pipelined)
    assert ds["zero_optimization"]["stage"] == 1
