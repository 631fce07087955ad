"""Every model class by name, in one table. A checkpoint records its model's class name; the
tasks, the tools and the checkpoint readers turn that name back into a class, or into the spec
table of a shape-only model of that class (a checkpoint saved before spec tables were stored,
a Megatron-LM directory).

The table names the module that defines each class and imports it when the class is first
asked for (as transformers' auto classes map names to modules): no class registers itself on
import, and the checkpoint readers, which sit below model/ and tasks/, look up a class without
importing every task. tests/test_model_classes.py holds the table to the classes defined.
"""
from __future__ import annotations

import dataclasses
import importlib

from megabert.errors import ConfigError
from megabert.parallel.param_spec import ParamSpec, spec_table
from megabert.parallel.state import ParallelState

# Class name -> the module that defines it.
MODULES: dict[str, str] = {
    "BertModel": "megabert.model.bert",
    "EncoderForMaskedLM": "megabert.model.masked_lm",
    "ModernBertForMaskedLM": "megabert.model.masked_lm",
    "EncoderForSequenceClassification": "megabert.model.classifier",
    "ModernBertForSequenceClassification": "megabert.model.classifier",
    "BertForPreTraining": "megabert.tasks.pretraining.model",
    "BertForQuestionAnswering": "megabert.tasks.squad.model",
    "ModernBertForQuestionAnswering": "megabert.tasks.squad.model",
    "BertForSequenceClassification": "megabert.tasks.glue.model",
    "BertForTokenClassification": "megabert.tasks.ner.model",
    "ModernBertForTokenClassification": "megabert.tasks.ner.model",
    "BertForSentenceEmbedding": "megabert.tasks.embeddings.model",
    "ModernBertForSentenceEmbedding": "megabert.tasks.embeddings.model",
}


def by_name(name: str) -> type:
    """The model class called `name` (a checkpoint's `model_class`, a family's task class)."""
    if name not in MODULES:
        raise ConfigError(f"unknown model class {name!r} (known: {', '.join(sorted(MODULES))})")
    return getattr(importlib.import_module(MODULES[name]), name)


def every_class() -> dict[str, type]:
    """Every model class by name (imports every task's model module)."""
    return {name: by_name(name) for name in MODULES}


def meta_model(cls: type, cfg):
    """A whole model of `cls` (one rank, TP=PP=1) built on the meta device: shapes and specs,
    no memory, no process group, no numbers."""
    shape_only = dataclasses.replace(cfg, attention_backend="torch", layernorm_backend="torch",
                                     dropout_add_backend="torch")
    return cls(shape_only, ParallelState.offline(), device="meta")


def reference_table(cfg, name: str = "BertForPreTraining") -> dict[str, ParamSpec]:
    """The spec table of a whole model of class `name` for `cfg`, from a meta model."""
    return spec_table(meta_model(by_name(name), cfg))
