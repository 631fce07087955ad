"""tools/mine_hard_negatives.py: the negatives sentence-transformers' mine_hard_negatives
chooses on the same model and data (ranks, maximum score, relative margin; prompts read from
our export), the same at DP=2 (the corpus sharded) as in one process, an output that
finetune_embeddings.py --train-file reads, and one-line errors."""
import json

import numpy as np
import pytest

from megabert.tasks.embeddings.data import read_corpus, read_pairs

from tests.helpers.cli_utils import main_worker, run_main
from tests.helpers.dist_utils import run_distributed
from tests.test_embeddings import run, setup  # noqa: F401 (fixture)

pytest.importorskip("transformers")
TOOL = "tools/mine_hard_negatives.py"
FILTERS = {"ranks": ["--range-min", 2, "--range-max", 12], "margin": ["--relative-margin", 0.05],
           "max_score": ["--max-score", 0.8]}


@pytest.fixture(scope="module")
def export(setup, tmp_path_factory):
    """The model after a few steps (positives mostly above the rest: the margins keep some
    candidates) as finetune_embeddings.py exports it, with query and document prompts."""
    out = tmp_path_factory.mktemp("mining") / "out"
    run("--train-file", setup["train"], "--eval-dir", setup["beir"], "--load", setup["plain"], "--output-dir", out,
        "--max-seq-length", 24, "--query-prompt", "f1 ", "--document-prompt", "f2 ", "--micro-batch-size", 16,
        "--global-batch-size", 16, "--train-iters", 6, "--lr", 3e-3)
    return str(out / "sentence-transformers")


def mine(setup, export, output, *extra, **launch):
    args = ["--pairs", setup["train"], "--corpus", f"{setup['beir']}/corpus.jsonl", "--load", export, "--output",
            output, "--num-negatives", 3, "--micro-batch-size", 8, *extra]
    if launch:
        run_distributed(main_worker, launch["world"], TOOL, [str(a) for a in args])
        return
    r = run_main(TOOL, *map(str, args))
    assert r.returncode == 0, r.stderr[-3000:]


def negatives_by_query(path):
    return {row["query"]: row["negative"] for row in map(json.loads, open(path))}


@pytest.mark.parametrize("name", list(FILTERS))
def test_mining_equals_sentence_transformers(setup, export, tmp_path, name):
    """Each query's negatives, in order, are those of sentence-transformers' mine_hard_negatives
    (sampling "top", triplets) on the same export, pairs and corpus with its prompts."""
    datasets = pytest.importorskip("datasets")
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import mine_hard_negatives

    mine(setup, export, tmp_path / "ours.jsonl", *FILTERS[name])
    ours = negatives_by_query(tmp_path / "ours.jsonl")
    pairs = read_pairs(setup["train"])
    corpus = read_corpus(f"{setup['beir']}/corpus.jsonl")[1]
    options = {"ranks": dict(range_min=2, range_max=12), "margin": dict(relative_margin=0.05),
               "max_score": dict(max_score=0.8)}[name]
    dataset = datasets.Dataset.from_dict({"query": [p.query for p in pairs], "positive": [p.positive for p in pairs]})
    theirs = mine_hard_negatives(dataset, SentenceTransformer(export, device="cpu"), corpus=corpus, num_negatives=3,
                                 query_prompt_name="query", corpus_prompt_name="document", output_format="triplet",
                                 verbose=False, **options)
    first_positive = {}
    expected = {q: [] for q in ours}
    for q, p, n in zip(theirs["query"], theirs["positive"], theirs["negative"]):
        if first_positive.setdefault(q, p) == p:
            expected[q].append(n)
    assert ours == expected
    assert sum(map(len, ours.values())) > len(ours)  # the filters left negatives to compare


def test_mining_layouts_equal_one_process_and_train(setup, export, tmp_path):
    """DP=2 (the corpus embedded and searched in two shards, merged) and TP=2 write the
    one-process file; the file is training pairs with 3 negatives each that --train-file reads."""
    mine(setup, export, tmp_path / "one.jsonl", "--range-min", 1)
    mine(setup, export, tmp_path / "dp2.jsonl", "--range-min", 1, world=2)
    mine(setup, export, tmp_path / "tp2.jsonl", "--range-min", 1, "--tensor-model-parallel-size", 2, world=2)
    assert open(tmp_path / "dp2.jsonl").read() == open(tmp_path / "one.jsonl").read()
    assert open(tmp_path / "tp2.jsonl").read() == open(tmp_path / "one.jsonl").read()
    pairs = read_pairs(str(tmp_path / "one.jsonl"))
    assert [p.query for p in pairs] == [p.query for p in read_pairs(setup["train"])]
    assert all(len(p.negatives) == 3 and p.positive not in p.negatives for p in pairs)
    corpus = set(read_corpus(f"{setup['beir']}/corpus.jsonl")[1]) | {p.positive for p in pairs}
    assert all(set(p.negatives) <= corpus for p in pairs)
    assert len({n for p in pairs for n in p.negatives}) > 3  # not one list for every query
    r = run_main("finetune_embeddings.py", "--train-file", str(tmp_path / "one.jsonl"), "--load", setup["plain"],
                 "--output-dir", str(tmp_path / "trained"), "--max-seq-length", "24", "--micro-batch-size", "8",
                 "--global-batch-size", "8", "--train-iters", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert np.isfinite(float(r.stdout.split("contrastive_loss ")[1].split()[0]))


def test_mining_errors_are_one_line(setup, export, tmp_path):
    r = run_main(TOOL, "--pairs", setup["train"], "--load", export, "--output", str(tmp_path / "o.jsonl"),
                 "--num-negatives", "5", "--range-min", "8", "--range-max", "10")
    assert r.returncode != 0 and r.stderr.strip() == (
        "error: --num-negatives 5: only 2 candidates between --range-min 8 and --range-max 10; lower it or raise "
        "--range-max"), r.stderr
    r = run_main(TOOL, "--load", export, "--output", str(tmp_path / "o.jsonl"))
    assert r.returncode != 0 and r.stderr.strip() == "error: --pairs and --output are required", r.stderr
