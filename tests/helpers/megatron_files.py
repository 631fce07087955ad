"""Megatron checkpoints in the layouts megatron-core's pip package cannot write, built from the
megatron-core fixtures (tests/fixtures/megatron, written by megatron-core itself).

megatron-core no longer ships the legacy model (megatron/legacy/model), so its files are made
here by renaming and reordering a megatron-core `torch` checkpoint per the documented maps:
legacy state dicts nest by module (`language_model` -> `embedding` / `transformer|encoder` /
`pooler`; `lm_head`; `binary_head`), name their tensors by era (A: `transformer`, `attention`,
`*_layernorm`; B: `encoder`, `self_attention`; C: `*_norm`), and order each TP shard's QKV
rows by `checkpoint_version` (0: [3, np, hn]; 1.0: [np, hn, 3]; 2.0 and 3.0: [np, 3, hn]).
A PP=2 layout splits the layers over `mp_rank_TT_PPP` directories, numbering them from 0 in
each stage, with the last stage's copy of the word embeddings (legacy
`word_embeddings_for_head`, megatron-core `output_layer.weight`).
"""
from __future__ import annotations

import argparse
import os
import random
import re

import numpy as np
import torch

from megabert.checkpoint.megatron.qkv import from_v2
from megabert.checkpoint.megatron.safe_load import foreign_to_plain, safe_torch_load

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "megatron")
HEADS = 4
ERAS = {"A": ("transformer", "attention", "layernorm"), "B": ("encoder", "self_attention", "layernorm"),
        "C": ("encoder", "self_attention", "norm")}


def mcore_rank_files(tp: int) -> list[dict]:
    """The megatron-core torch fixture's rank payloads at TP `tp`, `args` as a plain dict."""
    root = os.path.join(FIXTURES, f"tp{tp}_torch", "iter_0000010")
    payloads = [safe_torch_load(os.path.join(root, f"mp_rank_{r:02d}", "model_optim_rng.pt"), mmap=False)
                for r in range(tp)]
    return [{"model": p["model"], "args": foreign_to_plain(p["args"])} for p in payloads]


def rng_state() -> list:
    """Megatron's rng_state entry: Python and numpy generator states (numpy classes in the pickle)."""
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None}]


def _legacy_layer_suffix(rest: str, era: str) -> str:
    _, attention, norm = ERAS[era]
    for pattern, repl in ((r"^input_layernorm\.", f"input_{norm}."),
                          (r"^self_attention\.linear_qkv\.", f"{attention}.query_key_value."),
                          (r"^self_attention\.linear_proj\.", f"{attention}.dense."),
                          (r"^pre_mlp_layernorm\.", f"post_attention_{norm}."),
                          (r"^mlp\.linear_fc1\.", "mlp.dense_h_to_4h."), (r"^mlp\.linear_fc2\.", "mlp.dense_4h_to_h.")):
        rest = re.sub(pattern, repl, rest)
    return rest


def legacy_model(mcore: dict, era: str, version: float, heads_per_shard: int, *, first: bool, last: bool,
                 layers: range) -> dict:
    """One rank's megatron-core state dict -> the nested legacy state dict of one pipeline stage
    holding `layers` (numbered from 0 here)."""
    enc, _, norm = ERAS[era]
    lm: dict = {}
    out: dict = {"language_model": lm}
    if first:
        lm["embedding"] = {f"{n}_embeddings": {"weight": mcore[f"embedding.{n}_embeddings.weight"]}
                           for n in ("word", "position", "tokentype")}
    encoder = {}
    for local, layer in enumerate(layers):
        for key, t in mcore.items():
            m = re.match(rf"^encoder\.layers\.{layer}\.(.*)$", key)
            if not m or key.endswith("_extra_state"):
                continue
            if "linear_qkv.weight" in key or "linear_qkv.bias" in key:
                t = from_v2(t, version, heads_per_shard)
            encoder[f"layers.{local}.{_legacy_layer_suffix(m.group(1), era)}"] = t
    if last:
        for k in ("weight", "bias"):
            encoder[f"final_{norm}.{k}"] = mcore[f"encoder.final_layernorm.{k}"]
        lm["pooler"] = {f"dense.{k}": mcore[f"pooler.dense.{k}"] for k in ("weight", "bias")}
        out["lm_head"] = {"dense.weight": mcore["lm_head.dense.weight"], "dense.bias": mcore["lm_head.dense.bias"],
                          f"{norm}.weight": mcore["lm_head.layer_norm.weight"],
                          f"{norm}.bias": mcore["lm_head.layer_norm.bias"], "bias": mcore["output_layer.bias"]}
        out["binary_head"] = {k: mcore[f"binary_head.{k}"] for k in ("weight", "bias")}
        if not first:
            out["word_embeddings_for_head"] = {"weight": mcore["embedding.word_embeddings.weight"]}
    lm[enc] = encoder
    return out


def mcore_stage(mcore: dict, *, first: bool, last: bool, layers: range) -> dict:
    """One rank's megatron-core state dict cut to a pipeline stage (layers renumbered from 0)."""
    out = {}
    for key, t in mcore.items():
        m = re.match(r"^encoder\.layers\.(\d+)\.(.*)$", key)
        if m:
            if int(m.group(1)) in layers:
                out[f"encoder.layers.{int(m.group(1)) - layers.start}.{m.group(2)}"] = t
        elif key.startswith("embedding."):
            if first:
                out[key] = t
        elif last:
            out[key] = t
    if last and not first:
        out["output_layer.weight"] = mcore["embedding.word_embeddings.weight"]
    return out


def write_megatron_dir(root: str, tp: int, *, era: str | None = None, version: float = 3.0, pp: int = 1,
                       args: bool = True, iteration: int = 10) -> str:
    """A Megatron `torch`-format directory from the TP-`tp` fixture: legacy names of `era` and
    QKV of `version` (era None: megatron-core names), split over `pp` stages."""
    payloads = mcore_rank_files(tp)
    num_layers = 2
    per_stage = num_layers // pp
    it_dir = os.path.join(root, f"iter_{iteration:07d}")
    for t, payload in enumerate(payloads):
        for p in range(pp):
            layers = range(p * per_stage, (p + 1) * per_stage)
            first, last = p == 0, p == pp - 1
            if era is None:
                model = mcore_stage(payload["model"], first=first, last=last, layers=layers)
            else:
                model = legacy_model(payload["model"], era, version, HEADS // tp, first=first, last=last,
                                     layers=layers)
            out = {"model": model, "iteration": iteration, "rng_state": rng_state()}
            if version > 0:
                out["checkpoint_version"] = version
            if args:
                a = dict(payload["args"])
                a.update(pipeline_model_parallel_size=pp)
                a.pop("attention_backend")  # a megatron enum in real files; read back as its value here
                out["args"] = argparse.Namespace(**a)
            rank_dir = os.path.join(it_dir, f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}")
            os.makedirs(rank_dir, exist_ok=True)
            torch.save(out, os.path.join(rank_dir, "model_optim_rng.pt"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return root


def reference(tp: int) -> dict:
    return torch.load(os.path.join(FIXTURES, f"tp{tp}_reference.pt"), weights_only=True)
