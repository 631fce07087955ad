#!/usr/bin/env python
r"""Stream a Wikipedia XML dump (.xml or .xml.bz2) into jsonl with the wiki markup stripped.

    python tools/wikipedia_to_jsonl.py --input enwiki-latest-pages-articles.xml.bz2 \
        --output wiki.jsonl --workers 8
    python tools/preprocess_data.py --input wiki.jsonl --output-prefix wiki --vocab-file vocab.txt \
        --split-sentences --workers 8

Each line is {"id", "title", "text"}; text holds one paragraph per line. Redirects,
non-article namespaces and articles shorter than --min-chars are left out.
"""
import argparse
import json
import multiprocessing as mp
import sys
import time
from itertools import islice

from megabert.corpus.preprocess import ordered_pool_map
from megabert.corpus.wikipedia import clean_pages, iter_pages
from megabert.errors import ConfigError, DataError, cli_main


def _batches(pages, size):
    it = iter(pages)
    while batch := list(islice(it, size)):
        yield batch


@cli_main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="pages-articles dump, .xml or .xml.bz2")
    p.add_argument("--output", required=True, help="jsonl file to write")
    p.add_argument("--workers", type=int, default=mp.cpu_count(), help="processes cleaning wikitext")
    p.add_argument("--min-chars", type=int, default=200, help="drop articles with less text than this")
    p.add_argument("--max-articles", type=int, default=None, help="stop after this many pages (for a trial)")
    p.add_argument("--log-interval", type=int, default=10000, help="articles between progress lines")
    args = p.parse_args(argv)
    if args.workers < 1:
        raise ConfigError("--workers must be >= 1")
    pages = iter_pages(args.input)
    if args.max_articles:
        pages = islice(pages, args.max_articles)
    batches = _batches(pages, 64)  # one message per 64 articles keeps IPC off the critical path
    start, seen, kept, broken = time.time(), 0, 0, []
    pool = mp.get_context("fork").Pool(args.workers) if args.workers > 1 else None
    try:
        results = (ordered_pool_map(pool, clean_pages, ((b, args.min_chars) for b in batches), 2 * args.workers,
                                    star=True)
                   if pool else (clean_pages(b, args.min_chars) for b in batches))
        with open(args.output, "w", encoding="utf-8") as out:
            for cleaned in results:
                for page in cleaned:
                    seen += 1
                    if page.article is not None:
                        out.write(json.dumps(page.article, ensure_ascii=False) + "\n")
                        kept += 1
                    elif page.error is not None:
                        broken.append(page)
                    if args.log_interval and seen % args.log_interval == 0:
                        print(f"{seen} articles ({seen / (time.time() - start):.1f}/s), {kept} kept",
                              file=sys.stderr, flush=True)
    finally:
        if pool:
            pool.terminate()
            pool.join()
    if seen == 0:
        raise DataError(f"{args.input} holds no article page (namespace 0, not a redirect)")
    short = seen - kept - len(broken)
    print(f"wrote {kept} of {seen} articles to {args.output} in {time.time() - start:.1f} s ({short} shorter than "
          f"--min-chars, {len(broken)} unparsable)")
    if broken:
        print(f"unparsable wikitext, skipped: {len(broken)} articles, first {broken[0].title!r} "
              f"({broken[0].error})", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
