"""Mine hard negatives for retrieval training pairs with a model: megabert's
sentence-transformers' `mine_hard_negatives` (its range / max-score / margin semantics,
sampling "top"), at any parallel layout.

    torchrun --nproc-per-node 4 tools/mine_hard_negatives.py --pairs pairs.jsonl \\
        --corpus beir/corpus.jsonl --load emb_out/sentence-transformers --output mined.jsonl \\
        --num-negatives 5 --range-min 10 --range-max 100 --relative-margin 0.05

--pairs: JSON lines {"query": .., "positive": ..}; --corpus: a BEIR corpus.jsonl (default the
pairs' positives). --load: a megabert checkpoint, a transformers BERT / ModernBERT dir, or a
sentence-transformers export (finetune_embeddings.py's: its pooling, normalisation, prompts and
max_seq_length are the defaults). --query-prompt, --document-prompt and the lengths format the
texts as finetune_embeddings.py does. The corpus is embedded sharded over the data-parallel
ranks (--micro-batch-size texts a batch, a progress bar on rank 0) and searched exactly on the
device (--faiss: faiss' IndexFlatIP). --output: the pairs, each with a "negative" list, as
finetune_embeddings.py --train-file reads them. See megabert.tasks.embeddings.mining.
"""
from __future__ import annotations

import sys

from megabert.arguments import parse_cli
from megabert.errors import cli_main
from megabert.tasks.embeddings.mining import MiningTask, with_export_defaults
from megabert.training.driver import run_task


@cli_main
def main(argv=None) -> None:
    # An export's pooling, prompts and lengths are the defaults: the configs are made here, then run.
    cfg = with_export_defaults(parse_cli(argv, __doc__, MiningTask.cli))
    run_task(MiningTask, cfg=cfg)  # load the model -> embed -> search -> write --output


if __name__ == "__main__":
    sys.exit(main())
