"""Fine-tune BERT into a sentence-embedding model for retrieval (a bi-encoder trained with
InfoNCE over in-batch and hard negatives), score it on a BEIR-layout dev set and export it
for sentence-transformers; with tensor, pipeline and data parallelism.

    torchrun --nproc-per-node 4 finetune_embeddings.py --train-file pairs.jsonl \\
        --eval-dir beir/scifact --load bert-base-uncased/ --output-dir emb_out \\
        --max-seq-length 128 --epochs 1 --lr 2e-5 --micro-batch-size 32 --global-batch-size 128

--train-file: JSON lines {"query": .., "positive": .., "negative": .. (optional, a string or
a list)}, one file or several. Every query is scored against the positives and hard negatives of the whole
global batch (every DP rank's, every micro-batch's), so DP=4 x micro-batch 32 trains as one
rank with batch 128; --embedding-chunk-size N bounds activation memory to N examples at a
time (gradient cache) without changing the loss or the gradients. --pooling mean|cls,
--no-normalize (dot product instead of cosine), --temperature (0.05). --eval-dir: a BEIR
dir (corpus.jsonl, queries.jsonl, qrels/dev.tsv); eval_results.json gets ndcg_at_10,
mrr_at_10, recall_at_10 and recall_at_100. --output-dir/sentence-transformers/ is the model
as sentence_transformers.SentenceTransformer loads it. --save keeps the fine-tuned model
and an interrupted run resumes from it when the same command is run again.

The retrieval recipe (docs/retrieval.md): --query-prompt / --document-prompt and
--query-max-length / --document-max-length (training, evaluation and the export's prompts);
--matryoshka-dims 768,512,... (--matryoshka-weights; scores per size); --no-duplicates (no
text twice in a global batch); several --train-file (each global batch from one,
--dataset-sampling proportional|round_robin, --dataset-weights); --eval-interval N with
--keep-best ndcg_at_10; hard negatives from tools/mine_hard_negatives.py.
"""
from __future__ import annotations

import sys

from megabert.errors import cli_main
from megabert.tasks.embeddings.finetuning import EmbeddingsTask
from megabert.training.driver import run_task


@cli_main
def main(argv=None) -> None:  # resolve -> load -> train (resuming --save) -> evaluate and export
    run_task(EmbeddingsTask, argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
