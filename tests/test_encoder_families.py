"""The families beyond BERT and ModernBERT (EuroBERT, GTE, NomicBERT, UltraBERT) equal transformers' masked
LM loaded from the same directory: logits, loss and every parameter gradient (fp32), eager and
sdpa references, padded and unpadded encoders, at TP 1, TP 2 (grouped key/value heads split,
and replicated when TP exceeds them) and PP 2; a wrong GQA split, a wrong order of the GLU
halves or a wrong RoPE base is caught; convert_hf import/export round-trips."""
import json
import pathlib
import tempfile

import pytest
from safetensors.torch import load_file
import torch

import megabert
from megabert.checkpoint.hf import megabert_to_hf
from megabert.model.pretrained import gather_full
from megabert.parallel.param_spec import spec_table
from megabert.training.grads import sync_sequence_parallel_grads

from tests.helpers.dist_utils import run_distributed
from tests.helpers.family_models import family_config, make_family_dir
from tests.helpers.modernbert_models import modernbert_batch as family_batch
from tests.helpers.hf_models import close

transformers = pytest.importorskip("transformers")


FAMILIES = ["eurobert", "gte", "nomic_bert", "ultrabert"]


@pytest.fixture(scope="module", params=FAMILIES)
def hf_dir(request, tmp_path_factory):
    return make_family_dir(tmp_path_factory.mktemp(request.param) / "hf", request.param)


@pytest.fixture(scope="module")
def mqa_dir(tmp_path_factory):
    """One key/value head: at TP 2 it is replicated, each rank reading it for its query heads."""
    return make_family_dir(tmp_path_factory.mktemp("eurobert_mqa") / "hf", "eurobert", num_key_value_heads=1,
                           mlp_bias=True, attention_bias=True)


def _on_disk(hf_dir) -> dict:
    return load_file(str(pathlib.Path(hf_dir) / "model.safetensors"))


def _disk_grads(hf) -> dict:
    """transformers' gradients under the names its checkpoints use on disk: saved through
    save_pretrained (which renames and fuses as it does for the weights: GTE's qkv_proj and
    up_gate_proj, NomicBERT's Wqkv)."""
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.grad)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d, is_main_process=True)
        return _on_disk(d)


def _reference(hf_dir, impl):
    hf = transformers.AutoModelForMaskedLM.from_pretrained(hf_dir, attn_implementation=impl)
    ids, am, labels = family_batch()
    ref = hf(input_ids=ids, attention_mask=am, labels=labels)
    ref.loss.backward()
    return hf, ref


def _check(rank, world, hf_dir, impl, backend, unpad):
    ps = megabert.init_parallel(tensor_parallel_size=world)
    hf, ref = _reference(hf_dir, impl)
    ids, am, labels = family_batch()
    model = megabert.AutoModelForMaskedLM.from_pretrained(hf_dir, ps, attention_backend=backend, unpad_input=unpad)
    out = model(ids, attention_mask=am, labels=labels)
    assert out.logits.shape == (3, ids.size(1), hf.config.vocab_size)
    close(out.logits[am.bool()], ref.logits[am.bool()], "logits")
    close(out.loss, ref.loss, "loss")
    out.loss.backward()
    sync_sequence_parallel_grads(list(model.parameters()), ps)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    table = spec_table(model)
    hf_grads = megabert_to_hf(gather_full(grads, ps, table), table)
    if ps.rank != 0:
        return  # transformers' save_pretrained writes on rank 0 alone; the grads are gathered everywhere
    ref_grads = _disk_grads(hf)
    assert hf_grads.keys() == ref_grads.keys()
    for name, g in hf_grads.items():
        close(g, ref_grads[name], f"grad {name}")


@pytest.mark.parametrize("world,impl,backend,unpad", [
    (1, "eager", "torch", False), (1, "sdpa", "varlen", True), (2, "sdpa", "sdpa", False)])
def test_equals_transformers(hf_dir, world, impl, backend, unpad):
    run_distributed(_check, world, hf_dir, impl, backend, unpad)


def test_replicated_kv_heads_and_biases_equal_transformers(mqa_dir):
    run_distributed(_check, 2, mqa_dir, "eager", "torch", False)


