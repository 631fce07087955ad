#!/usr/bin/env python
"""The official SQuAD evaluation: prints the official script's JSON.

    python tools/squad_evaluate.py dev-v1.1.json predictions.json   # {"exact_match": .., "f1": ..}
    python tools/squad_evaluate.py dev-v2.0.json predictions.json   # {"exact": .., "f1": .., "total": .., "HasAns_exact": ..}

PREDICTIONS.json maps question id -> answer text ("" for no answer), as finetune_squad.py
writes it. The version is read from DATA.json (its "version", or is_impossible fields);
--version overrides it.
"""
import argparse
import json
import sys

from megabert.tasks.squad.examples import load_squad_json, read_json
from megabert.tasks.squad.evaluate import evaluate
from megabert.errors import DataError, cli_main


def load_predictions(path: str) -> dict:
    predictions = read_json(path, "predictions file")
    if not isinstance(predictions, dict) or not all(isinstance(v, str) for v in predictions.values()):
        raise DataError(f"{path} must map each question id to its answer text: {{\"id\": \"text\", ...}}")
    return predictions


@cli_main
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("data_file", metavar="DATA.json", help="SQuAD v1.1 or v2.0 dataset file")
    p.add_argument("pred_file", metavar="PREDICTIONS.json", help="{question id: answer text}")
    p.add_argument("--version", choices=("1.1", "2.0"), default=None, help="default: read from DATA.json")
    args = p.parse_args(argv)
    data = load_squad_json(args.data_file)
    print(json.dumps(evaluate(data, load_predictions(args.pred_file), args.version)))


if __name__ == "__main__":
    sys.exit(main())
