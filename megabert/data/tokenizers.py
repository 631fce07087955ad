"""Tokenizers with Megatron's names and interface: WordPiece (BERT), SentencePiece, tokenizer.json.

Every tokenizer exposes `vocab_size`, `vocab` (token -> id), `inv_vocab` (id -> token),
`tokenize(text) -> list[int]`, `tokenize_batch(texts)`, `detokenize(ids)`, the special
ids `cls`, `sep`, `pad`, `mask`, `unk`, `eod`, and `word_starts()` for whole-word masking
(which tokens of a sequence begin a word: WordStarts). The WordPiece tokenizers run on the
Rust `tokenizers` library configured as Hugging Face's BertTokenizer, so ids are identical to
transformers' for the same vocab.
"""
from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from megabert.data.byte_level import BLANK, CONTRACTIONS, SPACE, byte_class, byte_decoder
from megabert.data.text_files import read_utf8
from megabert.errors import ConfigError, DataError

TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer", "HuggingFaceTokenizer")


@dataclass(frozen=True)
class WordStarts:
    """Which tokens of a sequence begin a word (whole-word masking's units), as plain arrays
    over the vocab (cheap to send to DataLoader workers). Token i of a sequence begins a word
    when it is the sequence's first, when it does so by itself (`starts`: a WordPiece without
    "##", a "▁" or byte-level "Ġ" piece, a special token), when the token before it ends one
    (`ends`: a special token, a BPE end-of-word suffix, a byte-level piece ending in a newline
    "Ċ" or another whitespace but the space), or, with `first_class`/`last_class` (byte-level BPE), when the
    character class changes between the two (letter, number, other: the byte-level
    pre-tokenizer's regex splits there, so no BPE piece spans it).

    NOTE: byte-level BPE tokenizes a sentence on its own (preprocessing with
    --split-sentences) without the "Ġ" its first word has in running text; the class rule
    still starts it after the previous sentence's final punctuation, or after a newline, but
    not after a sentence ending in a letter followed by one starting with a letter."""

    starts: np.ndarray  # bool [vocab]
    ends: np.ndarray  # bool [vocab]
    first_class: Optional[np.ndarray] = None  # int8 [vocab]; 0 = none or unknown (mid-character byte)
    last_class: Optional[np.ndarray] = None
    # bool [vocab]: a piece ending in an apostrophe / one that may go on an English contraction
    # ('s 't 're 've 'm 'll 'd: one word of the byte-level regex, letters after a non-letter).
    apostrophe: Optional[np.ndarray] = None
    contraction: Optional[np.ndarray] = None

    def __call__(self, tokens: np.ndarray) -> np.ndarray:
        """tokens [n] (ids) -> bool [n]: True where a word begins."""
        out = self.starts[tokens]
        if len(tokens) == 0:
            return out
        out[0] = True
        prev, cur = tokens[:-1], tokens[1:]
        out[1:] |= self.ends[prev]
        if self.first_class is not None:
            first, last = self.first_class[cur], self.last_class[prev]
            changed = (first != 0) & (last != 0) & (first != last)
            out[1:] |= changed & ~(self.apostrophe[prev] & self.contraction[cur])
        return out


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

    # Whether a space is part of the next token (byte-level BPE's "Ġ"): text cut into pieces
    # must then keep the space in front of each piece (megabert.corpus.preprocess).
    byte_level = False

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

    def word_starts(self) -> WordStarts:
        """The rule whole-word masking groups a sequence's tokens by (see WordStarts): here a
        token's own marker, and a new word after every special token."""
        return WordStarts(starts=self.word_start_mask(), ends=self._special_mask())

    def _special_mask(self) -> np.ndarray:
        out = np.zeros(self.vocab_size, dtype=bool)
        out[[i for i in self.special_ids if i < self.vocab_size]] = True
        return out


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
    text = read_utf8(path)
    if text.lstrip().startswith("{"):
        raise DataError(f"vocab file {path} is JSON, not a WordPiece vocab.txt (one token per line): for a "
                        f"tokenizer.json pass --tokenizer-type HuggingFaceTokenizer")
    vocab = {}
    for i, line in enumerate(io.StringIO(text, newline=None)):  # text mode's line ends, as load_vocab's open()
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
            raise DataError(f"tokenizer file {path} does not exist: --tokenizer-model (or --vocab-file) takes a "
                            f"tokenizer.json or a directory holding one")
        _check_tokenizer_json(path)
        try:
            backend = RustTokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception with its parse error
            raise DataError(f"{path} is not a tokenizer.json the tokenizers library reads ({e}); save it again with "
                            f"transformers' save_pretrained or tokenizers' Tokenizer.save") from None
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
        # The tokenizers library's models differ: WordPiece has a subword prefix, BPE may have
        # a word-end suffix (and a prefix), Unigram neither.
        self._prefix = getattr(model, "continuing_subword_prefix", None) or None
        self._suffix = getattr(model, "end_of_word_suffix", None) or None
        spec = json.loads(backend.to_str())
        self._byte_level = _has_component(spec, "ByteLevel")
        self._metaspace = _has_component(spec, "Metaspace")
        self._added = sorted(t["id"] for t in spec.get("added_tokens") or [] if t.get("special"))
        self._set_backend(backend)

    @property
    def byte_level(self) -> bool:
        return self._byte_level

    def _continues_word(self, token: str) -> bool:
        if self._prefix:  # WordPiece: "##" marks a continuation
            return token.startswith(self._prefix)
        if self._byte_level:  # a piece that begins with a whitespace byte ("Ġ" a space, "Ċ" a newline)
            return byte_class(token, first=True) not in (BLANK, SPACE)
        return not token.startswith("\u2581")  # Metaspace "▁" marks a word start

    def _special_mask(self) -> np.ndarray:
        out = super()._special_mask()
        out[[i for i in self._added if i < self.vocab_size]] = True  # every special added token
        return out

    def word_starts(self) -> WordStarts:
        if not (self._prefix or self._suffix or self._byte_level or self._metaspace):
            raise ConfigError(f"--whole-word-masking: the tokens of {self.source} carry no word boundary (no "
                              f"continuing-subword prefix such as '##', no end-of-word suffix, neither byte-level "
                              f"'Ġ' nor Metaspace '▁' pieces), so whole words cannot be found; leave out "
                              f"--whole-word-masking or use a tokenizer whose pieces mark words")
        special = self._special_mask()
        starts = self.word_start_mask()
        starts[special] = True
        ends = special.copy()
        if self._suffix:  # BPE "</w>": a word ends with the piece that carries it
            starts[~special] = False
            for i, tok in self._inv_vocab.items():
                ends[i] |= tok.endswith(self._suffix)
        if not self._byte_level:
            return WordStarts(starts=starts, ends=ends)
        first = np.zeros(self.vocab_size, dtype=np.int8)
        last = np.zeros(self.vocab_size, dtype=np.int8)
        apostrophe = np.zeros(self.vocab_size, dtype=bool)
        contraction = np.zeros(self.vocab_size, dtype=bool)
        decode = byte_decoder()
        for i, tok in self._inv_vocab.items():
            if special[i]:
                continue
            first[i], last[i] = byte_class(tok, first=True), byte_class(tok, first=False)
            if all(c in decode for c in tok):
                text = bytes(decode[c] for c in tok).decode("utf-8", errors="replace")
                apostrophe[i] = text.endswith("'") and not text[:-1].endswith(" ")  # " '" opens a quote
                contraction[i] = text.startswith(CONTRACTIONS) or text in ("r", "v", "l")
            # A piece ending in a newline or a tab ends a word; one ending in a space does not:
            # the pre-tokenizer's words take one space in front (" ?\p{L}+"), so a lone "Ġ" piece
            # is the first of the next word's pieces.
            ends[i] |= last[i] == SPACE
        # Whitespace is handled by starts/ends; classes compare letters, numbers and the rest.
        first[first >= BLANK] = 0
        last[last >= BLANK] = 0
        return WordStarts(starts=starts, ends=ends, first_class=first, last_class=last, apostrophe=apostrophe,
                          contraction=contraction)