def _check_pp(rank, world, hf_dir):
    from megabert.pipeline_parallel.p2p import PipeComm
    from megabert.pipeline_parallel.schedules import PipelineSchedule
    from megabert.training.strategy import TrainingTask

    ps = megabert.init_parallel(pipeline_model_parallel_size=world)
    _, ref = _reference(hf_dir, "eager")
    ids, am, labels = family_batch()
    model = megabert.AutoModelForMaskedLM.from_pretrained(hf_dir, ps, attention_backend="torch")
    comm = PipeComm(ps, model.activation_shape(ids.size(1), ids.size(0)), torch.float32)
    schedule = PipelineSchedule(model, ps, comm, 1, TrainingTask(inputs=(), output_loss=lambda out: (out.loss, {})))
    logits = schedule.forward_only([dict(input_ids=ids, attention_mask=am)], lambda out: out.logits)
    if ps.is_last_stage:
        close(logits[0][am.bool()], ref.logits[am.bool()], "logits")


def test_pipeline_equals_transformers(hf_dir):
    run_distributed(_check_pp, 2, hf_dir)


def _logits_diff(hf_dir, tamper) -> float:
    """Largest logit difference to transformers after `tamper(state)` edits the weights megabert loads."""
    _, ref = _reference(hf_dir, "eager")
    ids, am, _ = family_batch()
    model = megabert.AutoModelForMaskedLM.from_pretrained(hf_dir, megabert.init_parallel(), attention_backend="torch")
    with torch.no_grad():
        tamper(dict(model.named_parameters()), model)
        out = model(ids, attention_mask=am).logits
    return (out - ref.logits)[am.bool()].abs().max().item()


def _swap_halves(weight: torch.Tensor) -> None:
    a, b = weight.clone().chunk(2, dim=0)
    weight.copy_(torch.cat((b, a)))


@pytest.mark.parametrize("wrong", ["gqa_groups", "glu_halves", "rope_base"])
def test_a_wrong_split_or_base_fails(hf_dir, wrong):
    """The parity above is not luck: key/value heads given to the wrong query group, the GLU's
    gate and up halves swapped, or another RoPE base each move the logits far off."""
    if wrong == "gqa_groups" and not any(f in hf_dir for f in ("eurobert", "ultrabert")):
        pytest.skip("no grouped-query attention")

    def tamper(params, model):
        layer = model.bert.encoder.layers["0"]
        if wrong == "gqa_groups":
            _swap_halves(params["bert.encoder.layers.0.attention.key_value.weight"][: 16])  # K's two heads
        elif wrong == "glu_halves":
            _swap_halves(params["bert.encoder.layers.0.mlp.dense_h_to_4h.weight"])
        else:
            layer.attention.theta = 10000.0

    assert _logits_diff(hf_dir, lambda params, model: None) < 1e-4
    assert _logits_diff(hf_dir, tamper) > 1e-2


def test_convert_import_export_round_trip(hf_dir, tmp_path):
    from tests.helpers.cli_utils import run_main

    r = run_main("tools/checkpoint/convert_hf.py", "import", "--hf-dir", hf_dir, "--output", str(tmp_path / "ck"),
                 "--tensor-model-parallel-size", "2")
    assert r.returncode == 0, r.stderr
    # The export ships the family's tokenizer: a tokenizer.json (any file will do here) or a WordPiece vocab.
    (tmp_path / "ck" / "tokenizer.json").write_text("{}")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    (tmp_path / "ck" / "vocab.txt").write_text("\n".join(specials + [f"w{i}" for i in range(99 - 5)]) + "\n")
    r = run_main("tools/checkpoint/convert_hf.py", "export", "--load", str(tmp_path / "ck"), "--hf-dir",
                 str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    config, original = (json.load(open(d / "config.json")) for d in (tmp_path / "out", pathlib.Path(hf_dir)))
    assert config["model_type"] == original["model_type"] and config["architectures"] == original["architectures"]
    assert _on_disk(str(tmp_path / "out")).keys() == _on_disk(hf_dir).keys()
    a = transformers.AutoModelForMaskedLM.from_pretrained(hf_dir)
    b = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "out"))
    ids, am, _ = family_batch()
    close(b(input_ids=ids, attention_mask=am).logits, a(input_ids=ids, attention_mask=am).logits, "exported logits")


