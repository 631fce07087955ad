"""GLUE as a fine-tuning task (megabert.training.finetune runs it): the data files of a
run, the model from --load with the task's labels, and evaluation and test predictions
(eval_results.json with run_glue.py's keys, the GLUE submission files)."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megabert.arguments import Cli
from megabert.checkpoint.start import Source
from megabert.config import FinetuneConfigs
from megabert.data.packing import PackingSpec
from megabert.errors import CheckpointError
from megabert.parallel import ParallelState
from megabert.tasks.glue.config import GLUE_DEFAULTS, GlueConfig
from megabert.tasks.glue.data import GlueExample, read_examples, warn_unseen_labels
from megabert.tasks.glue.features import examples_to_tensors
from megabert.tasks.glue.metrics import glue_metrics
from megabert import model_classes
from megabert.model_family import task_model_class_name
from megabert.tasks.glue.model import BertForSequenceClassification
from megabert.tasks.glue.tasks import TASKS, GlueTaskSpec
from megabert.training.finetune import FinetuneTask, Predictor, load_task_model, write_json
from megabert.training.strategy import TrainingTask, mean_loss_task

logger = logging.getLogger(__name__)


def glue_task() -> TrainingTask:
    """SequenceClassifierOutput -> (cross entropy, or MSE for regression; {"glue_loss"}); in
    training the mean over the global batch's samples (packed rows hold different numbers)."""

    def samples(batch: dict) -> torch.Tensor:
        packed = batch.get("packed_seqlens")
        # A fill on the device, not torch.tensor(n, device=...): that copies from pageable host
        # memory, which waits for the device to drain first.
        return ((packed > 0).sum() if packed is not None
                else torch.full((), batch["labels"].numel(), dtype=torch.int64, device=batch["labels"].device))

    return mean_loss_task("glue_loss", ("input_ids", "token_type_ids", "attention_mask", "labels", "position_ids",
                                        "packed_seqlens", "token_positions"), samples)


@dataclass(frozen=True)
class GlueFiles:
    """The files a run reads: train (or None), [(dev file, metric key suffix)],
    [(test file, submission name)]."""

    train: Optional[str]
    dev: list[tuple[str, str]]
    test: list[tuple[str, str]]


def glue_files(cfg: FinetuneConfigs) -> GlueFiles:
    """--train-file / --validation-file / --test-file, else the task's files in --data-dir
    (test files only where they exist: a custom data dir may have none)."""
    ft, task = cfg.finetune, TASKS[cfg.finetune.task_name]

    def in_dir(name: str) -> str:
        return os.path.join(ft.data_dir, name)

    train = (ft.train_file or in_dir("train.tsv")) if ft.do_train else None
    dev = (([(ft.validation_file, "")] if ft.validation_file else [(in_dir(f), s) for f, s in task.dev_files])
           if ft.do_eval else [])
    test = []
    if ft.do_predict:
        if ft.test_file:
            test = [(ft.test_file, task.submission)]
        elif ft.data_dir:
            test = [(in_dir(f), name or task.submission) for f, name in task.test_files if os.path.isfile(in_dir(f))]
    return GlueFiles(train, dev, test)


def load_glue_model(cfg: FinetuneConfigs, pretrained: Source, ps: ParallelState, vocab_size: int) -> BertForSequenceClassification:
    """BertForSequenceClassification from --load with the task's labels. The classifier is
    new unless --load is a model fine-tuned on a task with as many labels. The encoder runs
    unpadded: the head reads [CLS] alone, so padding changes no output, and GLUE's
    sentences leave most of max_seq_length to padding."""
    task = TASKS[cfg.finetune.task_name]
    id2label = None if task.is_regression else dict(enumerate(task.labels))
    # The --load's family says the classifier (its pooling, a prediction head) from its config.
    model_class = model_classes.by_name(task_model_class_name(pretrained, "sequence_classification"))
    try:
        return load_task_model(model_class, cfg, pretrained, ps, vocab_size, num_labels=task.num_labels,
                               id2label=id2label, unpad_input=True)
    except CheckpointError as e:
        if "classifier.weight has shape" not in str(e):
            raise
        # A model fine-tuned on another task: the shape error alone would not say so.
        raise CheckpointError(f"--load {cfg.train.load} holds a classifier for another number of labels than "
                              f"{task.name}'s {task.num_labels}: start from the pre-trained model, or from one "
                              f"fine-tuned on a task with the same labels") from None


