"""Pre-train BERT (masked LM + SOP/NSP) with tensor and data parallelism and ZeRO.

    torchrun --nproc-per-node 2 pretrain_bert.py --preset bert-base --tensor-model-parallel-size 2 \\
        --data-path my-corpus_text_sentence --vocab-file vocab.txt --seq-length 128 \\
        --micro-batch-size 32 --global-batch-size 256 --train-iters 100000 --lr 1e-4 --save ckpt/

Flags are Megatron-LM's; `--help` lists them. Also runs under the deepspeed launcher,
mpirun and srun, or as one process.
"""
from __future__ import annotations

import sys

from megabert.errors import cli_main
from megabert.tasks.pretraining.task import PretrainingTask
from megabert.training.driver import run_task


@cli_main
def main(argv=None) -> None:
    run_task(PretrainingTask, argv, description=__doc__)  # resolve -> data -> model -> train (resuming --save) -> close


if __name__ == "__main__":
    sys.exit(main())
