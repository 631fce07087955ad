"""Sentence embeddings as a fine-tuning task (megabert.training.finetune runs it): the
training pairs, the bi-encoder from --load, the contrastive step (directly, or through the
gradient cache), and evaluation on a BEIR dir (eval_results.json) with the export to
sentence-transformers."""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

import torch

from megabert.arguments import Cli
from megabert.checkpoint.start import Source
from megabert.config import FinetuneConfigs
from megabert.errors import ConfigError
from megabert.families import recipe
from megabert import model_classes
from megabert.checkpoint.reader import checkpoint_model_config
from megabert.model_family import task_model_class_name
from megabert.parallel import ParallelState
from megabert.tasks.embeddings.config import EMBEDDINGS_DEFAULTS, EmbeddingsConfig, number_list
from megabert.tasks.embeddings.data import BeirSet, Pair, read_beir, read_pairs
from megabert.tasks.embeddings.evaluation import BeirEvaluator
from megabert.tasks.embeddings.export import gather_whole_model, write_sentence_transformers
from megabert.tasks.embeddings.features import TextFormat, pairs_to_tensors, texts_per_pair
from megabert.tasks.embeddings.grad_cache import (EMBEDDING_FIELDS, ContrastiveObjective, GradientCacheRunner,
                                                   check_cache_layout, check_chunk_size)
from megabert.tasks.embeddings.loss import Matryoshka
from megabert.tasks.embeddings.model import BertForSentenceEmbedding, EmbeddingOptions
from megabert.tasks.embeddings.sampling import BatchPlan, TrainingFile, file_names, plan_batches
from megabert.training.build import build_runner
from megabert.training.finetune import FinetuneTask, Predictor, load_task_model, write_json
from megabert.training.resolve import ResolvedRun
from megabert.training.strategy import TrainingTask
from megabert.training.trainer import Trainer

logger = logging.getLogger(__name__)

WORDPIECE = ("BertWordPieceLowerCase", "BertWordPieceCase")


def load_embedding_model(cfg: FinetuneConfigs, pretrained: Source, ps: ParallelState, vocab_size: int,
                         texts_per_example: int) -> BertForSentenceEmbedding:
    """The bi-encoder from --load with the run's pooling and normalisation, as the loaded
    family's embedding model (megabert.families)."""
    model_class = model_classes.by_name(task_model_class_name(pretrained, "embeddings"))
    # Unpadded encoder: the pooling reads real tokens alone and retrieval texts leave much
    # of max_seq_length to padding.
    model = load_task_model(model_class, cfg, pretrained, ps, vocab_size, unpad_input=True)
    model.options = EmbeddingOptions(pooling=cfg.finetune.pooling, normalize=cfg.finetune.normalize,
                                     texts_per_example=texts_per_example)
    return model


