"""Sentence embeddings as a fine-tuning task (megabert.training.finetune runs it): the
training pairs, the bi-encoder from --load, the contrastive step (directly, or through the
gradient cache), and evaluation on a BEIR dir (eval_results.json) with the export to
sentence-transformers."""
from __future__ import annotations

import logging
import os
from typing import Optional

import numpy as np
import torch

from megabert.checkpoint.start import Source
from megabert.config import FinetuneConfigs
from megabert.errors import ConfigError
from megabert.families import recipe
from megabert.model.registry import MODEL_CLASSES
from megabert.model_family import checkpoint_model_config, task_model_class_name
from megabert.parallel import ParallelState
from megabert.tasks.embeddings.data import BeirSet, Pair, read_beir, read_pairs
from megabert.tasks.embeddings.export import gather_whole_model, write_sentence_transformers
from megabert.tasks.embeddings.features import group_texts, pairs_to_tensors, texts_per_pair, texts_to_tensors
from megabert.tasks.embeddings.grad_cache import (EMBEDDING_FIELDS, ContrastiveObjective, GradientCacheRunner,
                                                   check_cache_layout, check_chunk_size)
from megabert.tasks.embeddings.metrics import per_query_metrics
from megabert.tasks.embeddings.model import BertForSentenceEmbedding, EmbeddingOptions
from megabert.training.build import build_runner
from megabert.training.finetune import FinetuneTask, Predictor, load_task_model, write_json
from megabert.training.resolve import ResolvedRun
from megabert.training.strategy import TrainingTask
from megabert.training.trainer import Trainer

logger = logging.getLogger(__name__)

WORDPIECE = ("BertWordPieceLowerCase", "BertWordPieceCase")


def encode(texts: list[str], tokenizer, predictor: Predictor, max_seq_length: int) -> np.ndarray:
    """[len(texts), h] float32 embeddings, as the model (in eval mode) computes them, on every
    rank. Texts travel T to a row, the model's fixed texts per example."""
    if not texts:
        return np.zeros((0, predictor.model.config.hidden_size), np.float32)
    t = predictor.model.options.texts_per_example
    rows = group_texts(texts_to_tensors(texts, tokenizer, max_seq_length), t)
    out = predictor.outputs(rows, lambda o: (o.embeddings,))[0]  # [rows, T, h]
    return out.reshape(-1, out.shape[-1])[:len(texts)]


def score(queries: np.ndarray, passages: np.ndarray, beir: BeirSet, block: int = 256) -> dict[str, float]:
    """The retrieval metrics of the embeddings: similarities are the dot products of the
    (normalised, by default) embeddings, taken a block of queries at a time (a [block,
    passages] matrix in memory, not [queries, passages])."""
    per_query: dict[str, list[float]] = {}
    for i in range(0, len(queries), block):
        scores = queries[i:i + block].astype(np.float32) @ passages.astype(np.float32).T
        for k, v in per_query_metrics(scores, beir.query_ids[i:i + block], beir.corpus_ids, beir.qrels).items():
            per_query.setdefault(k, []).extend(v)
    return {k: float(np.mean(v)) for k, v in per_query.items()}