# Every {SequenceClassification,TokenClassification,QuestionAnswering} head transformers 5.x
# defines for the four families (EuroBERT's sequence classifier in each of its poolings).
HEADS = [("gte", "GteForSequenceClassification", {}), ("gte", "GteForTokenClassification", {}),
         ("nomic_bert", "NomicBertForSequenceClassification", {}), ("nomic_bert", "NomicBertForTokenClassification", {}),
         ("eurobert", "EuroBertForTokenClassification", {}),
         ("eurobert", "EuroBertForSequenceClassification", {}),  # classifier_pooling "late", its default
         ("eurobert", "EuroBertForSequenceClassification", {"classifier_pooling": "bos"}),
         ("eurobert", "EuroBertForSequenceClassification", {"classifier_pooling": "mean"}),
         ("ultrabert", "UltrabertForSequenceClassification", {}), ("ultrabert", "UltrabertForTokenClassification", {}),
         ("ultrabert", "UltrabertForQuestionAnswering", {})]


@pytest.mark.parametrize("family,arch,extra", HEADS)
def test_task_heads_equal_transformers(family, arch, extra, tmp_path):
    """Each family's fine-tuning model (the registry's task class: the same classes every family
    uses) loads transformers' task model of that family and gives its logits; convert_hf imports
    it as that task model."""
    from megabert.families import task_class_name
    from megabert.model.registry import MODEL_CLASSES
    from megabert.tasks import model_classes
    from tests.helpers.cli_utils import run_main

    cfg, _ = family_config(family, num_labels=3, **extra)
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(cfg).eval()
    hf.save_pretrained(str(tmp_path / "hf"))
    task = {"SequenceClassification": "sequence_classification", "TokenClassification": "token_classification",
            "QuestionAnswering": "question_answering"}[arch.split("For")[-1]]
    model_classes()
    ids, am, _ = family_batch()
    model = megabert.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "hf"), megabert.init_parallel())
    cls = MODEL_CLASSES[task_class_name(model.config, task)]
    model = cls.from_pretrained(str(tmp_path / "hf"), megabert.init_parallel()).eval()
    out, ref = model(ids, attention_mask=am), hf(input_ids=ids, attention_mask=am)
    if task == "question_answering":
        close(out.start_logits[am.bool()], ref.start_logits[am.bool()], "start logits")
    elif task == "token_classification":
        close(out.logits[am.bool()], ref.logits[am.bool()], "logits")
    else:
        close(out.logits, ref.logits, "logits")
    r = run_main("tools/checkpoint/convert_hf.py", "import", "--hf-dir", str(tmp_path / "hf"), "--output",
                 str(tmp_path / "ck"))
    assert r.returncode == 0, r.stderr
    from megabert.checkpoint.reader import read_full

    assert read_full(str(tmp_path / "ck"))[1]["model_class"] == cls.__name__


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_auto_model_takes_bert_and_modernbert_dirs(family, tmp_path):
    """megabert.AutoModelForMaskedLM reads the family from config.json's model_type for the first
    two families too: transformers' masked LM's logits over the config's vocab."""
    from tests.helpers.modernbert_models import make_modernbert_dir

    if family == "bert":
        cfg = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=64)
        torch.manual_seed(0)
        transformers.BertForMaskedLM(cfg).save_pretrained(str(tmp_path / "hf"))
        hf_dir = str(tmp_path / "hf")
    else:
        hf_dir = make_modernbert_dir(tmp_path / "hf")
    ids, am, _ = family_batch()
    ref = transformers.AutoModelForMaskedLM.from_pretrained(hf_dir).eval()(input_ids=ids, attention_mask=am).logits
    model = megabert.AutoModelForMaskedLM.from_pretrained(hf_dir, megabert.init_parallel()).eval()
    assert model.config.model_family == family
    close(model(ids, attention_mask=am).logits[am.bool()], ref[am.bool()], "logits")
