"""Training a WordPiece vocab.txt or a SentencePiece model from text (tools/train_tokenizer.py)."""
from __future__ import annotations

import os
from typing import Iterable, Iterator

# BERT's special tokens first, in the order of Google's vocab files' first ids ([PAD] = 0).
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# SentencePiece pieces that SentencePieceTokenizer picks up as BERT's specials.
SPM_SPECIALS = ["<CLS>", "<SEP>", "<MASK>", "<EOD>"]


def train_wordpiece(texts: Iterable[str], vocab_file: str, vocab_size: int = 30522, lower_case: bool = True,
                    min_frequency: int = 2, limit_alphabet: int = 1000) -> str:
    """Trains BERT's WordPiece (normalisation as BertTokenizer) and writes vocab.txt; returns its path."""
    from tokenizers import BertWordPieceTokenizer as Trainer

    trainer = Trainer(clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lower_case)
    trainer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency,
                                limit_alphabet=limit_alphabet, special_tokens=BERT_SPECIALS,
                                wordpieces_prefix="##", show_progress=False)
    vocab = trainer.get_vocab()
    os.makedirs(os.path.dirname(os.path.abspath(vocab_file)), exist_ok=True)
    with open(vocab_file, "w", encoding="utf-8") as f:
        for token in sorted(vocab, key=vocab.get):
            f.write(token + "\n")
    return vocab_file


def _lines(texts: Iterable[str]) -> Iterator[str]:
    # SentencePiece trains on sentences; one line of a document is close enough.
    for text in texts:
        for line in text.splitlines():
            if line.strip():
                yield line


def train_sentencepiece(texts: Iterable[str], model_prefix: str, vocab_size: int = 32000,
                        model_type: str = "unigram") -> str:
    """Trains a SentencePiece model with BERT's special pieces; returns the .model path."""
    import sentencepiece

    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=_lines(texts), model_prefix=model_prefix, vocab_size=vocab_size, model_type=model_type,
        user_defined_symbols=SPM_SPECIALS, pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, pad_piece="<PAD>",
        hard_vocab_limit=False, minloglevel=2, num_threads=os.cpu_count() or 1)
    return model_prefix + ".model"
