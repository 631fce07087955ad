"""Training a WordPiece vocab.txt, a byte-level BPE tokenizer.json or a SentencePiece model from text
(tools/train_tokenizer.py)."""
from __future__ import annotations

import json
import os
from collections import Counter
from typing import Iterable, Iterator

from megabert.corpus.bpe_merges import alphabet_of, learn_merges

# BERT's special tokens first, in the order of Google's vocab files' first ids ([PAD] = 0).
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# SentencePiece pieces that SentencePieceTokenizer picks up as BERT's specials.
SPM_SPECIALS = ["<CLS>", "<SEP>", "<MASK>", "<EOD>"]
# A byte-level BPE's special tokens by --special-tokens-style, in id order from 0: BERT's
# bracketed ones (ModernBERT's tokenizer keeps them), or RoBERTa's angle-bracket ones (as
# EuroBERT's and other byte-level encoders' <s>, </s>, <mask>, <pad>).
SPECIAL_STYLES = {
    "bert": {"order": ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"), "pad_token": "[PAD]", "unk_token": "[UNK]",
             "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"},
    "roberta": {"order": ("<s>", "<pad>", "</s>", "<unk>", "<mask>"), "bos_token": "<s>", "eos_token": "</s>",
                "pad_token": "<pad>", "unk_token": "<unk>", "cls_token": "<s>", "sep_token": "</s>",
                "mask_token": "<mask>"},
}


def count_words(texts: Iterable[str], normalizer, pre_tokenizer) -> Counter:
    """Word counts of `texts` split as the tokenizer will split them (its Rust normalizer and
    pre-tokenizer), so the vocab is learnt on the words it will see."""
    counts: Counter = Counter()
    for text in texts:
        if normalizer is not None:
            text = normalizer.normalize_str(text)
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(text))
    return counts


def train_wordpiece(texts: Iterable[str], vocab_file: str, vocab_size: int = 30522, lower_case: bool = True,
                    min_frequency: int = 2, limit_alphabet: int = 1000) -> str:
    """Trains BERT's WordPiece (normalisation as BertTokenizer) and writes vocab.txt; returns its
    path. The same corpus gives the same file on every run (megabert.corpus.bpe_merges)."""
    from tokenizers.normalizers import BertNormalizer
    from tokenizers.pre_tokenizers import BertPreTokenizer

    normalizer = BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                lowercase=lower_case)
    counts = count_words(texts, normalizer, BertPreTokenizer())
    vocab, _ = learn_merges(counts, alphabet_of(counts, limit_alphabet), vocab_size, specials=BERT_SPECIALS,
                            min_frequency=min_frequency, prefix="##")
    _write(vocab_file, "".join(token + "\n" for token in vocab))
    return vocab_file


def train_byte_level_bpe(texts: Iterable[str], output_dir: str, vocab_size: int = 50265, min_frequency: int = 2,
                         special_tokens_style: str = "bert", model_max_length: int = 512) -> str:
    """Trains a byte-level BPE (GPT-2's and RoBERTa's scheme, ModernBERT's kind of tokenizer) and
    writes OUTPUT_DIR/tokenizer.json with `special_tokens_style`'s special tokens (SPECIAL_STYLES)
    plus a tokenizer_config.json that transformers' AutoTokenizer reads; returns the dir. The
    same corpus gives the same bytes on every run."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    style = SPECIAL_STYLES[special_tokens_style]
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    counts = count_words(texts, None, pre)
    specials = list(style["order"])
    vocab, merges = learn_merges(counts, alphabet_of(counts, None, pre_tokenizers.ByteLevel.alphabet()), vocab_size,
                                 specials=specials, min_frequency=min_frequency)
    tok = Tokenizer(BPE({t: i for i, t in enumerate(vocab)}, merges, unk_token=None))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    cls, sep = style["cls_token"], style["sep_token"]
    pair_sep = f"{sep} {sep}" if special_tokens_style == "roberta" else sep  # RoBERTa: <s> A </s></s> B </s>
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {pair_sep} $B:1 {sep}:1",
        special_tokens=[(t, vocab.index(t)) for t in sorted({cls, sep})])
    os.makedirs(output_dir, exist_ok=True)
    # Tokenizer.save writes the vocab by id and the merges by rank: the same bytes for the same model.
    _write(os.path.join(output_dir, "tokenizer.json"), tok.to_str(pretty=True) + "\n")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
              "clean_up_tokenization_spaces": False,
              **{k: v for k, v in style.items() if k.endswith("_token")}}
    _write(os.path.join(output_dir, "tokenizer_config.json"), json.dumps(config, indent=2, sort_keys=True) + "\n")
    return output_dir


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


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
