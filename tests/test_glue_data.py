"""GLUE's files and figures without a model: each task's TSV layout as the distribution
ships it (CoLA without a header, MNLI's extra columns and two dev sets, QQP's short rows),
CSV / JSON-lines files, errors naming file:line, the official metrics against scipy /
scikit-learn and by hand, eval_results.json's keys and the submission files, and the
names of Google's run_classifier head. The model and finetune_glue.py: tests/test_glue.py."""
import json

import numpy as np
import pytest
import torch

from megabert.errors import DataError
from megabert.tasks.glue.data import read_examples
from megabert.tasks.glue.metrics import average_ranks, glue_metrics, matthews_corrcoef, spearman
from megabert.tasks.glue.tasks import TASKS

from tests.helpers.glue_files import write


# ---------------------------------------------------------------- the distribution's TSVs


def test_tsv_layout_of_every_task(tmp_path):
    """Sentences and labels come from each task's columns, headers skipped where GLUE has them."""
    cases = {
        "cola": (["gj04\t1\t\tThe sailors rode the breeze clear of the rocks.", "gj04\t0\t*\tThe more we study."],
                 [("The sailors rode the breeze clear of the rocks.", None, 1), ("The more we study.", None, 0)]),
        "sst-2": (["sentence\tlabel", "it 's a \" charming \" journey \t1"], [("it 's a \" charming \" journey ", None, 1)]),
        "mrpc": (["Quality\t#1 ID\t#2 ID\t#1 String\t#2 String", "1\t702876\t702977\tAmrozi accused .\tReferring ."],
                 [("Amrozi accused .", "Referring .", 1)]),
        "sts-b": (["index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore",
                   "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane.\tAn air plane.\t5.000"],
                  [("A plane.", "An air plane.", 5.0)]),
        "qqp": (["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate", "1\t3\t4\tWhy?\tHow?\t0"],
                [("Why?", "How?", 0)]),
        "mnli": (["index\tpromptID\tpairID\tgenre\tp1\tp2\tp3\tp4\tsentence1\tsentence2\tlabel1\tgold_label",
                  "0\t31193\t31193n\tgov\t(\t(\t(\t(\tPremise .\tHypothesis .\tneutral\tneutral"],
                 [("Premise .", "Hypothesis .", 2)]),
        "qnli": (["index\tquestion\tsentence\tlabel", "0\tWhat?\tThis.\tnot_entailment"], [("What?", "This.", 1)]),
        "rte": (["index\tsentence1\tsentence2\tlabel", "0\tA .\tB .\tentailment"], [("A .", "B .", 0)]),
        "wnli": (["index\tsentence1\tsentence2\tlabel", "0\tA .\tB .\t1"], [("A .", "B .", 1)]),
    }
    for name, (lines, want) in cases.items():
        got = read_examples(write(tmp_path / f"{name}.tsv", lines), TASKS[name])
        assert [(e.text_a, e.text_b, e.label) for e in got] == want, name
    # MNLI's dev rows carry five annotator labels before the gold one (16 columns).
    dev = write(tmp_path / "dev_matched.tsv", ["header"] + ["\t".join(
        ["0", "1", "1e", "fiction"] + ["("] * 4 + ["P", "H"] + ["neutral"] * 4 + ["contradiction", "entailment"])])
    assert read_examples(dev, TASKS["mnli"])[0].label == 1
    # Test files: an index column and no label (CoLA's has a header, unlike its train/dev).
    test = read_examples(write(tmp_path / "t.tsv", ["index\tsentence", "0\tBill left ."]), TASKS["cola"], test=True)
    assert [(e.text_a, e.label) for e in test] == [("Bill left .", None)]
    test = read_examples(write(tmp_path / "q.tsv", ["id\tquestion1\tquestion2", "0\tA?\tB?"]), TASKS["qqp"], test=True)
    assert [(e.text_a, e.text_b) for e in test] == [("A?", "B?")]


