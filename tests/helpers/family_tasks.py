"""Fine-tuning inputs for the families beyond BERT and ModernBERT: one small data set per task
script (MNLI, CoNLL NER, the SQuAD demo, a retrieval set), a BPE tokenizer.json trained on all
of their texts, and a tiny transformers dir of a family carrying that tokenizer; the argv of
each finetune_*.py on them (tests/test_family_finetuning.py and the by-hand matrix)."""
import json
import os
import random
import shutil

import numpy as np

from tests.helpers.family_models import make_family_dir
from tests.helpers.modernbert_models import save_tokenizer
from tests.helpers.ner_files import conll, tagged_sentences, write
from tests.helpers.retrieval_files import write_retrieval_set
from tests.helpers.squad_demo import DEMO

VOCAB = 256  # the tokenizer's size and the models' vocab_size
SCRIPTS = {"glue": "finetune_glue.py", "ner": "finetune_ner.py", "squad": "finetune_squad.py",
           "embeddings": "finetune_embeddings.py"}
LOSS_KEYS = {"glue": "glue_loss", "ner": "ner_loss", "squad": "qa_loss", "embeddings": "contrastive_loss"}


def _mnli(path, rng):
    """An MNLI folder (train and both dev sets): the class is cued by the hypothesis' first word."""
    labels = ("contradiction", "entailment", "neutral")
    path.mkdir()
    head = "index\tpromptID\tpairID\tgenre\tp1\tp2\tp3\tp4\tsentence1\tsentence2"
    texts = []
    for name, n, dev in (("train.tsv", 48, False), ("dev_matched.tsv", 16, True), ("dev_mismatched.tsv", 8, True)):
        rows = []
        for i in range(n):
            y = int(rng.integers(0, 3))
            p = " ".join(f"w{int(k)}" for k in rng.integers(3, 40, rng.integers(3, 9)))
            h = " ".join([f"w{y}"] + [f"w{int(k)}" for k in rng.integers(3, 40, rng.integers(1, 5))])
            texts += [p, h]
            tail = "\t".join([labels[y]] * 6) if dev else f"{labels[y]}\t{labels[y]}"
            rows.append(f"{i}\t0\t0n\tfiction\t(\t(\t(\t(\t{p}\t{h}\t{tail}")
        extra = "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label" if dev else "\tlabel1\tgold_label"
        write(path / name, "\n".join([head + extra] + rows) + "\n")
    return str(path), texts


def write_task_data(root) -> dict:
    """Every script's data under `root` and a tokenizer.json trained on all of their texts:
    {"glue": dir, "ner": (train, dev), "squad": (train, dev), "embeddings": {train, beir},
    "tokenizer": dir}."""
    root.mkdir(parents=True, exist_ok=True)
    glue, texts = _mnli(root / "MNLI", np.random.default_rng(0))
    rng = random.Random(3)
    train, dev = (conll(tagged_sentences(rng, n, longest=10)) for n in (32, 12))
    ner = (write(root / "ner_train.txt", train), write(root / "ner_dev.txt", dev))
    texts += [" ".join(s.words) for s in tagged_sentences(random.Random(9), 100, longest=10)]
    for name in ("train.json", "dev.json"):
        for article in json.load(open(os.path.join(DEMO, name)))["data"]:
            for p in article["paragraphs"]:
                texts += [p["context"]] + [q["question"] for q in p["qas"]]
    retrieval = write_retrieval_set(root / "retrieval", train_pairs=32, dev_queries=8, train_topics=16, dev_topics=8)
    texts += [t for line in open(retrieval["train"]) for t in json.loads(line).values() if isinstance(t, str)]
    save_tokenizer(root / "tokenizer", texts, vocab_size=VOCAB)
    return {"glue": glue, "ner": ner, "squad": (os.path.join(DEMO, "train.json"), os.path.join(DEMO, "dev.json")),
            "embeddings": retrieval, "tokenizer": str(root / "tokenizer")}


def make_task_family_dir(path, family: str, data: dict, **config) -> str:
    """A tiny transformers masked LM of `family` over the tokenizer's vocab, with its
    tokenizer.json beside it (the dir finetune_*.py --load reads)."""
    make_family_dir(path, family, vocab_size=VOCAB, max_position_embeddings=128, **config)
    for name in os.listdir(data["tokenizer"]):
        shutil.copyfile(os.path.join(data["tokenizer"], name), os.path.join(path, name))
    return str(path)


def task_argv(task: str, load: str, data: dict, out, iters: int, *extra) -> list[str]:
    """finetune_<task>.py's argv: `iters` steps of batch 8 from `load`, a loss logged each step to
    out/metrics.jsonl, the fine-tuned model saved to out/ckpt, results in out/run."""
    common = ["--load", load, "--output-dir", str(out / "run"), "--micro-batch-size", "8", "--global-batch-size",
              "8", "--train-iters", str(iters), "--lr", "2e-3", "--seed", "3", "--log-interval", "1",
              "--metrics-file", str(out / "metrics.jsonl"), "--save", str(out / "ckpt")]
    if task == "glue":
        inputs = ["--task-name", "mnli", "--data-dir", data["glue"], "--max-seq-length", "32"]
    elif task == "ner":
        inputs = ["--train-file", data["ner"][0], "--validation-file", data["ner"][1], "--max-seq-length", "32"]
    elif task == "squad":
        inputs = ["--train-file", data["squad"][0], "--predict-file", data["squad"][1], "--max-seq-length", "96",
                  "--doc-stride", "32", "--max-query-length", "24"]
    else:
        inputs = ["--train-file", data["embeddings"]["train"], "--eval-dir", data["embeddings"]["beir"],
                  "--max-seq-length", "24"]
    return [SCRIPTS[task], *inputs, *common, *extra]


def losses(out, task: str) -> list[float]:
    path = out / "metrics.jsonl"
    key = LOSS_KEYS[task]
    return [row[key] for row in map(json.loads, open(path)) if key in row] if path.exists() else []
