"""Tokenizers with Megatron's names and interface: WordPiece (BERT), SentencePiece, tokenizer.json.

Every tokenizer exposes `vocab_size`, `vocab` (token -> id), `inv_vocab` (id -> token),
`tokenize(text) -> list[int]`, `tokenize_batch(texts)`, `detokenize(ids)`, the special
ids `cls`, `sep`, `pad`, `mask`, `unk`, `eod`, and `word_start_mask()` for whole-word
masking. The WordPiece tokenizers run on the Rust `tokenizers` library configured as
Hugging Face's BertTokenizer, so ids are identical to transformers' for the same vocab.
"""
from __future__ import annotations

import os
import re
from typing import Optional, Sequence

import numpy as np

from megabert.errors import ConfigError, DataError

TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer", "HuggingFaceTokenizer")


class Tokenizer:
    """Common interface; subclasses fill `_vocab`, `_inv_vocab` and the special ids."""

    name: str = "tokenizer"

    def __init__(self, source: str):
        self.source = source
        self._vocab: dict[str, int] = {}
        self._inv_vocab: dict[int, str] = {}
        self._special: dict[str, Optional[int]] = {}

    @property
    def vocab_size(self) -> int:
        # Ids can be sparse (a repeated line in vocab.txt, added tokens); the embedding must cover the largest.
        return max(self._inv_vocab) + 1

    @property
    def vocab(self) -> dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        return self._inv_vocab

    def _special_id(self, role: str) -> int:
        value = self._special.get(role)
        if value is None:
            raise DataError(f"tokenizer {self.source} has no {role} token, which BERT needs; "
                            f"add one to the vocabulary (e.g. retrain with tools/train_tokenizer.py)")
        return value

    cls = property(lambda self: self._special_id("cls"))
    sep = property(lambda self: self._special_id("sep"))
    pad = property(lambda self: self._special_id("pad"))
    mask = property(lambda self: self._special_id("mask"))
    unk = property(lambda self: self._special_id("unk"))
    # BERT vocabularies have no end-of-document token; Megatron's BERT data marks it with [SEP].
    eod = property(lambda self: self._special_id("eod"))

    @property
    def special_ids(self) -> list[int]:
        return sorted({v for v in self._special.values() if v is not None})

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def word_start_mask(self) -> np.ndarray:
        """bool[vocab_size]: True where a token begins a word (whole-word masking groups the rest with it)."""
        out = np.ones(self.vocab_size, dtype=bool)
        for i, tok in self._inv_vocab.items():
            out[i] = not self._continues_word(tok)
        out[self.special_ids] = True
        return out

    def _continues_word(self, token: str) -> bool:
        return token.startswith("##")


