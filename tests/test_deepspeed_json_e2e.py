"""pretrain_bert.py with the DeepSpeed BERT tutorial's JSON (fp16 left out: CPU): it trains
(ZeRO-2, main() on the warm pool's two ranks) with the JSON's own lr and clipping and saves
DeepSpeed's checkpoint; under torchrun, a typed --lr that disagrees stops with one line per
rank naming both values, no traceback. (ZeRO-3
with CPU offload trains and saves in test_zero_offload.py, on the warm worker pool.)"""
import json
import os

from tests.helpers.pretrain_runs import TORCHRUN, pretrain_args, rows, run_cmd, run_ranks


# bing_bert's deepspeed_bsz4096_adam_config.json, batch sizes cut to the tiny run's.
TUTORIAL = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 100,
            "optimizer": {"type": "Adam", "params": {"lr": 2e-4, "max_grad_norm": 1.0, "weight_decay": 0.01,
                                                     "bias_correction": False}}}


def without_lr(args):
    i = args.index("--lr")
    return args[:i] + args[i + 2:]


def test_tutorial_json_trains_with_its_lr(dataset, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({**TUTORIAL, "zero_optimization": {"stage": 2}}))
    metrics = tmp_path / "m.jsonl"
    args = without_lr(pretrain_args(dataset, metrics, "--deepspeed", "--deepspeed_config", str(ds),
                                    "--lr-decay-style", "constant", "--save", str(tmp_path / "ck")))
    run_ranks(2, args)
    train = [x for x in rows(metrics) if "lm_loss" in x]
    assert [x["iteration"] for x in train] == [1, 2, 3]
    assert all(x["lr"] == 2e-4 for x in train)
    # The communication ledger: the busiest rank's bytes per step, DeepSpeed's counted as zero.
    assert all(x["comm_gb"] > 0 and x["comm_gb_by_group"]["zero"] > 0 for x in train), train
    assert os.path.isdir(tmp_path / "ck" / "deepspeed" / "iter_0000003")


def test_typed_lr_that_disagrees_stops_with_one_line(dataset, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(TUTORIAL))
    args = pretrain_args(dataset, tmp_path / "m.jsonl", "--deepspeed", "--deepspeed_config", str(ds))
    args[args.index("--lr") + 1] = "0.5"
    r = run_cmd([*TORCHRUN, "--standalone", "--nproc-per-node", "2", *args])
    # torchrun adds its own traceback for a failed child; the ranks print one line each.
    assert r.returncode != 0 and "[rank0]" not in r.stderr and 'pretrain_bert.py", line' not in r.stderr, \
        r.stderr[-4000:]
    # Each rank stops on its own; torchrun may end one before it prints, so one or two lines.
    errors = {line.split(": ", 1)[1] for line in r.stderr.splitlines() if line.startswith("error")}
    assert errors == {f"--deepspeed_config {ds} sets optimizer.params.lr=0.0002 but --lr is 0.5; "
                      f"make them agree, or drop one of them"}
