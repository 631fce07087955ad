#!/usr/bin/env python
"""Train a WordPiece vocab.txt (BERT) or a SentencePiece model on a corpus.

    python tools/train_tokenizer.py --input corpus.jsonl --output vocab.txt --vocab-size 30522
    python tools/train_tokenizer.py --input corpus.txt --output spm --tokenizer-type SentencePieceTokenizer

--input is read as tools/preprocess_data.py reads it (jsonl or text, compressed or not, parquet, Arrow, a glob).
"""
import argparse
import itertools
import sys

from megabert.corpus.text_input import expand_inputs, input_format, text_stream
from megabert.corpus.tokenizer_training import train_sentencepiece, train_wordpiece
from megabert.errors import ConfigError, DataError, cli_main


@cli_main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="Corpus file, glob or save_to_disk directory (jsonl, text, parquet, "
                                                  "Arrow).")
    p.add_argument("--input-format", default="auto", choices=("auto", "jsonl", "text", "parquet", "arrow"))
    p.add_argument("--json-keys", nargs="+", default=["text"],
                   help="JSON keys (parquet/Arrow columns) whose text is used.")
    p.add_argument("--output", required=True, help="vocab.txt path, or the SentencePiece model prefix.")
    p.add_argument("--tokenizer-type", default="BertWordPieceLowerCase",
                   choices=("BertWordPieceLowerCase", "BertWordPieceCase", "SentencePieceTokenizer"))
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--min-frequency", type=int, default=2, help="WordPiece: ignore rarer pairs.")
    p.add_argument("--sentencepiece-model-type", default="unigram", choices=("unigram", "bpe"))
    p.add_argument("--max-documents", type=int, default=None, help="Train on the first N documents only.")
    args = p.parse_args(argv)
    if args.vocab_size < 16:
        raise ConfigError("--vocab-size must be at least 16")
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
    else:
        out = train_wordpiece(texts, args.output, args.vocab_size, args.tokenizer_type == "BertWordPieceLowerCase",
                              args.min_frequency)
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
