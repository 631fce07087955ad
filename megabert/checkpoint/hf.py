"""Hugging Face <-> megabert, every family of the registry (megabert.families): configs and
full (unsharded) state dicts.

Only names and fusions (QKV, a GLU's halves) differ; the numbers are copied as they are. Which of our
parameters is which HF tensor is part of each parameter's ParamSpec (`hf_names`), set by
the module that owns it. The vocab is padded on load (zero rows, never reached by a
user-visible logit) and cut on export.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch

from megabert.checkpoint import safe_pickle
from megabert.config import ModelConfig
from megabert.errors import CheckpointError, ConfigError, RefusedFileError
from megabert.families import family_for_model_type, get_family
from megabert.parallel.param_spec import ParamSpec

# ---------------------------------------------------------------- configs

def model_config_from_hf(hf: dict, where: str = "config.json", **overrides) -> ModelConfig:
    """config.json -> ModelConfig, by the family its model_type names (megabert.families). A
    config that is not a JSON object, or whose family megabert does not build, is a one-line
    error naming `where` (the file) and the field; never BERT by default."""
    if not isinstance(hf, dict):
        raise CheckpointError(f"{where} holds a JSON {type(hf).__name__}, not an object of config fields")
    try:
        family = family_for_model_type(hf.get("model_type", "bert"), where)
        fields = family.config_from_hf(hf)
    except KeyError as e:
        raise CheckpointError(f"{where} lacks {e.args[0]!r}, which a {hf.get('model_type', 'bert')} config "
                              f"needs") from None
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    for name, value in fields.items():
        kind = _FIELD_TYPES.get(name)
        if kind is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise CheckpointError(f"{where}: {name} (ModelConfig field) is {value!r}, not a "
                                  f"{' or '.join(k.__name__ for k in kind)}")
    if any(str(a).endswith(("ForSequenceClassification", "ForTokenClassification"))
           for a in hf.get("architectures") or []):
        # transformers derives num_labels from id2label; a config may carry either.
        id2label = hf.get("id2label")
        fields.update(num_labels=len(id2label) if id2label else hf.get("num_labels", 2), id2label=id2label)
    try:
        return ModelConfig(**{"model_family": family.name, **fields, **overrides})
    except ConfigError as e:
        raise CheckpointError(f"{where}: {e}") from None


# ModelConfig fields a config.json supplies, with the JSON types that can hold them.
_FIELD_TYPES = {**{k: (int,) for k in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                                       "vocab_size", "max_position_embeddings", "type_vocab_size",
                                       "global_attn_every_n_layers", "local_attention")},
                **{k: (int, float) for k in ("layernorm_epsilon", "init_method_std", "hidden_dropout",
                                             "attention_dropout", "global_rope_theta", "local_rope_theta")}}


def hf_config_from_model(cfg: ModelConfig, architecture: Optional[str] = None) -> dict:
    """config.json for `cfg` (its family's), naming `architecture` (default: the family's masked LM)."""
    family = get_family(cfg.model_family)
    architecture = architecture or family.architectures.get("pretraining", "")
    return {**family.hf_config(cfg, architecture),
            **(_classification_fields(cfg, architecture)
               if architecture.endswith(("ForSequenceClassification", "ForTokenClassification")) else {})}


def hf_architecture(cfg: ModelConfig, model_class: str) -> str:
    """The transformers architecture an export of our `model_class` names: a masked LM without a
    sentence-pair head is the family's *ForMaskedLM; a task model keeps its name."""
    family = get_family(cfg.model_family)
    if model_class == "EncoderForMaskedLM" or (model_class == family.task_classes.get("pretraining")
                                               and not cfg.bert_binary_head):
        return family.architectures["masked_lm"]
    task = next((t for t, c in family.task_classes.items() if c == model_class and t != "pretraining"), None)
    if task is None:
        return model_class
    if task not in family.architectures:
        raise CheckpointError(f"transformers defines no {task.replace('_', ' ')} model of the {family.name} family: "
                              f"a fine-tuned {model_class} of it cannot be exported (its head has no transformers "
                              f"counterpart)")
    return family.architectures[task]


def _classification_fields(cfg: ModelConfig, architecture: str) -> dict:
    """What AutoModelFor{Sequence,Token}Classification and pipeline("text-classification" /
    "token-classification") read: the labels (ids as JSON strings, as transformers writes
    them) and, for a sequence classifier, the loss, regression with one output
    (transformers infers the same from num_labels 1, but says it)."""
    id2label = cfg.id2label or {i: f"LABEL_{i}" for i in range(cfg.num_labels)}
    fields = {"num_labels": cfg.num_labels, "id2label": {str(k): v for k, v in sorted(id2label.items())},
              "label2id": {v: k for k, v in sorted(id2label.items())}}
    if architecture.endswith("ForSequenceClassification"):
        fields["problem_type"] = "regression" if cfg.num_labels == 1 else "single_label_classification"
    return fields


# ---------------------------------------------------------------- state dicts

