#!/usr/bin/env python
"""Write the quickstart corpus (Python standard library docstrings) as jsonl: no download needed.

    python tools/make_demo_corpus.py --output demo_out/corpus.jsonl
"""
import argparse
import sys

from megabert.corpus.demo_corpus import write_demo_corpus
from megabert.errors import DataError, cli_main


@cli_main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", required=True, help="jsonl file to write.")
    p.add_argument("--max-documents", type=int, default=None)
    p.add_argument("--stdlib-dir", default=None, help="Standard library to read (default: this Python's).")
    args = p.parse_args(argv)
    n = write_demo_corpus(args.output, args.max_documents, args.stdlib_dir)
    if n == 0:
        raise DataError(f"found no docstrings under {args.stdlib_dir or 'the standard library'}")
    print(f"wrote {n} documents to {args.output}")


if __name__ == "__main__":
    sys.exit(main())
