"""Megatron-LM BERT checkpoints read by megabert give megatron-core's own logits.

The fixtures (tests/fixtures/megatron, made by make_megatron_fixtures.py with megatron-core's
BertModel and its own save code) hold megatron-core `torch` and `torch_dist` checkpoints at
TP 1 and 2 and megatron-core's MLM and binary-head logits on fixed inputs. Legacy-format
files (naming eras A/B/C, QKV checkpoint_version 0/1.0/2.0/3.0, PP 2) are built from them
by tests/helpers/megatron_files.py (megatron-core's pip package no longer has the legacy model).
Logits are compared at real tokens (megatron-core's b1ss mask also masks padded queries).
"""
import importlib.abc
import importlib.util
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

import megabert
from megabert.checkpoint.megatron import checkpoint_format, read_header
from megabert.checkpoint.megatron.safe_load import safe_torch_load
from megabert.checkpoint.reader import read_rank
from megabert.parallel.layout import StageLayout
from megabert.errors import CheckpointError, RefusedFileError
from tests.helpers import cli_utils
from tests.helpers.dist_utils import run_distributed
from tests.helpers.glue_files import write
from tests.helpers.megatron_files import FIXTURES, reference, write_megatron_dir
from tests.helpers.pretrain_runs import pretrain_args, rows, run_main

TOL = 1e-5


def _max_diffs(model, tp_saved: int) -> tuple[float, float]:
    ref = reference(tp_saved)
    with torch.no_grad():
        out = model(ref["input_ids"], token_type_ids=ref["token_type_ids"], attention_mask=ref["attention_mask"])
    real = ref["attention_mask"].bool()
    assert out.mlm_logits.shape == ref["mlm_logits"].shape  # the vocab padding is cut
    return ((out.mlm_logits - ref["mlm_logits"])[real].abs().max().item(),
            (out.nsp_logits - ref["binary_logits"]).abs().max().item())


def _load(path, ps=None, **kw):
    return megabert.BertForPreTraining.from_pretrained(path, ps, attention_backend="torch", **kw).eval()


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
@pytest.mark.parametrize("saved_tp", [1, 2])
def test_megatron_core_checkpoint_gives_its_logits(fmt, saved_tp):
    path = os.path.join(FIXTURES, f"tp{saved_tp}_{fmt}")
    assert checkpoint_format(path) == fmt
    model = _load(path)
    cfg = model.config
    assert (cfg.layernorm_position, cfg.embedding_layernorm, cfg.layernorm_epsilon, cfg.vocab_size) == \
        ("pre", False, 1e-5, 200)
    mlm, nsp = _max_diffs(model, saved_tp)
    assert mlm < TOL and nsp < TOL, (mlm, nsp)


def _read_at_tp2(rank, world):
    ps = megabert.init_parallel(tensor_parallel_size=2)
    for saved_tp in (1, 2):
        for fmt in ("torch", "torch_dist"):
            mlm, nsp = _max_diffs(_load(os.path.join(FIXTURES, f"tp{saved_tp}_{fmt}"), ps), saved_tp)
            assert mlm < TOL and nsp < TOL, (fmt, saved_tp, mlm, nsp)


def test_megatron_core_checkpoints_at_megabert_tp2():
    run_distributed(_read_at_tp2, 2)


def test_megatron_checkpoint_at_megabert_pp2(tmp_path):
    """Each pipeline stage takes its layers (and the last stage its copy of the tied word
    embeddings) from a Megatron TP-2 x PP-2 legacy directory: equal to the same tensors read at PP 1."""
    path = write_megatron_dir(str(tmp_path / "m"), 2, era="B", version=2.0, pp=2)
    whole = _load(path).state_dict()
    torch.save(whole, tmp_path / "whole.pt")
    run_distributed(_compare_stage, 2, path, str(tmp_path / "whole.pt"))


def _compare_stage(rank, world, path, whole_file):
    ps = megabert.init_parallel(1, 2)
    whole = torch.load(whole_file, weights_only=True)
    local = _load(path, ps).state_dict()
    expected = {"bert.encoder.layers.0.attention.qkv.weight"} if ps.pp_rank == 0 else \
        {"bert.encoder.layers.1.attention.qkv.weight", "lm_head.bias", "bert.embeddings.word_embeddings.weight"}
    assert expected <= set(local), sorted(local)
    for name, t in local.items():
        assert torch.equal(t, whole[name]), name


