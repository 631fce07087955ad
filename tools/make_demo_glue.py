"""A small GLUE task in SST-2's format, built from the demo corpus (no download): sentences
of the standard library's docstrings, labelled 1 when they say what something returns and 0
when they say what it raises (sentences that say both are left out). Deterministic: the same
corpus gives the same files.

    make_demo_glue.py --corpus demo_out/corpus.jsonl --output demo_out/glue/SST-2

Writes train.tsv and dev.tsv ("sentence<TAB>label" with a header, as SST-2) and test.tsv
("index<TAB>sentence"), balanced between the classes.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

RETURNS = {"return", "returns", "returned", "returning"}
RAISES = {"raise", "raises", "raised", "error", "errors", "exception", "exceptions"}


def labelled_sentences(corpus: str) -> tuple[list[str], list[str]]:
    """(sentences about a return value, sentences about an error), 5 to 30 words each, in a
    fixed pseudo-random order (by hash), without duplicates."""
    returns, raises = set(), set()
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            for sentence in re.split(r"(?<=[.!?])\s+|\n", json.loads(line)["text"]):
                sentence = " ".join(sentence.split())
                words = set(re.findall(r"[a-z]+", sentence.lower()))
                if not 5 <= len(sentence.split()) <= 30 or "\t" in sentence:
                    continue
                if words & RETURNS and not words & RAISES:
                    returns.add(sentence)
                elif words & RAISES and not words & RETURNS:
                    raises.add(sentence)

    def shuffled(items):
        return sorted(items, key=lambda s: hashlib.md5(s.encode()).hexdigest())

    return shuffled(returns), shuffled(raises)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", required=True, help="demo corpus JSON lines (tools/make_demo_corpus.py)")
    p.add_argument("--output", required=True, help="folder for train.tsv, dev.tsv, test.tsv")
    p.add_argument("--train-per-class", type=int, default=300)
    p.add_argument("--dev-per-class", type=int, default=100)
    p.add_argument("--test-per-class", type=int, default=25)
    args = p.parse_args(argv)
    returns, raises = labelled_sentences(args.corpus)
    need = args.train_per_class + args.dev_per_class + args.test_per_class
    n = min(need, len(returns), len(raises))
    if n < 20:
        sys.exit(f"error: {args.corpus} has only {min(len(returns), len(raises))} sentences of one class; "
                 f"build a larger corpus (tools/make_demo_corpus.py --max-documents)")
    # Every split keeps the classes balanced; a corpus too small for the sizes asked for
    # gives a quarter to dev, an eighth to test and the rest to train.
    if n == need:
        train, dev, test = args.train_per_class, args.dev_per_class, args.test_per_class
    else:
        dev, test = n // 4, n // 8
        train = n - dev - test
    splits = {"train": (0, train), "dev": (train, train + dev), "test": (train + dev, n)}
    os.makedirs(args.output, exist_ok=True)
    for name, (lo, hi) in splits.items():
        rows = [(s, 1) for s in returns[lo:hi]] + [(s, 0) for s in raises[lo:hi]]
        rows.sort(key=lambda r: hashlib.md5(r[0].encode()).hexdigest())  # classes interleaved
        with open(os.path.join(args.output, f"{name}.tsv"), "w", encoding="utf-8") as f:
            if name == "test":
                f.write("index\tsentence\n" + "".join(f"{i}\t{s}\n" for i, (s, _) in enumerate(rows)))
            else:
                f.write("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows))
        print(f"{args.output}/{name}.tsv: {len(rows)} sentences")
    return 0


if __name__ == "__main__":
    sys.exit(main())
