"""Change a checkpoint's tensor/pipeline layout: model weights and optimizer moments
are merged to full tensors and split again; RNG streams, which belong to a rank of
the old layout, are dropped (the new run reseeds them)."""
from __future__ import annotations

from typing import Optional

from megabert.checkpoint.layout import load_file, parallel_meta, rank_files
from megabert.checkpoint.optimizer_state import shard_optimizer_state, unshard_optimizer_states
from megabert.checkpoint.sharding import repad_vocab, shard_state, unshard_states
from megabert.config import ModelConfig, ParallelConfig, validate_layout


def reshard_payloads(ckpt_dir: str, tp_size: int, pp_size: int, layers_per_virtual_stage: Optional[int] = None
                     ) -> dict[tuple[int, int], dict]:
    """Every rank's payload of the new layout (tp, pp, and the interleaved chunk size)."""
    files = rank_files(ckpt_dir)
    tp0 = max(t for t, _ in files) + 1
    pp0 = max(p for _, p in files) + 1
    payloads = {k: load_file(f) for k, f in files.items()}
    first = payloads[(0, 0)]
    cfg = ModelConfig(**first["model_config"])
    validate_layout(cfg, ParallelConfig(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
                                        num_layers_per_virtual_pipeline_stage=layers_per_virtual_stage),
                    tp_size * pp_size)
    if layers_per_virtual_stage == cfg.num_layers // pp_size:
        layers_per_virtual_stage = None  # one chunk per stage: the plain layout
    padded = cfg.padded_vocab_size(tp_size)
    grid = [[payloads[(t, p)] for t in range(tp0)] for p in range(pp0)]
    full_model = repad_vocab(unshard_states([[r["model"] for r in row] for row in grid]), cfg.vocab_size, padded)
    full_optim = None
    if all(r.get("optimizer") is not None for row in grid for r in row):
        full_optim = unshard_optimizer_states([[r["optimizer"] for r in row] for row in grid])
        full_optim["state"] = repad_vocab(full_optim["state"], cfg.vocab_size, padded)
    out = {}
    for p in range(pp_size):
        for t in range(tp_size):
            model = shard_state(full_model, tp_rank=t, tp_size=tp_size, pp_rank=p, pp_size=pp_size,
                                num_layers=cfg.num_layers, layers_per_virtual_stage=layers_per_virtual_stage)
            payload = {k: v for k, v in first.items() if k not in ("model", "optimizer", "rng")}
            payload.update(model=model, rng=None,
                           parallel=parallel_meta(tp_size, pp_size, layers_per_virtual_stage),
                           optimizer=shard_optimizer_state(full_optim, set(model), t, tp_size) if full_optim else None)
            out[(t, p)] = payload
    return out
