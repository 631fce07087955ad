"""Fine-tune BERT on SQuAD v1.1 / v2.0, predict and score, with tensor, pipeline and data
parallelism and ZeRO (--deepspeed --zero-stage N).

    torchrun --nproc-per-node 2 finetune_squad.py --tensor-model-parallel-size 2 \\
        --load bert-base-uncased/ --vocab-file bert-base-uncased/vocab.txt \\
        --train-file train-v1.1.json --predict-file dev-v1.1.json --output-dir squad_out \\
        --max-seq-length 384 --doc-stride 128 --max-query-length 64 --epochs 2 --lr 3e-5 \\
        --micro-batch-size 12 --global-batch-size 24 --seed 42

--load takes a megabert checkpoint (pretrain_bert.py --save, any TP layout), a Hugging
Face or a Google TF BERT directory. Writes predictions.json (id -> text),
nbest_predictions.json, null_odds.json (v2.0) and eval_results.json (the official
evaluation's figures) to --output-dir. --save keeps the fine-tuned checkpoint (every
--save-interval steps, and at the end); an interrupted run resumes from it when the same
command is run again. Omit --train-file to predict only, --predict-file to train only.
"""
from __future__ import annotations

import sys

from megabert.errors import cli_main
from megabert.tasks.squad.finetuning import SquadTask
from megabert.training.driver import run_task


@cli_main
def main(argv=None) -> None:  # resolve -> load -> train (resuming --save) -> predict and score
    run_task(SquadTask, argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
