"""SQuAD fine-tuning pieces handed to the generic Trainer: the QA task, the model from
--load and prediction (start and end logits of every feature). The task-free parts (vocab,
step count, feature batches, prediction over layouts) live in megabert.training.finetune."""
from __future__ import annotations

import numpy as np
import torch

from megabert.config import FinetuneConfigs
from megabert.parallel import ParallelState
from megabert.tasks.squad import BertForQuestionAnswering
from megabert.training.finetune import (feature_batches, load_task_model, num_train_steps, predict_outputs,
                                        resolve_vocab_file)
from megabert.training.strategy import Task

# Re-exported: finetune_squad.py and its tests import them from here.
__all__ = ["qa_task", "load_qa_model", "predict_logits", "feature_batches", "num_train_steps", "resolve_vocab_file"]


def qa_task() -> Task:
    """QuestionAnsweringOutput -> (mean of the start and end cross entropies, {"qa_loss"})."""
    return Task(inputs=("input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions"),
                output_loss=lambda out: (out.loss, {"qa_loss": out.loss}))


def load_qa_model(cfg: FinetuneConfigs, ps: ParallelState, vocab_size: int) -> BertForQuestionAnswering:
    """BertForQuestionAnswering from --load (megabert checkpoint of any TP layout, or a
    Hugging Face directory); the QA head is new unless the checkpoint already has one."""
    return load_task_model(BertForQuestionAnswering, cfg, ps, vocab_size)


def predict_logits(model: torch.nn.Module, tensors: dict[str, torch.Tensor], ps: ParallelState, batch_size: int,
                   bf16: bool = False, fp16: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Start and end logits [n_features, max_seq_length] of every feature, on every rank."""
    arrays = predict_outputs(model, tensors, ps, batch_size, qa_task(), lambda out: (out.start_logits, out.end_logits),
                             bf16=bf16, fp16=fp16)
    if arrays is None:
        seq = tensors["input_ids"].shape[1]
        return np.zeros((0, seq), np.float32), np.zeros((0, seq), np.float32)
    return arrays[0], arrays[1]
