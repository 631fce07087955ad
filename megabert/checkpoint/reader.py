"""One reader for every checkpoint a model or a run starts from.

`read_rank` gives one rank its view of a checkpoint, in the shapes of the layout that
reads it, whatever was saved:
- a megabert/Megatron checkpoint of the same TP x PP layout (and interleaved chunk size):
  the rank's own file, read as it is;
- one of another layout: resharded here. The rank files are memory-mapped, not read, and
  only the tensors this rank holds are merged and split again, so a rank touches its
  share of the checkpoint, not all of it;
- a Hugging Face or Google TF BERT directory: weights only, in the reading model's names.

`from_pretrained`, `--load` / `--finetune` / `--pretrained-checkpoint`, the offline
reshard tool and the exporter all read through here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megabert.checkpoint import external
from megabert.checkpoint import hf as hf_io
from megabert.checkpoint import megatron
from megabert.checkpoint.start import Format, Source, require_source
from megabert.checkpoint.layout import (load_file, parallel_meta, resolve_checkpoint_dir, saved_layout,
    saved_virtual_stage_layers)
from megabert.checkpoint.optimizer_state import shard_optimizer_state, unshard_optimizer_states
from megabert.checkpoint.sharding import checkpoint_table, repad_vocab, shard_state, unshard_states
from megabert.families import get_family
from megabert.config import ModelConfig, ParallelConfig
from megabert.errors import CheckpointError, MegabertError
from megabert.parallel.layout import StageLayout
from megabert.model_classes import reference_table
from megabert.parallel.param_spec import ParamSpec, table_to_dict
from megabert.rules import validate_layout


@dataclass
class RankCheckpoint:
    """What one rank reads: `payload` has a rank file's keys ("model": this rank's weights,
    "optimizer": its by-name moments or None, "rng": None unless read from the rank's own
    file, "iteration", "args", ...). `saved_tp`/`saved_pp` are the layout it was saved at
    (None for a Hugging Face / TF directory)."""

    payload: dict
    external: bool = False
    resharded: bool = False
    saved_tp: Optional[int] = None
    saved_pp: Optional[int] = None


def as_source(source: Union[Source, str]) -> Source:
    """A path from a caller outside the run (the Python API, the tools): detected here, once."""
    return source if isinstance(source, Source) else require_source(source, "checkpoint")


def read_model_config(source: Union[Source, str], overrides: Optional[dict] = None) -> dict:
    """The ModelConfig fields a checkpoint was saved with (rank 0's file; for a Hugging Face
    or TF directory, its config translated; for a Megatron-LM directory, its args or tensor
    shapes checked against `overrides`). Reads no tensor."""
    source = as_source(source)
    path = source.path
    if source.format is Format.MEGATRON:
        return dataclasses.asdict(megatron.read_config(path, overrides))
    if not source.external:
        layout = saved_layout(resolve_checkpoint_dir(path))
        return load_file(layout.files[(0, 0)], mmap=True)["model_config"]
    # A Hugging Face or TF directory: its config read, then translated by its family.
    hf = external.read_external_config(source)
    return dataclasses.asdict(hf_io.model_config_from_hf(hf))


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


def read_rank(source: Union[Source, str], *, tp_rank: int, tp_size: int, stage: StageLayout, padded_vocab_size: Optional[int] = None,
              table: Optional[dict[str, ParamSpec]] = None, optimizer: bool = True,
              model_config: Optional[ModelConfig] = None) -> RankCheckpoint:
    """Rank (tp_rank, stage.pp_rank)'s view of the checkpoint at `path` for a model of
    `tp_size` x `stage` (see the module docstring). `padded_vocab_size`: the reading model's
    (default: the saved config's for `tp_size`). `table`: the reading model's spec table,
    needed for a Hugging Face / TF directory, whose files carry none. `optimizer=False`
    leaves the moments unread when resharding (weights-only starts). `model_config`: the
    reading model's, which a Megatron directory without args needs (its number of heads)."""
    source = as_source(source)
    path = source.path
    if source.format is Format.MEGATRON:
        return _read_megatron(path, tp_rank, tp_size, stage, padded_vocab_size, table, model_config, optimizer)
    if source.external:
        return _read_external(source, tp_rank, tp_size, stage, padded_vocab_size, table)
    layout = saved_layout(resolve_checkpoint_dir(path))
    if (layout.tp_size, layout.pp_size) == (tp_size, stage.pp_size):
        payload = load_file(layout.files[(tp_rank, stage.pp_rank)])
        if saved_virtual_stage_layers(payload) == stage.virtual_stage_layers and _same_layers(payload, stage):
            return RankCheckpoint(payload, saved_tp=layout.tp_size, saved_pp=layout.pp_size)
    # Mapped, not read: the pages of the tensors this rank does not take are never loaded.
    files = {k: load_file(f, mmap=True) for k, f in layout.files.items()}
    payload = _reshard(layout.grid(files), tp_rank, tp_size, stage, padded_vocab_size, optimizer)
    return RankCheckpoint(payload, resharded=True, saved_tp=layout.tp_size, saved_pp=layout.pp_size)


def read_full(source: Union[Source, str]) -> tuple[dict, dict, dict[str, ParamSpec]]:
    """(full state dict, rank 0's metadata, spec table): the whole model as one rank of a
    TP 1 x PP 1 layout reads it (conversion, export). Vocab rows stay padded as saved."""
    source = as_source(source)
    cfg = ModelConfig(**read_model_config(source))
    ckpt = read_rank(source, tp_rank=0, tp_size=1, stage=StageLayout(cfg.num_layers), optimizer=False,
                     padded_vocab_size=None)
    payload = ckpt.payload
    meta = {k: v for k, v in payload.items() if k != "model"}
    table = checkpoint_table([payload], cfg)
    return payload["model"], meta, table


def _read_external(source: Source, tp_rank: int, tp_size: int, stage: StageLayout, padded_vocab_size: Optional[int],
                   table: Optional[dict[str, ParamSpec]]) -> RankCheckpoint:
    if table is None:
        raise ValueError(f"{source.path} is a Hugging Face / TF directory: reading it needs the model's spec table")
    hf_config, hf_state = external.read_external(source)
    cfg = hf_io.model_config_from_hf(hf_config)
    family = get_family(cfg.model_family)
    full = hf_io.hf_to_megabert(hf_state, table, family.hf_prefix_aliases, family.hf_base_prefix)
    full = repad_vocab(full, table, padded_vocab_size or cfg.padded_vocab_size(tp_size))
    model = shard_state(full, table, tp_rank=tp_rank, tp_size=tp_size, stage=stage)
    return RankCheckpoint({"model": model, "model_config": dataclasses.asdict(cfg), "iteration": 0},
                          external=True)


def _read_megatron(path: str, tp_rank: int, tp_size: int, stage: StageLayout, padded_vocab_size: Optional[int],
                   table: Optional[dict[str, ParamSpec]], model_config: Optional[ModelConfig],
                   optimizer: bool) -> RankCheckpoint:
    """A Megatron-LM directory: its weights for this rank, as an external checkpoint's
    (megabert.checkpoint.megatron), only the files / slices holding them read; `iteration` and
    `args` as Megatron saved them. With `optimizer`, its Adam moments by name, resharded as
    megabert's own ("optimizer"; None, with "optimizer_note" saying why, when it has none
    megabert reads). Without a `table` (conversion, export) it is read as the pre-training
    model it is."""
    header = megatron.read_header(path)
    if table is None:
        table = reference_table(megatron.read_config(path), "BertForPreTraining")
    reading = {"vocab_size": next((s.valid_rows for s in table.values() if s.valid_rows is not None), None)}
    if model_config is not None:
        if model_config.layernorm_position != "pre" or model_config.embedding_layernorm:
            raise CheckpointError(f"{path} is a Megatron-LM BERT (pre-LN, no LayerNorm after the embeddings): build "
                                  f"the model with --layernorm-position pre --no-embedding-layernorm")
        reading.update({f: getattr(model_config, f) for f in ("num_layers", "hidden_size", "num_attention_heads",
                                                               "ffn_hidden_size", "max_position_embeddings",
                                                               "vocab_size")})
    cfg = megatron.read_config(path, reading)
    padded = padded_vocab_size or cfg.padded_vocab_size(tp_size)
    # The reading model's tensors on this stage only: a task model has no MLM / binary head to take.
    held = frozenset(name for name, spec in table.items() if stage.holds(spec))
    read = megatron.read_tensors(path, cfg, optimizer=optimizer, share=megatron.Share(tp_rank, tp_size, padded, held))
    full = repad_vocab({k: v for k, v in read.weights.items() if k in held}, table, padded)
    model = shard_state(full, table, tp_rank=tp_rank, tp_size=tp_size, stage=stage)
    moments = None
    if read.moments is not None:
        full_optim = {"state": repad_vocab({k: v for k, v in read.moments.items() if k in held}, table, padded),
                      "param_groups": []}  # the run's own groups and flags: checkpoint.manager
        moments = shard_optimizer_state(full_optim, table, set(model), tp_rank, tp_size)
    return RankCheckpoint({"model": model, "model_config": dataclasses.asdict(cfg), "iteration": header["iteration"],
                           "megatron_args": header["args"], "optimizer": moments, "optimizer_note": read.note},
                          external=True, saved_tp=None, saved_pp=None)


def _reshard(grid: list[list[dict]], tp_rank: int, tp_size: int, stage: StageLayout,
             padded_vocab_size: Optional[int], optimizer: bool) -> dict:
    """grid[pp][tp] of saved rank files -> this rank's payload: the tensors `stage` holds,
    merged over the saved TP ranks, re-padded for `tp_size` and split again."""
    first = grid[0][0]
    cfg = ModelConfig(**first["model_config"])
    validate_layout(cfg, ParallelConfig(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=stage.pp_size,
                                        num_layers_per_virtual_pipeline_stage=stage.virtual_stage_layers,
                                        decoder_first_pipeline_num_layers=stage.first_stage_layers,
                                        decoder_last_pipeline_num_layers=stage.last_stage_layers),
                    tp_size * stage.pp_size)
    table = checkpoint_table([r for row in grid for r in row], cfg)
    wanted = {name for name, spec in table.items() if stage.holds(spec)}
    padded = padded_vocab_size or cfg.padded_vocab_size(tp_size)
    full = repad_vocab(unshard_states([[r["model"] for r in row] for row in grid], table, wanted), table, padded)
    model = shard_state(full, table, tp_rank=tp_rank, tp_size=tp_size, stage=stage)
    moments = None
    if optimizer and all(r.get("optimizer") is not None for row in grid for r in row):
        full_optim = unshard_optimizer_states([[r["optimizer"] for r in row] for row in grid], table, wanted)
        full_optim["state"] = repad_vocab(full_optim["state"], table, padded)
        moments = shard_optimizer_state(full_optim, table, set(model), tp_rank, tp_size)
    # The rest of rank 0's file (iteration, args, loss scale) is copied out of the mapping;
    # RNG streams belong to a rank of the old layout and are dropped (the run reseeds them).
    rest = {k: _copied(v) for k, v in first.items() if k not in ("model", "optimizer", "rng")}
    return {**rest, "model": model, "optimizer": moments, "rng": None,
            "param_specs": table_to_dict({k: table[k] for k in model}),
            "parallel": parallel_meta(tp_size, stage.pp_size, stage.virtual_stage_layers)}


def _same_layers(payload: dict, stage: StageLayout) -> bool:
    """Whether a rank file saved at this TP x PP holds the layers `stage` holds: uneven stages
    (--decoder-first/last-pipeline-num-layers) split the same PP size differently. A file
    without its spec table was saved before uneven stages existed: an even split."""
    specs = payload.get("param_specs")
    if specs is None:
        return stage.first_stage_layers is None and stage.last_stage_layers is None
    return {s["layer"] for s in specs.values() if s.get("layer") is not None} == set(stage.layer_ids)


def _copied(value):
    if torch.is_tensor(value):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value
