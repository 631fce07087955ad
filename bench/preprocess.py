#!/usr/bin/env python
"""Preprocessing throughput: tools/preprocess_data.py against the Megatron-style peer, and the time to
build the BERT sample mapping for one million documents. Prints figures; never passes or fails on time.

The peer is what Megatron-LM's tools/preprocess_data.py does with a Hugging Face tokenizer:
a multiprocessing pool where each worker parses one JSON line, calls transformers'
BertTokenizerFast per sentence and returns Python lists, and megatron-core's
IndexedDatasetBuilder appends each document. Both sides read the same jsonl (built from the
stdlib-docstring demo corpus), use the same sentence splitter, and must write byte-identical
.bin/.idx files; the run says so or stops.

    python bench/preprocess.py [--mb 32] [--workers 2]
"""
import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

import numpy as np

from megabert.corpus.demo_corpus import stdlib_documents
from megabert.corpus.preprocess import EncodeOptions, preprocess
from megabert.corpus.sentence_splitter import split_sentences
from megabert.corpus.tokenizer_training import train_wordpiece


# Docstrings are almost pure ASCII; encyclopedic text is not. A third of the paragraphs get one of these,
# so the bench also measures the tokenizer's mixed path (ASCII runs fast, the rest through Rust).
NON_ASCII = ["café", "Zürich", "naïve", "1815–1852", "Ångström", "東京", "São Paulo", "Dvořák", "résumé", "€5"]


def make_corpus(path: str, megabytes: float, seed: int = 0) -> int:
    """Documents of 5-40 paragraphs drawn at random from the stdlib docstrings (Wikipedia-like sizes)."""
    paragraphs = [p for doc in stdlib_documents() for p in doc.split("\n")]
    rng = np.random.default_rng(seed)
    size, n = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 2 ** 20:
            picks = rng.integers(0, len(paragraphs), int(rng.integers(5, 40)))
            paras = [paragraphs[i] if rng.random() > 1 / 3 else f"{paragraphs[i]} ({NON_ASCII[i % len(NON_ASCII)]})"
                     for i in picks]
            line = json.dumps({"text": "\n".join(paras)}, ensure_ascii=False) + "\n"
            f.write(line)
            size += len(line.encode())
            n += 1
    return n


# ---- the peer: Megatron-LM's pipeline with transformers' fast tokenizer -------------------------------

class PeerEncoder:
    def __init__(self, vocab_file: str, split: bool):
        self.vocab_file, self.split = vocab_file, split

    def initializer(self):
        import transformers

        PeerEncoder.tokenizer = transformers.BertTokenizerFast(self.vocab_file, do_lower_case=True)

    def encode(self, line: str):
        text = json.loads(line)["text"]
        ids, lens = [], []
        for sentence in (split_sentences(text) if self.split else [text]):
            s = PeerEncoder.tokenizer(sentence, add_special_tokens=False)["input_ids"]
            if s:
                ids.extend(s)
                lens.append(len(s))
        return ids, lens, len(line)


def run_peer(src: str, prefix: str, vocab: str, split: bool, workers: int) -> float:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    encoder = PeerEncoder(vocab, split)
    start = time.time()
    with mp.get_context("fork").Pool(workers, initializer=encoder.initializer) as pool, \
            open(src, encoding="utf-8") as fin:
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for ids, lens, _ in pool.imap(encoder.encode, fin, 32):
            builder.add_document(np.array(ids, dtype=np.int64), lens)
        builder.finalize(prefix + ".idx")
    return time.time() - start


def run_ours(src: str, prefix: str, vocab: str, split: bool, workers: int) -> tuple[float, str]:
    opts = EncodeOptions("BertWordPieceLowerCase", vocab, ("text",), split)
    start = time.time()
    with open(os.devnull, "w") as quiet:
        out = preprocess(src, prefix, opts, workers=workers, log_interval=0, log=quiet).outputs[0]
    return time.time() - start, out


def identical(a: str, b: str) -> bool:
    return all(open(a + ext, "rb").read() == open(b + ext, "rb").read() for ext in (".bin", ".idx"))


def bench_mapping(num_docs: int = 1_000_000) -> None:
    """Sample mapping for 1M documents of 1-30 sentences (about 15M sentences), as the trainer builds it."""
    from megabert.data.indexed_dataset import IndexedDatasetWriter
    from megabert.tasks.pretraining.sample_mapping import build_mapping, get_mapping
    from megabert.data.indexed_dataset import IndexedDataset

    rng = np.random.default_rng(0)
    sentences = rng.integers(1, 31, num_docs)
    lengths = rng.integers(5, 40, int(sentences.sum())).astype(np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "m")
        with IndexedDatasetWriter(prefix, np.uint16) as w:  # only the index matters: tokens are zeros
            w.add_encoded(np.zeros(int(lengths.sum()), np.uint16).tobytes(), lengths, sentences)
        ds = IndexedDataset(prefix)
        t = time.time()
        mapping, stats = build_mapping(ds, (0, num_docs), None, 509, 0.1, 1234, 2)
        one_epoch = time.time() - t
        t = time.time()
        build_mapping(ds, (0, num_docs), 10 * len(mapping), 509, 0.1, 1234, 2)
        ten_epochs = time.time() - t
        get_mapping(ds, (0, num_docs), None, 509, 0.1, 1234, 2, "train", cache_dir=tmp)
        t = time.time()
        get_mapping(ds, (0, num_docs), None, 509, 0.1, 1234, 2, "train", cache_dir=tmp)
        cached = time.time() - t
    print(f"\nsample mapping, {num_docs:,} documents / {len(lengths):,} sentences, seq 512, SOP:")
    print(f"  one epoch ({len(mapping):,} samples): {one_epoch:.3f} s   10 epochs: {ten_epochs:.3f} s   "
          f"cached load: {cached * 1000:.1f} ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=32, help="corpus size in MB")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="runs per side, alternating; the best counts")
    p.add_argument("--skip-mapping", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "corpus.jsonl")
        docs = make_corpus(src, args.mb)
        mb = os.path.getsize(src) / 2 ** 20
        vocab = train_wordpiece(stdlib_documents(), os.path.join(tmp, "vocab.txt"), vocab_size=16000)
        print(f"corpus: {docs:,} documents, {mb:.1f} MB jsonl; {args.workers} workers; {os.cpu_count()} CPU cores; "
              f"best of {args.repeats} runs per side")
        print(f"{'mode':<22}{'ours MB/s':>11}{'peer MB/s':>11}{'ratio':>8}  output")
        for split in (False, True):
            # Alternating runs, best of each: a shared 2-core machine is noisy, and the best run is
            # the one least disturbed by anything else.
            t_peer = t_ours = float("inf")
            for _ in range(args.repeats):
                t_peer = min(t_peer, run_peer(src, os.path.join(tmp, f"peer{split}"), vocab, split, args.workers))
                t, out = run_ours(src, os.path.join(tmp, f"ours{split}"), vocab, split, args.workers)
                t_ours = min(t_ours, t)
            same = identical(out, os.path.join(tmp, f"peer{split}"))
            mode = "--split-sentences" if split else "documents"
            print(f"{mode:<22}{mb / t_ours:>11.2f}{mb / t_peer:>11.2f}{t_peer / t_ours:>7.2f}x  "
                  f"{'byte-identical' if same else 'DIFFERENT'}")
            if not same:
                print("error: outputs differ; the comparison is void", file=sys.stderr)
                return 1
    if not args.skip_mapping:
        bench_mapping()
    return 0


if __name__ == "__main__":
    sys.exit(main())
