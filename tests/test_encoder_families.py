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
from tests.helpers.modernbert_models import masked_lm_reference, modernbert_batch as family_batch
from tests.helpers.hf_models import close

transformers = pytest.importorskip("transformers")


FAMILIES = ["eurobert", "gte", "nomic_bert", "ultrabert"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict:
    """Each family's tiny transformers masked LM, saved once for the module."""
    return {f: make_family_dir(tmp_path_factory.mktemp(f) / "hf", f) for f in FAMILIES}


@pytest.fixture(scope="module", params=FAMILIES)
def hf_dir(request, family_dirs):
    return family_dirs[request.param]


def _parity(model, layout: str, what: str, out, ref, show: bool = True) -> None:
    """close(out, ref), printing (`show`) the max-abs-diff for the parity table
    (docs/model-families.md; pytest -s shows it)."""
    if show:
        print(f"PARITY {model.config.model_family} {layout} {what} {(out - ref).abs().max().item():.1e}", flush=True)
    close(out, ref, what)


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


def _outputs(model, ps) -> tuple:
    """(logits, loss, every gradient under transformers' names, gathered over TP) on the batch."""
    ids, am, labels = family_batch()
    out = model(ids, attention_mask=am, labels=labels)
    out.loss.backward()
    sync_sequence_parallel_grads(list(model.parameters()), ps)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    table = spec_table(model)
    return out.logits.detach(), out.loss.detach(), megabert_to_hf(gather_full(grads, ps, table), table)


def _check(rank, world, hf_dir, impl, backend, unpad, sequence_parallel=False, tp1=None):
    """At TP `world`: logits, loss and gradients equal transformers' (and `tp1`'s outputs, given)."""
    ps = megabert.init_parallel(tensor_parallel_size=world)
    hf, ref = masked_lm_reference(hf_dir, impl)
    _, am, _ = family_batch()
    model = megabert.AutoModelForMaskedLM.from_pretrained(hf_dir, ps, attention_backend=backend, unpad_input=unpad,
                                                          sequence_parallel=sequence_parallel)
    logits, loss, hf_grads = _outputs(model, ps)
    assert logits.shape == (3, am.size(1), hf.config.vocab_size)
    layout = f"TP{world}" + (" SP" if sequence_parallel else "") + f" {impl}"
    _parity(model, layout, "logits", logits[am.bool()], ref.logits[am.bool()], show=rank == 0)
    _parity(model, layout, "loss", loss, ref.loss, show=rank == 0)
    if tp1 is not None:
        assert hf_grads.keys() == tp1[2].keys()
        worst = max(hf_grads, key=lambda n: (hf_grads[n] - tp1[2][n]).abs().max().item())
        for what, a, b in (("logits vs TP1", logits[am.bool()], tp1[0][am.bool()]), ("loss vs TP1", loss, tp1[1]),
                           (f"grad {worst} vs TP1", hf_grads[worst], tp1[2][worst])):
            _parity(model, layout, what, a, b, show=rank == 0)
        for name, g in hf_grads.items():
            close(g, tp1[2][name], f"grad {name} vs TP1")
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


def test_grouped_kv_heads_with_sequence_parallelism_equal_tp1(family_dirs):
    """EuroBERT's two key/value heads split over TP 2 with sequence parallelism: logits, loss and
    every gradient equal TP 1's (this process's) and transformers'."""
    ps = megabert.init_parallel()
    tp1 = _outputs(megabert.AutoModelForMaskedLM.from_pretrained(family_dirs["eurobert"], ps,
                                                                 attention_backend="torch"), ps)
    run_distributed(_check, 2, family_dirs["eurobert"], "eager", "torch", False, True, tp1)


def _check_pp(rank, world, hf_dirs, tp):
    """Each dir's masked LM through the pipeline schedule at TP `tp` x PP world / tp: the last
    stage's logits and loss equal transformers'."""
    from megabert.pipeline_parallel.p2p import PipeComm
    from megabert.pipeline_parallel.schedules import PipelineSchedule
    from megabert.training.strategy import TrainingTask

    ps = megabert.init_parallel(tensor_parallel_size=tp, pipeline_model_parallel_size=world // tp)
    for hf_dir in hf_dirs:
        _, ref = masked_lm_reference(hf_dir, "eager")
        ids, am, labels = family_batch()
        model = megabert.AutoModelForMaskedLM.from_pretrained(hf_dir, ps, attention_backend="torch")
        cfg = model.config
        for name, p in model.named_parameters():  # grouped key/value heads: each TP rank holds its share
            if name.endswith("key_value.weight"):
                assert p.size(0) == 2 * cfg.num_kv_heads // tp * cfg.head_dim, (name, tuple(p.shape))
        comm = PipeComm(ps, model.activation_shape(ids.size(1), ids.size(0)), torch.float32)
        task = TrainingTask(inputs=(), output_loss=lambda out: (out.loss, {}))
        schedule = PipelineSchedule(model, ps, comm, 1, task)
        outs = schedule.forward_only([dict(input_ids=ids, attention_mask=am, labels=labels)],
                                     lambda out: (out.logits, out.loss))
        if ps.is_last_stage:
            logits, loss = outs[0]
            layout = f"TP{tp}xPP{world // tp}" if tp > 1 else f"PP{world}"
            _parity(model, layout, "logits", logits[am.bool()], ref.logits[am.bool()], show=ps.tp_rank == 0)
            _parity(model, layout, "loss", loss, ref.loss, show=ps.tp_rank == 0)


def test_pipeline_equals_transformers(hf_dir):
    run_distributed(_check_pp, 2, [hf_dir], 1)


def test_tp2_pp2_equals_transformers(family_dirs):
    """TP 2 x PP 2 (4 processes, one spawn for every family): EuroBERT's and UltraBERT's grouped
    key/value heads split over TP, each pipeline stage a half of the layers."""
    run_distributed(_check_pp, 4, [family_dirs[f] for f in FAMILIES], 2)


def _logits_diff(hf_dir, tamper) -> float:
    """Largest logit difference to transformers after `tamper(state)` edits the weights megabert loads."""
    _, ref = masked_lm_reference(hf_dir, "eager")
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


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_convert_import_export_round_trip(hf_dir, tp, pp, tmp_path):
    """convert_hf import at a layout (TP 2 x PP 2 splits both ways at once), then export: the same
    tensors bit for bit, and transformers loads the export with megabert's logits (the
    checkpoint's, read by one process)."""
    from tests.helpers.cli_utils import run_main

    r = run_main("tools/checkpoint/convert_hf.py", "import", "--hf-dir", hf_dir, "--output", str(tmp_path / "ck"),
                 "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp))
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
    back, before = _on_disk(str(tmp_path / "out")), _on_disk(hf_dir)
    assert back.keys() == before.keys() and all(torch.equal(back[k], before[k]) for k in before)
    exported = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "out"))
    ids, am, _ = family_batch()
    model = megabert.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "ck"), megabert.init_parallel(),
                                                          attention_backend="torch").eval()
    with torch.no_grad():
        ours = model(ids, attention_mask=am).logits
    layout = {(1, 1): "TP1", (2, 1): "TP2", (1, 2): "PP2", (2, 2): "TP2xPP2"}[tp, pp]
    _parity(model, layout, "export logits", exported(input_ids=ids, attention_mask=am).logits[am.bool()],
            ours[am.bool()])


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
    from megabert import model_classes
    from megabert.families import task_class_name
    from tests.helpers.cli_utils import run_main

    cfg, _ = family_config(family, num_labels=3, **extra)
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(cfg).eval()
    hf.save_pretrained(str(tmp_path / "hf"))
    task = {"SequenceClassification": "sequence_classification", "TokenClassification": "token_classification",
            "QuestionAnswering": "question_answering"}[arch.split("For")[-1]]
    ids, am, _ = family_batch()
    model = megabert.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "hf"), megabert.init_parallel())
    cls = model_classes.by_name(task_class_name(model.config, task))
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
