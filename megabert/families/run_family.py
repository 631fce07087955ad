"""A run's model family and that family's defaults (issues 42, 50).

`pretrain_bert.py --model-family NAME` builds that family (megabert.families) from the size
flags, with its recipe where a flag was left out (family_defaults; ModernBERT's: 30% masking,
no binary head, no dropout, LayerNorm eps 1e-5, 8192 positions; its MLP width, 1.5 x hidden,
is set where the flags become its ModelConfig: megabert.families.scratch_config). A run that starts from a
checkpoint of a family that carries its architecture (`--load` or `--pretrained-checkpoint`
of a transformers directory or of a megabert checkpoint of one) takes it from that checkpoint's config:
continued pre-training is one command. The checkpoint is the run's start, decided once
(megabert.checkpoint.start); resolve_run reads its config (megabert.checkpoint.reader.checkpoint_model_config)
and hands it down here. Flags then choose only how the model computes (RUN_TIME_FIELDS) and
its dropouts; an architecture flag that contradicts the checkpoint is an error. BERT runs are
unchanged: their architecture comes from the flags, as before.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from megabert.config import Configs, ModelConfig
from megabert.errors import ConfigError
from megabert.families import get_family


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


def resolve_model_family(cfg: Configs, loaded: Optional[ModelConfig] = None, start_dir: Optional[str] = None
                         ) -> Configs:
    """cfg with `loaded` adopted (the start checkpoint's config where its family takes the
    architecture from there: megabert.checkpoint.reader.checkpoint_model_config; `start_dir`:
    that checkpoint's directory), and the family's defaults where a flag was left out (see the
    module docstring). Without `loaded` (parsing, or a start that does not say): the flags alone."""
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
        beside = os.path.join(start_dir, "tokenizer.json")
        if cfg.data.vocab_file is None and os.path.isfile(beside):
            data_values.update(vocab_file=beside, tokenizer_type="HuggingFaceTokenizer")
    model = dataclasses.replace(model, **model_values)
    return dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, **data_values), explicit=explicit)
