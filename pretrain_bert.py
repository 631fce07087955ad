"""Pre-train BERT (masked LM + SOP/NSP) with tensor and data parallelism and ZeRO.

    torchrun --nproc-per-node 2 pretrain_bert.py --preset bert-base --tensor-model-parallel-size 2 \\
        --data-path my-corpus_text_sentence --vocab-file vocab.txt --seq-length 128 \\
        --micro-batch-size 32 --global-batch-size 256 --train-iters 100000 --lr 1e-4 --save ckpt/

Flags are Megatron-LM's; `--help` lists them. Also runs under the deepspeed launcher,
mpirun and srun, or as one process.
"""
from __future__ import annotations

import sys

import megabert
import megabert.planning
from megabert.arguments import parse_args
from megabert.errors import cli_main
from megabert.paths import check_config_paths
from megabert.training.metrics import configure_process_logging
from megabert.data import build_tokenizer
from megabert.tasks.pretraining.batches import build_batches
from megabert.tasks.pretraining.task import build_pretraining
from megabert.training.resolve import check_pretraining_tokenizer, resolve_run


@cli_main
def main(argv=None) -> None:
    cfg = parse_args(argv, description=__doc__)
    check_config_paths(cfg)  # every file read and every directory written, before any process group or model
    ps = megabert.init_parallel(cfg.parallel.tensor_model_parallel_size,
                                cfg.parallel.pipeline_model_parallel_size,
                                backend=cfg.parallel.distributed_backend,
                                timeout_minutes=cfg.parallel.distributed_timeout_minutes)
    configure_process_logging(ps.is_logging_rank)
    run = resolve_run(cfg, ps)  # flags + DeepSpeed JSON, checked once; everything below reads it
    if not cfg.data.data_path:
        raise megabert.ConfigError("--data-path is required: a dataset prefix made by tools/preprocess_data.py")
    check_pretraining_tokenizer(run)
    tokenizer = build_tokenizer(run.data.tokenizer_type, run.data.vocab_file)
    if ps.is_logging_rank:  # the planner's predicted peak against --memory-budget-gb
        megabert.planning.log_preflight(run, ps.device, vocab_size=tokenizer.vocab_size)
    train_batches, valid_batches = build_batches(run, ps, tokenizer)
    trainer = build_pretraining(run, ps, tokenizer.vocab_size, train_batches, valid_batches)
    try:
        state = trainer.train()
    finally:
        trainer.close()
    if ps.is_logging_rank:
        print(f"done: iteration {state.iteration}, {state.consumed_samples} samples", flush=True)
    megabert.destroy_parallel()


if __name__ == "__main__":
    sys.exit(main())
