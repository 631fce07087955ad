"""Google TensorFlow BERT checkpoints, read without TensorFlow: the tensors equal a Hugging
Face twin written from the same numbers (tests/fixtures/make_tf_bert_checkpoint.py), the
model loaded from them gives the twin's logits at TP 1 and 2 (ours and transformers'), and a
damaged file is a one-line error that names it."""
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import megabert
from megabert.checkpoint import hf as hf_io
from megabert.checkpoint import tf as tf_io
from megabert.checkpoint import tf_bundle
from megabert.checkpoint.layout import resolve_checkpoint_dir, saved_layout
from megabert.checkpoint.reader import read_full
from megabert.errors import CheckpointError

from tests.helpers.cli_utils import run_main
from tests.helpers.dist_utils import run_distributed


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
PRETRAINING = os.path.join(FIXTURES, "tf_bert_tiny")
SQUAD = os.path.join(FIXTURES, "tf_bert_tiny_squad")
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "attention_backend": "torch"}


def twin(path):
    return load_file(os.path.join(path, "hf", "model.safetensors"))


def batch():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 86, (3, 12), generator=gen)
    tt = torch.zeros_like(ids)
    tt[:, 6:] = 1
    am = torch.ones_like(ids)
    am[1, 8:] = 0
    return ids, tt, am


def close(a, b, what, atol=1e-5):
    assert a.shape == b.shape, (what, tuple(a.shape), tuple(b.shape))
    diff = (a - b).abs().max().item()
    assert diff <= atol, f"{what}: max diff {diff}"


# ---------------------------------------------------------------- the reader

@pytest.mark.parametrize("path", [PRETRAINING, SQUAD])
def test_tensors_equal_the_hf_twin(path):
    config, state = tf_io.read_tf_as_hf(path)
    expected = twin(path)
    assert set(expected) <= set(state)
    # The TF SQuAD model keeps the pooler it was initialised with; BertForQuestionAnswering has none.
    assert set(state) - set(expected) <= {"bert.pooler.dense.weight", "bert.pooler.dense.bias"}
    for name, t in expected.items():
        assert state[name].dtype == torch.float32 and torch.equal(state[name], t), name
    assert config["architectures"] == (["BertForPreTraining"] if path == PRETRAINING else ["BertForQuestionAnswering"])
    assert hf_io.model_config_from_hf(config).num_layers == 2


def test_raw_variables_keep_tf_names_slots_and_step():
    variables = tf_io.read_tf_variables(PRETRAINING)
    assert variables["global_step"].dtype == torch.int64 and variables["global_step"].item() == 1000
    kernel = "bert/encoder/layer_1/intermediate/dense/kernel"
    assert tuple(variables[kernel].shape) == (32, 64)  # [in, out]: TF's orientation, as stored
    assert torch.allclose(variables[kernel + "/adam_m"], variables[kernel] * 0.01)
    assert torch.equal(variables[kernel].t(), twin(PRETRAINING)["bert.encoder.layer.1.intermediate.dense.weight"])
    only = tf_io.read_tf_variables(PRETRAINING, ["global_step"])
    assert list(only) == ["global_step"]


def test_dir_detection_and_prefix_resolution(tmp_path):
    assert tf_io.is_tf_dir(PRETRAINING) and tf_io.is_tf_dir(SQUAD)  # bert_model.ckpt; the `checkpoint` file
    assert tf_io.is_tf_dir(os.path.join(PRETRAINING, "bert_model.ckpt"))  # a prefix, as --init_checkpoint
    assert not tf_io.is_tf_dir(os.path.join(PRETRAINING, "hf")) and not hf_io.is_hf_dir(PRETRAINING)
    assert not tf_io.is_tf_dir(str(tmp_path / "nothing"))
    assert tf_io.hf_name("bert/encoder/layer_11/attention/output/LayerNorm/gamma") == \
        ("bert.encoder.layer.11.attention.output.LayerNorm.weight", False)
    assert tf_io.hf_name("cls/predictions/transform/dense/kernel") == ("cls.predictions.transform.dense.weight", True)
    for skipped in ("global_step", "bert/pooler/dense/kernel/adam_v", "cls/predictions/output_bias/adam_m",
                    "bert/encoder/layer_0/output/dense/kernel/ExponentialMovingAverage"):
        assert tf_io.hf_name(skipped) is None, skipped


# ---------------------------------------------------------------- damaged files

def copy_fixture(tmp_path):
    dst = tmp_path / "tf"
    shutil.copytree(PRETRAINING, dst, ignore=shutil.ignore_patterns("hf"))
    return dst


