"""Every finetune_*.py takes --load of a transformers dir of the families beyond BERT and
ModernBERT (a tokenizer.json beside it): a rotation runs each family once and each script at
least once (the whole 16-cell matrix is run by hand, see docs/model-families.md), plus
--pack-sequences on one; the loss falls, the results are written, and the fine-tuned task
model exports (convert_hf.py export) to transformers' class of the family, whose logits are
megabert's. A head transformers lacks is a one-line error, on import and on export."""
import json

import pytest
import torch

import megabert

from tests.helpers.cli_utils import run_main
from tests.helpers.family_tasks import VOCAB, losses, make_task_family_dir, task_argv, write_task_data
from tests.helpers.hf_models import close

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_task_data(tmp_path_factory.mktemp("family_tasks"))


# (family, script, extra flags, the transformers class its fine-tuned model exports to)
ROTATION = [("eurobert", "glue", (), "EuroBertForSequenceClassification"),
            ("gte", "embeddings", (), None),
            ("nomic_bert", "ner", (), "NomicBertForTokenClassification"),
            ("ultrabert", "squad", (), "UltrabertForQuestionAnswering"),
            ("gte", "glue", ("--pack-sequences",), None)]
RESULTS = {"glue": {"eval_accuracy", "eval_accuracy_mm"}, "ner": {"eval_f1", "eval_accuracy"},
           "squad": {"exact_match", "f1"}, "embeddings": {"ndcg_at_10"}}
AUTO = {"Sequence": "AutoModelForSequenceClassification", "Token": "AutoModelForTokenClassification",
        "Question": "AutoModelForQuestionAnswering"}


@pytest.mark.parametrize("family,task,extra,arch", ROTATION, ids=[f"{r[0]}-{r[1]}{'-packed' * bool(r[2])}"
                                                                 for r in ROTATION])
def test_finetune_each_family(data, tmp_path, family, task, extra, arch):
    hf_dir = make_task_family_dir(tmp_path / "hf", family, data)
    r = run_main(*task_argv(task, hf_dir, data, tmp_path, 8, *extra))
    assert r.returncode == 0, r.stderr[-3000:]
    steps = losses(tmp_path, task)
    assert len(steps) == 8 and sum(steps[-3:]) < sum(steps[:3]), steps
    results = json.load(open(tmp_path / "run" / "eval_results.json"))
    assert RESULTS[task] <= set(results) and all(results[k] == results[k] for k in RESULTS[task]), results
    if task == "embeddings":
        assert json.load(open(tmp_path / "run" / "sentence-transformers" / "config.json"))["architectures"] == \
            [transformers.GteModel.__name__]
    if arch is None:
        return
    # The fine-tuned model exports to transformers' task class of the family: the same logits.
    r = run_main("tools/checkpoint/convert_hf.py", "export", "--load", str(tmp_path / "ckpt"), "--hf-dir",
                 str(tmp_path / "export"))
    assert r.returncode == 0, r.stderr[-3000:]
    auto = next(v for k, v in AUTO.items() if f"For{k}" in arch)
    hf = getattr(transformers, auto).from_pretrained(str(tmp_path / "export"), attn_implementation="eager").eval()
    assert type(hf).__name__ == arch
    from megabert.checkpoint.reader import read_full
    from megabert.model_classes import by_name

    cls = by_name(read_full(str(tmp_path / "ckpt"))[1]["model_class"])
    ours = cls.from_pretrained(str(tmp_path / "ckpt"), megabert.init_parallel(), attention_backend="torch").eval()
    ids = torch.randint(5, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(ids)
    am[1, 13:] = 0
    with torch.no_grad():
        out, ref = ours(ids, attention_mask=am), hf(input_ids=ids, attention_mask=am)
    names = ("start_logits", "end_logits") if "Question" in arch else ("logits",)
    for name in names:
        a, b = getattr(out, name), getattr(ref, name)
        close(a, b, name) if "Sequence" in arch else close(a[am.bool()], b[am.bool()], name)
    if "Token" in arch:
        assert hf.config.id2label == ours.config.id2label


def test_a_head_megabert_does_not_build_is_one_line(tmp_path):
    """config.json naming a head megabert has no model for is refused on import, naming the
    file and the heads it reads; a fine-tuned head transformers has no class for (GTE's span
    head) is refused on export."""
    from megabert.checkpoint import hf as hf_io
    from megabert.errors import CheckpointError
    from tests.helpers.family_models import make_family_dir

    hf_dir = make_family_dir(tmp_path / "hf", "gte")
    config = json.load(open(tmp_path / "hf" / "config.json"))
    json.dump({**config, "architectures": ["GteForMultipleChoice"]}, open(tmp_path / "hf" / "config.json", "w"))
    r = run_main("tools/checkpoint/convert_hf.py", "import", "--hf-dir", hf_dir, "--output", str(tmp_path / "ck"))
    assert r.returncode != 0 and "\n" not in r.stderr.strip(), r.stderr
    assert "'GteForMultipleChoice'" in r.stderr and "GteForSequenceClassification" in r.stderr
    cfg = hf_io.model_config_from_hf(config)
    with pytest.raises(CheckpointError, match="no question answering model of the gte family") as e:
        hf_io.hf_architecture(cfg, "BertForQuestionAnswering")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- GTE's Hub names


@pytest.mark.parametrize("prefix", ["new.", ""])
def test_gte_hub_names_load_as_transformers_loads_them(tmp_path, prefix):
    """Alibaba's GTE checkpoints on the Hub name the base model `new.` (their remote code's
    NewModel), a bare base model none: transformers' gte conversion mapping strips `new.`
    (PrefixChange) and adds its `gte.` back, so both load. megabert's from_pretrained and
    convert_hf.py import read a tiny GteForMaskedLM renamed to either form with transformers'
    logits; model_type `new` (remote code only, no transformers class) stays a one-line error."""
    from safetensors.torch import load_file, save_file

    from tests.helpers.family_models import make_family_dir
    from tests.helpers.modernbert_models import modernbert_batch

    hf_dir = make_family_dir(tmp_path / "hf", "gte")
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    renamed = {prefix + k.removeprefix("gte.") if k.startswith("gte.") else k: v for k, v in state.items()}
    assert not any(k.startswith("gte.") for k in renamed)
    save_file(renamed, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    ids, am, _ = modernbert_batch()
    ref = transformers.GteForMaskedLM.from_pretrained(hf_dir).eval()(input_ids=ids, attention_mask=am).logits
    r = run_main("tools/checkpoint/convert_hf.py", "import", "--hf-dir", hf_dir, "--output", str(tmp_path / "ck"))
    assert r.returncode == 0, r.stderr
    for source in (hf_dir, str(tmp_path / "ck")):
        model = megabert.AutoModelForMaskedLM.from_pretrained(source, megabert.init_parallel()).eval()
        with torch.no_grad():
            close(model(ids, attention_mask=am).logits[am.bool()], ref[am.bool()], f"logits from {source}")

    config = json.load(open(tmp_path / "hf" / "config.json"))
    json.dump({**config, "model_type": "new"}, open(tmp_path / "hf" / "config.json", "w"))
    r = run_main("tools/checkpoint/convert_hf.py", "import", "--hf-dir", hf_dir, "--output", str(tmp_path / "ck2"))
    assert r.returncode != 0 and "\n" not in r.stderr.strip() and "model_type 'new'" in r.stderr, r.stderr
