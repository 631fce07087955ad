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
(convert_hf.py export makes it a transformers BertForSequenceClassification).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys

import megabert
from megabert.arguments import parse_finetune_args
from megabert.data import build_tokenizer
from megabert.errors import cli_main
from megabert.tasks.glue.config import GLUE_DEFAULTS, GlueConfig
from megabert.tasks.glue.data import read_examples
from megabert.tasks.glue.finetuning import (eval_results, glue_files, glue_task, load_glue_model, predict_logits,
                                            tensors_of, write_json, write_submission)
from megabert.tasks.glue.tasks import TASKS
from megabert.training.build import build_trainer
from megabert.checkpoint.run_state import holds_checkpoint
from megabert.training.finetune import feature_batches, num_train_steps, resolve_vocab_file
from megabert.training.metrics import bert_flops_per_sample, configure_process_logging
from megabert.training.resolve import resolve_run

logger = logging.getLogger("megabert")


def train(run, ps, model, tokenizer, path):
    """Fine-tunes `model` in place; returns the Trainer (close it after predicting: a
    ZeRO-3 engine holds the partitioned weights until then)."""
    ft, t, batch = run.finetune, run.train, run.batch
    _, tensors = tensors_of(path, TASKS[ft.task_name], tokenizer, ft.max_seq_length)
    n = len(tensors["input_ids"])
    # --load named the pre-trained model (already loaded); --save keeps the fine-tuned one, and
    # once it holds a checkpoint of this run the same command resumes it (weights, optimizer,
    # RNG and data position), as pre-training's --save X --load X restarts do.
    resume = t.save if t.save and holds_checkpoint(t.save) else None
    train_cfg = dataclasses.replace(t, load=resume, train_iters=num_train_steps(n, ft, batch.global_batch_size))
    logger.info("fine-tuning %s for %d steps of %d examples (%.2f epochs)", ft.task_name, train_cfg.train_iters,
                batch.global_batch_size, train_cfg.train_iters * batch.global_batch_size / n)
    trainer = build_trainer(
        model, ps, dataclasses.replace(run, train=train_cfg), glue_task(),
        lambda consumed: feature_batches(tensors, global_batch=batch.global_batch_size, micro_batch=t.micro_batch_size,
                                         dp_rank=ps.dp_rank, dp_size=ps.dp_size, seed=t.seed,
                                         consumed=consumed),
        flops_per_sample=bert_flops_per_sample(model.config, ft.max_seq_length, masked_tokens=0),
        checkpoint_extra={"train": dataclasses.asdict(train_cfg), "optim": dataclasses.asdict(run.optim),
                          "finetune": dataclasses.asdict(ft)})
    trainer.train()
    return trainer


def evaluate_and_predict(cfg, ps, model, tokenizer, files) -> None:
    """eval_results.json over the dev set(s), then the submission file of each test set."""
    ft, task = cfg.finetune, TASKS[cfg.finetune.task_name]
    batch_size = ft.predict_batch_size or cfg.train.micro_batch_size

    def logits_of(path, test=False):
        _, tensors = tensors_of(path, task, tokenizer, ft.max_seq_length, test=test)
        return predict_logits(model, tensors, ps, batch_size, cfg.train.bf16, cfg.train.fp16), tensors

    results = {}
    for path, suffix in files.dev:
        logits, tensors = logits_of(path)
        results.update(eval_results(task, logits, tensors["labels"].numpy(), suffix))
    submissions = []
    for path, name in files.test:
        logits, _ = logits_of(path, test=True)
        submissions.append((os.path.join(ft.output_dir, f"{name}.tsv"), logits))
    if ps.rank != 0:
        return
    os.makedirs(ft.output_dir, exist_ok=True)
    for out, logits in submissions:
        write_submission(out, task, logits)
    if files.dev:
        write_json(os.path.join(ft.output_dir, "eval_results.json"), results)
        figures = " | ".join(f"{k} {v:.4f}" for k, v in results.items() if k not in ("eval_samples",))
        print(f"{task.name} dev: {figures} -> {ft.output_dir}", flush=True)
    for out, _ in submissions:
        print(f"{task.name} test predictions -> {out}", flush=True)


@cli_main
def main(argv=None) -> None:
    cfg = parse_finetune_args(argv, description=__doc__, task_config=GlueConfig, defaults=GLUE_DEFAULTS)
    ps = megabert.init_parallel(cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size,
                                backend=cfg.parallel.distributed_backend,
                                timeout_minutes=cfg.parallel.distributed_timeout_minutes)
    configure_process_logging(ps.is_logging_rank)
    # The vocab in use is recorded with the checkpoint (--save), where convert_hf.py export finds it.
    cfg = dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, vocab_file=resolve_vocab_file(cfg)))
    tokenizer = build_tokenizer(cfg.finetune.tokenizer_type, cfg.finetune.vocab_file)
    files = glue_files(cfg)
    task = TASKS[cfg.finetune.task_name]
    for path in [files.train] + [p for p, _ in files.dev]:
        if path:
            read_examples(path, task)  # a missing or malformed file stops the run before the model loads
    model = load_glue_model(cfg, ps, tokenizer.vocab_size)
    run = resolve_run(cfg, ps, model.config)  # the layout, the batch and the DeepSpeed JSON, checked once
    trainer = train(run, ps, model, tokenizer, files.train) if files.train else None
    try:
        if files.dev or files.test:
            evaluate_and_predict(cfg, ps, model, tokenizer, files)
    finally:
        if trainer is not None:
            trainer.close()
    megabert.destroy_parallel()


if __name__ == "__main__":
    sys.exit(main())
