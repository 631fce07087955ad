"""Checkpoints made elsewhere, read as a Hugging Face BERT: (config dict, state dict in
transformers' names). Everything downstream (config mapping, name mapping by ParamSpec,
sharding) then treats them alike."""
from __future__ import annotations

from typing import Optional

from megabert.checkpoint import hf as hf_io


def read_foreign_dir(path: str) -> Optional[tuple[dict, dict]]:
    """(HF-style config, HF-named full state) of a Hugging Face BERT directory; None when
    `path` is not one (a megabert/Megatron checkpoint)."""
    if hf_io.is_hf_dir(path):
        return hf_io.read_hf_config(path), hf_io.read_hf_state(path)
    return None