class EmbeddingsTask(FinetuneTask):
    """--train-file to fine-tune on, --eval-dir (BEIR) to score into eval_results.json; the
    model goes to --output-dir/sentence-transformers/."""

    name = "embeddings"
    cli = Cli(EmbeddingsConfig, EMBEDDINGS_DEFAULTS)

    def __init__(self, cfg: FinetuneConfigs, pretrained: Source):
        super().__init__(cfg, pretrained)
        self.files: list[TrainingFile] = []
        self.pairs: Optional[list[Pair]] = None  # every file's, in order
        self.beir: Optional[BeirSet] = None
        self.objective: Optional[ContrastiveObjective] = None
        self.model: Optional[BertForSentenceEmbedding] = None
        self.trainer: Optional[Trainer] = None
        self.plan: Optional[BatchPlan] = None
        self.evaluator: Optional[BeirEvaluator] = None
        self.predictor: Optional[Predictor] = None
        self.tokenizer = None
        self.best: Optional[tuple[float, int]] = None  # --keep-best: (value, step) of the exported model
        self.fmt = TextFormat.of(self.config)
        # A --load of a family with a tokenizer.json (a transformers dir or a megabert checkpoint
        # of one) exports with its tokenizer.json.
        loaded = checkpoint_model_config(pretrained)
        self.tokenizer_json = loaded is not None and recipe(loaded).tokenizer == "tokenizer.json"

    @property
    def training_task(self) -> TrainingTask:
        return TrainingTask(inputs=EMBEDDING_FIELDS, output_loss=self.objective)

    def check_inputs(self) -> None:
        if self.config.output_dir and self.tokenizer_json and self.config.tokenizer_type != "HuggingFaceTokenizer":
            raise ConfigError(f"--tokenizer-type {self.config.tokenizer_type}: the sentence-transformers export of a "
                              f"model with a tokenizer.json (ModernBERT, EuroBERT, ...) copies it; use "
                              f"HuggingFaceTokenizer with --vocab-file PATH/tokenizer.json (the default for such a "
                              f"--load)")
        if self.config.output_dir and self.config.tokenizer_type not in (*WORDPIECE, "HuggingFaceTokenizer"):
            raise ConfigError(f"--tokenizer-type {self.config.tokenizer_type}: the sentence-transformers export "
                              f"writes a BERT WordPiece tokenizer or copies a tokenizer.json; use "
                              f"{' or '.join(WORDPIECE)} with a vocab.txt, or HuggingFaceTokenizer")
        check_chunk_size(self.cfg.train.micro_batch_size, self.config.embedding_chunk_size)
        paths = self.config.train_file or []
        start = 0
        for name, path in zip(file_names(paths), paths):
            pairs = read_pairs(path)
            self.files.append(TrainingFile(name, path, start, pairs))
            start += len(pairs)
        if self.files:
            self.pairs = [p for f in self.files for p in f.pairs]
        if self.config.eval_dir:
            self.beir = read_beir(self.config.eval_dir)

    def load_model(self, ps: ParallelState, vocab_size: int) -> torch.nn.Module:
        ft = self.config
        model = load_embedding_model(self.cfg, self.pretrained, ps, vocab_size,
                                     texts_per_pair(self.pairs) if self.pairs else 1)
        matryoshka = ft.matryoshka()
        if matryoshka is not None and max(matryoshka[0]) > model.config.hidden_size:
            raise ConfigError(f"--matryoshka-dims {ft.matryoshka_dims}: {max(matryoshka[0])} exceeds the model's "
                              f"hidden size {model.config.hidden_size} ({self.cfg.train.load})")
        self.objective = ContrastiveObjective(
            ft.temperature, ps.dp_group, Matryoshka(*matryoshka, normalize=ft.normalize) if matryoshka else None)
        self.model = model
        return model

    def train_tensors(self, tokenizer):
        self.tokenizer = tokenizer
        if not self.pairs:
            return None
        tensors = pairs_to_tensors(self.pairs, tokenizer, self.fmt)
        for f in self.files:
            logger.info("%s: %d pairs, %d texts each (query, positive, up to %d hard negatives)", f.path,
                        len(f.pairs), tensors["text_mask"].size(1), tensors["text_mask"].size(1) - 2)
        return tensors

    def train_batches(self, tensors, run: ResolvedRun, ps: ParallelState):
        """Several files (each global batch from one) or --no-duplicates: BatchPlan's order;
        otherwise the driver's shuffle."""
        ft = self.config
        if len(self.files) < 2 and ft.duplicates:
            return None
        weights = number_list(ft.dataset_weights, "--dataset-weights", float) if ft.dataset_weights else None
        self.plan = BatchPlan(self.files, global_batch=run.batch.global_batch_size, seed=run.train.seed,
                              no_duplicates=not ft.duplicates, sampling=ft.dataset_sampling, weights=weights)
        several = len(self.files) > 1

        def on_step(d: int) -> None:
            # The per-file loss's name (ContrastiveObjective.metrics) for the step about to run.
            self.objective.dataset = self.files[d].name if several else None

        def batches(consumed: int):
            return plan_batches(self.plan, tensors, micro_batch=run.train.micro_batch_size, dp_rank=ps.dp_rank,
                                dp_size=ps.dp_size, consumed=consumed, on_step=on_step)

        return batches

    def prepare_trainer(self, trainer: Trainer, run: ResolvedRun) -> None:
        """One micro-batch per rank and no chunk size: the step as it is (the loss straight
        from the model's output). Otherwise the gradient cache, over pieces of the chunk
        size (or of the micro-batch). --eval-interval: an evaluation after every N steps."""
        self.trainer = trainer
        if trainer.flops_per_sample:
            # The driver counts one text of max_seq_length per feature; ours are T texts (the
            # model's FLOPs: the cache's second forward is not counted, as recompute is not).
            trainer.flops_per_sample *= self.model.options.texts_per_example
        strategy = trainer.strategy
        chunk, t = self.config.embedding_chunk_size, run.train
        if self.config.eval_interval:
            self.predictor = Predictor(self.model, strategy.ps, self.training_task,
                                       self.config.predict_batch_size or t.micro_batch_size, t.bf16, t.fp16)
            trainer.step_hooks.append(self._evaluate_while_training)
            self.best = self._best_so_far(trainer.state.iteration)
        if chunk is None and run.batch.num_micro_batches == 1:
            return
        check_cache_layout(run.deepspeed_config is not None)
        piece = chunk or t.micro_batch_size
        pieces = run.batch.num_micro_batches * (t.micro_batch_size // piece)
        inner = build_runner(strategy.model, strategy.ps, self.training_task, seq_length=run.seq_length,
                             micro_batch_size=piece, num_micro_batches=pieces, bf16=t.bf16, fp16=t.fp16)
        strategy.runner = GradientCacheRunner(inner, strategy.model, self.objective, strategy.ps, piece_size=piece,
                                              reducer=strategy.reducer)  # a LocalStrategy: DeepSpeed refused above
        if strategy.ps.is_logging_rank:
            logger.info("gradient cache: negatives from the global batch of %d, taken through the model %d examples "
                        "at a time (%d pieces per rank per step)", run.batch.global_batch_size, piece, pieces)

    # ------------------------------------------------------------------ evaluation and export

    def _evaluator(self, tokenizer) -> BeirEvaluator:
        if self.evaluator is None:
            matryoshka = self.config.matryoshka()
            self.evaluator = BeirEvaluator(self.beir, self.fmt, tokenizer, matryoshka[0] if matryoshka else None)
        return self.evaluator

    def _evaluate_while_training(self, it: int) -> None:
        """Trainer.step_hooks: every --eval-interval steps, score --eval-dir; with --keep-best,
        a new best is exported at once (so a resumed run still has it). The last step's
        evaluation is predict()'s."""
        if it % self.config.eval_interval or it == self.trainer.cfg.train_iters:
            return
        full = self._gather() if self.config.keep_best else None
        results = self._evaluator(self.tokenizer).evaluate(self.predictor)
        text = " | ".join(f"{k} {v:.4f}" for k, v in results.items())
        self.trainer.log.event(it, f"iteration {it} | retrieval dev: {text}",
                               {f"dev/{k}": v for k, v in results.items()},
                               record={f"dev_{k}": v for k, v in results.items()})
        if self.config.keep_best and self._improves(results):
            self.best = (results[self.config.keep_best], it)
            self._write(full, results, it)

    def _improves(self, results: dict) -> bool:
        return self.best is None or results[self.config.keep_best] > self.best[0]

    def _best_so_far(self, iteration: int) -> Optional[tuple[float, int]]:
        """--keep-best on a resumed run: the best exported before the interruption
        (--output-dir's eval_results.json of a step the checkpoint has passed), if any."""
        path = os.path.join(self.config.output_dir, "eval_results.json")
        if not self.config.keep_best or iteration == 0 or not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
        step = saved.get("step")
        if not isinstance(step, int) or step > iteration or self.config.keep_best not in saved:
            return None
        return float(saved[self.config.keep_best]), step

    def _gather(self) -> Optional[dict]:
        """The whole model's weights on rank 0 (collective). Taken as the strategy holds them
        (a ZeRO-3 engine's partitions gathered) and before an evaluation's forward passes, as
        a save takes them: ZeRO-3 may leave parameters prefetched (in flight) after a forward."""
        local = self.trainer.checkpoint.parts.model.state_dict() if self.trainer is not None else None
        return gather_whole_model(self.model, local)

    def _write(self, full: Optional[dict], results: Optional[dict], step: Optional[int]) -> None:
        """eval_results.json (under --keep-best with the step of the model) and the
        sentence-transformers dir, on rank 0."""
        ft = self.config
        if not self.predictor.writes:
            return
        os.makedirs(ft.output_dir, exist_ok=True)
        if results is not None:
            write_json(os.path.join(ft.output_dir, "eval_results.json"),
                       {**results, "step": step} if ft.keep_best else results)
        st_dir = os.path.join(ft.output_dir, "sentence-transformers")
        write_sentence_transformers(st_dir, self.model, full, ft.vocab_file,
                                    lower_case=ft.tokenizer_type == "BertWordPieceLowerCase",
                                    max_seq_length=ft.document_length,
                                    prompts={"query": ft.query_prompt, "document": ft.document_prompt})
        print(f"sentence-transformers model -> {st_dir}", flush=True)

    def predict(self, tokenizer, predictor: Predictor) -> None:
        """eval_results.json over --eval-dir, then the sentence-transformers export (with
        --keep-best, of the best model evaluated: this one, or an earlier one already exported)."""
        self.predictor = predictor
        if self.plan is not None and self.plan.keys is not None and predictor.writes:
            print(f"--no-duplicates: {len(self.plan.deferred_pairs)} pairs waited for a later global batch "
                  f"({self.plan.deferrals} deferrals in all)", flush=True)
        full = self._gather()
        results = None
        if self.beir is not None:
            results = self._evaluator(tokenizer).evaluate(predictor)
            if predictor.writes:
                figures = " | ".join(f"{k} {v:.4f}" for k, v in results.items())
                print(f"retrieval dev ({len(self.beir.query_ids)} queries, {len(self.beir.corpus_ids)} passages): "
                      f"{figures} -> {self.config.output_dir}", flush=True)
            if self.config.keep_best and not self._improves(results):
                if predictor.writes:
                    print(f"--keep-best {self.config.keep_best}: the model of step {self.best[1]} "
                          f"({self.best[0]:.4f}) stays exported", flush=True)
                return
        self._write(full, results, self.trainer.state.iteration if self.trainer is not None else 0)
