"""Hugging Face BERT <-> megabert: configs and full (unsharded) state dicts.

Only names and the QKV fusion differ; the numbers are copied as they are. The vocab is
padded on import (zero rows, never reached by a user-visible logit) and cut on export.
"""
from __future__ import annotations

import json
import os
import re
from typing import Optional

import torch

from megabert.config import ModelConfig
from megabert.errors import CheckpointError

_LAYER_MAP = {  # HF suffix after bert.encoder.layer.{i}. -> ours after bert.encoder.layers.{i}.
    "attention.output.dense": "attention.dense",
    "attention.output.LayerNorm": "attention_layernorm",
    "intermediate.dense": "mlp.dense_h_to_4h",
    "output.dense": "mlp.dense_4h_to_h",
    "output.LayerNorm": "mlp_layernorm",
}
_FIXED_MAP = {
    "bert.embeddings.word_embeddings.weight": "bert.embeddings.word_embeddings.weight",
    "bert.embeddings.position_embeddings.weight": "bert.embeddings.position_embeddings.weight",
    "bert.embeddings.token_type_embeddings.weight": "bert.embeddings.tokentype_embeddings.weight",
    "bert.embeddings.LayerNorm.weight": "bert.embeddings.layernorm.weight",
    "bert.embeddings.LayerNorm.bias": "bert.embeddings.layernorm.bias",
    "bert.pooler.dense.weight": "bert.pooler.dense.weight",
    "bert.pooler.dense.bias": "bert.pooler.dense.bias",
    "cls.predictions.transform.dense.weight": "lm_head.dense.weight",
    "cls.predictions.transform.dense.bias": "lm_head.dense.bias",
    "cls.predictions.transform.LayerNorm.weight": "lm_head.layernorm.weight",
    "cls.predictions.transform.LayerNorm.bias": "lm_head.layernorm.bias",
    "cls.predictions.bias": "lm_head.bias",
    "cls.seq_relationship.weight": "binary_head.weight",
    "cls.seq_relationship.bias": "binary_head.bias",
    "qa_outputs.weight": "qa_outputs.weight",
    "qa_outputs.bias": "qa_outputs.bias",
}
_FIXED_INV = {v: k for k, v in _FIXED_MAP.items()}
_VOCAB_PADDED = ("bert.embeddings.word_embeddings.weight", "lm_head.bias")


# ---------------------------------------------------------------- configs

def model_config_from_hf(hf: dict, **overrides) -> ModelConfig:
    if hf.get("model_type", "bert") != "bert":
        raise CheckpointError(f"config.json has model_type {hf.get('model_type')!r}; only BERT is supported")
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        raise CheckpointError(f"config.json has hidden_act {act!r}; megabert's BERT uses exact GELU ('gelu')")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError("only absolute position embeddings are supported "
                              f"(config.json says {hf['position_embedding_type']!r})")
    fields = dict(num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                  num_attention_heads=hf["num_attention_heads"], ffn_hidden_size=hf["intermediate_size"],
                  vocab_size=hf["vocab_size"], max_position_embeddings=hf["max_position_embeddings"],
                  type_vocab_size=hf.get("type_vocab_size", 2),
                  hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
                  attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
                  layernorm_epsilon=hf.get("layer_norm_eps", 1e-12),
                  init_method_std=hf.get("initializer_range", 0.02))
    fields.update(overrides)
    return ModelConfig(**fields)


def hf_config_from_model(cfg: ModelConfig, architecture: str) -> dict:
    if cfg.layernorm_position != "post":
        raise CheckpointError("transformers' BERT is post-LayerNorm; a pre-LN model cannot be exported to it")
    return {
        "architectures": [architecture], "model_type": "bert", "hidden_act": "gelu",
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.ffn_hidden_size,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
        "type_vocab_size": cfg.type_vocab_size, "hidden_dropout_prob": cfg.hidden_dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout, "layer_norm_eps": cfg.layernorm_epsilon,
        "initializer_range": cfg.init_method_std, "position_embedding_type": "absolute",
        "pad_token_id": 0, "torch_dtype": "float32",
    }


