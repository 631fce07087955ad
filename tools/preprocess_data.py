#!/usr/bin/env python
r"""Tokenize a corpus into Megatron's .bin/.idx (Megatron-LM's tools/preprocess_data.py flags).

    python tools/preprocess_data.py --input corpus.jsonl.zst --output-prefix data/my-bert \
        --vocab-file vocab.txt --tokenizer-type BertWordPieceLowerCase --split-sentences --workers 8

writes data/my-bert_text_sentence.bin/.idx (`_document` without --split-sentences).
--input is jsonl (one JSON object per line) or plain text (.txt: documents separated by
empty lines), optionally .gz/.bz2/.xz/.zst, a parquet file (.parquet), an Arrow file (.arrow)
or a directory written by datasets' `save_to_disk`, or a glob of such files; for parquet and
Arrow, --json-keys names the columns:

    python tools/preprocess_data.py --input 'wikipedia/20231101.en/train-*.parquet' --json-keys text ...

Malformed records (bad JSON, a missing key, invalid UTF-8, empty or null text) are skipped and
reported with their line (row) numbers; --strict stops at the first one instead.
"""
import argparse
import glob
import sys

from megabert.corpus.preprocess import EncodeOptions, preprocess
from megabert.data.tokenizers import TOKENIZER_TYPES
from megabert.errors import ConfigError, cli_main
from megabert.paths import FILE_OR_DIR, check_input, check_output_prefix


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True,
                   help="Input file, glob or save_to_disk directory: jsonl or text (optionally compressed), parquet, "
                        "Arrow.")
    g.add_argument("--input-format", default="auto", choices=("auto", "jsonl", "text", "parquet", "arrow"),
                   help="auto: a directory is a save_to_disk dataset, .parquet parquet, .arrow Arrow, .txt/.text text, "
                        "anything else jsonl.")
    g.add_argument("--json-keys", nargs="+", default=["text"],
                   help="Keys to extract from each JSON object (columns of parquet and Arrow input).")
    g.add_argument("--split-sentences", action="store_true", help="Split documents into sentences (BERT needs this).")
    g.add_argument("--keep-newlines", action="store_true",
                   help="Accepted for Megatron compatibility; a line break always ends a sentence here.")
    g.add_argument("--strict", action="store_true", help="Stop at the first malformed record instead of skipping it.")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default="BertWordPieceLowerCase", choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", "--tokenizer-model", dest="vocab_file", default=None,
                   help="vocab.txt, SentencePiece .model, or tokenizer.json.")
    g.add_argument("--append-eod", action="store_true", help="Append an end-of-document token to each document.")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="Output path without the _{key}_{level}.bin suffix.")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="Worker processes that tokenize.")
    g.add_argument("--log-interval", type=int, default=1000, help="Documents between progress lines.")
    args = p.parse_args(argv)
    if args.workers < 1:
        raise ConfigError("--workers must be >= 1")
    if args.log_interval < 0:
        raise ConfigError("--log-interval must be >= 0")
    if not glob.has_magic(args.input):  # a glob is expanded and checked by the reader
        check_input(args.input, "--input", FILE_OR_DIR)
    if args.vocab_file is not None:
        check_input(args.vocab_file, "--vocab-file", FILE_OR_DIR)
    check_output_prefix(args.output_prefix, "--output-prefix")
    return args


@cli_main
def main(argv=None):
    args = get_args(argv)
    opts = EncodeOptions(tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                         json_keys=tuple(args.json_keys), split_sentences=args.split_sentences,
                         append_eod=args.append_eod)
    if args.tokenizer_type.startswith("Bert") and not args.split_sentences:
        print("note: without --split-sentences every document is one sentence, and BERT's sentence-pair "
              "head (SOP/NSP) cannot use it", file=sys.stderr)
    stats = preprocess(args.input, args.output_prefix, opts, workers=args.workers,
                       log_interval=args.log_interval, strict=args.strict, input_fmt=args.input_format)
    for prefix in stats.outputs:
        print(f"wrote {prefix}.bin and {prefix}.idx")


if __name__ == "__main__":
    sys.exit(main())