def _normalise_hf_keys(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        out[k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")] = v
    # Older exports keep the MLM output bias only under the decoder's name.
    if "cls.predictions.bias" not in out and "cls.predictions.decoder.bias" in out:
        out["cls.predictions.bias"] = out["cls.predictions.decoder.bias"]
    return out


def hf_to_megabert(hf_state: dict, table: dict[str, ParamSpec], aliases: Optional[dict] = None,
                   base_prefix: str = "") -> dict:
    """Full HF state dict -> full megabert state dict, for the parameters of `table` (a
    model's spec table) whose Hugging Face names are all present; the rest is left out
    for the loader to report. Vocab rows are as HF has them (unpadded): loading pads.
    `aliases`: prefixes another writer of the family uses -> transformers' (Family.hf_prefix_aliases).
    `base_prefix`: the base model's prefix (Family.hf_base_prefix), which a bare base model
    (GteModel, a sentence-transformers export) saves without, as transformers reads either.
    A tensor holding NaN or inf is refused by name."""
    hf_state = _normalise_hf_keys(hf_state)
    for old, new in (aliases or {}).items():
        hf_state = {new + k[len(old):] if k.startswith(old) else k: v for k, v in hf_state.items()}

    def find(name: str) -> Optional[torch.Tensor]:
        found = hf_state.get(name)
        if found is None and base_prefix and name.startswith(base_prefix):
            found = hf_state.get(name[len(base_prefix):])
        return found

    out: dict[str, torch.Tensor] = {}
    for name, spec in table.items():
        parts = [find(n) for n in spec.hf_names]
        if not parts or any(p is None for p in parts):
            continue
        bad = next((n for n, p in zip(spec.hf_names, parts) if p.is_floating_point() and not torch.isfinite(p).all()),
                   None)
        if bad is not None:
            raise CheckpointError(f"{bad} holds NaN or inf values: the checkpoint is damaged (re-download or "
                                  f"re-export it)")
        out[name] = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
        if spec.valid_rows is not None and out[name].size(0) != spec.valid_rows:
            raise CheckpointError(f"{spec.hf_names[0]} has {out[name].size(0)} rows but config.json's vocab_size is "
                                  f"{spec.valid_rows}; the checkpoint and its config disagree")
    return out


def megabert_to_hf(state: dict, table: dict[str, ParamSpec]) -> dict:
    """Full megabert state dict -> HF names: fused tensors split, vocab padding removed."""
    out: dict[str, torch.Tensor] = {}
    for name, v in state.items():
        spec = table.get(name)
        if spec is None or not spec.hf_names:
            raise CheckpointError(f"no Hugging Face name for megabert parameter {name!r}: transformers' BERT has no "
                                  f"such tensor (a pre-LN model cannot be exported)")
        if spec.valid_rows is not None:
            v = v[: spec.valid_rows]
        for hf_name, part in zip(spec.hf_names, v.chunk(len(spec.hf_names), dim=0)):
            out[hf_name] = part
    return {k: v.contiguous() for k, v in out.items()}


# ---------------------------------------------------------------- files

def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        os.path.exists(os.path.join(path, f)) for f in
        ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"))


def read_hf_config(path: str) -> dict:
    """config.json of `path`: a JSON object, else a one-line error naming the file."""
    where = os.path.join(path, "config.json")
    try:
        with open(where) as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{where} holds a JSON {type(config).__name__}, not an object of config fields")
    return config


HF_FILES = safe_pickle.Allowed("Hugging Face checkpoint", safe_pickle.TENSORS)


def read_hf_state(path: str) -> dict:
    """safetensors (single or sharded), else pytorch_model.bin (zip or pre-1.6 format) read
    through safe_pickle: tensors by name, nothing else."""
    from megabert.checkpoint.safetensors_file import read_safetensors

    def load_one(fname: str) -> dict:
        full = os.path.join(path, fname)
        if not isinstance(fname, str) or os.path.basename(fname) != fname or fname in ("", ".", ".."):
            raise RefusedFileError(f"{path}: refused: its index names {str(fname)[:80]!r}, a file outside the "
                                   f"directory, which no {HF_FILES.kind} does")
        if fname.endswith(".safetensors"):
            return read_safetensors(full)  # one line naming the file for damage, NaN or inf
        state = safe_pickle.load(full, HF_FILES, mmap=False)
        if not isinstance(state, dict):
            raise safe_pickle.wrong_type(full, state, "a state dict", HF_FILES.kind)
        bad = next((kv for kv in state.items() if not isinstance(kv[0], str) or not torch.is_tensor(kv[1])), None)
        if bad is not None:
            raise safe_pickle.wrong_type(full, bad[1], f"tensor {str(bad[0])[:80]!r}", HF_FILES.kind)
        return state

    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if os.path.exists(os.path.join(path, index)):
            with open(os.path.join(path, index)) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            state: dict = {}
            for fname in files:
                state.update(load_one(fname))
            return state
    for fname in ("model.safetensors", "pytorch_model.bin"):
        if os.path.exists(os.path.join(path, fname)):
            return load_one(fname)
    raise CheckpointError(f"{path} has no model.safetensors or pytorch_model.bin")


def write_hf_dir(path: str, hf_state: dict, hf_config: dict, vocab_file: Optional[str] = None, *,
                 lower_case: bool = True) -> None:
    """model.safetensors + config.json, and with `vocab_file` the tokenizer files
    (hf_tokenizer.TOKENIZER_FILES), so transformers loads the directory as it stands.
    Every file is made 0644: safetensors writes 0600, which hides an export from the other
    users of a shared model directory."""
    from safetensors.torch import save_file

    from megabert.checkpoint.hf_tokenizer import write_tokenizer_files

    os.makedirs(path, exist_ok=True)
    written = [os.path.join(path, "model.safetensors"), os.path.join(path, "config.json")]
    save_file({k: v.detach().cpu().contiguous() for k, v in hf_state.items()}, written[0], metadata={"format": "pt"})
    with open(written[1], "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
    if vocab_file:
        written += write_tokenizer_files(path, vocab_file, lower_case=lower_case,
                                         model_max_length=hf_config["max_position_embeddings"],
                                         vocab_size=hf_config.get("vocab_size"))
    for f in written:
        os.chmod(f, 0o644)
