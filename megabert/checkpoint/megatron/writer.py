"""megabert weights -> a Megatron-LM BERT checkpoint directory, as Megatron's own save writes it.

    ROOT/latest_checkpointed_iteration.txt       the iteration, or "release"
    ROOT/iter_NNNNNNN/ (or release/)
      torch:      mp_rank_TT[_PPP]/model_optim_rng.pt   {"model", "args", "checkpoint_version": 3.0, "iteration"}
      torch_dist: .metadata, __0_0.distcp, common.pt ({"args", "checkpoint_version", "iteration"}),
                  metadata.json

`torch` writes megatron-core names (what Megatron-LM's `--ckpt-format torch` loads into its
BertModel), or with `legacy` the nested names of the legacy model, era B (`encoder`,
`self_attention`, `*_layernorm`: what transformers' convert_megatron_bert_checkpoint.py
reads). `torch_dist` writes every tensor at its global shape, the layers stacked, the
per-layer LayerNorms under their fused names and megatron-core's (empty) `_extra_state`
objects, so `dist_checkpointing.load` fills a BertModel of any TP from it. The vocab is padded
as Megatron pads it (a multiple of 128 x TP) with zero rows. The Adam state goes along where
the caller gives it (adam_state.AdamExport; megatron-core names only), else there is none; there
is never RNG state (load with --no-load-rng, or --finetune).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import warnings
from typing import Optional, Union

import torch

from megabert.checkpoint.layout import TRACKER, tag_dir_name
from megabert.checkpoint.megatron import adam_state, names, qkv
from megabert.checkpoint.megatron.adam_state import AdamExport
from megabert.config import ModelConfig
from megabert.errors import CheckpointError

_EXTRA_STATE_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def megabert_to_canonical(full: dict[str, torch.Tensor], cfg: ModelConfig, tp_size: int) -> dict[str, torch.Tensor]:
    """A full megabert BertForPreTraining state dict -> canonical names (names.py), QKV in
    version-2.0 order, vocab rows padded for Megatron at `tp_size`."""
    if cfg.layernorm_position != "pre" or cfg.embedding_layernorm:
        raise CheckpointError("Megatron-LM's BERT is pre-LN without a LayerNorm after the embeddings; this model is "
                              f"layernorm_position={cfg.layernorm_position!r}, embedding_layernorm="
                              f"{cfg.embedding_layernorm}: it has no Megatron equivalent")
    padded = cfg.padded_vocab_size(tp_size)
    out = {}
    for name, t in full.items():
        canonical = names.canonical_from_megabert(name)
        if canonical is None:
            raise CheckpointError(f"megabert tensor {name} has no Megatron BERT equivalent (a task head?): export a "
                                  f"BertForPreTraining checkpoint")
        if canonical.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            t = qkv.megabert_to_v2(t, cfg.num_attention_heads)
        if canonical in ("embedding.word_embeddings.weight", "output_layer.bias"):
            t = t[: cfg.vocab_size]
            t = torch.cat([t, t.new_zeros((padded - t.size(0),) + tuple(t.shape[1:]))])
        out[canonical] = t.detach().cpu().contiguous()
    return out


def megatron_args(cfg: ModelConfig, tp_size: int, pp_size: int, iteration: int, ckpt_format: str):
    """The `args` Megatron-LM reads back from a checkpoint (its own argument names)."""
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.ffn_hidden_size,
        num_attention_heads=cfg.num_attention_heads, kv_channels=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, seq_length=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size, padded_vocab_size=cfg.padded_vocab_size(tp_size),
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by, layernorm_epsilon=cfg.layernorm_epsilon,
        hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std, bert_binary_head=cfg.bert_binary_head,
        num_tokentypes=cfg.type_vocab_size, tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        position_embedding_type="learned_absolute", normalization="LayerNorm", add_bias_linear=True, swiglu=False,
        group_query_attention=False, num_query_groups=None, untie_embeddings_and_output_weights=False,
        apply_residual_connection_post_layernorm=False, openai_gelu=False, tokenizer_type="BertWordPieceLowerCase",
        ckpt_format=ckpt_format, iteration=iteration, consumed_train_samples=0)


def _split(t: torch.Tensor, name: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    dim = names.tp_split_dim(name)
    return t if dim is None or tp_size == 1 else t.chunk(tp_size, dim=dim)[tp_rank].clone()


def _stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    per = num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def _mcore_stage(canonical: dict, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, num_layers: int) -> dict:
    layers = _stage_layers(num_layers, pp_size, pp_rank)
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: dict = {}
    for name, t in canonical.items():
        m = re.match(r"^encoder\.layers\.(\d+)\.(.*)$", name)
        if m:
            if int(m.group(1)) in layers:
                out[f"encoder.layers.{int(m.group(1)) - layers.start}.{m.group(2)}"] = _split(t, name, tp_rank,
                                                                                              tp_size)
        elif name.startswith("embedding."):
            if first:
                out[name] = _split(t, name, tp_rank, tp_size)
        elif last:
            out[name] = _split(t, name, tp_rank, tp_size)
    for local in range(len(layers)):
        for linear in _EXTRA_STATE_LINEARS:
            out[f"encoder.layers.{local}.{linear}._extra_state"] = None
    if last:
        out["output_layer._extra_state"] = None
        if not first:  # the last stage's copy of the tied word embeddings
            out["output_layer.weight"] = _split(canonical["embedding.word_embeddings.weight"],
                                                "output_layer.weight", tp_rank, tp_size)
    return out


def _legacy_stage(mcore_stage: dict, first: bool, last: bool) -> dict:
    """A megatron-core stage dict -> the legacy model's nested dict, era B names."""
    layer = [("input_layernorm.", "input_layernorm."),
             ("self_attention.linear_qkv.", "self_attention.query_key_value."),
             ("self_attention.linear_proj.", "self_attention.dense."),
             ("pre_mlp_layernorm.", "post_attention_layernorm."),
             ("mlp.linear_fc1.", "mlp.dense_h_to_4h."), ("mlp.linear_fc2.", "mlp.dense_4h_to_h.")]
    encoder, lm = {}, {}
    out: dict = {"language_model": lm}
    for name, t in mcore_stage.items():
        if name.endswith("_extra_state"):
            continue
        m = re.match(r"^encoder\.layers\.(\d+)\.(.*)$", name)
        if m:
            rest = m.group(2)
            for old, new in layer:
                if rest.startswith(old):
                    rest = new + rest[len(old):]
            encoder[f"layers.{m.group(1)}.{rest}"] = t
    if first:
        lm["embedding"] = {f"{n}_embeddings": {"weight": mcore_stage[f"embedding.{n}_embeddings.weight"]}
                           for n in ("word", "position", "tokentype")
                           if f"embedding.{n}_embeddings.weight" in mcore_stage}
    if last:
        for k in ("weight", "bias"):
            encoder[f"final_layernorm.{k}"] = mcore_stage[f"encoder.final_layernorm.{k}"]
        lm["pooler"] = {f"dense.{k}": mcore_stage[f"pooler.dense.{k}"] for k in ("weight", "bias")
                        if f"pooler.dense.{k}" in mcore_stage}
        out["lm_head"] = {"dense.weight": mcore_stage["lm_head.dense.weight"],
                          "dense.bias": mcore_stage["lm_head.dense.bias"],
                          "layernorm.weight": mcore_stage["lm_head.layer_norm.weight"],
                          "layernorm.bias": mcore_stage["lm_head.layer_norm.bias"],
                          "bias": mcore_stage["output_layer.bias"]}
        if "binary_head.weight" in mcore_stage:
            out["binary_head"] = {k: mcore_stage[f"binary_head.{k}"] for k in ("weight", "bias")}
        if "output_layer.weight" in mcore_stage:
            out["word_embeddings_for_head"] = {"weight": mcore_stage["output_layer.weight"]}
    lm["encoder"] = encoder
    return out


