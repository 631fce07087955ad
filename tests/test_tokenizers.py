"""Our tokenizers against transformers' BertTokenizer on hard text, plus SentencePiece and tokenizer.json."""
import pickle
import unicodedata

import numpy as np
import pytest

from megabert.data import build_tokenizer
from megabert.corpus.tokenizer_training import train_sentencepiece, train_wordpiece
from megabert.errors import ConfigError, DataError

transformers = pytest.importorskip("transformers")

TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "Café, naïve, façade, résumé and Ångström are words with accents; ÉCOLE is upper case.",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "Numbers: 3.14159, 1,000,000, 2nd, 42%, -7, 1e-9, and version 3.11.7 of Python.",
    "Visit https://example.com/path?q=1&x=y#frag or mail someone@example.org today!",
    "Emoji 😀🎉 and symbols ©®™ and math ∑∫√ appear too.",
    "Supercalifragilisticexpialidocious antidisestablishmentarianism pneumonoultramicroscopic words.",
] * 20

HARD_TEXT = TRAIN_TEXT[:7] + [
    "control\x00chars\x07and\x1bescapes\ttabs\r\nnewlines",
    "zero\u200bwidth\u200cjoiner\u200dspaces\ufeffbom and soft\u00adhyphen",
    "combining e\u0301 and precomposed \u00e9, full-width ＡＢＣ１２３ and ligature ﬁ",
    "x" * 150 + " " + "ab" * 60 + " short",  # longer than 100 chars per word -> [UNK]
    "MiXeD CaSe WoRdS and [MASK] [CLS] [SEP] special tokens inline",
    "   leading and trailing spaces   ",
    "",
    "ünïcödé 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 Ελληνικά русский עברית العربية हिन्दी ไทย",
]


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    return str(train_wordpiece(TRAIN_TEXT, str(path), vocab_size=600, lower_case=False, min_frequency=1))


@pytest.mark.parametrize("lower", [True, False])
@pytest.mark.parametrize("reference", ["BertTokenizer", "BertTokenizerLegacy"])
def test_wordpiece_matches_transformers(vocab_file, lower, reference):
    ref_cls = getattr(transformers, reference, None) or getattr(transformers.models.bert, reference, None)
    if ref_cls is None:
        pytest.skip(f"transformers has no {reference}")
    ref = ref_cls(vocab_file, do_lower_case=lower)
    ours = build_tokenizer("BertWordPieceLowerCase" if lower else "BertWordPieceCase", vocab_file)
    for text in HARD_TEXT:
        if reference == "BertTokenizerLegacy" and not lower and unicodedata.normalize("NFC", text) != text:
            # NOTE: transformers' two implementations disagree here: the Python one NFC-composes
            # "e\u0301" first, the Rust one (BertTokenizer since transformers 5) does not.
            continue
        expected = ref(text, add_special_tokens=False)["input_ids"]
        assert ours.tokenize(text) == expected, text
    assert ours.tokenize_batch(HARD_TEXT) == [ours.tokenize(t) for t in HARD_TEXT]


@pytest.mark.parametrize("lower", [True, False])
def test_ascii_fast_path_matches_rust_pipeline_on_fuzzed_text(vocab_file, lower):
    """The cached ASCII fast path must agree with the full normaliser + pre-tokenizer + WordPiece."""
    rng = np.random.default_rng(0)
    pieces = (list("abcXYZ019") + ["quick", "Brown", "JUMPS", "lazy", "dozen", "fox", "ing", "the"] +
              list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + [" ", "  ", "\t", "\n", "\r\n", "\x0b", "\x0c", "\x1c"] +
              ["\x00", "\x07", "\x7f", "[MASK]", "[CLS]", "[mask]", "[SEP", "x" * 120] +
              ["é", "東", "😀", "\u200b", "\xa0", "\u3000", "e\u0301", "Σ", "ΟΔΥΣΣΕΥΣ", "Straße", "İ"])
    texts = ["".join(rng.choice(pieces, size=int(rng.integers(0, 40)))) for _ in range(3000)]
    ours = build_tokenizer("BertWordPieceLowerCase" if lower else "BertWordPieceCase", vocab_file)
    rust = ours._backend
    assert 300 < sum(map(ours._fast_ok, texts)) < 2700  # the fast, mixed and Rust paths are all exercised
    assert ours.tokenize_batch(texts) == [rust.encode(t, add_special_tokens=False).ids for t in texts]
    ref = transformers.BertTokenizer(vocab_file, do_lower_case=lower)
    assert [ours.tokenize(t) for t in texts[:300]] == [ref(t, add_special_tokens=False)["input_ids"]
                                                        for t in texts[:300]]


