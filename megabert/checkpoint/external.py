"""Checkpoints made by other tools, read into one shape.

`--load` and `from_pretrained` take a Hugging Face BERT directory or a Google TensorFlow BERT
directory besides a megabert checkpoint. Both become (Hugging Face config dict, state dict in
Hugging Face names) here, which megabert.checkpoint.reader turns into a rank's weights like any
other checkpoint. What a path holds was detected once (megabert.checkpoint.start).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from megabert.checkpoint import hf as hf_io
from megabert.checkpoint import tf as tf_io
from megabert.checkpoint.start import Format, Source
from megabert.config import TaskConfig
from megabert.errors import ConfigError


def read_external_config(source: Source) -> dict:
    """The Hugging Face config dict of either kind, without reading a tensor."""
    return hf_io.read_hf_config(source.path) if source.format is Format.HF else tf_io.read_tf_config(source.path)


def read_external(source: Source) -> tuple[dict, dict]:
    """(Hugging Face config dict, Hugging Face-named full state dict) of either kind."""
    if source.format is Format.HF:
        return hf_io.read_hf_config(source.path), hf_io.read_hf_state(source.path)
    return tf_io.read_tf_as_hf(source.path)


def external_vocab_file(source: Source) -> Optional[str]:
    """The vocab.txt that ships with an external checkpoint (beside the files, or beside a
    TF checkpoint prefix), or None."""
    candidate = os.path.join(source.directory, "vocab.txt")
    return candidate if source.external and os.path.isfile(candidate) else None


def pretrained_vocab(task: TaskConfig, explicit: frozenset, pretrained: Source) -> TaskConfig:
    """--vocab-file, else the vocab.txt that came with the pre-trained model: a Hugging Face
    or Google TF directory's own, or the one convert_hf.py import put beside a megabert
    checkpoint; a ModernBERT's tokenizer.json, read as HuggingFaceTokenizer unless
    --tokenizer-type says otherwise."""
    vocab = task.vocab_file
    if not vocab:
        candidates = [external_vocab_file(pretrained), os.path.join(pretrained.directory, "vocab.txt"),
                      os.path.join(pretrained.directory, "tokenizer.json")]
        vocab = next((c for c in candidates if c and os.path.isfile(c)), None)
        if vocab is None:
            raise ConfigError(f"--vocab-file (or --tokenizer-model) is required: {pretrained.path} has neither a "
                              f"vocab.txt nor a tokenizer.json; pass the tokenizer the model was pre-trained with")
    kind = task.tokenizer_type
    if vocab.endswith(".json") and "finetune.tokenizer_type" not in explicit:
        kind = "HuggingFaceTokenizer"
    return dataclasses.replace(task, vocab_file=vocab, tokenizer_type=kind)