def _check_tokenizer_json(path: str) -> None:
    """Words what the Rust parser reports as "expected ident at line 1 column 2": the file is not JSON,
    or JSON of another kind (a config.json, a tokenizer_config.json)."""
    try:
        spec = json.loads(read_utf8(path))
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not JSON (line {e.lineno}, column {e.colno}: {e.msg}): a tokenizer.json is "
                        f"JSON; a WordPiece vocab.txt takes --tokenizer-type BertWordPieceLowerCase or "
                        f"BertWordPieceCase") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        what = "an object without a \"model\"" if isinstance(spec, dict) else f"a JSON {type(spec).__name__}"
        raise DataError(f"{path} is {what}, not a tokenizer.json (its \"model\" object holds the vocab): is it "
                        f"a config.json or tokenizer_config.json? Pass the model's tokenizer.json")


def _has_component(spec, kind: str) -> bool:
    """Whether a tokenizer.json's pre-tokenizer or decoder (nested in a Sequence or not) is of `kind`."""
    def walk(node) -> bool:
        if isinstance(node, dict):
            return node.get("type") == kind or any(walk(v) for v in node.values())
        if isinstance(node, list):
            return any(walk(v) for v in node)
        return False
    return walk(spec.get("pre_tokenizer")) or walk(spec.get("decoder"))


def build_tokenizer(tokenizer_type: str, vocab_file: Optional[str]) -> Tokenizer:
    """The tokenizer named by --tokenizer-type, loaded from --vocab-file."""
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ConfigError(f"--tokenizer-type {tokenizer_type} is not supported; "
                          f"choose one of {', '.join(TOKENIZER_TYPES)}")
    if not vocab_file:
        flag = ("--tokenizer-model (a tokenizer.json or its directory)" if tokenizer_type == "HuggingFaceTokenizer"
                else "--vocab-file")
        raise ConfigError(f"--tokenizer-type {tokenizer_type} needs {flag} (tools/train_tokenizer.py makes one from "
                          f"your corpus)")
    if tokenizer_type == "BertWordPieceLowerCase":
        return BertWordPieceTokenizer(vocab_file, lower_case=True)
    if tokenizer_type == "BertWordPieceCase":
        return BertWordPieceTokenizer(vocab_file, lower_case=False)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(vocab_file)
    return HuggingFaceTokenizer(vocab_file)
