"""NER as a fine-tuning task (megabert.training.finetune runs it): the files of a run, the
label set (the training file's tags, saved with the model as its id2label), the model from
--load, and evaluation and test predictions (eval_results.json with run_ner.py's keys,
predictions.txt in CoNLL form)."""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megabert.arguments import Cli
from megabert.checkpoint.reader import read_model_config
from megabert.checkpoint.start import Source
from megabert.config import FinetuneConfigs
from megabert.data.packing import PackingSpec
from megabert.errors import CheckpointError, ConfigError
from megabert.parallel import ParallelState
from megabert.tasks.ner.config import NER_DEFAULTS, NerConfig
from megabert.tasks.ner.data import Sentence, label_set, read_sentences, warn_unless_entity_tags
from megabert.tasks.ner.features import Features, sentences_to_features, word_logits
from megabert.tasks.ner.metrics import ner_metrics
from megabert import model_classes
from megabert.model_family import task_model_class_name
from megabert.tasks.ner.model import IGNORE_INDEX
from megabert.training.finetune import FinetuneTask, Predictor, load_task_model, write_json
from megabert.training.strategy import LOSS_SHARES, Metrics, TrainingTask, mean_loss_task

logger = logging.getLogger(__name__)


def label_weights(batch: dict) -> torch.Tensor:
    """Each position's weight in the training loss: 0 unlabelled, else 1, or with
    --train-windows weighted one over the number of windows that label it (`label_windows`),
    so that a word counts once however many windows label it."""
    labelled = (batch["labels"] != IGNORE_INDEX).float()
    windows = batch.get("label_windows")
    return labelled if windows is None else labelled / windows.clamp(min=1)


@dataclass(frozen=True)
class NerTrainingTask(TrainingTask):
    """mean_loss_task's, the training loss a weighted mean when the batch carries
    `label_windows`: sum(weight x cross entropy) over the global batch's summed weights."""

    def train_loss(self, output, batch: dict) -> tuple[torch.Tensor, Metrics]:
        if "label_windows" not in batch:
            return super().train_loss(output, batch)
        flat = batch["labels"].reshape(-1)
        losses = torch.nn.functional.cross_entropy(output.logits.float().reshape(flat.numel(), -1), flat,
                                                   ignore_index=IGNORE_INDEX, reduction="none")
        weights = label_weights(batch).reshape(-1)
        total = batch[LOSS_SHARES][0] if LOSS_SHARES in batch else weights.sum().clamp(min=1e-6)
        loss = (losses * weights).sum() / total
        return loss, {"ner_loss": loss}


def ner_task() -> TrainingTask:
    """TokenClassifierOutput -> (cross entropy over the labelled sub-words; {"ner_loss"}); in
    training the (weighted: label_weights) mean over the global batch's labelled sub-words
    (micro-batches and packed rows hold different numbers), so a step's loss and gradients do
    not depend on how its features are grouped."""

    base = mean_loss_task("ner_loss", ("input_ids", "token_type_ids", "attention_mask", "labels", "position_ids",
                                       "packed_seqlens", "token_positions"),
                          lambda batch: label_weights(batch).sum())
    return NerTrainingTask(**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)})


def resolve_labels(pretrained: Source, train: Optional[list[Sentence]]) -> tuple[str, ...]:
    """The label set, in id order: the training file's tags (sorted, as run_ner.py), or,
    when --load was fine-tuned on the same tags, its order, so its classifier keeps its
    meaning; without training, the tags --load was fine-tuned on (its id2label)."""
    load = pretrained.path
    saved = read_model_config(pretrained).get("id2label")
    saved = tuple(saved[k] for k in sorted(saved, key=int)) if saved else None
    if train is None:
        if saved is None:
            raise ConfigError(f"--load {load} names no tags (no id2label in its config): fine-tune it on tagged "
                              f"sentences first (--train-file)")
        return saved
    tags = label_set(train)
    if saved is None:
        return tags
    if set(saved) != set(tags):
        raise CheckpointError(f"--load {load} holds a classifier for the labels {', '.join(saved)}, the training file "
                              f"has {', '.join(tags)}: start from the pre-trained model, or from one fine-tuned on "
                              f"these tags")
    return saved


def tags_of(ids: np.ndarray, labels: tuple[str, ...]) -> list[str]:
    return [labels[int(i)] for i in ids]


def eval_results(sentences: list[Sentence], logits: list[np.ndarray], labels: tuple[str, ...],
                 prefix: str = "eval") -> dict[str, float]:
    """run_ner.py's results for tagged sentences: {prefix}_loss (the mean cross entropy of the
    words whose gold tag is in the label set), {prefix}_precision, _recall, _f1 (entity level,
    seqeval), _accuracy (of word tags), _samples (sentences)."""
    gold = [list(s.tags) for s in sentences]
    predicted = [tags_of(x.argmax(axis=-1), labels) for x in logits]
    result = ner_metrics(gold, predicted)
    index = {t: i for i, t in enumerate(labels)}
    known = [(x[w], index[t]) for x, s in zip(logits, sentences) for w, t in enumerate(s.tags) if t in index]
    if known:  # none when every gold tag is one the model was not trained on
        x = torch.from_numpy(np.stack([k[0] for k in known])).double()
        result = {"loss": float(torch.nn.functional.cross_entropy(x, torch.tensor([k[1] for k in known]))), **result}
    result = {**result, "samples": len(sentences)}
    return {f"{prefix}_{k}": v for k, v in result.items()}