def test_truncated_index_is_a_clear_error(tmp_path):
    d = copy_fixture(tmp_path)
    index = d / "bert_model.ckpt.index"
    index.write_bytes(index.read_bytes()[:2000])
    with pytest.raises(CheckpointError, match=r"bert_model\.ckpt\.index is not a TensorFlow checkpoint index "
                                              r"\(no table footer: truncated"):
        tf_io.read_tf_as_hf(str(d))


def test_corrupt_index_is_a_clear_error(tmp_path):
    d = copy_fixture(tmp_path)
    index = d / "bert_model.ckpt.index"
    data = bytearray(index.read_bytes())
    data[100] ^= 0xFF
    index.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"bert_model\.ckpt\.index is corrupt \(block checksum mismatch"):
        tf_io.read_tf_as_hf(str(d))


def test_truncated_or_missing_data_is_a_clear_error(tmp_path):
    d = copy_fixture(tmp_path)
    data = d / "bert_model.ckpt.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:50_000])
    with pytest.raises(CheckpointError, match=r"data-00000-of-00001 is truncated: .* copy the checkpoint again"):
        tf_io.read_tf_as_hf(str(d))
    data.unlink()
    with pytest.raises(CheckpointError, match=r"data-00000-of-00001 is missing"):
        tf_io.read_tf_variables(str(d))


def test_unsupported_dtype_and_missing_config_are_clear_errors(tmp_path):
    entry = tf_bundle.BundleEntry(name="vocab_table", dtype=7, shape=(3,), shard_id=0, offset=0, size=9,
                                  sliced=False)
    with pytest.raises(CheckpointError, match=r"ckpt\.index: vocab_table has dtype string, which megabert "
                                              r"does not read"):
        tf_bundle.read_tensors(str(tmp_path / "ckpt"), 1, [entry])
    d = copy_fixture(tmp_path)
    (d / "bert_config.json").unlink()
    with pytest.raises(CheckpointError, match=r"bert_config\.json is missing"):
        tf_io.read_tf_as_hf(str(d))
    with pytest.raises(CheckpointError, match=r"holds no TensorFlow checkpoint"):
        tf_io.read_tf_as_hf(str(tmp_path))


# ---------------------------------------------------------------- the model

def _model_from_tf(cls, path, ps):
    """The path users take: from_pretrained (and --load) on the TF directory itself."""
    return cls.from_pretrained(path, ps, **NO_DROPOUT).eval()


def _check_pretraining_logits(rank, world):
    import transformers

    ps = megabert.init_parallel(tensor_parallel_size=world)
    ours = _model_from_tf(megabert.BertForPreTraining, PRETRAINING, ps)
    ref = megabert.BertForPreTraining.from_pretrained(os.path.join(PRETRAINING, "hf"), ps, **NO_DROPOUT).eval()
    hf = transformers.BertForPreTraining.from_pretrained(os.path.join(PRETRAINING, "hf"), attn_implementation="eager")
    ids, tt, am = batch()
    with torch.no_grad():
        out = ours(ids, token_type_ids=tt, attention_mask=am)
        expected = ref(ids, token_type_ids=tt, attention_mask=am)
        theirs = hf(input_ids=ids, token_type_ids=tt, attention_mask=am)
    assert out.mlm_logits.shape == (3, 12, 86)
    close(out.mlm_logits, expected.mlm_logits, "mlm logits vs megabert from the HF twin")
    close(out.nsp_logits, expected.nsp_logits, "nsp logits vs megabert from the HF twin")
    close(out.mlm_logits, theirs.prediction_logits, "mlm logits vs transformers")
    close(out.nsp_logits, theirs.seq_relationship_logits, "nsp logits vs transformers")


def _check_squad_logits(rank, world):
    import transformers

    ps = megabert.init_parallel(tensor_parallel_size=world)
    ours = _model_from_tf(megabert.BertForQuestionAnswering, SQUAD, ps)
    hf = transformers.BertForQuestionAnswering.from_pretrained(os.path.join(SQUAD, "hf"), attn_implementation="eager")
    ids, tt, am = batch()
    with torch.no_grad():
        out = ours(ids, token_type_ids=tt, attention_mask=am)
        theirs = hf(input_ids=ids, token_type_ids=tt, attention_mask=am)
    close(out.start_logits, theirs.start_logits, "start logits")
    close(out.end_logits, theirs.end_logits, "end logits")


@pytest.mark.parametrize("world", [1, 2])
def test_pretraining_logits_equal_hf_twin(world):
    pytest.importorskip("transformers")
    run_distributed(_check_pretraining_logits, world)


def test_squad_logits_equal_transformers_at_tp2():
    pytest.importorskip("transformers")
    run_distributed(_check_squad_logits, 2)


