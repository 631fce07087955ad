"""A small synthetic retrieval set (tests and bench/embeddings_vs_sentence_transformers.py):
training pairs as finetune_embeddings.py reads them and a BEIR-layout dev dir.

Topics are sets of key words; a passage of a topic is a title (two of its key words) and a
text mixing key words with common filler words; a query is a few of its topic's key words
and a filler word. The positive of a query is a passage of its topic, the hard negative a
passage of a sibling topic, which shares half of the key words. Dev topics are new: the
model must learn to match words, not to remember topics. Every word is one WordPiece token
of the vocab written beside the data."""
from __future__ import annotations

import json
import os

import numpy as np

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def vocab_words(n_key: int, n_filler: int) -> tuple[list[str], list[str]]:
    return [f"k{i}" for i in range(n_key)], [f"f{i}" for i in range(n_filler)]


def write_vocab(path, n_key: int = 400, n_filler: int = 60) -> str:
    keys, fillers = vocab_words(n_key, n_filler)
    with open(path, "w") as f:
        f.write("\n".join(SPECIALS + keys + fillers) + "\n")
    return str(path)


class Topics:
    def __init__(self, rng: np.random.Generator, keys: list[str], fillers: list[str], n: int, size: int = 8):
        self.rng, self.fillers = rng, fillers
        self.words = []
        for _ in range(n // 2):  # sibling pairs: half of the key words shared
            a = list(rng.choice(keys, size, replace=False))
            b = a[:size // 2] + list(rng.choice([k for k in keys if k not in a], size - size // 2, replace=False))
            self.words += [a, b]

    def sibling(self, t: int) -> int:
        return t ^ 1

    def passage(self, t: int) -> tuple[str, str]:
        words = self.words[t]
        title = " ".join(self.rng.choice(words, 2, replace=False))
        body = list(self.rng.choice(words, 5, replace=False)) + list(self.rng.choice(self.fillers, 7))
        self.rng.shuffle(body)
        return title, " ".join(body)

    def query(self, t: int) -> str:
        words = list(self.rng.choice(self.words[t], 3, replace=False)) + [str(self.rng.choice(self.fillers))]
        self.rng.shuffle(words)
        return " ".join(words)


def write_retrieval_set(root, *, train_pairs: int = 256, dev_queries: int = 32, train_topics: int = 64,
                        dev_topics: int = 32, passages_per_dev_topic: int = 2, seed: int = 0,
                        negatives: str = "one") -> dict:
    """Writes root/vocab.txt, root/train.jsonl and root/beir/; returns their paths.
    `negatives`: "one" (a string per pair), "mixed" (a list of 0 to 2 per pair) or "none"."""
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab = write_vocab(os.path.join(root, "vocab.txt"))
    keys, fillers = vocab_words(400, 60)
    train = Topics(rng, keys[:250], fillers, train_topics)
    with open(os.path.join(root, "train.jsonl"), "w") as f:
        for i in range(train_pairs):
            t = int(rng.integers(train_topics))
            row = {"query": train.query(t), "positive": " ".join(train.passage(t))}
            if negatives == "one":
                row["negative"] = " ".join(train.passage(train.sibling(t)))
            elif negatives == "mixed":
                row["negative"] = [" ".join(train.passage(train.sibling(t))) for _ in range(i % 3)]
            f.write(json.dumps(row) + "\n")
    dev = Topics(rng, keys[250:], fillers, dev_topics)
    beir = os.path.join(root, "beir")
    os.makedirs(os.path.join(beir, "qrels"), exist_ok=True)
    with open(os.path.join(beir, "corpus.jsonl"), "w") as f:
        for t in range(dev_topics):
            for j in range(passages_per_dev_topic):
                title, text = dev.passage(t)
                f.write(json.dumps({"_id": f"d{t}-{j}", "title": title, "text": text}) + "\n")
    with open(os.path.join(beir, "queries.jsonl") , "w") as fq, \
            open(os.path.join(beir, "qrels", "dev.tsv"), "w") as fr:
        fr.write("query-id\tcorpus-id\tscore\n")
        for q in range(dev_queries):
            t = q % dev_topics
            fq.write(json.dumps({"_id": f"q{q}", "text": dev.query(t)}) + "\n")
            for j in range(passages_per_dev_topic):
                fr.write(f"q{q}\td{t}-{j}\t1\n")
    return {"vocab": vocab, "train": os.path.join(root, "train.jsonl"), "beir": beir}
