"""The tokenizer half of a Hugging Face export: which vocab and casing a checkpoint was
trained with, and the files that make `AutoTokenizer.from_pretrained(dir)` and
`pipeline("fill-mask", model=dir)` work on the export as it stands.

transformers needs `vocab.txt` plus `tokenizer_config.json` (class and casing: without it
AutoTokenizer guesses from config.json and lower-cases, wrongly for a cased model) and
`special_tokens_map.json`. A checkpoint saved by training records its data flags under
payload["args"] ("data" for pre-training, "finetune" for SQuAD); a converted one keeps the
source's vocab.txt (and tokenizer_config.json) beside it.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

from megabert.errors import CheckpointError

logger = logging.getLogger(__name__)

# --tokenizer-type -> lower-case? Only WordPiece vocabularies become a BertTokenizer.
WORDPIECE_TYPES = {"BertWordPieceLowerCase": True, "BertWordPieceCase": False}
SPECIAL_TOKENS = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
                  "mask_token": "[MASK]"}
TOKENIZER_FILES = ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json")


def _trained_with(meta: dict) -> dict:
    """The data flags a training run saved (pre-training's "data", fine-tuning's "finetune")."""
    args = meta.get("args") or {}
    return args.get("data") or args.get("finetune") or {}


def export_tokenizer(load: str, meta: dict, vocab_file: Optional[str] = None,
                     tokenizer_type: Optional[str] = None) -> tuple[str, bool]:
    """(vocab.txt, lower-case?) for exporting checkpoint `load`, whose rank-0 metadata is `meta`.
    Flags win; then what the checkpoint was trained with; then files beside it."""
    trained = _trained_with(meta)
    beside = os.path.join(load, "vocab.txt")
    if vocab_file:
        if not os.path.isfile(vocab_file):
            raise CheckpointError(f"--vocab-file {vocab_file} does not exist")
    elif trained.get("vocab_file") and os.path.isfile(trained["vocab_file"]):
        vocab_file = trained["vocab_file"]
    elif os.path.isfile(beside):
        vocab_file = beside
    else:
        named = trained.get("vocab_file")
        why = (f"it was trained with --vocab-file {named}, which does not exist here, and" if named
               else "it names no vocab file and")
        raise CheckpointError(f"no vocab to export with {load}: {why} it has no vocab.txt beside it; "
                              f"pass --vocab-file VOCAB.txt (the WordPiece vocab the model was trained with)")
    kind = tokenizer_type or trained.get("tokenizer_type") or _casing_beside(load)
    if kind is None:
        logger.warning("%s does not say how it was tokenized; exporting a lower-casing tokenizer "
                       "(pass --tokenizer-type BertWordPieceCase for a cased vocab)", load)
        kind = "BertWordPieceLowerCase"
    if kind not in WORDPIECE_TYPES:
        raise CheckpointError(f"{load} was trained with --tokenizer-type {kind}; the export writes a BERT WordPiece "
                              f"tokenizer: pass --tokenizer-type {' or '.join(WORDPIECE_TYPES)} with its --vocab-file")
    return vocab_file, WORDPIECE_TYPES[kind]


def _casing_beside(load: str) -> Optional[str]:
    """The tokenizer type a converted checkpoint's copied tokenizer_config.json implies."""
    path = os.path.join(load, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        lower = json.load(f).get("do_lower_case")
    return None if lower is None else ("BertWordPieceLowerCase" if lower else "BertWordPieceCase")


def read_vocab_tokens(vocab_file: str) -> list:
    with open(vocab_file, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def write_tokenizer_files(path: str, vocab_file: str, *, lower_case: bool, model_max_length: int,
                          vocab_size: Optional[int] = None) -> list:
    """Writes TOKENIZER_FILES for transformers' BertTokenizer; returns the paths written.
    `vocab_size`: the model's, which the vocab must not exceed (an id past the embedding
    table would crash transformers at the first such token)."""
    tokens = read_vocab_tokens(vocab_file)
    missing = [t for t in SPECIAL_TOKENS.values() if t not in tokens]
    if missing:
        raise CheckpointError(f"vocab {vocab_file} lacks {', '.join(missing)}; BERT's tokenizer needs "
                              f"{', '.join(SPECIAL_TOKENS.values())}: is it the model's WordPiece vocab.txt?")
    if vocab_size is not None and len(tokens) > vocab_size:
        raise CheckpointError(f"vocab {vocab_file} has {len(tokens)} tokens but the model has {vocab_size} word "
                              f"embeddings; pass the --vocab-file the model was trained with")
    out = os.path.join(path, "vocab.txt")
    if not (os.path.exists(out) and os.path.samefile(vocab_file, out)):
        with open(vocab_file, "rb") as src, open(out, "wb") as dst:
            dst.write(src.read())
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": lower_case, "model_max_length": model_max_length,
              # As BERT's own tokenizer: accents follow the casing, CJK characters split one by one.
              "strip_accents": None, "tokenize_chinese_chars": True, "clean_up_tokenization_spaces": True,
              **SPECIAL_TOKENS}
    for name, value in (("tokenizer_config.json", config), ("special_tokens_map.json", SPECIAL_TOKENS)):
        with open(os.path.join(path, name), "w") as f:
            json.dump(value, f, indent=2)
    return [os.path.join(path, n) for n in TOKENIZER_FILES]
