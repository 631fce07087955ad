"""BERT pre-training samples with a realistic length distribution, made by megabert's own
sample generator (pretrain_bert.py's: Megatron's sample mapping in helpers.cpp, then
BertDataset's SOP pairs, truncation and 15% masking) from a synthetic corpus of random token
ids, for the GPU bench (bench/gpu_bert_large.py). No download, no tokenizer training.

Where the lengths come from. The generator accumulates whole sentences of one document until
they reach a target of seq-3 tokens (short_seq_prob 0.1: a target drawn from [2, seq-3]
instead) or the document ends, so a sample's length depends on the corpus's document and
sentence lengths. The corpus here: sentences of lognormal length (median 24 WordPiece tokens,
sigma 0.5, 4-160 tokens: English encyclopedic prose), documents of lognormal sentence count
(median 7, sigma 1.0, at least 2). The document median (7 sentences, ~170 tokens) is chosen so
that at seq 512 about half the token slots are padding (47.9% real here), which is what
Krell et al. 2021 ("Efficient Sequence Packing without Cross-contamination", the packing behind
MLPerf's BERT) measured on the Wikipedia pre-training set at seq 512: "padding tokens represent
in excess of 50%". The same documents then give seq 128's distribution (85.6% real: mostly full
rows, a short tail from short_seq_prob and document ends). The lengths are a model of Wikipedia's,
not Wikipedia's: a run on real shards can differ by a few points of real-token share.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

VOCAB = 30522
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
SENTENCE_MEDIAN, SENTENCE_SIGMA, SENTENCE_RANGE = 24, 0.5, (4, 160)
DOC_SENTENCES_MEDIAN, DOC_SENTENCES_SIGMA = 7, 1.0


def write_corpus(workdir: str, num_documents: int, seed: int = 0, vocab_size: int = VOCAB) -> tuple[str, str]:
    """(indexed-dataset prefix, vocab file) of a sentence-level corpus of random ids."""
    from megabert.data.indexed_dataset import IndexedDatasetWriter

    rng = np.random.default_rng(seed)
    vocab = os.path.join(workdir, "vocab.txt")
    with open(vocab, "w") as f:
        f.write("\n".join(list(SPECIAL) + [f"w{i}" for i in range(vocab_size - len(SPECIAL))]) + "\n")
    prefix = os.path.join(workdir, "corpus_text_sentence")
    with IndexedDatasetWriter(prefix, dtype=np.uint16) as w:
        for _ in range(num_documents):
            n = max(2, int(round(rng.lognormal(np.log(DOC_SENTENCES_MEDIAN), DOC_SENTENCES_SIGMA))))
            lengths = np.clip(np.rint(rng.lognormal(np.log(SENTENCE_MEDIAN), SENTENCE_SIGMA, n)),
                              *SENTENCE_RANGE).astype(np.int64)
            w.add_document(rng.integers(len(SPECIAL), vocab_size, int(lengths.sum())), lengths)
    return prefix, vocab


def bert_samples(seq_length: int, num_samples: int, seed: int = 1234, vocab_size: int = VOCAB) -> list[dict]:
    """`num_samples` pretrain_bert.py samples (dicts of numpy arrays, padded to seq_length) in
    the dataset's order, SOP head, short_seq_prob 0.1, 15% masking."""
    from megabert.data import build_tokenizer
    from megabert.tasks.pretraining.indexed_samples import BertDataset, SampleSpec
    from megabert.data.indexed_dataset import IndexedDataset

    with tempfile.TemporaryDirectory() as tmp:
        # ~0.4 samples per document at seq 512, a few at seq 128: enough documents for one pass.
        prefix, vocab = write_corpus(tmp, num_documents=max(64, num_samples * 3), vocab_size=vocab_size)
        indexed = IndexedDataset(prefix)
        spec = SampleSpec(seq_length=seq_length, short_seq_prob=0.1, seed=seed)
        ds = BertDataset(indexed, (0, indexed.num_documents), "train", num_samples, spec,
                         build_tokenizer("BertWordPieceLowerCase", vocab), cache_dir=tmp)
        return [ds[i] for i in range(num_samples)]


def real_token_share(samples: list[dict]) -> float:
    """Real tokens / token slots of samples padded one to a row."""
    return float(sum(s["attention_mask"].sum() for s in samples)) / sum(s["attention_mask"].size for s in samples)
