"""Where a run starts: one value (megabert.checkpoint.start.RunStart), decided once from the
flags and the disk, for every case of the README's table; a run detects each path's format
once and logs the decision once."""
import logging
import os

import pytest

from megabert.checkpoint import hf as hf_io
from megabert.checkpoint import megatron
from megabert.checkpoint import start as start_mod
from megabert.checkpoint import tf as tf_io
from megabert.checkpoint.layout import commit, staging_dir, write_rank_file
from megabert.checkpoint.start import Format, decide_start, detect_source
from megabert.config import TrainConfig
from megabert.errors import CheckpointError

from tests.helpers.megatron_files import FIXTURES as MEGATRON
from tests.helpers.pretrain_runs import one_line_error, pretrain_args, run_main

TF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "tf_bert_tiny")
HF_DIR = os.path.join(TF_DIR, "hf")


def _checkpoint(root, tag):
    """A committed checkpoint of one rank file (the start reads the pointer and each rank
    file's zip index, no tensor)."""
    write_rank_file(staging_dir(str(root), tag), 0, 0, 1, {"iteration": 0 if tag == "release" else tag})
    commit(str(root), tag)
    return str(root)


def test_every_format_is_told_apart(tmp_path):
    own, release = _checkpoint(tmp_path / "own", 5), _checkpoint(tmp_path / "rel", "release")
    cases = {own: (Format.MEGABERT, False), release: (Format.RELEASE, True), HF_DIR: (Format.HF, True),
             TF_DIR: (Format.TF, True), os.path.join(MEGATRON, "tp2_torch"): (Format.MEGATRON, False),
             os.path.join(MEGATRON, "tp2_torch_dist"): (Format.MEGATRON, False)}
    for path, (fmt, weights_only) in cases.items():
        source = detect_source(path)
        assert (source.format, source.weights_only) == (fmt, weights_only), path
        assert (source.megatron_args is not None) == (fmt is Format.MEGATRON), path  # read with its header
    assert detect_source(own).root == own and detect_source(os.path.join(own, "iter_0000005")).root == own
    assert detect_source(str(tmp_path)) is None and detect_source(str(tmp_path / "missing")) is None


def test_the_pretraining_table(tmp_path):
    own, release = _checkpoint(tmp_path / "own", 5), _checkpoint(tmp_path / "rel", "release")
    empty = tmp_path / "empty"
    empty.mkdir()

    def start(**kw):
        s = decide_start(TrainConfig(**kw))
        return (s.path, s.weights_only, s.flag)

    assert start() == (None, False, "--load")  # the seed
    assert start(load=own) == (own, False, "--load")  # a run of megabert's: resumed whole
    assert start(load=release) == (release, True, "--load")
    assert start(load=HF_DIR) == (HF_DIR, True, "--load")
    assert start(load=TF_DIR) == (TF_DIR, True, "--load")
    megatron_dir = os.path.join(MEGATRON, "tp2_torch")
    assert start(load=megatron_dir) == (megatron_dir, False, "--load")  # Megatron's --load: its iteration
    assert start(load=own, finetune=True) == (own, True, "--finetune")
    assert start(load=str(empty), save=str(empty)) == (None, False, "--load")  # the restart pattern
    assert start(pretrained_checkpoint=own, save=str(empty)) == (own, True, "--pretrained-checkpoint")
    assert start(pretrained_checkpoint=release, load=own) == (own, False, "--load")
    with pytest.raises(CheckpointError, match=r"--load .*empty holds no checkpoint .*point it at a checkpoint"):
        start(load=str(empty))
    with pytest.raises(CheckpointError, match="--load .*missing does not exist"):
        start(load=str(tmp_path / "missing"))


def test_the_finetuning_table(tmp_path):
    """Fine-tuning: --load is the pre-trained model, --save the run it resumes once it holds one."""
    save = tmp_path / "ft"
    s = decide_start(TrainConfig(load=HF_DIR, save=str(save)), finetuning=True)
    assert (s.pretrained.format, s.source, s.architecture.path) == (Format.HF, None, HF_DIR)
    assert s.describe() == f"start: the model from --load {HF_DIR} (Hugging Face); a new fine-tuning run " \
                           f"(--save holds no checkpoint of it)"
    _checkpoint(save, 3)
    s = decide_start(TrainConfig(load=HF_DIR, save=str(save)), finetuning=True)
    assert (s.pretrained.path, s.path, s.weights_only, s.flag) == (HF_DIR, str(save), False, "--save")
    assert "holds this fine-tuning run's checkpoint: resuming it" in s.describe()
    with pytest.raises(CheckpointError, match="--load .* does not exist"):
        decide_start(TrainConfig(load=str(tmp_path / "missing")), finetuning=True)


def test_a_damaged_newest_checkpoint(tmp_path):
    """A truncated rank file stops the run naming it and the newest intact iteration; under
    --save X --load X that iteration is resumed after a warning."""
    root = _checkpoint(tmp_path / "ck", 2)
    _checkpoint(root, 4)
    rank_file = os.path.join(root, "iter_0000004", "mp_rank_00", "model_optim_rng.pt")
    with open(rank_file, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match=r"model_optim_rng.pt .* newest intact checkpoint is .*iter_0000002"):
        decide_start(TrainConfig(load=root))
    s = decide_start(TrainConfig(load=root, save=root))
    assert s.warn and s.path == os.path.join(root, "iter_0000002") and s.source.root == root
    assert s.describe().startswith(f"start: --load {s.path} (megabert; resuming")


def test_a_run_detects_each_format_once_and_logs_its_start_once(dataset, tmp_path, monkeypatch, caplog):
    """pretrain_bert.py --load of a run's checkpoint, through main(): every format predicate
    runs on the start's path in the one detection, and one log line says where it starts."""
    ckpt, metrics = str(tmp_path / "ck"), tmp_path / "m.jsonl"
    assert run_main(*pretrain_args(dataset, metrics, "--train-iters", "2", "--save", ckpt)).returncode == 0
    calls = []
    for module, name in ((megatron, "is_megatron_dir"), (hf_io, "is_hf_dir"), (tf_io, "is_tf_dir"),
                         (start_mod, "detect_source")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda path, _real=real, _name=name: calls.append(_name) or _real(path))
    with caplog.at_level(logging.INFO, logger="megabert"):
        r = run_main(*pretrain_args(dataset, metrics, "--train-iters", "3", "--load", ckpt, "--save", ckpt))
    assert r.returncode == 0, r.stderr
    assert sorted(calls) == ["detect_source", "is_hf_dir", "is_megatron_dir", "is_tf_dir"], calls
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("start: ")]
    assert lines == [f"start: --load {ckpt} (megabert; resuming its iteration, optimizer and data position)"]


def test_a_wrong_load_stops_before_the_data_is_built(dataset, tmp_path):
    args = pretrain_args(dataset, tmp_path / "m.jsonl", "--load", str(tmp_path / "nothing"))
    one_line_error(run_main(*args), f"--load {tmp_path / 'nothing'} does not exist")