class _RustTokenizer(Tokenizer):
    """A tokenizer backed by a `tokenizers.Tokenizer` (Rust): fast batch encoding without offsets."""

    def _set_backend(self, backend) -> None:
        self._backend = backend

    def tokenize(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # encode_batch_fast skips offset tracking, which nothing here needs.
        return [e.ids for e in self._backend.encode_batch_fast(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(map(int, ids)), skip_special_tokens=False)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and each token's (start, end) character span in `text` (the Rust
        pipeline's offsets, as transformers' return_offsets_mapping): SQuAD maps
        answer characters to tokens and predicted tokens back to text with them."""
        enc = self._backend.encode(text, add_special_tokens=False)
        return enc.ids, [_trimmed(text, a, b) for a, b in enc.offsets]


def _trimmed(text: str, start: int, end: int) -> tuple[int, int]:
    """A token's span without the whitespace at its ends: a byte-level "Ġword" covers the
    space before the word, and a span that reaches into whitespace would put it into an
    answer (what the ByteLevel post-processor's trim_offsets does; ModernBERT's tokenizer.json
    has a TemplateProcessing one, which does not). A token of whitespace alone keeps its span;
    WordPiece and Metaspace spans never hold whitespace, so they are unchanged."""
    a, b = start, end
    while a < b and text[a].isspace():
        a += 1
    while b > a and text[b - 1].isspace():
        b -= 1
    return (a, b) if a < b else (start, end)


def read_wordpiece_vocab(path: str) -> dict[str, int]:
    """vocab.txt -> {token: line number}, read exactly as transformers' load_vocab does
    (only the newline is stripped; a repeated token keeps its last line)."""
    if not os.path.isfile(path):
        raise DataError(f"vocab file {path} does not exist: check --vocab-file "
                        f"(tools/train_tokenizer.py makes one)")
    with open(path, encoding="utf-8") as f:
        vocab = {}
        for i, line in enumerate(f):
            vocab[line.rstrip("\n")] = i
    if not vocab:
        raise DataError(f"vocab file {path} is empty")
    return vocab


# Characters the fast path cannot take: all but printable ASCII and the whitespace \t \n \r that
# BERT's normaliser turns into spaces (it deletes the other control characters).
_UNSAFE_CHARS = r"[^\x09\x0a\x0d\x20-\x7e]"
_CHUNK_END = re.compile(r"[ \t\n\r]")
_WORD_CACHE_LIMIT = 1 << 20


class BertWordPieceTokenizer(_RustTokenizer):
    """BERT's WordPiece from a vocab.txt, identical to transformers' BertTokenizer(vocab, do_lower_case).

    Fast path (why preprocessing beats the Rust pipeline by a wide margin): for ASCII text
    with no control character and no special token, BERT's normaliser is just lower-casing
    and its pre-tokenizer just splits off runs of letters and digits and single punctuation
    marks, which one regex does at C speed. Each distinct word then goes through the
    `tokenizers` WordPiece model once and is cached. Other stretches of text (between ASCII
    whitespace) take the full Rust pipeline, so ids are always those of BertTokenizer
    (tests compare both on fuzzed text).
    """

    def __init__(self, vocab_file: str, lower_case: bool = True):
        from tokenizers import Tokenizer as RustTokenizer, decoders, normalizers, pre_tokenizers
        from tokenizers.models import WordPiece

        super().__init__(vocab_file)
        self.name = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        self.lower_case = lower_case
        self._vocab = read_wordpiece_vocab(vocab_file)
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        if "[UNK]" not in self._vocab:
            raise DataError(f"vocab file {vocab_file} has no [UNK] token; a BERT vocab needs "
                            f"[PAD], [UNK], [CLS], [SEP] and [MASK]")
        backend = RustTokenizer(WordPiece(self._vocab, unk_token="[UNK]", max_input_chars_per_word=100))
        # strip_accents=None follows lowercase, as in the original BERT and transformers.
        backend.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                        strip_accents=None, lowercase=lower_case)
        backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        backend.decoder = decoders.WordPiece(prefix="##")
        roles = {"cls": "[CLS]", "sep": "[SEP]", "pad": "[PAD]", "mask": "[MASK]", "unk": "[UNK]"}
        self._special_texts = tuple(tok for tok in roles.values() if tok in self._vocab)
        # transformers never splits its special tokens when they appear in text; neither do we.
        backend.add_special_tokens(list(self._special_texts))
        self._special = {role: self._vocab.get(tok) for role, tok in roles.items()}
        self._special["eod"] = self._special["sep"]
        self._set_backend(backend)
        self._words = re.compile(r"[0-9a-z]+|[^0-9a-z\s]" if lower_case else r"[0-9A-Za-z]+|[^0-9A-Za-z\s]")
        self._unsafe = re.compile("|".join([_UNSAFE_CHARS, *map(re.escape, self._special_texts)]))
        self._cache: dict[str, list[int]] = {}

    def __getstate__(self):
        return {**self.__dict__, "_cache": {}}  # the word cache is rebuilt where it is used

    def _fast_ok(self, text: str) -> bool:
        return text.isascii() and self._unsafe.search(text) is None

    def _fast(self, text: str) -> list[int]:
        if self.lower_case:
            text = text.lower()
        cache, model, out = self._cache, self._backend.model, []
        for word in self._words.findall(text):
            ids = cache.get(word)
            if ids is None:
                if len(cache) >= _WORD_CACHE_LIMIT:
                    cache.clear()
                ids = cache[word] = [t.id for t in model.tokenize(word)]
            out += ids
        return out

    def tokenize(self, text: str) -> list[int]:
        if self._fast_ok(text):
            return self._fast(text)
        # Nothing in BERT's normaliser, pre-tokenizer or special-token matching crosses ASCII
        # whitespace, so each whitespace-delimited chunk holding something the fast path cannot
        # take (non-ASCII, a control character, a special token) goes through Rust on its own.
        out, pos = [], 0
        while (m := self._unsafe.search(text, pos)) is not None:
            start = max(pos, *(text.rfind(c, pos, m.start()) + 1 for c in " \t\n\r"))
            end = _CHUNK_END.search(text, m.end())
            end = end.start() if end else len(text)
            if start > pos:
                out += self._fast(text[pos:start])
            out += super().tokenize(text[start:end])
            pos = end
        if pos < len(text):
            out += self._fast(text[pos:])
        return out

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One text at a time: the fast path beats the Rust batch call, which stays single-threaded
        # inside preprocessing workers anyway.
        return [self.tokenize(t) for t in texts]


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model. BERT's special tokens are taken from the model when it has them
    (tools/train_tokenizer.py adds them) and otherwise appended after its pieces, as Megatron does."""

    name = "SentencePieceTokenizer"
    _ROLES = {"cls": ("<CLS>", "[CLS]", "<cls>"), "sep": ("<SEP>", "[SEP]", "<sep>"),
              "mask": ("<MASK>", "[MASK]", "<mask>"), "eod": ("<EOD>", "<eod>", "</s>"),
              "pad": ("<PAD>", "[PAD]", "<pad>"), "unk": ("<unk>", "<UNK>", "[UNK]")}

    def __init__(self, model_file: str):
        import sentencepiece

        super().__init__(model_file)
        if not os.path.isfile(model_file):
            raise DataError(f"SentencePiece model {model_file} does not exist: check --vocab-file")
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as e:
            raise DataError(f"{model_file} is not a SentencePiece model ({e}); check --vocab-file "
                            f"and --tokenizer-type") from None
        for i in range(self._sp.get_piece_size()):
            piece = self._sp.id_to_piece(i)
            self._vocab.setdefault(piece, i)
            self._inv_vocab[i] = piece
        self._n_model = self._sp.get_piece_size()
        for role, names in self._ROLES.items():
            found = next((self._vocab[n] for n in names if n in self._vocab), None)
            if found is None:  # appended ids the model never emits, as Megatron's wrapper does
                found = len(self._inv_vocab)
                self._vocab[names[0]] = found
                self._inv_vocab[found] = names[0]
            self._special[role] = found

    def tokenize(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def detokenize(self, ids: Sequence[int]) -> str:
        # Appended special ids are unknown to the model: write them as text.
        out, run = [], []
        for i in map(int, ids):
            if i < self._n_model:
                run.append(i)
            else:
                out += [self._sp.decode(run), self._inv_vocab[i]]
                run = []
        out.append(self._sp.decode(run))
        return " ".join(s for s in out if s)

    def _continues_word(self, token: str) -> bool:
        return not token.startswith("\u2581")  # "▁" marks the start of a word


class HuggingFaceTokenizer(_RustTokenizer):
    """Any Hugging Face `tokenizer.json` (or a directory holding one)."""

    name = "HuggingFaceTokenizer"
    _ROLES = {"cls": ("[CLS]", "<s>", "<cls>", "[BOS]"), "sep": ("[SEP]", "</s>", "<sep>", "[EOS]"),
              "pad": ("[PAD]", "<pad>"), "mask": ("[MASK]", "<mask>"), "unk": ("[UNK]", "<unk>"),
              "eod": ("<|endoftext|>", "</s>", "[SEP]", "[EOS]")}

    def __init__(self, path: str):
        from tokenizers import Tokenizer as RustTokenizer

        super().__init__(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise DataError(f"tokenizer file {path} does not exist: --vocab-file takes a tokenizer.json "
                            f"or a directory holding one")
        try:
            backend = RustTokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception with its parse error
            raise DataError(f"{path} is not a valid tokenizer.json ({e})") from None
        # A tokenizer.json saved with padding or truncation on (transformers writes what the
        # tokenizer was last called with) would pad every document to its length, or cut it:
        # megabert tokenizes whole documents and builds samples itself.
        backend.no_padding()
        backend.no_truncation()
        self._vocab = backend.get_vocab(with_added_tokens=True)
        self._inv_vocab = {i: t for t, i in self._vocab.items()}
        for role, names in self._ROLES.items():
            self._special[role] = next((self._vocab[n] for n in names if n in self._vocab), None)
        model = backend.model
        self._prefix = getattr(model, "continuing_subword_prefix", None) or None
        self._set_backend(backend)

    def _continues_word(self, token: str) -> bool:
        if self._prefix:  # WordPiece: "##" marks a continuation
            return token.startswith(self._prefix)
        return not token.startswith(("\u2581", "\u0120"))  # Metaspace "▁" / byte-level "Ġ" mark a word start


def build_tokenizer(tokenizer_type: str, vocab_file: Optional[str]) -> Tokenizer:
    """The tokenizer named by --tokenizer-type, loaded from --vocab-file."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ConfigError(f"--tokenizer-type {tokenizer_type} is not supported; "
                          f"choose one of {', '.join(TOKENIZER_TYPES)}")
    if not vocab_file:
        raise ConfigError(f"--tokenizer-type {tokenizer_type} needs --vocab-file "
                          f"(tools/train_tokenizer.py makes one from your corpus)")
    if tokenizer_type == "BertWordPieceLowerCase":
        return BertWordPieceTokenizer(vocab_file, lower_case=True)
    if tokenizer_type == "BertWordPieceCase":
        return BertWordPieceTokenizer(vocab_file, lower_case=False)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(vocab_file)
    return HuggingFaceTokenizer(vocab_file)