# ---------------------------------------------------------------- state dicts

def _normalise_hf_keys(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        k = k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if k.startswith(("embeddings.", "encoder.", "pooler.")):  # a bare BertModel
            k = "bert." + k
        out[k] = v
    return out


def hf_to_megabert(hf_state: dict, cfg: ModelConfig, padded_vocab_size: int) -> dict:
    """Full HF state dict -> full megabert state dict (names of BertForPreTraining /
    BertForQuestionAnswering). Keys megabert has no use for (e.g. position_ids) are dropped."""
    hf_state = _normalise_hf_keys(hf_state)
    out: dict[str, torch.Tensor] = {}
    layer_re = re.compile(r"bert\.encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")
    for k, v in hf_state.items():
        if k in _FIXED_MAP:
            out[_FIXED_MAP[k]] = v
            continue
        m = layer_re.match(k)
        if m and m.group(2) in _LAYER_MAP:
            out[f"bert.encoder.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}.{m.group(3)}"] = v
    for i in range(cfg.num_layers):
        for kind in ("weight", "bias"):
            parts = [hf_state.get(f"bert.encoder.layer.{i}.attention.self.{p}.{kind}") for p in ("query", "key", "value")]
            if any(p is None for p in parts):
                raise CheckpointError(f"Hugging Face checkpoint lacks layer {i}'s attention.self query/key/value "
                                      f"{kind}; is it a BERT checkpoint with {cfg.num_layers} layers?")
            out[f"bert.encoder.layers.{i}.attention.qkv.{kind}"] = torch.cat(parts, dim=0)
    if "lm_head.bias" not in out and "cls.predictions.decoder.bias" in hf_state:
        out["lm_head.bias"] = hf_state["cls.predictions.decoder.bias"]
    for name in _VOCAB_PADDED:
        if name in out:
            t = out[name]
            pad = padded_vocab_size - t.size(0)
            if pad < 0:
                raise CheckpointError(f"{name} has {t.size(0)} rows, more than the padded vocab {padded_vocab_size}")
            out[name] = torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))], dim=0) if pad else t
    return out


def megabert_to_hf(state: dict, cfg: ModelConfig) -> dict:
    """Full megabert state dict -> HF names, QKV split, vocab padding removed."""
    out: dict[str, torch.Tensor] = {}
    layer_re = re.compile(r"bert\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")
    inv_layer = {v: k for k, v in _LAYER_MAP.items()}
    for k, v in state.items():
        if k in _VOCAB_PADDED:
            v = v[: cfg.vocab_size]
        if k in _FIXED_INV:
            out[_FIXED_INV[k]] = v
            continue
        m = layer_re.match(k)
        if not m:
            raise CheckpointError(f"no Hugging Face name for megabert parameter {k!r}")
        i, name, kind = m.groups()
        if name == "attention.qkv":
            for p, t in zip(("query", "key", "value"), v.chunk(3, dim=0)):
                out[f"bert.encoder.layer.{i}.attention.self.{p}.{kind}"] = t
        elif name in inv_layer:
            out[f"bert.encoder.layer.{i}.{inv_layer[name]}.{kind}"] = v
        else:
            raise CheckpointError(f"no Hugging Face name for megabert parameter {k!r}")
    return {k: v.contiguous() for k, v in out.items()}


# ---------------------------------------------------------------- files

def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        os.path.exists(os.path.join(path, f)) for f in
        ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"))


def read_hf_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def read_hf_state(path: str) -> dict:
    """safetensors (single or sharded), else pytorch_model.bin loaded with weights_only."""
    from safetensors.torch import load_file

    def load_one(fname: str) -> dict:
        full = os.path.join(path, fname)
        if fname.endswith(".safetensors"):
            return load_file(full)
        return torch.load(full, map_location="cpu", weights_only=True)

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