def tensors_of(path: str, task: GlueTaskSpec, tokenizer, max_seq_length: int, *, test: bool = False
               ) -> tuple[list[GlueExample], dict[str, torch.Tensor]]:
    examples = read_examples(path, task, test=test)
    logger.info("%s: %d examples", path, len(examples))
    return examples, examples_to_tensors(examples, tokenizer, max_seq_length, task.is_regression)


def predictions_of(task: GlueTaskSpec, logits: np.ndarray) -> np.ndarray:
    """Class ids (argmax), or STS-B's scores."""
    return logits[:, 0] if task.is_regression else logits.argmax(axis=-1)


def eval_results(task: GlueTaskSpec, logits: np.ndarray, labels: np.ndarray, suffix: str = "") -> dict[str, float]:
    """run_glue.py's eval_results.json fields for one dev set: eval_loss, eval_{metric}
    (eval_combined_score, their mean, where a task has two), eval_samples; MNLI's
    mismatched set adds them again with the suffix "_mm"."""
    preds = predictions_of(task, logits)
    result = glue_metrics(task.metrics, preds, labels)
    if len(result) > 1:
        result["combined_score"] = float(np.mean(list(result.values())))
    t = torch.from_numpy(logits).double()
    if task.is_regression:
        loss = torch.nn.functional.mse_loss(t[:, 0], torch.from_numpy(labels).double())
    else:
        loss = torch.nn.functional.cross_entropy(t, torch.from_numpy(labels).long())
    result = {"loss": float(loss), **result, "samples": len(labels)}
    return {f"eval_{k}{suffix}": v for k, v in result.items()}


def write_submission(path: str, task: GlueTaskSpec, logits: np.ndarray) -> None:
    """GLUE's submission format: a header, then index<TAB>prediction per test row in order;
    classes as the task's label words (MNLI, QNLI, RTE: entailment...; 0/1 elsewhere),
    STS-B's scores with three decimals (run_glue.py's format)."""
    preds = predictions_of(task, logits)
    with open(path, "w", encoding="utf-8") as f:
        f.write("index\tprediction\n")
        for i, p in enumerate(preds):
            f.write(f"{i}\t{p:3.3f}\n" if task.is_regression else f"{i}\t{task.labels[int(p)]}\n")


class GlueTask(FinetuneTask):
    """A GLUE task (--task-name): train.tsv (or --train-file) to fine-tune on, the dev set(s)
    scored into eval_results.json, the test set(s) written as submission files."""

    name = "glue"
    cli = Cli(GlueConfig, GLUE_DEFAULTS)

    def __init__(self, cfg: FinetuneConfigs, pretrained: Source):
        super().__init__(cfg, pretrained)
        self.glue, self.files = TASKS[self.config.task_name], glue_files(cfg)
        self.name = self.glue.name

    @property
    def training_task(self) -> TrainingTask:
        return glue_task()

    def check_inputs(self) -> None:
        train = read_examples(self.files.train, self.glue) if self.files.train else None
        for path, _ in self.files.dev:
            if path:
                dev = read_examples(path, self.glue)
                if train is not None:
                    warn_unseen_labels(self.glue, train, path, dev)

    def load_model(self, ps: ParallelState, vocab_size: int) -> torch.nn.Module:
        return load_glue_model(self.cfg, self.pretrained, ps, vocab_size)

    def packing(self, seed: int) -> Optional[PackingSpec]:
        ft = self.config
        if not ft.pack_sequences:
            return None
        return PackingSpec(seq_length=ft.max_seq_length, max_samples_per_row=ft.max_samples_per_row,
                           window=ft.packing_window, seed=seed, sample_fields=("labels",))

    def train_tensors(self, tokenizer):
        if not self.files.train:
            return None
        return tensors_of(self.files.train, self.glue, tokenizer, self.config.max_seq_length)[1]

    def predict(self, tokenizer, predictor: Predictor) -> None:
        """eval_results.json over the dev set(s), then the submission file of each test set."""
        ft, task, files = self.config, self.glue, self.files

        def logits_of(path, test=False):
            _, tensors = tensors_of(path, task, tokenizer, ft.max_seq_length, test=test)
            arrays = predictor.outputs(tensors, lambda out: (out.logits,))
            return (arrays[0] if arrays is not None else np.zeros((0, task.num_labels), np.float32)), tensors

        results = {}
        for path, suffix in files.dev:
            logits, tensors = logits_of(path)
            results.update(eval_results(task, logits, tensors["labels"].numpy(), suffix))
        submissions = [(os.path.join(ft.output_dir, f"{name}.tsv"), logits_of(path, test=True)[0])
                       for path, name in files.test]
        if not predictor.writes or not (files.dev or submissions):
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
