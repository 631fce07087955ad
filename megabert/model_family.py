"""The registered model class of a task, and the vocab a model is built with, as the run's
start checkpoint and its family say (megabert.families; a run's family and its defaults:
megabert.families.run_family)."""
from __future__ import annotations

from typing import Optional

from megabert.checkpoint.reader import checkpoint_model_config
from megabert.checkpoint.start import Source
from megabert.config import ModelConfig
from megabert.errors import ConfigError
from megabert.families import task_class_name


def task_model_class_name(source: Optional[Source], task: str, flags: Optional[ModelConfig] = None) -> str:
    """The registered model class that runs `task` from the start checkpoint `source`: its
    family's (megabert.families), else the flags' family."""
    loaded = checkpoint_model_config(source)
    return task_class_name(loaded if loaded is not None else (flags or ModelConfig()), task)


def model_vocab_size(model: ModelConfig, explicit: frozenset, tokenizer_vocab_size: int) -> int:
    """The vocab the model is built with: the tokenizer's, unless a checkpoint's config fixed
    it (resolve_model_family marks that), which must then cover every token id."""
    if "model.vocab_size" not in explicit:
        return tokenizer_vocab_size
    if tokenizer_vocab_size > model.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer_vocab_size} ids but the checkpoint's vocab_size is "
                          f"{model.vocab_size}: pass the --vocab-file the checkpoint was trained with")
    return model.vocab_size
