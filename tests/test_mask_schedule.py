"""The masking rate over training (--mask-prob-schedule, issue 50 item 5): the string's checks,
the rate of each sample, the samples themselves, the metrics line and an exact resume."""
import json

import numpy as np
import pytest

from megabert.config import DataConfig, mask_prob_points
from megabert.data import build_tokenizer
from megabert.data.indexed_dataset import IndexedDataset
from megabert.errors import ConfigError
from megabert.tasks.pretraining.indexed_samples import BertDataset, SampleSpec
from megabert.tasks.pretraining.masking import MaskRates, ScheduledMasking

from tests.helpers.pretrain_runs import curve, one_line_error, pretrain_args, rows, run_main, run_ranks


@pytest.mark.parametrize("text,fragment", [
    ("0:0.3,10:", "'10:' is not ITER:P"),
    ("0.3", "'0.3' is not ITER:P"),
    ("a:0.3", "'a:0.3' is not ITER:P"),
    ("0:0.3,10:1.5", "'10:1.5' needs an iteration >= 0 and a rate in (0, 1)"),
    ("-1:0.3", "needs an iteration >= 0"),
    ("0:0.3,0:0.2", "iteration 0 comes after 0"),
    ("10:0.3,5:0.2", "iteration 5 comes after 10"),
])
def test_bad_schedules_are_one_line(text, fragment):
    with pytest.raises(ConfigError, match="--mask-prob-schedule") as e:
        DataConfig(mask_prob_schedule=text)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_bad_schedule_on_the_command_line(dataset, tmp_path):
    r = run_main(*pretrain_args(dataset, tmp_path / "m.jsonl", "--mask-prob-schedule", "0:0.3;10:0.1"))
    one_line_error(r, "--mask-prob-schedule '0:0.3;10:0.1'")


def test_rates_by_sample():
    points = mask_prob_points("0:0.3, 10:0.15,20:0.05")
    assert points == ((0, 0.3), (10, 0.15), (20, 0.05))
    rates = MaskRates(0.15, points, samples_per_iteration=4)
    assert [rates.for_sample(i) for i in (0, 39, 40, 79, 80, 10 ** 6)] == [0.3, 0.3, 0.15, 0.15, 0.05, 0.05]
    late = MaskRates(0.2, ((5, 0.1),), 2)  # --mask-prob before the first point
    assert [late.for_sample(i) for i in (0, 9, 10)] == [0.2, 0.2, 0.1]
    assert DataConfig(mask_prob=0.15, mask_prob_schedule="0:0.3,5:0.05").highest_mask_prob == 0.3


def test_scheduled_samples(dataset):
    """A sample under the schedule is the sample at its rate: the same sentences and draws
    before the masking, and, at the rate --mask-prob gives, the same sample bit for bit."""
    tok = build_tokenizer("BertWordPieceLowerCase", str(dataset / "vocab.txt"))
    indexed = IndexedDataset(str(dataset / "c_text_sentence"))
    spec = SampleSpec(seq_length=64, mask_prob=0.15)
    plain = BertDataset(indexed, (0, indexed.num_documents), "train", 40, spec, tok)
    scheduled = ScheduledMasking(plain, MaskRates(0.15, ((2, 0.45), (4, 0.15)), samples_per_iteration=8))
    masked = []
    for i in range(40):
        got, ref = scheduled[i], plain[i]
        same = all(np.array_equal(got[k], ref[k]) for k in ref)
        assert same == (not 16 <= i < 32), i
        assert np.array_equal(got["attention_mask"], ref["attention_mask"])  # the same sentences
        masked.append(int((got["labels"] != -100).sum()) / int(got["attention_mask"].sum() - 3))
    assert np.mean(masked[16:32]) == pytest.approx(0.45, abs=0.03)
    assert np.mean(masked[:16]) == pytest.approx(0.15, abs=0.03)


def test_metrics_line_and_exact_resume(dataset, tmp_path):
    """Global batch 4: 0.3 for iterations 1-2, 0.15 for 3-4, 0.05 from 5. A run stopped at 3
    and resumed gives the uninterrupted run's losses bit for bit."""
    flags = ["--train-iters", "6", "--mask-prob-schedule", "0:0.3,2:0.15,4:0.05", "--eval-interval", "0"]
    full = tmp_path / "full.jsonl"
    run_ranks(1, pretrain_args(dataset, full, *flags))
    assert [r["mask_prob"] for r in rows(full)] == [0.3, 0.3, 0.15, 0.15, 0.05, 0.05]
    part, ckpt = tmp_path / "part.jsonl", str(tmp_path / "ckpt")
    run_ranks(1, pretrain_args(dataset, part, *flags, "--save", ckpt, "--exit-interval", "3"))
    run_ranks(1, pretrain_args(dataset, part, *flags, "--save", ckpt, "--load", ckpt))
    assert curve(part) == curve(full)
    assert [r["mask_prob"] for r in rows(part)] == [r["mask_prob"] for r in rows(full)]
    plain = tmp_path / "plain.jsonl"
    run_ranks(1, pretrain_args(dataset, plain, "--train-iters", "1", "--eval-interval", "0"))
    assert json.loads(open(plain).readline())["mask_prob"] == 0.15  # --mask-prob's, without a schedule
