#!/usr/bin/env python
"""Train a WordPiece vocab.txt (BERT), a byte-level BPE tokenizer.json (ModernBERT-style) or a
SentencePiece model on a corpus.

    python tools/train_tokenizer.py --input corpus.jsonl --output vocab.txt --vocab-size 30522
    python tools/train_tokenizer.py --input corpus.jsonl --output tok_dir --tokenizer-type HuggingFaceTokenizer \
        --vocab-size 50368 [--special-tokens-style roberta]
    python tools/train_tokenizer.py --input corpus.txt --output spm --tokenizer-type SentencePieceTokenizer

WordPiece and byte-level BPE: the same corpus gives the same files, byte for byte, on every run.

--input is read as tools/preprocess_data.py reads it (jsonl or text, compressed or not, parquet, Arrow, a glob).
"""
import argparse
import itertools
import os
import sys

from megabert.corpus.text_input import expand_inputs, input_format, text_stream
from megabert.corpus.tokenizer_training import (SPECIAL_STYLES, train_byte_level_bpe, train_sentencepiece,
                                                 train_wordpiece)
from megabert.errors import ConfigError, DataError, cli_main


@cli_main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="Corpus file, glob or save_to_disk directory (jsonl, text, parquet, "
                                                  "Arrow).")
    p.add_argument("--input-format", default="auto", choices=("auto", "jsonl", "text", "parquet", "arrow"))
    p.add_argument("--json-keys", nargs="+", default=["text"],
                   help="JSON keys (parquet/Arrow columns) whose text is used.")
    p.add_argument("--output", required=True, help="vocab.txt path; HuggingFaceTokenizer: a directory (tokenizer.json "
                                                   "and tokenizer_config.json); the SentencePiece model prefix.")
    p.add_argument("--tokenizer-type", default="BertWordPieceLowerCase",
                   choices=("BertWordPieceLowerCase", "BertWordPieceCase", "HuggingFaceTokenizer",
                            "SentencePieceTokenizer"))
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--min-frequency", type=int, default=2, help="WordPiece and BPE: ignore rarer pairs.")
    p.add_argument("--special-tokens-style", default="bert", choices=tuple(SPECIAL_STYLES),
                   help="HuggingFaceTokenizer: bert ([CLS] [SEP] [MASK] [PAD] [UNK], as ModernBERT's tokenizer) or "
                        "roberta (<s> </s> <mask> <pad> <unk>).")
    p.add_argument("--model-max-length", type=int, default=512,
                   help="HuggingFaceTokenizer: model_max_length in tokenizer_config.json (8192 for ModernBERT).")
    p.add_argument("--sentencepiece-model-type", default="unigram", choices=("unigram", "bpe"))
    p.add_argument("--max-documents", type=int, default=None, help="Train on the first N documents only.")
    args = p.parse_args(argv)
    if args.vocab_size < 16:
        raise ConfigError("--vocab-size must be at least 16")
    if args.tokenizer_type == "HuggingFaceTokenizer" and args.vocab_size < 256 + len(SPECIAL_STYLES["bert"]["order"]):
        raise ConfigError(f"--vocab-size {args.vocab_size} is below a byte-level BPE's 256 bytes and 5 special tokens: "
                          f"give at least 261")
    paths = expand_inputs(args.input)
    texts = (t for path in paths for key in args.json_keys
             for t in text_stream(path, input_format(path, args.input_format), key))
    if args.max_documents:
        texts = itertools.islice(texts, args.max_documents)
    first = next(texts, None)
    if first is None:
        raise DataError(f"--input {args.input} holds no text under --json-keys {' '.join(args.json_keys)}")
    texts = itertools.chain([first], texts)
    if args.tokenizer_type == "SentencePieceTokenizer":
        out = train_sentencepiece(texts, args.output, args.vocab_size, args.sentencepiece_model_type)
    elif args.tokenizer_type == "HuggingFaceTokenizer":
        if os.path.isfile(args.output):
            raise ConfigError(f"--output {args.output} is a file: --tokenizer-type HuggingFaceTokenizer writes a "
                              f"directory (tokenizer.json, tokenizer_config.json); give a directory path")
        out = train_byte_level_bpe(texts, args.output, args.vocab_size, args.min_frequency, args.special_tokens_style,
                                   args.model_max_length)
    else:
        out = train_wordpiece(texts, args.output, args.vocab_size, args.tokenizer_type == "BertWordPieceLowerCase",
                              args.min_frequency)
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
