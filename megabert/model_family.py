"""Which model family a run builds, and that family's defaults (issues 42, 50).

`pretrain_bert.py --model-family NAME` builds that family (megabert.families) from the size
flags, with its recipe where a flag was left out (family_defaults; ModernBERT's: 30% masking,
no binary head, no dropout, LayerNorm eps 1e-5, 8192 positions; its MLP width, 1.5 x hidden,
is set where the flags become its ModelConfig: megabert.families.scratch_config). A run that starts from a
checkpoint of a family that carries its architecture (`--load` or `--pretrained-checkpoint`
of a transformers directory or of a megabert checkpoint of one) takes it from that checkpoint's config:
continued pre-training is one command. The checkpoint is the run's start, decided once
(megabert.checkpoint.start); resolve_run adopts its architecture here. Flags then choose only how the model computes
(RUN_TIME_FIELDS) and its dropouts; an architecture flag that contradicts the checkpoint is
an error. BERT runs are unchanged: their architecture comes from the flags, as before.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from megabert.checkpoint.reader import read_model_config
from megabert.checkpoint.start import Format, Source
from megabert.config import Configs, ModelConfig
from megabert.errors import ConfigError, MegabertError
from megabert.families import get_family, task_class_name



def family_defaults(name: str) -> dict:
    """{"section.field": value} a run of family `name` takes where a flag is left out: its
    scratch defaults and its recipe's mask rate."""
    family = get_family(name)
    return {**{f"model.{k}": v for k, v in family.scratch_defaults.items()}, "data.mask_prob": family.recipe.mask_prob}


# How the model computes, not what it is: always the flags' (pretrain_bert.py's defaults
# included), whatever a loaded checkpoint says.
RUN_TIME_FIELDS = ("attention_backend", "layernorm_backend", "dropout_add_backend", "recompute_granularity",
                   "sequence_parallel", "unpad_input", "mlm_logits_at_masked_only")
# May differ from the checkpoint when typed: regularisation of the continued run.
OVERRIDABLE_FIELDS = ("hidden_dropout", "attention_dropout", "embedding_dropout", "mlp_dropout")


def checkpoint_model_config(source: Optional[Source]) -> Optional[ModelConfig]:
    """The config of the checkpoint `source` when its family takes the architecture from it
    (Family.architecture_from_checkpoint: a transformers dir of such a family or a megabert
    checkpoint of one), or None (no checkpoint, or a family whose flags say the architecture)."""
    if source is None or source.format is Format.MEGATRON:  # Megatron-LM checkpoints are BERTs of the flags
        return None
    try:
        saved = read_model_config(source)
    except MegabertError:
        return None  # unreadable: reported where the run loads it, as for any family
    if not get_family(saved.get("model_family", "bert")).architecture_from_checkpoint:
        return None
    return ModelConfig(**saved)


def task_model_class_name(source: Optional[Source], task: str, flags: Optional[ModelConfig] = None) -> str:
    """The registered model class that runs `task` from the start checkpoint `source`: its
    family's (megabert.families), else the flags' family."""
    loaded = checkpoint_model_config(source)
    return task_class_name(loaded if loaded is not None else (flags or ModelConfig()), task)


def resolve_model_family(cfg: Configs, start: Optional[Source] = None) -> Configs:
    """cfg with the architecture of the start checkpoint (`start`: the run's RunStart.source)
    adopted where its family takes it from there, and the family's defaults where a flag was
    left out (see the module docstring). Without `start` (parsing): the flags alone."""
    loaded = checkpoint_model_config(start)
    model = cfg.model
    if loaded is not None:
        if "model.model_family" in cfg.explicit and model.model_family != loaded.model_family:
            raise ConfigError(f"--model-family {model.model_family}, but the checkpoint to start from is a "
                              f"{loaded.model_family}; drop --model-family (the architecture comes from the "
                              f"checkpoint)")
        fields = {}
        for f in dataclasses.fields(ModelConfig):
            mine, theirs = getattr(model, f.name), getattr(loaded, f.name)
            typed = f"model.{f.name}" in cfg.explicit
            if f.name in RUN_TIME_FIELDS or (typed and f.name in OVERRIDABLE_FIELDS):
                fields[f.name] = mine
            elif typed and f.name != "model_family" and mine != theirs:
                flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
                raise ConfigError(f"{flag} {mine} contradicts the {loaded.model_family} checkpoint to start from "
                                  f"({theirs}): the architecture comes from its config; drop {flag}")
            else:
                fields[f.name] = theirs
        model = ModelConfig(**fields)
    if loaded is None and not get_family(model.model_family).scratch_defaults:
        return cfg
    model_values, data_values = {}, {}
    for key, value in family_defaults(model.model_family).items():
        if key in cfg.explicit:
            continue
        section, name = key.split(".")
        if section == "data":
            data_values[name] = value
        elif loaded is None or name == "bert_binary_head":  # a loaded config already says
            model_values[name] = value
    explicit = cfg.explicit
    if loaded is not None:
        # The checkpoint's vocab (transformers' ModernBERT pads its tokenizer's 50,280 ids to
        # 50,368; others pad too) is the model's, not the tokenizer's: see model_vocab_size.
        explicit = explicit | {"model.vocab_size"}
        beside = os.path.join(start.directory, "tokenizer.json")
        if cfg.data.vocab_file is None and os.path.isfile(beside):
            data_values.update(vocab_file=beside, tokenizer_type="HuggingFaceTokenizer")
    model = dataclasses.replace(model, **model_values)
    return dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, **data_values), explicit=explicit)


def model_vocab_size(model: ModelConfig, explicit: frozenset, tokenizer_vocab_size: int) -> int:
    """The vocab the model is built with: the tokenizer's, unless a checkpoint's config fixed
    it (resolve_model_family marks that), which must then cover every token id."""
    if "model.vocab_size" not in explicit:
        return tokenizer_vocab_size
    if tokenizer_vocab_size > model.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer_vocab_size} ids but the checkpoint's vocab_size is "
                          f"{model.vocab_size}: pass the --vocab-file the checkpoint was trained with")
    return model.vocab_size
