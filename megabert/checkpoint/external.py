"""Checkpoints made by other tools, read into one shape.

`--load` and `from_pretrained` take a Hugging Face BERT directory or a Google TensorFlow BERT
directory besides a megabert checkpoint. Both become (Hugging Face config dict, state dict in
Hugging Face names) here, which megabert.checkpoint.reader turns into a rank's weights like any
other checkpoint.
"""
from __future__ import annotations

import os
from typing import Optional

from megabert.checkpoint import hf as hf_io
from megabert.checkpoint import megatron
from megabert.checkpoint import tf as tf_io


def is_external(path: str) -> bool:
    """A Hugging Face BERT directory, a Google TF BERT directory (or checkpoint prefix), or a
    Megatron-LM directory (read by megabert.checkpoint.megatron, weights only)."""
    return hf_io.is_hf_dir(path) or tf_io.is_tf_dir(path) or megatron.is_megatron_dir(path)


def read_external_config(path: str) -> dict:
    """The Hugging Face config dict of either kind, without reading a tensor."""
    return hf_io.read_hf_config(path) if hf_io.is_hf_dir(path) else tf_io.read_tf_config(path)


def read_external(path: str) -> tuple[dict, dict]:
    """(Hugging Face config dict, Hugging Face-named full state dict) of either kind."""
    if hf_io.is_hf_dir(path):
        return hf_io.read_hf_config(path), hf_io.read_hf_state(path)
    return tf_io.read_tf_as_hf(path)


def external_vocab_file(path: str) -> Optional[str]:
    """The vocab.txt that ships with an external checkpoint (beside the files, or beside a
    TF checkpoint prefix), or None."""
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    candidate = os.path.join(directory, "vocab.txt")
    return candidate if is_external(path) and os.path.isfile(candidate) else None