class EmbeddingsTask(FinetuneTask):
    """--train-file to fine-tune on, --eval-dir (BEIR) to score into eval_results.json; the
    model goes to --output-dir/sentence-transformers/."""

    name = "embeddings"

    def __init__(self, cfg: FinetuneConfigs, pretrained: Source):
        super().__init__(cfg, pretrained)
        self.pairs: Optional[list[Pair]] = None
        self.beir: Optional[BeirSet] = None
        self.objective: Optional[ContrastiveObjective] = None
        self.model: Optional[BertForSentenceEmbedding] = None
        self.trainer: Optional[Trainer] = None
        # A --load of a family with a tokenizer.json (a transformers dir or a megabert checkpoint
        # of one) exports with its tokenizer.json.
        loaded = checkpoint_model_config(pretrained)
        self.tokenizer_json = loaded is not None and recipe(loaded).tokenizer == "tokenizer.json"
        self.model_class = MODEL_CLASSES[task_model_class_name(pretrained, "embeddings")]

    @property
    def training_task(self) -> TrainingTask:
        return TrainingTask(inputs=EMBEDDING_FIELDS, output_loss=self.objective)

    def check_inputs(self) -> None:
        if self.config.output_dir and self.tokenizer_json and self.config.tokenizer_type != "HuggingFaceTokenizer":
            raise ConfigError(f"--tokenizer-type {self.config.tokenizer_type}: the sentence-transformers export of a "
                              f"model with a tokenizer.json (ModernBERT, EuroBERT, ...) copies it; use "
                              f"HuggingFaceTokenizer with --vocab-file PATH/tokenizer.json (the default for such a "
                              f"--load)")
        if self.config.output_dir and not self.tokenizer_json and self.config.tokenizer_type not in WORDPIECE:
            raise ConfigError(f"--tokenizer-type {self.config.tokenizer_type}: the sentence-transformers export "
                              f"writes a BERT WordPiece tokenizer; use {' or '.join(WORDPIECE)} with a vocab.txt")
        check_chunk_size(self.cfg.train.micro_batch_size, self.config.embedding_chunk_size)
        if self.config.train_file:
            self.pairs = read_pairs(self.config.train_file)
        if self.config.eval_dir:
            self.beir = read_beir(self.config.eval_dir)

    def load_model(self, ps: ParallelState, vocab_size: int) -> torch.nn.Module:
        # Unpadded encoder: the pooling reads real tokens alone and retrieval texts leave much
        # of max_seq_length to padding.
        model = load_task_model(self.model_class, self.cfg, self.pretrained, ps, vocab_size, unpad_input=True)
        ft = self.config
        model.options = EmbeddingOptions(pooling=ft.pooling, normalize=ft.normalize,
                                         texts_per_example=texts_per_pair(self.pairs) if self.pairs else 1)
        self.objective = ContrastiveObjective(ft.temperature, ps.dp_group)
        self.model = model
        return model

    def train_tensors(self, tokenizer):
        if not self.pairs:
            return None
        tensors = pairs_to_tensors(self.pairs, tokenizer, self.config.max_seq_length)
        logger.info("%s: %d pairs, %d texts each (query, positive, up to %d hard negatives)", self.config.train_file,
                    len(self.pairs), tensors["text_mask"].size(1), tensors["text_mask"].size(1) - 2)
        return tensors

    def prepare_trainer(self, trainer: Trainer, run: ResolvedRun) -> None:
        """One micro-batch per rank and no chunk size: the step as it is (the loss straight
        from the model's output). Otherwise the gradient cache, over pieces of the chunk
        size (or of the micro-batch)."""
        self.trainer = trainer
        if trainer.flops_per_sample:
            # The driver counts one text of max_seq_length per feature; ours are T texts (the
            # model's FLOPs: the cache's second forward is not counted, as recompute is not).
            trainer.flops_per_sample *= self.model.options.texts_per_example
        strategy = trainer.strategy
        chunk, t = self.config.embedding_chunk_size, run.train
        if chunk is None and run.batch.num_micro_batches == 1:
            return
        check_cache_layout(run.deepspeed_config is not None)
        piece = chunk or t.micro_batch_size
        pieces = run.batch.num_micro_batches * (t.micro_batch_size // piece)
        inner = build_runner(strategy.model, strategy.ps, self.training_task, seq_length=run.seq_length,
                             micro_batch_size=piece, num_micro_batches=pieces, bf16=t.bf16, fp16=t.fp16)
        strategy.runner = GradientCacheRunner(inner, strategy.model, self.objective, strategy.ps, piece_size=piece,
                                              reducer=getattr(strategy, "reducer", None))
        if strategy.ps.is_logging_rank:
            logger.info("gradient cache: negatives from the global batch of %d, taken through the model %d examples "
                        "at a time (%d pieces per rank per step)", run.batch.global_batch_size, piece, pieces)

    def predict(self, tokenizer, predictor: Predictor) -> None:
        """eval_results.json over --eval-dir, then the sentence-transformers export."""
        ft = self.config
        # The trained weights as the strategy holds them (a ZeRO-3 engine's partitions
        # gathered), taken before the evaluation's forward passes, as a save would take them:
        # ZeRO-3 may leave parameters prefetched (in flight) after a forward.
        local = self.trainer.strategy.cpu_state_dict(keep=True) if self.trainer is not None else None
        full = gather_whole_model(self.model, local)  # collective
        results = None
        if self.beir is not None:
            beir = self.beir
            queries = encode(beir.queries, tokenizer, predictor, ft.max_seq_length)
            passages = encode(beir.passages, tokenizer, predictor, ft.max_seq_length)
            results = score(queries, passages, beir)
        if not predictor.writes:
            return
        os.makedirs(ft.output_dir, exist_ok=True)
        if results is not None:
            write_json(os.path.join(ft.output_dir, "eval_results.json"), results)
            figures = " | ".join(f"{k} {v:.4f}" for k, v in results.items())
            print(f"retrieval dev ({len(self.beir.query_ids)} queries, {len(self.beir.corpus_ids)} passages): "
                  f"{figures} -> {ft.output_dir}", flush=True)
        st_dir = os.path.join(ft.output_dir, "sentence-transformers")
        write_sentence_transformers(st_dir, self.model, full, ft.vocab_file,
                                    lower_case=ft.tokenizer_type == "BertWordPieceLowerCase",
                                    max_seq_length=ft.max_seq_length)
        print(f"sentence-transformers model -> {st_dir}", flush=True)