# ---------------------------------------------------------------- convert_hf.py import --tf-checkpoint

def convert(*args):
    return run_main("tools/checkpoint/convert_hf.py", *map(str, args))


def test_convert_tf_checkpoint_at_tp2_then_export_gives_the_twin(tmp_path):
    r = convert("import", "--tf-checkpoint", PRETRAINING, "--output", tmp_path / "ckpt",
                "--tensor-model-parallel-size", 2)
    assert r.returncode == 0, r.stderr
    assert os.path.isfile(tmp_path / "ckpt" / "release" / "mp_rank_01" / "model_optim_rng.pt")
    assert (tmp_path / "ckpt" / "vocab.txt").read_text() == open(os.path.join(PRETRAINING, "vocab.txt")).read()
    assert saved_layout(resolve_checkpoint_dir(str(tmp_path / "ckpt"))).tp_size == 2
    full, meta, _ = read_full(str(tmp_path / "ckpt"))
    assert meta["model_class"] == "BertForPreTraining"
    r = convert("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    exported, expected = load_file(str(tmp_path / "out" / "model.safetensors")), twin(PRETRAINING)
    assert set(exported) == set(expected)
    for name, t in expected.items():
        assert torch.equal(exported[name], t), name


def test_convert_tf_squad_checkpoint_prefix(tmp_path):
    r = convert("import", "--tf-checkpoint", os.path.join(SQUAD, "model.ckpt-2"), "--output", tmp_path / "ckpt",
                "--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2)
    assert r.returncode == 0, r.stderr
    full, meta, _ = read_full(str(tmp_path / "ckpt"))
    assert meta["model_class"] == "BertForQuestionAnswering"
    assert torch.equal(full["qa_outputs.weight"], twin(SQUAD)["qa_outputs.weight"])
    assert (tmp_path / "ckpt" / "vocab.txt").is_file()


def test_convert_source_flags_are_exclusive_and_checked(tmp_path):
    r = convert("import", "--tf-checkpoint", PRETRAINING, "--hf-dir", PRETRAINING, "--output", tmp_path / "c")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr
    r = convert("import", "--tf-checkpoint", tmp_path, "--output", tmp_path / "c")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"error: --tf-checkpoint {tmp_path} is not a Google BERT directory " \
                               f"(bert_config.json + bert_model.ckpt.index/.data-*) or checkpoint prefix"


def test_external_reads_hf_and_tf_dirs_alike(tmp_path):
    from megabert.checkpoint import external
    from megabert.checkpoint.start import Format, detect_source

    for path in (PRETRAINING, os.path.join(PRETRAINING, "bert_model.ckpt"), os.path.join(PRETRAINING, "hf")):
        source = detect_source(path)
        assert source is not None and source.external and source.weights_only, path
        assert source.format is (Format.HF if path.endswith("hf") else Format.TF)
        config, state = external.read_external(source)
        assert config["hidden_size"] == 32
        assert torch.equal(state["cls.predictions.bias"], twin(PRETRAINING)["cls.predictions.bias"])
    vocab = lambda path: external.external_vocab_file(detect_source(path))  # noqa: E731
    assert vocab(PRETRAINING) == os.path.join(PRETRAINING, "vocab.txt")
    assert vocab(os.path.join(SQUAD, "model.ckpt-2")) == os.path.join(SQUAD, "vocab.txt")
    assert vocab(os.path.join(PRETRAINING, "hf")) is None  # the twin ships none
    assert detect_source(str(tmp_path)) is None


def test_state_file_with_the_training_machines_path(tmp_path):
    """run_squad.py on a TPU records gs://... (or /home/...) paths in `checkpoint`; a copied
    directory is still found by base name."""
    d = tmp_path / "squad_out"
    shutil.copytree(SQUAD, d, ignore=shutil.ignore_patterns("hf"))
    (d / "checkpoint").write_text('model_checkpoint_path: "gs://bucket/squad_out/model.ckpt-2"\n')
    assert tf_io.is_tf_dir(str(d))
    assert torch.equal(tf_io.read_tf_as_hf(str(d))[1]["qa_outputs.bias"], twin(SQUAD)["qa_outputs.bias"])
    shutil.copy(d / "model.ckpt-2.index", d / "model.ckpt-1.index")
    (d / "checkpoint").unlink()
    with pytest.raises(CheckpointError, match=r"holds several TensorFlow checkpoints \(model.ckpt-1, model.ckpt-2\) "
                                              r"and no 'checkpoint' file naming the latest; pass the prefix"):
        tf_io.read_tf_as_hf(str(d))
