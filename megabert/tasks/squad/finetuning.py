"""SQuAD as a fine-tuning task (megabert.training.finetune runs it): the features of the
json files, the QA model from --load, and predictions (start and end logits of every
feature -> answers), the official scores and the output files."""
from __future__ import annotations

import logging
import os

import numpy as np
import torch

from megabert.arguments import Cli
from megabert.checkpoint.start import Source
from megabert.config import FinetuneConfigs
from megabert.parallel import ParallelState
from megabert.tasks.squad.config import SquadConfig
from megabert.tasks.squad.evaluate import evaluate
from megabert.tasks.squad.examples import load_squad_json, read_squad_examples
from megabert.tasks.squad.features import convert_examples_to_features, features_to_tensors
from megabert import model_classes
from megabert.model_family import task_model_class_name
from megabert.tasks.squad.model import BertForQuestionAnswering
from megabert.tasks.squad.postprocess import postprocess_predictions
from megabert.training.finetune import FinetuneTask, Predictor, load_task_model, write_json
from megabert.training.strategy import TrainingTask

logger = logging.getLogger(__name__)


def qa_task() -> TrainingTask:
    """QuestionAnsweringOutput -> (mean of the start and end cross entropies, {"qa_loss"})."""
    return TrainingTask(inputs=("input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions",
                                "token_positions"),
                output_loss=lambda out: (out.loss, {"qa_loss": out.loss}))


def load_qa_model(cfg: FinetuneConfigs, pretrained: Source, ps: ParallelState, vocab_size: int) -> BertForQuestionAnswering:
    """BertForQuestionAnswering from --load (megabert checkpoint of any TP layout, or a
    Hugging Face / TF directory); the QA head is new unless the checkpoint already has one."""
    # The --load's family (a transformers dir or a megabert checkpoint of one) says the span head.
    model_class = model_classes.by_name(task_model_class_name(pretrained, "question_answering"))
    return load_task_model(model_class, cfg, pretrained, ps, vocab_size)


class SquadTask(FinetuneTask):
    """SQuAD v1.1 / v2.0: --train-file to fine-tune on, --predict-file to predict and score
    (predictions.json, nbest_predictions.json, v2.0's null_odds.json, eval_results.json)."""

    name = "squad"
    cli = Cli(SquadConfig)

    @property
    def training_task(self) -> TrainingTask:
        return qa_task()

    def check_inputs(self) -> None:
        for path in (self.config.train_file, self.config.predict_file):
            if path:
                load_squad_json(path)

    def load_model(self, ps: ParallelState, vocab_size: int) -> torch.nn.Module:
        return load_qa_model(self.cfg, self.pretrained, ps, vocab_size)

    def features(self, path: str, tokenizer, is_training: bool):
        ft = self.config
        examples = read_squad_examples(path, is_training=is_training,
                                       version_2_with_negative=ft.version_2_with_negative)
        feats = convert_examples_to_features(examples, tokenizer, max_seq_length=ft.max_seq_length,
                                             doc_stride=ft.doc_stride, max_query_length=ft.max_query_length,
                                             is_training=is_training)
        logger.info("%s: %d questions -> %d features", path, len(examples), len(feats))
        return examples, feats

    def train_tensors(self, tokenizer):
        if not self.config.train_file:
            return None
        return features_to_tensors(self.features(self.config.train_file, tokenizer, is_training=True)[1])

    def predict(self, tokenizer, predictor: Predictor) -> None:
        ft = self.config
        if not ft.predict_file:
            return
        examples, feats = self.features(ft.predict_file, tokenizer, is_training=False)
        tensors = features_to_tensors(feats)
        arrays = predictor.outputs(tensors, lambda out: (out.start_logits, out.end_logits))
        if not predictor.writes:
            return
        start, end = arrays if arrays is not None else [np.zeros((0, ft.max_seq_length), np.float32)] * 2
        predictions, nbest, null_odds = postprocess_predictions(
            examples, feats, start, end, n_best_size=ft.n_best_size, max_answer_length=ft.max_answer_length,
            version_2_with_negative=ft.version_2_with_negative, null_score_diff_threshold=ft.null_score_diff_threshold)
        os.makedirs(ft.output_dir, exist_ok=True)
        outputs = {"predictions.json": predictions, "nbest_predictions.json": nbest}
        if ft.version_2_with_negative:
            outputs["null_odds.json"] = null_odds
        for name, value in outputs.items():  # before scoring, which needs gold answers
            write_json(os.path.join(ft.output_dir, name), value)
        results = evaluate(load_squad_json(ft.predict_file), predictions,
                           "2.0" if ft.version_2_with_negative else "1.1")
        write_json(os.path.join(ft.output_dir, "eval_results.json"), results)
        figures = " | ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in results.items())
        print(f"{ft.predict_file}: {figures} -> {ft.output_dir}", flush=True)