def _write_tracker(root: str, tag: Union[int, str]) -> None:
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(str(tag))


def write_torch(root: str, canonical: dict, cfg: ModelConfig, *, tp_size: int, pp_size: int,
                tag: Union[int, str] = "release", legacy: bool = False, adam: Optional[AdamExport] = None) -> str:
    """Megatron's `--ckpt-format torch` directory; returns the iteration directory. `adam`
    (megatron-core names only): each rank's `optimizer` entry, as its FP32Optimizer saves it."""
    if adam is not None and legacy:
        raise CheckpointError("the legacy model's parameter order is not written: export its optimizer state with "
                              "megatron-core names (leave out --legacy)")
    iteration = 0 if tag == "release" else int(tag)
    it_dir = os.path.join(root, tag_dir_name(tag))
    args = megatron_args(cfg, tp_size, pp_size, iteration, "torch")
    for pp in range(pp_size):
        for tp in range(tp_size):
            stage = _mcore_stage(canonical, tp, tp_size, pp, pp_size, cfg.num_layers)
            # In megatron-core's own order, so that a reader naming positional optimizer state
            # from the model entry (as megabert's does) finds Megatron's parameter order.
            stage = {k: stage[k] for k in sorted(stage, key=adam_state.mcore_order)}
            model = _legacy_stage(stage, pp == 0, pp == pp_size - 1) if legacy else stage
            rank_dir = os.path.join(it_dir, f"mp_rank_{tp:02d}" if pp_size == 1 else f"mp_rank_{tp:02d}_{pp:03d}")
            os.makedirs(rank_dir, exist_ok=True)
            payload = {"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": model}
            if adam is not None:
                local = {kind: {k: t for k, t in _mcore_stage(adam.moments[kind], tp, tp_size, pp, pp_size,
                                                              cfg.num_layers).items() if t is not None}
                         for kind in adam_state.MOMENTS}
                payload["optimizer"] = adam_state.torch_optimizer_entry(local, adam)
            torch.save(payload, os.path.join(rank_dir, "model_optim_rng.pt"))
    _write_tracker(root, tag)
    return it_dir