@pytest.mark.parametrize("era,version,saved_tp,pp", [
    ("A", 0.0, 2, 1), ("A", 1.0, 2, 2), ("B", 2.0, 1, 2), ("B", 0.0, 1, 1), ("C", 3.0, 2, 1), (None, 3.0, 2, 2)])
def test_legacy_eras_and_qkv_versions(tmp_path, era, version, saved_tp, pp):
    path = write_megatron_dir(str(tmp_path / "m"), saved_tp, era=era, version=version, pp=pp)
    mlm, nsp = _max_diffs(_load(path), saved_tp)
    assert mlm < TOL and nsp < TOL, (mlm, nsp)


def test_qkv_read_in_the_wrong_order_is_caught(tmp_path):
    """Version-0 rows labelled 2.0: read as 2.0, the heads mix and the logits move."""
    path = write_megatron_dir(str(tmp_path / "m"), 2, era="B", version=0.0)
    for rank in ("mp_rank_00", "mp_rank_01"):
        f = tmp_path / "m" / "iter_0000010" / rank / "model_optim_rng.pt"
        payload = torch.load(f, weights_only=False)  # our own file, written above
        payload["checkpoint_version"] = 2.0
        torch.save(payload, f)
    mlm, _ = _max_diffs(_load(path), 2)
    assert mlm > 1e-2


class _BlockMegatron(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "megatron" or name.startswith("megatron."):
            raise ImportError(f"test: importing {name} is blocked")
        return None


def test_loading_never_imports_megatron(tmp_path, monkeypatch):
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_BlockMegatron()] + sys.meta_path)
    legacy = write_megatron_dir(str(tmp_path / "legacy"), 2, era="A", version=0.0, pp=2)
    for path, saved_tp in ((os.path.join(FIXTURES, "tp2_torch"), 2), (os.path.join(FIXTURES, "tp2_torch_dist"), 2),
                           (legacy, 2)):
        header = read_header(path)
        assert header["iteration"] == 10 and header["args"]["hidden_size"] == 32
        mlm, nsp = _max_diffs(_load(path), saved_tp)
        assert mlm < TOL and nsp < TOL
    # megatron-core's enum in args came back as its value, through a stub, not the class
    assert read_header(os.path.join(FIXTURES, "tp1_torch"))["args"]["attention_backend"] == 4
    assert not [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_cannot_run_code(tmp_path):
    marker = tmp_path / "ran"
    path = write_megatron_dir(str(tmp_path / "m"), 1)
    f = tmp_path / "m" / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    payload = torch.load(f, weights_only=False)  # our own file, written above
    payload["args"] = _Evil(str(marker))
    torch.save(payload, f)
    with pytest.raises(RefusedFileError, match="it names posix.system"):  # tests/test_hostile_checkpoints.py: all
        _load(path)
    assert not marker.exists()


def test_flags_that_disagree_with_the_checkpoint_are_one_line(tmp_path):
    with pytest.raises(CheckpointError) as e:
        _load(os.path.join(FIXTURES, "tp1_torch_dist"), num_layers=3)
    assert "--num-layers 3" in str(e.value) and "num_layers=2" in str(e.value) and "\n" not in str(e.value)


def test_without_args_the_shapes_and_flags_give_the_config(tmp_path):
    path = write_megatron_dir(str(tmp_path / "m"), 2, args=False)
    with pytest.raises(CheckpointError, match="--num-attention-heads"):
        _load(path)
    model = _load(path, num_attention_heads=4, vocab_size=200)
    assert (model.config.num_layers, model.config.hidden_size, model.config.ffn_hidden_size) == (2, 32, 128)
    mlm, nsp = _max_diffs(model, 2)
    assert mlm < TOL and nsp < TOL


# ---------------------------------------------------------------- entry scripts

MEGATRON_ARCH = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
                 "--max-position-embeddings", "32", "--layernorm-position", "pre", "--no-embedding-layernorm",
                 "--layernorm-epsilon", "1e-5"]


def _pretrain(dataset, metrics, *extra):
    return run_main(*pretrain_args(dataset, metrics, *MEGATRON_ARCH, *extra))  # later flags win


