"""The registry of encoder families: each a small module mapping its transformers config and
weight names onto one EncoderSpec (megabert.families.spec), and holding its pre-training recipe.

Code outside this package never asks which family a model is: it reads the spec
(`encoder_spec(config)`), the recipe, or the class a task builds (`task_class_name`). A new
family is one more module here and one line in FAMILIES.
"""
from __future__ import annotations

import dataclasses

from megabert.config import ModelConfig
from megabert.errors import CheckpointError, ConfigError
from megabert.families import bert, eurobert, gte, modernbert, nomic_bert, ultrabert
from megabert.families.family import Family, Recipe
from megabert.families.spec import EncoderSpec

FAMILIES: dict[str, Family] = {f.name: f for f in (bert.FAMILY, modernbert.FAMILY, eurobert.FAMILY, gte.FAMILY,
                                                  nomic_bert.FAMILY, ultrabert.FAMILY)}


def get_family(name: str) -> Family:
    found = FAMILIES.get(name)
    if found is None:
        raise ConfigError(f"unknown model family {name!r}: megabert knows {', '.join(sorted(FAMILIES))}")
    return found


def family_for_model_type(model_type: object, where: str) -> Family:
    """The family whose config.json model_type is `model_type` (`where`: the file, for the error)."""
    for f in FAMILIES.values():
        if f.model_type == model_type:
            return f
    known = ", ".join(sorted(f.model_type for f in FAMILIES.values()))
    raise ConfigError(f"{where}: model_type {model_type!r} is not a family megabert builds (it knows {known})")


def scratch_config(**fields) -> ModelConfig:
    """ModelConfig(**fields) made from scratch: its family's scratch defaults and MLP width where
    `fields` leave them out (what --model-family NAME gives the flags left out)."""
    config = ModelConfig(**fields)
    family = get_family(config.model_family)
    defaults = {**family.scratch_defaults, "ffn_hidden_size": family.ffn_size(config.hidden_size)}
    return dataclasses.replace(config, **{k: v for k, v in defaults.items() if fields.get(k) is None})


def encoder_spec(config: ModelConfig) -> EncoderSpec:
    """The EncoderSpec of `config` (its family's mapping)."""
    return get_family(config.model_family).spec(config)


def task_class_name(config: ModelConfig, task: str) -> str:
    """The registered model class that runs `task` for `config`'s family."""
    f = get_family(config.model_family)
    name = f.task_classes.get(task)
    if name is None:
        raise ConfigError(f"the {f.name} family has no {task.replace('_', ' ')} model in megabert")
    return name


def recipe(config: ModelConfig) -> Recipe:
    return get_family(config.model_family).recipe


def check_task_class(config: ModelConfig, class_name: str) -> None:
    """A task class of other families only (BertForPreTraining) built for this family's config
    is an error naming the class this family runs the task with."""
    mine = get_family(config.model_family)
    if class_name in mine.task_classes.values():
        return
    for f in FAMILIES.values():
        for task, name in f.task_classes.items():
            if name == class_name:
                raise ConfigError(f"{class_name} is the {f.name} family's {task.replace('_', ' ')} model but the "
                                  f"config is a {mine.name} one: build {mine.task_classes.get(task, 'another model')}")


# transformers' task heads (class name endings) a family may define.
HEAD_SUFFIXES = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForMultipleChoice",
                 "ForNextSentencePrediction")


def model_class_for_architectures(family: Family, architectures: list, where: str) -> str:
    """The registered model class holding the head config.json's `architectures` name (a
    transformers name or ours), else the family's pre-training model. A task head megabert
    does not build is a one-line error naming `where` (the file), never a model without it."""
    tasks = [t for t in family.task_classes if t not in ("pretraining", "masked_lm", "embeddings")]
    heads = {name: family.task_classes[t] for t in tasks for name in (family.task_classes[t],
                                                                      family.architectures.get(t)) if name}
    for arch in architectures or []:
        if arch in heads:
            return heads[arch]
        if str(arch).endswith(HEAD_SUFFIXES):
            known = ", ".join(sorted(family.architectures[t] for t in tasks if t in family.architectures))
            raise CheckpointError(f"{where} names architecture {arch!r}, a head megabert does not build for the "
                                  f"{family.name} family (it reads {known})")
    return family.task_classes["pretraining"]