def test_qqp_short_rows_are_skipped_elsewhere_errors_name_file_and_line(tmp_path, caplog):
    """QQP's train.tsv has rows cut short by stray newlines: run_glue.py skips them, so do we
    (with one warning); any other task's short row, and an unknown label, stop with file:line."""
    qqp = write(tmp_path / "qqp.tsv", ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate", "1\t3\t4\tWhy?\tHow?\t0",
                                       "2\t5\t6\tHow do I", "read this?\t1", "3\t7\t8\tA?\tB?\t1"])
    assert [e.label for e in read_examples(qqp, TASKS["qqp"])] == [0, 1]
    assert "skipped 2 rows" in caplog.text and "line 3" in caplog.text
    rte = write(tmp_path / "rte.tsv", ["index\tsentence1\tsentence2\tlabel", "0\tA\tB\tentailment", "1\tA only"])
    with pytest.raises(DataError, match=r"rte\.tsv:3: 2 tab-separated columns, rte needs 4"):
        read_examples(rte, TASKS["rte"])
    bad = write(tmp_path / "mnli.tsv", ["h"] + ["\t".join(["0"] * 8 + ["P", "H", "neutral", "maybe"])])
    with pytest.raises(DataError, match=r"mnli\.tsv:2: label 'maybe' is not one of mnli's labels \(contradiction, "):
        read_examples(bad, TASKS["mnli"])
    sts = write(tmp_path / "sts.tsv", ["h", "\t".join(["x"] * 9 + ["high"])])
    with pytest.raises(DataError, match=r"sts\.tsv:2: label 'high' is not a number"):
        read_examples(sts, TASKS["sts-b"])
    with pytest.raises(DataError, match="does not exist"):
        read_examples(str(tmp_path / "none.tsv"), TASKS["rte"])
    (tmp_path / "latin1.tsv").write_bytes("index\tsentence1\tsentence2\tlabel\n0\tcaf\u00e9\tB\tentailment\n"
                                          .encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.tsv:2: byte 0xe9 at column 6 is not UTF-8 \(invalid "
                                         r"continuation byte\); save the file as UTF-8"):
        read_examples(str(tmp_path / "latin1.tsv"), TASKS["rte"])


def test_csv_and_json_lines_with_named_columns(tmp_path):
    """run_glue.py's --train_file: sentence1/sentence2 when present, else the first two
    non-label columns; labels by name or id."""
    csv_path = write(tmp_path / "d.csv", ["idx,sentence1,sentence2,label", '0,"A, quoted",B,entailment', "1,C,D,1"])
    assert [(e.text_a, e.text_b, e.label) for e in read_examples(csv_path, TASKS["rte"])] == \
        [("A, quoted", "B", 0), ("C", "D", 1)]
    js = write(tmp_path / "d.json", [json.dumps({"sentence": "good", "label": 1}), "",
                                     json.dumps({"sentence": "bad", "label": "0"})])
    assert [(e.text_a, e.text_b, e.label) for e in read_examples(js, TASKS["sst-2"])] == \
        [("good", None, 1), ("bad", None, 0)]
    broken = write(tmp_path / "b.json", [json.dumps({"sentence": "x", "label": 1}), "{oops"])
    with pytest.raises(DataError, match=r"b\.json:2: not a JSON object"):
        read_examples(broken, TASKS["sst-2"])
    with pytest.raises(DataError, match=r"c\.csv:3: label '7' is not one of sst-2's labels"):
        read_examples(write(tmp_path / "c.csv", ["sentence,label", "a,1", "b,7"]), TASKS["sst-2"])


# ---------------------------------------------------------------- metrics


def test_metrics_equal_scipy_and_sklearn():
    scipy_stats = pytest.importorskip("scipy.stats")
    sk = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    labels, preds = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
    got = glue_metrics(("accuracy", "f1", "matthews_correlation"), preds, labels)
    assert got["accuracy"] == pytest.approx(sk.accuracy_score(labels, preds))
    assert got["f1"] == pytest.approx(sk.f1_score(labels, preds))
    assert got["matthews_correlation"] == pytest.approx(sk.matthews_corrcoef(labels, preds))
    three = rng.integers(0, 3, 100), rng.integers(0, 3, 100)
    assert matthews_corrcoef(*three) == pytest.approx(sk.matthews_corrcoef(*three))
    assert matthews_corrcoef([1, 1, 1], [0, 1, 1]) == 0.0  # a constant side: sklearn's 0
    # STS-B: scores on a 0.2 grid and rounded predictions, so both sides hold many ties.
    gold, pred = np.round(rng.uniform(0, 5, 300) * 5) / 5, np.round(rng.uniform(0, 5, 300), 1)
    got = glue_metrics(("pearson", "spearmanr"), pred, gold)
    assert got["pearson"] == pytest.approx(scipy_stats.pearsonr(pred, gold)[0], abs=1e-12)
    assert got["spearmanr"] == pytest.approx(scipy_stats.spearmanr(pred, gold)[0], abs=1e-12)


def test_metrics_by_hand():
    """Cases checked by hand, for machines without scipy / scikit-learn."""
    assert list(average_ranks([10, 20, 20, 5])) == [2.0, 3.5, 3.5, 1.0]
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)  # 3/sqrt(10)
    # tp=2 fp=1 fn=1 tn=1: F1 = 4/6, MCC = (2*1 - 1*1) / sqrt(3*3*2*2) = 1/6
    preds, labels = [1, 1, 1, 0, 0], [1, 1, 0, 1, 0]
    got = glue_metrics(("accuracy", "f1", "matthews_correlation"), np.array(preds), np.array(labels))
    assert got == pytest.approx({"accuracy": 0.6, "f1": 2 / 3, "matthews_correlation": 1 / 6})