def test_pretrain_continues_a_megatron_run_or_finetunes_from_it(dataset, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="megabert")
    load = os.path.join(FIXTURES, "tp2_torch")
    r = _pretrain(dataset, tmp_path / "go_on.jsonl", "--load", load, "--save", str(tmp_path / "s1"),
                  "--train-iters", "12")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "optimizer state not continued: " in caplog.text and "holds no optimizer state" in caplog.text
    assert [x["iteration"] for x in rows(tmp_path / "go_on.jsonl") if "lm_loss" in x] == [11, 12]
    r = _pretrain(dataset, tmp_path / "new.jsonl", "--load", load, "--finetune", "--train-iters", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["iteration"] for x in rows(tmp_path / "new.jsonl") if "lm_loss" in x] == [1, 2]
    r = _pretrain(dataset, tmp_path / "bad.jsonl", "--load", load, "--layernorm-position", "post")
    assert r.returncode != 0
    assert "--layernorm-position pre --no-embedding-layernorm" in r.stderr.strip().splitlines()[-1]


def test_pretrain_continues_megatron_adam_moments_or_says_why_not(dataset, tmp_path, caplog):
    """megatron-core's checkpoint with its optimizer state (tests/test_megatron_optimizer.py checks
    the step itself): continued by pretrain_bert.py --load (here into megabert's distributed
    optimizer, which takes the same by-name state), or not, with one line saying why."""
    caplog.set_level(logging.INFO, logger="megabert")
    load = os.path.join(FIXTURES, "optim", "tp2_fp32_torch_dist")
    r = _pretrain(dataset, tmp_path / "on.jsonl", "--load", load, "--train-iters", "3", "--adam-beta2", "0.98",
                  "--adam-eps", "1e-8", "--save", str(tmp_path / "on"), "--use-distributed-optimizer")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Adam moments continued (optimizer step 2)" in caplog.text
    assert [x["iteration"] for x in rows(tmp_path / "on.jsonl") if "lm_loss" in x] == [3]
    caplog.clear()
    r = _pretrain(dataset, tmp_path / "off.jsonl", "--load", load, "--train-iters", "3", "--optimizer", "lamb",
                  "--save", str(tmp_path / "off"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "optimizer state not restored (--optimizer lamb here: Megatron's Adam moments are not lamb's state)" \
        in caplog.text
    assert "Adam moments continued" not in caplog.text
    caplog.clear()
    r = _pretrain(dataset, tmp_path / "no.jsonl", "--load", load, "--train-iters", "3", "--no-load-optim")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "optimizer state not restored (--no-load-optim)" in caplog.text
    assert [x["iteration"] for x in rows(tmp_path / "no.jsonl") if "lm_loss" in x] == [3]
    # Back to Megatron: the continued run's moments (step 3) round-trip through an export at another
    # TP; the LAMB run's state is not Adam's and stays behind, said in one line.
    r = _convert("export", "--load", tmp_path / "on", "--megatron-dir", tmp_path / "m", "--format", "torch",
                 "--tensor-model-parallel-size", 2)
    assert "optimizer state: Adam moments at step 3" in r.stdout
    written = safe_torch_load(str(tmp_path / "m" / "release" / "mp_rank_01" / "model_optim_rng.pt"))["model"]
    own = safe_torch_load(os.path.join(FIXTURES, "optim", "tp2_fp32_torch", "iter_0000002", "mp_rank_01",
                                       "model_optim_rng.pt"))["model"]  # megatron-core's own file
    assert list(written) == list(own)  # megatron-core's key order: its optimizer's positions follow it
    whole = read_rank(str(tmp_path / "on"), tp_rank=0, tp_size=1, stage=StageLayout(2)).payload["optimizer"]["state"]
    back = read_rank(str(tmp_path / "m"), tp_rank=0, tp_size=1, stage=StageLayout(2),
                     padded_vocab_size=256).payload["optimizer"]["state"]
    assert set(back) == set(whole)
    for name, s in back.items():
        assert float(s["step"]) == 3.0
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(s[m], whole[name][m]), (name, m)
    r = _convert("export", "--load", tmp_path / "off", "--megatron-dir", tmp_path / "m2", "--format", "torch_dist")
    assert "optimizer state: none (the run trained with LAMB" in r.stdout


def test_finetune_glue_from_a_torch_dist_dir(tmp_path):
    """An SST-2-format task fine-tuned from megatron-core's torch_dist directory as it ships."""
    words = [f"w{i}" for i in range(40)]
    vocab_file = tmp_path / "vocab.txt"
    vocab_file.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n")
    data = tmp_path / "SST-2"
    data.mkdir()
    for name, n in (("train.tsv", 16), ("dev.tsv", 8)):
        write(data / name, ["sentence\tlabel"] + [f"{' '.join(words[(i * 7 + j) % 40] for j in range(5))}\t{i % 2}"
                                                  for i in range(n)])
    r = cli_utils.run_main("finetune_glue.py", "--task-name", "sst-2", "--data-dir", str(data), "--load",
                           os.path.join(FIXTURES, "tp2_torch_dist"), "--vocab-file", str(vocab_file), "--output-dir",
                           str(tmp_path / "out"), "--max-seq-length", "32", "--micro-batch-size", "8",
                           "--train-iters", "2", "--no-do-predict")
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.load(open(tmp_path / "out" / "eval_results.json"))
    assert results["eval_samples"] == 8 and 0 <= results["eval_accuracy"] <= 1


# ---------------------------------------------------------------- convert_megatron.py import / export

def _convert(*args):
    r = cli_utils.run_main("tools/checkpoint/convert_megatron.py", *[str(a) for a in args])
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """megatron-core's TP-2 torch checkpoint imported into megabert at TP 2 x PP 2."""
    out = tmp_path_factory.mktemp("imported") / "ckpt"
    _convert("import", "--megatron-dir", os.path.join(FIXTURES, "tp2_torch"), "--output", out,
             "--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2)
    return str(out)


@pytest.mark.parametrize("fmt,extra", [("torch", ["--legacy", "--pipeline-model-parallel-size", 2]),
                                       ("torch", ["--tensor-model-parallel-size", 2]),
                                       ("torch_dist", ["--tensor-model-parallel-size", 2])])
def test_export_reads_back(imported, tmp_path, fmt, extra):
    _convert("export", "--load", imported, "--megatron-dir", tmp_path / "m", "--format", fmt, *extra)
    assert (tmp_path / "m" / "latest_checkpointed_iteration.txt").read_text() == "release"
    header = read_header(str(tmp_path / "m"))
    assert header["format"] == fmt and header["checkpoint_version"] == 3.0
    assert header["shapes"]["embedding.word_embeddings.weight"] == (256, 32)  # padded as Megatron pads
    mlm, nsp = _max_diffs(_load(str(tmp_path / "m")), 2)
    assert mlm < TOL and nsp < TOL, (mlm, nsp)


def test_megatron_torch_tp1_becomes_another_layout_directly(tmp_path):
    """export --load of a Megatron directory: one Megatron format and layout into another."""
    _convert("export", "--load", os.path.join(FIXTURES, "tp1_torch"), "--megatron-dir", tmp_path / "m",
             "--format", "torch", "--tensor-model-parallel-size", 2, "--pipeline-model-parallel-size", 2)
    assert sorted(os.listdir(tmp_path / "m" / "release")) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000",
                                                               "mp_rank_01_001"]
    mlm, nsp = _max_diffs(_load(str(tmp_path / "m")), 1)
    assert mlm < TOL and nsp < TOL, (mlm, nsp)


def test_export_loads_into_megatron_core(imported, tmp_path):
    """megatron-core's own loaders (load_state_dict of each rank file; dist_checkpointing.load) at TP 2."""
    if importlib.util.find_spec("megatron") is None:  # not imported here: megatron-core runs in its own process
        pytest.skip("megatron-core is not installed (the test extra)")
    dirs = []
    for fmt in ("torch", "torch_dist"):
        dirs.append(str(tmp_path / fmt))
        _convert("export", "--load", imported, "--megatron-dir", dirs[-1], "--format", fmt,
                 "--tensor-model-parallel-size", 2)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "tests.helpers.megatron_core", "logits", "2", str(tmp_path / "l.pt"),
                        *dirs], cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = reference(2)
    real = ref["attention_mask"].bool()
    for path, out in torch.load(tmp_path / "l.pt", weights_only=True).items():
        assert (out["mlm_logits"] - ref["mlm_logits"])[real].abs().max() < TOL, path
        assert (out["binary_logits"] - ref["binary_logits"]).abs().max() < TOL, path


def test_legacy_export_in_transformers_megatron_bert(imported, tmp_path):
    """The legacy (`--legacy`) export, mapped as transformers' convert_megatron_bert_checkpoint.py
    maps a checkpoint_version-3.0 file (transformers 5 no longer ships that script, so its
    documented mapping is applied here: QKV rows [heads, 3, hn] split into query/key/value,
    `input_layernorm` -> `attention.ln`, `post_attention_layernorm` -> `ln`, `final_layernorm`
    -> `encoder.ln`, `lm_head` -> `cls.predictions`), gives megatron-core's logits in
    transformers' MegatronBertForPreTraining: an architecture check by a third party."""
    transformers = pytest.importorskip("transformers")
    from megabert.checkpoint.megatron.safe_load import foreign_to_plain

    _convert("export", "--load", imported, "--megatron-dir", tmp_path / "m", "--format", "torch", "--legacy")
    payload = safe_torch_load(str(tmp_path / "m" / "release" / "mp_rank_00" / "model_optim_rng.pt"), mmap=False)
    args, model = foreign_to_plain(payload["args"]), payload["model"]
    assert payload["checkpoint_version"] == 3.0
    lm, enc = model["language_model"], model["language_model"]["encoder"]
    vocab, heads, h = args["vocab_size"], args["num_attention_heads"], args["hidden_size"]
    hf = {"bert.embeddings.word_embeddings.weight": lm["embedding"]["word_embeddings"]["weight"][:vocab],
          "bert.embeddings.position_embeddings.weight": lm["embedding"]["position_embeddings"]["weight"],
          "bert.embeddings.token_type_embeddings.weight": lm["embedding"]["tokentype_embeddings"]["weight"],
          "bert.pooler.dense.weight": lm["pooler"]["dense.weight"],
          "bert.pooler.dense.bias": lm["pooler"]["dense.bias"],
          "cls.predictions.transform.dense.weight": model["lm_head"]["dense.weight"],
          "cls.predictions.transform.dense.bias": model["lm_head"]["dense.bias"],
          "cls.predictions.transform.LayerNorm.weight": model["lm_head"]["layernorm.weight"],
          "cls.predictions.transform.LayerNorm.bias": model["lm_head"]["layernorm.bias"],
          "cls.predictions.bias": model["lm_head"]["bias"][:vocab],
          "cls.seq_relationship.weight": model["binary_head"]["weight"],
          "cls.seq_relationship.bias": model["binary_head"]["bias"]}
    names_map = {"input_layernorm": "attention.ln", "post_attention_layernorm": "ln",
                 "self_attention.dense": "attention.output.dense", "mlp.dense_h_to_4h": "intermediate.dense",
                 "mlp.dense_4h_to_h": "output.dense"}
    for key, t in enc.items():
        if key.startswith("final_layernorm."):
            hf[f"bert.encoder.ln.{key.split('.')[-1]}"] = t
            continue
        _, i, rest = key.split(".", 2)
        op, kind = rest.rsplit(".", 1)
        if op == "self_attention.query_key_value":
            rows = t.reshape(heads, 3, h // heads, *t.shape[1:])
            for j, part in enumerate(("query", "key", "value")):
                hf[f"bert.encoder.layer.{i}.attention.self.{part}.{kind}"] = rows[:, j].reshape(h, *t.shape[1:])
        else:
            hf[f"bert.encoder.layer.{i}.{names_map[op]}.{kind}"] = t
    config = transformers.MegatronBertConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=args["num_layers"],
                                             num_attention_heads=heads, intermediate_size=args["ffn_hidden_size"],
                                             max_position_embeddings=args["max_position_embeddings"],
                                             layer_norm_eps=args["layernorm_epsilon"], hidden_dropout_prob=0.0,
                                             attention_probs_dropout_prob=0.0)
    model_hf = transformers.MegatronBertForPreTraining(config).eval()
    missing, unexpected = model_hf.load_state_dict(hf, strict=False)
    assert not unexpected and all("decoder" in k or "position_ids" in k for k in missing), missing
    ref = reference(2)
    with torch.no_grad():
        out = model_hf(input_ids=ref["input_ids"], token_type_ids=ref["token_type_ids"],
                       attention_mask=ref["attention_mask"])
    real = ref["attention_mask"].bool()
    assert (out.prediction_logits - ref["mlm_logits"])[real].abs().max() < TOL
    assert (out.seq_relationship_logits - ref["binary_logits"]).abs().max() < TOL


def test_task_models_take_the_encoder():
    """SQuAD's and GLUE's models from a Megatron directory: the encoder as pre-trained, a new head."""
    path = os.path.join(FIXTURES, "tp2_torch_dist")
    pretrained = _load(path).state_dict()
    for cls, kw in ((megabert.BertForQuestionAnswering, {}), (megabert.BertForSequenceClassification, {"num_labels": 3})):
        model = cls.from_pretrained(path, **kw)
        encoder = {k: v for k, v in model.state_dict().items() if k.startswith("bert.encoder.")}
        assert encoder and all(torch.equal(v, pretrained[k]) for k, v in encoder.items())
