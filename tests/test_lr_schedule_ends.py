"""No optimizer step at lr 0 (issue 51): the first and last steps of every schedule, and a
one-step fine-tuning run that moves the weights (before, its only step ran at lr 0)."""
import json

import numpy as np
import pytest
import torch

from megabert.config import OptimConfig
from megabert.errors import ConfigError
from megabert.optim import LRSchedule
from megabert.rules import check_steps_past_decay

from tests.helpers.cli_utils import run_main
from tests.helpers.dist_utils import run_distributed
from tests.helpers.glue_files import write
from tests.helpers.hf_models import make_hf_dir
from tests.helpers.train_utils import read_metrics, train_worker

STYLES = [dict(lr_decay_style=s) for s in ("linear", "cosine", "polynomial", "constant", "warmup_exp_decay_exp")] + \
         [dict(lr_decay_style="WSD", lr_wsd_decay_iters=4, lr_wsd_decay_style=s)
          for s in ("exponential", "linear", "cosine", "minus_sqrt")]


@pytest.mark.parametrize("style", STYLES, ids=lambda s: s.get("lr_wsd_decay_style", s["lr_decay_style"]))
@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("min_lr", [0.0, 0.1])
def test_first_and_last_steps_are_above_the_ends(style, warmup, min_lr):
    n = 10
    s = LRSchedule(OptimConfig(lr=1.0, min_lr=min_lr, lr_warmup_iters=warmup, **style), train_iters=n)
    lrs = [s(it) for it in range(1, n + 1)]
    assert lrs[0] > 0 and lrs[-1] > min_lr
    # The peak: the warm-up's last step (or, with none, the first); once only where the
    # schedule decays from it (constant and WSD's stable phase hold it by design).
    assert max(lrs) == pytest.approx(1.0) and lrs[max(warmup, 1) - 1] == pytest.approx(1.0)
    if style["lr_decay_style"] in ("linear", "cosine", "polynomial"):
        assert len(set(lrs)) == n  # all distinct
        assert all(a > b for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))  # strictly down after the peak
    if style["lr_decay_style"] == "WSD":
        assert len(set(lrs[-5:])) == 5  # the peak, then 4 annealing steps of their own


def test_one_step_without_warmup_runs_at_the_peak():
    # A 1-step fine-tuning run (10% warm-up rounds to none): its step is the peak, not lr 0.
    assert LRSchedule(OptimConfig(lr=3e-5, lr_warmup_fraction=0.1), train_iters=1)(1) == pytest.approx(3e-5)


def test_steps_past_the_decay_at_lr_0_are_refused():
    with pytest.raises(ConfigError, match="--lr-decay-iters 4 < --train-iters 6 with --min-lr 0: the last 2 steps"):
        check_steps_past_decay(OptimConfig(lr_decay_iters=4), 6)
    check_steps_past_decay(OptimConfig(lr_decay_iters=4, min_lr=1e-6), 6)
    check_steps_past_decay(OptimConfig(lr_decay_iters=4, lr_decay_style="constant"), 6)


def test_pretraining_logs_no_lr_0(tmp_path):
    """A 6-iteration run (before: lr 0.0 at iteration 6)."""
    metrics = tmp_path / "m.jsonl"
    run_distributed(train_worker, 1, ["--train-iters", "6", "--lr-warmup-iters", "2", "--metrics-file", str(metrics)])
    lrs = read_metrics(metrics, "lr")
    assert len(lrs) == 6 and min(lrs) > 0 and lrs[1] == pytest.approx(1e-3) and len(set(lrs)) == 6


def test_one_step_finetuning_changes_the_weights(tmp_path):
    vocab = write(tmp_path / "vocab.txt", ["[PAD]"] + [f"[unused{i}]" for i in range(74)] +
                  ["[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(20)])
    hf = make_hf_dir(tmp_path / "hf")  # 99 ids, as the vocab
    rng = np.random.default_rng(0)
    data = tmp_path / "SST-2"
    data.mkdir()
    rows = [" ".join(f"w{int(i)}" for i in rng.integers(0, 20, 5)) + f"\t{int(rng.integers(0, 2))}" for _ in range(8)]
    write(data / "train.tsv", ["sentence\tlabel"] + rows)
    write(data / "dev.tsv", ["sentence\tlabel"] + rows[:4])
    out = tmp_path / "out"
    r = run_main("finetune_glue.py", "--task-name", "sst-2", "--data-dir", str(data), "--load", hf, "--vocab-file",
                 vocab, "--output-dir", str(out), "--max-seq-length", "16", "--micro-batch-size", "8",
                 "--train-iters", "1", "--lr", "1e-3", "--no-do-eval", "--no-do-predict", "--save", str(out / "ckpt"),
                 "--metrics-file", str(tmp_path / "m.jsonl"))
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert row["lr"] == pytest.approx(1e-3)
    import megabert

    megabert.init_parallel()
    try:
        before, after = (megabert.BertForSequenceClassification.from_pretrained(str(d)).full_state_dict()
                         for d in (hf, out / "ckpt"))
    finally:
        megabert.destroy_parallel()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(moved) == len(before), sorted(set(before) - set(moved))  # every weight took the step
