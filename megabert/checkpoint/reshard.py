"""Change a checkpoint's tensor/pipeline layout: model weights and optimizer moments
are merged to full tensors and split again, by the ParamSpecs the checkpoint carries;
RNG streams, which belong to a rank of the old layout, are dropped (the new run reseeds
them)."""
from __future__ import annotations

from typing import Optional

from megabert.checkpoint.layout import parallel_meta, saved_layout
from megabert.checkpoint.optimizer_state import shard_optimizer_state, unshard_optimizer_states
from megabert.checkpoint.sharding import checkpoint_table, repad_vocab, shard_state, unshard_states
from megabert.config import ModelConfig, ParallelConfig
from megabert.rules import validate_layout
from megabert.parallel.layout import StageLayout
from megabert.parallel.param_spec import table_to_dict


def reshard_payloads(ckpt_dir: str, tp_size: int, pp_size: int, layers_per_virtual_stage: Optional[int] = None
                     ) -> dict[tuple[int, int], dict]:
    """Every rank's payload of the new layout (tp, pp, and the interleaved chunk size)."""
    layout = saved_layout(ckpt_dir)
    payloads = layout.load_all()
    first = payloads[(0, 0)]
    cfg = ModelConfig(**first["model_config"])
    validate_layout(cfg, ParallelConfig(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
                                        num_layers_per_virtual_pipeline_stage=layers_per_virtual_stage),
                    tp_size * pp_size)
    table = checkpoint_table(list(payloads.values()), cfg)
    padded = cfg.padded_vocab_size(tp_size)
    grid = layout.grid(payloads)
    full_model = repad_vocab(unshard_states([[r["model"] for r in row] for row in grid], table), table, padded)
    full_optim = None
    if all(r.get("optimizer") is not None for row in grid for r in row):
        full_optim = unshard_optimizer_states([[r["optimizer"] for r in row] for row in grid], table)
        full_optim["state"] = repad_vocab(full_optim["state"], table, padded)
    out = {}
    for p in range(pp_size):
        stage = StageLayout(cfg.num_layers, pp_size, p, layers_per_virtual_stage)
        for t in range(tp_size):
            model = shard_state(full_model, table, tp_rank=t, tp_size=tp_size, stage=stage)
            payload = {k: v for k, v in first.items() if k not in ("model", "optimizer", "rng")}
            payload.update(model=model, rng=None, param_specs=table_to_dict({k: table[k] for k in model}),
                           parallel=parallel_meta(tp_size, pp_size, stage.virtual_stage_layers),
                           optimizer=shard_optimizer_state(full_optim, table, set(model), t, tp_size)
                           if full_optim else None)
            out[(t, p)] = payload
    return out
