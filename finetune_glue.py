"""Fine-tune BERT on a GLUE task, score its dev set(s) and write the test set's GLUE
submission file, with tensor, pipeline and data parallelism and ZeRO (--deepspeed
--zero-stage N).

    torchrun --nproc-per-node 2 finetune_glue.py --tensor-model-parallel-size 2 \\
        --task-name mrpc --data-dir glue_data/MRPC --load bert-base-uncased/ \\
        --output-dir mrpc_out --max-seq-length 128 --epochs 3 --lr 2e-5 \\
        --micro-batch-size 32 --global-batch-size 32 --seed 42

--data-dir is the task's folder of the GLUE distribution, read as it is (train.tsv, dev.tsv or
MNLI's dev_matched.tsv / dev_mismatched.tsv, test.tsv); --train-file / --validation-file /
--test-file take other TSVs or CSV / JSON-lines files with named columns instead, as
run_glue.py's. --load takes a megabert checkpoint, a Hugging Face or a Google TF BERT
directory. Writes eval_results.json (run_glue.py's keys: eval_accuracy, eval_f1,
eval_matthews_correlation, eval_pearson, eval_spearmanr, MNLI's *_mm) and the submission
files ({TASK}.tsv: index<TAB>prediction) to --output-dir; --save keeps the fine-tuned model
(convert_hf.py export makes it a transformers BertForSequenceClassification), and an
interrupted run resumes from it when the same command is run again.
"""
from __future__ import annotations

import sys

from megabert.errors import cli_main
from megabert.tasks.glue.finetuning import GlueTask
from megabert.training.driver import run_task


@cli_main
def main(argv=None) -> None:  # resolve -> load -> train (resuming --save) -> evaluate and predict
    run_task(GlueTask, argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