def test_wordpiece_interface(vocab_file):
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file)
    assert (tok.pad, tok.unk, tok.cls, tok.sep, tok.mask) == (0, 1, 2, 3, 4)
    assert tok.eod == tok.sep and tok.vocab_size == len(tok.vocab) == len(tok.inv_vocab) > 300
    assert all(tok.vocab[t] == i for i, t in tok.inv_vocab.items())
    ids = tok.tokenize("the quick brown fox")
    assert tok.detokenize(ids) == "the quick brown fox"
    starts = tok.word_start_mask()
    assert starts.dtype == bool and starts.shape == (tok.vocab_size,)
    assert all(starts[i] != t.startswith("##") for i, t in tok.inv_vocab.items() if i > 4)
    assert pickle.loads(pickle.dumps(tok)).tokenize("fox jumps") == tok.tokenize("fox jumps")


def test_vocab_read_as_transformers(tmp_path):
    """A repeated token keeps its last line, and only the newline is stripped."""
    from megabert.data.tokenizers import read_wordpiece_vocab

    (tmp_path / "v.txt").write_text("[PAD]\n[UNK]\na\nb \na\n", encoding="utf-8")
    assert read_wordpiece_vocab(str(tmp_path / "v.txt")) == {"[PAD]": 0, "[UNK]": 1, "a": 4, "b ": 3}


def test_sentencepiece(tmp_path):
    model = train_sentencepiece(TRAIN_TEXT, str(tmp_path / "spm"), vocab_size=200)
    tok = build_tokenizer("SentencePieceTokenizer", model)
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    text = "The quick brown fox jumps over the lazy dog."
    assert tok.tokenize(text) == sp.encode(text)
    assert tok.tokenize_batch([text, "Café"]) == [sp.encode(text), sp.encode("Café")]
    assert tok.detokenize(tok.tokenize(text)) == text
    assert len({tok.cls, tok.sep, tok.mask, tok.pad, tok.eod}) == 5
    assert max(tok.cls, tok.sep, tok.mask, tok.pad) < sp.get_piece_size()  # trained in, not appended
    assert tok.word_start_mask()[tok.tokenize("fox")[0]]
    assert pickle.loads(pickle.dumps(tok)).tokenize(text) == tok.tokenize(text)


def test_huggingface_tokenizer_json(vocab_file, tmp_path):
    ref = transformers.BertTokenizer(vocab_file, do_lower_case=True)
    ref.save_pretrained(str(tmp_path / "hf"))
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "hf"))  # a directory works too
    ours = build_tokenizer("BertWordPieceLowerCase", vocab_file)
    for text in HARD_TEXT:
        assert tok.tokenize(text) == ours.tokenize(text)
    assert (tok.cls, tok.sep, tok.pad, tok.mask) == (ours.cls, ours.sep, ours.pad, ours.mask)
    np.testing.assert_array_equal(tok.word_start_mask(), ours.word_start_mask())


@pytest.mark.parametrize("kind,path,err,words", [
    ("BertWordPieceLowerCase", None, ConfigError, "needs --vocab-file"),
    ("GPT2BPETokenizer", "x", ConfigError, "not supported"),
    ("BertWordPieceLowerCase", "/nonexistent/vocab.txt", DataError, "does not exist"),
    ("SentencePieceTokenizer", "/nonexistent.model", DataError, "does not exist"),
    ("HuggingFaceTokenizer", "/nonexistent", DataError, "does not exist"),
])
def test_build_errors(kind, path, err, words):
    with pytest.raises(err, match=words):
        build_tokenizer(kind, path)


def test_wrong_files_are_clear_errors(vocab_file, tmp_path):
    with pytest.raises(DataError, match="not a SentencePiece model"):
        build_tokenizer("SentencePieceTokenizer", vocab_file)
    with pytest.raises(DataError, match="is not JSON .*: a tokenizer.json is JSON; a WordPiece vocab.txt takes "
                                        "--tokenizer-type"):
        build_tokenizer("HuggingFaceTokenizer", vocab_file)
    (tmp_path / "v.txt").write_text("a\nb\n")
    with pytest.raises(DataError, match="no \\[UNK\\]"):
        build_tokenizer("BertWordPieceCase", str(tmp_path / "v.txt"))
