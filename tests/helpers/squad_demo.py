"""The SQuAD-format demo set shipped in data/squad_demo and a WordPiece vocabulary trained on
it: the data of the SQuAD feature tests and of the fine-tuning runs."""
import json
import os

from megabert.corpus.tokenizer_training import train_wordpiece

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "data", "squad_demo")


def train_demo_vocab(path: str) -> str:
    """A 400-token vocabulary of the demo set's contexts and questions, written to `path`."""
    texts = []
    for name in ("train.json", "dev.json"):
        for article in json.load(open(os.path.join(DEMO, name)))["data"]:
            for p in article["paragraphs"]:
                texts += [p["context"]] + [q["question"] for q in p["qas"]]
    return train_wordpiece(texts, path, vocab_size=400, min_frequency=1)
