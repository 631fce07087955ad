"""Fine-tune BERT on SQuAD v1.1 / v2.0, predict and score, with tensor, pipeline and data
parallelism and ZeRO (--deepspeed --zero-stage N).

    torchrun --nproc-per-node 2 finetune_squad.py --tensor-model-parallel-size 2 \\
        --load bert-base-uncased/ --vocab-file bert-base-uncased/vocab.txt \\
        --train-file train-v1.1.json --predict-file dev-v1.1.json --output-dir squad_out \\
        --max-seq-length 384 --doc-stride 128 --max-query-length 64 --epochs 2 --lr 3e-5 \\
        --micro-batch-size 12 --global-batch-size 24 --seed 42

--load takes a megabert checkpoint (pretrain_bert.py --save, any TP layout) or a Hugging
Face BERT directory. Writes predictions.json (id -> text), nbest_predictions.json,
null_odds.json (v2.0) and eval_results.json (the official evaluation's figures) to
--output-dir; --save also keeps the fine-tuned checkpoint. Omit --train-file to predict
only, --predict-file to train only.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys

import megabert
from megabert.arguments import parse_finetune_args
from megabert.data import build_tokenizer
from megabert.tasks.squad.config import SquadConfig
from megabert.tasks.squad.examples import load_squad_json, read_squad_examples
from megabert.tasks.squad.evaluate import evaluate
from megabert.tasks.squad.features import convert_examples_to_features, features_to_tensors
from megabert.tasks.squad.postprocess import postprocess_predictions
from megabert.errors import cli_main
from megabert.training.build import build_trainer
from megabert.tasks.squad.finetuning import (feature_batches, load_qa_model, num_train_steps, predict_logits, qa_task,
                                          resolve_vocab_file)
from megabert.training.metrics import bert_flops_per_sample, configure_process_logging
from megabert.training.resolve import resolve_run

logger = logging.getLogger("megabert")


def features(path, tokenizer, ft, is_training):
    examples = read_squad_examples(path, is_training=is_training, version_2_with_negative=ft.version_2_with_negative)
    feats = convert_examples_to_features(examples, tokenizer, max_seq_length=ft.max_seq_length,
                                         doc_stride=ft.doc_stride, max_query_length=ft.max_query_length,
                                         is_training=is_training)
    logger.info("%s: %d questions -> %d features", path, len(examples), len(feats))
    return examples, feats


def train(run, ps, model, tokenizer):
    """Fine-tunes `model` in place; returns the Trainer (close it after predicting: a
    ZeRO-3 engine holds the partitioned weights until then)."""
    ft, t = run.finetune, run.train
    _, feats = features(ft.train_file, tokenizer, ft, is_training=True)
    batch = run.batch
    # --load named the pre-trained model (already loaded); --save keeps the fine-tuned one.
    train_cfg = dataclasses.replace(t, load=None, train_iters=num_train_steps(len(feats), ft, batch.global_batch_size))
    logger.info("fine-tuning for %d steps of %d features (%.2f epochs)", train_cfg.train_iters,
                batch.global_batch_size, train_cfg.train_iters * batch.global_batch_size / len(feats))
    tensors = features_to_tensors(feats)
    trainer = build_trainer(
        model, ps, dataclasses.replace(run, train=train_cfg), qa_task(),
        lambda consumed: feature_batches(tensors, global_batch=batch.global_batch_size,
                                         micro_batch=t.micro_batch_size, dp_rank=ps.dp_rank, dp_size=ps.dp_size,
                                         seed=t.seed),
        flops_per_sample=bert_flops_per_sample(model.config, ft.max_seq_length, masked_tokens=0),
        checkpoint_extra={"train": dataclasses.asdict(train_cfg), "optim": dataclasses.asdict(run.optim),
                          "finetune": dataclasses.asdict(ft)})
    trainer.train()
    return trainer


def write_json(output_dir: str, files: dict) -> None:
    for name, value in files.items():
        with open(os.path.join(output_dir, name), "w", encoding="utf-8") as f:
            json.dump(value, f, indent=2, ensure_ascii=False)


def predict(cfg, ps, model, tokenizer) -> None:
    ft = cfg.finetune
    examples, feats = features(ft.predict_file, tokenizer, ft, is_training=False)
    start, end = predict_logits(model, features_to_tensors(feats), ps, ft.predict_batch_size or
                                cfg.train.micro_batch_size, cfg.train.bf16, cfg.train.fp16)
    if ps.rank != 0:
        return
    predictions, nbest, null_odds = postprocess_predictions(
        examples, feats, start, end, n_best_size=ft.n_best_size, max_answer_length=ft.max_answer_length,
        version_2_with_negative=ft.version_2_with_negative, null_score_diff_threshold=ft.null_score_diff_threshold)
    os.makedirs(ft.output_dir, exist_ok=True)
    outputs = {"predictions.json": predictions, "nbest_predictions.json": nbest}
    if ft.version_2_with_negative:
        outputs["null_odds.json"] = null_odds
    write_json(ft.output_dir, outputs)  # before scoring, which needs gold answers
    results = evaluate(load_squad_json(ft.predict_file), predictions, "2.0" if ft.version_2_with_negative else "1.1")
    write_json(ft.output_dir, {"eval_results.json": results})
    figures = " | ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in results.items())
    print(f"{ft.predict_file}: {figures} -> {ft.output_dir}", flush=True)


@cli_main
def main(argv=None) -> None:
    cfg = parse_finetune_args(argv, description=__doc__, task_config=SquadConfig)
    ps = megabert.init_parallel(cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size,
                                backend=cfg.parallel.distributed_backend,
                                timeout_minutes=cfg.parallel.distributed_timeout_minutes)
    configure_process_logging(ps.is_logging_rank)
    tokenizer = build_tokenizer(cfg.finetune.tokenizer_type, resolve_vocab_file(cfg))
    for path in (cfg.finetune.train_file, cfg.finetune.predict_file):
        if path:
            load_squad_json(path)  # a missing or malformed file stops the run before the model loads
    model = load_qa_model(cfg, ps, tokenizer.vocab_size)
    run = resolve_run(cfg, ps, model.config)  # the layout, the batch and the DeepSpeed JSON, checked once
    trainer = train(run, ps, model, tokenizer) if cfg.finetune.train_file else None
    try:
        if cfg.finetune.predict_file:
            predict(cfg, ps, model, tokenizer)
    finally:
        if trainer is not None:
            trainer.close()
    megabert.destroy_parallel()


if __name__ == "__main__":
    sys.exit(main())
