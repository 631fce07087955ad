"""GPT-2's byte-level alphabet as byte-level BPE tokenizer.json files use it: a piece's
characters back to bytes, and the character classes of a piece's ends (letter, number,
other, blank, space), which tell where its pre-tokenizer's words start (WordStarts)."""
from __future__ import annotations

from functools import lru_cache

CONTRACTIONS = ("s", "t", "re", "ve", "m", "ll", "d")  # after "'": the byte-level regex's first alternatives
# 0: no class (empty, or part of a multi-byte character); BLANK is the space " ", SPACE other whitespace.
LETTER, NUMBER, OTHER, BLANK, SPACE = 1, 2, 3, 4, 5


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet back to bytes (the inverse of its bytes_to_unicode): printable
    Latin-1 bytes stand for themselves, the others for chr(256 + k) ("Ġ" is the space, "Ċ" the newline)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, k = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + k)] = b
            k += 1
    return chars


def char_class(c: str) -> int:
    if c == " ":
        return BLANK
    if c.isspace():
        return SPACE
    if c.isalpha():
        return LETTER
    if c.isnumeric():
        return NUMBER
    return OTHER if c != "\ufffd" else 0  # U+FFFD: an incomplete UTF-8 sequence


def byte_class(token: str, *, first: bool) -> int:
    """The class of a byte-level piece's first (or last) character; 0 when the piece starts
    (ends) inside a multi-byte character, or is not byte-level text (an added token)."""
    decode = byte_decoder()
    if not token or any(c not in decode for c in token):
        return 0
    raw = bytes(decode[c] for c in token)
    text = raw.decode("utf-8", errors="replace")
    return char_class(text[0] if first else text[-1])