def _stacked(canonical: dict, num_layers: int) -> dict:
    """Per-layer tensors stacked [L, ...] under torch_dist's names (fused LayerNorm names)."""
    fused = {"input_layernorm": "self_attention.linear_qkv.layer_norm_",
             "pre_mlp_layernorm": "mlp.linear_fc1.layer_norm_"}
    out, per_layer = {}, {}
    for name, t in canonical.items():
        m = re.match(r"^encoder\.layers\.(\d+)\.(.*)$", name)
        if not m:
            out[name] = t
            continue
        rest = m.group(2)
        ln = re.match(r"^(input_layernorm|pre_mlp_layernorm)\.(weight|bias)$", rest)
        if ln:
            rest = fused[ln.group(1)] + ln.group(2)
        per_layer.setdefault(rest, {})[int(m.group(1))] = t
    for rest, layers in per_layer.items():
        out[f"encoder.layers.{rest}"] = torch.stack([layers[i] for i in range(num_layers)])
    return out


def write_torch_dist(root: str, canonical: dict, cfg: ModelConfig, *, tp_size: int,
                     tag: Union[int, str] = "release", adam: Optional[AdamExport] = None) -> str:
    """megatron-core's `torch_dist` directory (one writer, global shapes: any TP reads it).
    `adam`: the moments under `optimizer.state.exp_avg[_sq].*`, the step and param groups in
    common.pt, as megatron-core's FP32Optimizer.sharded_state_dict saves them."""
    import torch.distributed.checkpoint as dcp

    iteration = 0 if tag == "release" else int(tag)
    it_dir = os.path.join(root, tag_dir_name(tag))
    os.makedirs(it_dir, exist_ok=True)
    state: dict = dict(_stacked(canonical, cfg.num_layers))
    # megatron-core's ShardedObjects: per object key, the list of its shards' data (a local-spec
    # linear's _extra_state is None). DCP torch.saves a non-tensor value as a byte item, as
    # megatron-core does; no flattening, so the list stays one item and no planner data is kept.
    for linear in _EXTRA_STATE_LINEARS:
        for i in range(cfg.num_layers):
            state[f"encoder.layers.{linear}._extra_state/shard_{i}_{cfg.num_layers}"] = [None]
    state["output_layer._extra_state/shard_0_1"] = [None]
    if adam is not None:
        for kind in adam_state.MOMENTS:
            state.update({adam_state.dist_keys(kind, k): t for k, t in _stacked(adam.moments[kind],
                                                                                 cfg.num_layers).items()})
    planner = dcp.DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    with warnings.catch_warnings():  # one process writes every shard: no process group is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(it_dir), planner=planner, no_dist=True)
    common = {"args": megatron_args(cfg, tp_size, 1, iteration, "torch_dist"), "checkpoint_version": 3.0,
              "iteration": iteration}
    if adam is not None:
        common["optimizer"] = adam_state.dist_common(adam)
    torch.save(common, os.path.join(it_dir, "common.pt"))
    with open(os.path.join(it_dir, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)
    _write_tracker(root, tag)
    return it_dir
