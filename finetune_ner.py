"""Fine-tune BERT for token classification (named entities: CoNLL-2003 and the like), score
the validation file and tag the test file, with tensor, pipeline and data parallelism and
ZeRO (--deepspeed --zero-stage N).

    torchrun --nproc-per-node 2 finetune_ner.py --tensor-model-parallel-size 2 \\
        --train-file conll2003/train.txt --validation-file conll2003/valid.txt \\
        --test-file conll2003/test.txt --load bert-base-cased/ --tokenizer-type BertWordPieceCase \\
        --output-dir ner_out --max-seq-length 128 --epochs 3 --lr 5e-5 \\
        --micro-batch-size 32 --global-batch-size 32 --seed 42

Files are CoNLL (one token per line, its tag in the last column, a blank line between
sentences, -DOCSTART- lines skipped) or JSON lines (.json/.jsonl: {"tokens": [...],
"ner_tags": ["B-PER", ...]}); tags are taken as they come (IOB1, IOB2, IOBES), the label set
from the training file. Only a word's first sub-word is labelled (--label-all-tokens: all);
a sentence longer than --max-seq-length is cut into overlapping windows (--stride) and each
word is predicted from the window where it sits most central; --pack-sequences trains on rows
filled with whole features (evaluation stays unpacked). Writes eval_results.json
(run_ner.py's keys: eval_precision, eval_recall, eval_f1 at the entity level as seqeval
computes them, eval_accuracy) and predictions.txt (`word tag` lines, a blank line between
sentences) to --output-dir; --save keeps the fine-tuned model with its tags (convert_hf.py
export makes it a transformers BertForTokenClassification), and an interrupted run resumes
from it when the same command is run again.
"""
from __future__ import annotations

import sys

from megabert.errors import cli_main
from megabert.tasks.ner.finetuning import NerTask
from megabert.training.driver import run_task


@cli_main
def main(argv=None) -> None:  # resolve -> load -> train (resuming --save) -> evaluate and predict
    run_task(NerTask, argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
