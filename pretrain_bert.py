"""Pre-train BERT (masked LM + SOP/NSP) with tensor and data parallelism and ZeRO.

    torchrun --nproc-per-node 2 pretrain_bert.py --preset bert-base --tensor-model-parallel-size 2 \\
        --data-path my-corpus_text_sentence --vocab-file vocab.txt --seq-length 128 \\
        --micro-batch-size 32 --global-batch-size 256 --train-iters 100000 --lr 1e-4 --save ckpt/

Flags are Megatron-LM's; `--help` lists them. Also runs under the deepspeed launcher,
mpirun and srun, or as one process.
"""
from __future__ import annotations

import logging
import sys

import megabert
import megabert.planning
from megabert.arguments import parse_args
from megabert.errors import cli_main
from megabert.parallel.layout import BatchLayout
from megabert.training.metrics import configure_process_logging
from megabert.tasks.pretraining.task import build_pretraining, checked_batches, infinite, validate_run


def build_data(cfg, ps, tokenizer):
    """Train/valid loaders positioned by consumed samples (Megatron's sample counts)."""
    from megabert.data import build_pretraining_data_loader
    from megabert.tasks.pretraining.datasets import build_train_valid_test_datasets

    t = cfg.train
    global_batch = BatchLayout.of(t.micro_batch_size, t.global_batch_size, ps.dp_size).global_batch_size
    evals = (t.train_iters // t.eval_interval + 1) if t.eval_interval else 0
    num_samples = (t.train_iters * global_batch, evals * t.eval_iters * global_batch, t.eval_iters * global_batch)
    train_ds, valid_ds, _ = build_train_valid_test_datasets(cfg.data, tokenizer, num_samples, t.seed,
                                                            cfg.model.bert_binary_head)
    source = " ".join(cfg.data.data_path)

    def loader(ds, consumed):
        return build_pretraining_data_loader(ds, consumed, t.micro_batch_size, ps.dp_rank, ps.dp_size,
                                             cfg.data.num_workers)

    def train_batches(consumed):
        return checked_batches(infinite(lambda: loader(train_ds, consumed)), tokenizer.vocab_size, source)

    valid_batches = None
    if valid_ds is not None and evals:
        def valid_batches():
            return iter(checked_batches(loader(valid_ds, 0), tokenizer.vocab_size, source))
    return train_batches, valid_batches


def log_memory_preflight(cfg, ps, vocab_size: int) -> None:
    """Before any model tensor is allocated: the planner's predicted per-rank peak against
    --memory-budget-gb (default the GPU's memory; no check on CPU without the flag). A
    layout that will not fit is named with the flags that would make it fit, instead of an
    out-of-memory error minutes later; one that fits gets one info line."""
    check = megabert.planning.preflight(cfg, ps.dp_size, ps.device, vocab_size=vocab_size)
    if check is not None:
        logging.getLogger("megabert").log(logging.INFO if check.fits else logging.WARNING, check.message())


@cli_main
def main(argv=None) -> None:
    cfg = parse_args(argv, description=__doc__)
    ps = megabert.init_parallel(cfg.parallel.tensor_model_parallel_size,
                                cfg.parallel.pipeline_model_parallel_size,
                                backend=cfg.parallel.distributed_backend,
                                timeout_minutes=cfg.parallel.distributed_timeout_minutes)
    configure_process_logging(ps.is_logging_rank)
    validate_run(cfg, ps)
    from megabert.data import build_tokenizer

    if not cfg.data.data_path:
        raise megabert.ConfigError("--data-path is required: a dataset prefix made by tools/preprocess_data.py")
    tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.vocab_file)
    if ps.is_logging_rank:
        log_memory_preflight(cfg, ps, tokenizer.vocab_size)
    train_batches, valid_batches = build_data(cfg, ps, tokenizer)
    trainer = build_pretraining(cfg, ps, tokenizer.vocab_size, train_batches, valid_batches)
    try:
        state = trainer.train()
    finally:
        trainer.close()
    if ps.is_logging_rank:
        print(f"done: iteration {state.iteration}, {state.consumed_samples} samples", flush=True)
    megabert.destroy_parallel()


if __name__ == "__main__":
    sys.exit(main())