def test_google_run_classifier_head_names():
    """run_classifier.py keeps its classifier as top-level output_weights [num_labels, hidden]
    and output_bias: read as transformers' classifier, which makes the checkpoint a
    BertForSequenceClassification of that many labels."""
    from megabert.checkpoint.tf import _architecture, hf_name

    assert hf_name("output_weights") == ("classifier.weight", False)
    assert hf_name("output_bias") == ("classifier.bias", False)
    assert hf_name("output_weights/adam_m") is None
    assert _architecture({"classifier.weight": torch.zeros(3, 8)}) == "BertForSequenceClassification"
    assert _architecture({"qa_outputs.weight": torch.zeros(2, 8)}) == "BertForQuestionAnswering"


def test_eval_results_keys_and_submission_formats(tmp_path):
    """run_glue.py's keys (eval_combined_score where a task has two metrics) and GLUE's
    submission lines: label words, 0/1, STS-B scores with three decimals."""
    from megabert.tasks.glue.finetuning import eval_results, write_submission

    logits = np.array([[2.0, -1.0], [0.0, 1.0], [0.5, 0.1]], np.float32)
    mrpc = eval_results(TASKS["mrpc"], logits, np.array([0, 1, 1]))
    assert set(mrpc) == {"eval_loss", "eval_accuracy", "eval_f1", "eval_combined_score", "eval_samples"}
    assert mrpc["eval_accuracy"] == pytest.approx(2 / 3) and mrpc["eval_f1"] == pytest.approx(2 / 3)
    scores = np.array([[4.25], [0.5], [2.0]], np.float32)
    sts = eval_results(TASKS["sts-b"], scores, np.array([5.0, 1.0, 2.5]))
    assert sts["eval_pearson"] > 0.9 and sts["eval_spearmanr"] == pytest.approx(1.0)
    assert sts["eval_loss"] == pytest.approx(np.mean([0.75 ** 2, 0.5 ** 2, 0.5 ** 2]))
    write_submission(tmp_path / "STS-B.tsv", TASKS["sts-b"], scores)
    assert open(tmp_path / "STS-B.tsv").read() == "index\tprediction\n0\t4.250\n1\t0.500\n2\t2.000\n"
    write_submission(tmp_path / "RTE.tsv", TASKS["rte"], logits)
    assert open(tmp_path / "RTE.tsv").read().splitlines()[1:] == ["0\tentailment", "1\tnot_entailment",
                                                                    "2\tentailment"]
    write_submission(tmp_path / "CoLA.tsv", TASKS["cola"], logits)
    assert open(tmp_path / "CoLA.tsv").read().splitlines()[1:] == ["0\t0", "1\t1", "2\t0"]