def write_predictions(path: str, sentences: list[Sentence], logits: list[np.ndarray], labels: tuple[str, ...]) -> None:
    """CoNLL form: one `word tag` line per word, a blank line between sentences."""
    blocks = ["\n".join(f"{w} {t}" for w, t in zip(s.words, tags_of(x.argmax(axis=-1), labels)))
              for s, x in zip(sentences, logits)]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(blocks) + "\n")


class NerTask(FinetuneTask):
    """Token classification: --train-file to fine-tune on, --validation-file scored into
    eval_results.json, --test-file tagged into predictions.txt."""

    name = "ner"
    cli = Cli(NerConfig, NER_DEFAULTS)

    def __init__(self, cfg: FinetuneConfigs, pretrained: Source):
        super().__init__(cfg, pretrained)
        self.labels: tuple[str, ...] = ()
        self.sentences: dict[str, list[Sentence]] = {}

    @property
    def training_task(self) -> TrainingTask:
        return ner_task()

    def check_inputs(self) -> None:
        ft = self.config
        for key, path in (("train", ft.train_file), ("validation", ft.validation_file), ("test", ft.test_file)):
            if path:
                self.sentences[key] = read_sentences(path, labelled=key != "test")
                logger.info("%s: %d sentences", path, len(self.sentences[key]))
        self.labels = resolve_labels(self.pretrained, self.sentences.get("train"))
        if "train" in self.sentences:
            warn_unless_entity_tags(ft.train_file, self.labels)
        for key, path in (("validation", ft.validation_file), ("test", ft.test_file)):
            unseen = sorted({t for s in self.sentences.get(key, []) if s.tags for t in s.tags} - set(self.labels))
            if unseen:
                logger.warning("%s has tags the model never predicts (not in the training file): %s", path,
                               ", ".join(unseen))

    def load_model(self, ps: ParallelState, vocab_size: int) -> torch.nn.Module:
        """The classifier is new unless --load was fine-tuned on these tags. The encoder runs
        unpadded: the padding's outputs are never labelled nor read."""
        # The --load's family says the token classifier (a prediction head before the linear, or not).
        model_class = model_classes.by_name(task_model_class_name(self.pretrained, "token_classification"))
        return load_task_model(model_class, self.cfg, self.pretrained, ps, vocab_size, num_labels=len(self.labels),
                               id2label=dict(enumerate(self.labels)), unpad_input=True)

    def packing(self, seed: int) -> Optional[PackingSpec]:
        """Windows pack as any feature: the labels are per token, so every field is a token
        field and each feature keeps its positions from 0 and its token types."""
        ft = self.config
        if not ft.pack_sequences:
            return None
        return PackingSpec(seq_length=ft.max_seq_length, max_samples_per_row=ft.max_samples_per_row,
                           window=ft.packing_window, seed=seed)

    def features(self, sentences: list[Sentence], tokenizer, *, train: bool = False) -> Features:
        ft = self.config
        return sentences_to_features(sentences, tokenizer, ft.max_seq_length,
                                     label2id={t: i for i, t in enumerate(self.labels)}, overlap=ft.stride,
                                     label_all_tokens=ft.label_all_tokens and train, drop_unlabelled=train,
                                     train_windows=ft.train_windows if train else None)

    def train_tensors(self, tokenizer):
        if "train" not in self.sentences:
            return None
        features = self.features(self.sentences["train"], tokenizer, train=True)
        logger.info("%s: %d features", self.config.train_file, len(features.windows))
        return features.tensors

    def word_logits(self, sentences: list[Sentence], tokenizer, predictor: Predictor) -> list[np.ndarray]:
        features = self.features(sentences, tokenizer)
        arrays = predictor.outputs(features.tensors, lambda out: (out.logits,))
        return word_logits(features, arrays[0], [len(s.words) for s in sentences], self.config.predict_windows)

    def predict(self, tokenizer, predictor: Predictor) -> None:
        """eval_results.json over the validation file, predictions.txt of the test file (and
        predict_results.json when its sentences carry tags)."""
        ft, results, tagged = self.config, None, None
        if "validation" in self.sentences:
            results = eval_results(self.sentences["validation"],
                                   self.word_logits(self.sentences["validation"], tokenizer, predictor), self.labels)
        if "test" in self.sentences:
            tagged = self.word_logits(self.sentences["test"], tokenizer, predictor)
        if not predictor.writes or (results is None and tagged is None):
            return
        os.makedirs(ft.output_dir, exist_ok=True)
        if results is not None:
            write_json(os.path.join(ft.output_dir, "eval_results.json"), results)
            figures = " | ".join(f"{k} {v:.4f}" for k, v in results.items() if k != "eval_samples")
            print(f"ner dev: {figures} -> {ft.output_dir}", flush=True)
        if tagged is not None:
            test = self.sentences["test"]
            out = os.path.join(ft.output_dir, "predictions.txt")
            write_predictions(out, test, tagged, self.labels)
            if all(s.tags is not None for s in test):
                write_json(os.path.join(ft.output_dir, "predict_results.json"),
                           eval_results(test, tagged, self.labels, prefix="predict"))
            print(f"ner test predictions -> {out}", flush=True)
