"""The distributed optimizer (--use-distributed-optimizer, Megatron-LM's flag): optimizer
states sharded over data parallelism, gradients reduce-scattered while backward runs,
parameters all-gathered while the next forward runs. This module holds the optimizer over
this rank's pieces and its states by name; the training step that orders the reductions
around it is megabert.training.distributed_optimizer_strategy's.

Per step: backward fills the contiguous gradient buffer, and each bucket is
reduce-scattered as soon as its last micro-batch's gradients are in
(megabert.data_parallel.sharded_buffers); each DP rank then holds the averaged gradients of
its shard of every bucket. The sums over TP (sequence-parallel LayerNorms) and over the
embedding group (the pipeline's tied word embeddings, bucketed alone so that both stages
shard them alike) apply to the shards; the global norm sums the shards' squares over
every rank; the optimizer (AdamW or LAMB, the same as without this flag) steps only the
pieces of parameters in this rank's shards, so its moments take 1/DP of the memory; the
parameter buckets are then all-gathered. Bytes per step: a reduce-scatter and an
all-gather of the buffer, what a ring all-reduce sends.

Parameters are the fp32 master weights already (megabert.training.precision: bf16/fp16
run under autocast), so the shard the optimizer steps is a view of the parameter buffer:
no second copy.

Checkpoints hold the states by parameter name, whole (TP-local) tensors, as a run without
this flag writes them: gathered over DP at save time, sliced to this rank's pieces at load,
so a checkpoint moves between DP sizes and between runs with and without the flag.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from megabert.config import OptimConfig
from megabert.data_parallel.sharded_buffers import Piece, ShardedBuffers
from megabert.data_parallel.sharded_lamb import ShardedLamb
from megabert.errors import CheckpointError
from megabert.optim import build_optimizer, param_groups
from megabert.parallel import ParallelState, comm

# The optimizers' per-element states (AdamW's and LAMB's, torch's names); "step" is a scalar.
ELEMENT_STATES = ("exp_avg", "exp_avg_sq")


class DistributedOptimizer:
    """The optimizer `cfg` describes, over this rank's pieces of `model`'s parameters."""

    def __init__(self, model: torch.nn.Module, cfg: OptimConfig, ps: ParallelState, buffers: ShardedBuffers):
        self.model, self.ps, self.buffers = model, ps, buffers
        self.params = [p for p in model.parameters() if p.requires_grad]
        # The pieces take their parameter's group (BERT's weight-decay rule), in the groups'
        # order, so a checkpoint's param groups line up with a plain run's.
        self.model_groups = param_groups(model, cfg.weight_decay)
        group_of = {id(p): i for i, g in enumerate(self.model_groups) for p in g["params"]}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in self.model_groups]
        for piece in buffers.pieces:
            groups[group_of[id(piece.param)]]["params"].append(piece.tensor)
        self.pieces = buffers.pieces
        self.tensors = [piece.tensor for piece in self.pieces]
        lamb = functools.partial(ShardedLamb, pieces=self.pieces, params=self.params, ps=ps)
        self.optimizer = build_optimizer(model, cfg, ps.tp_group, groups=groups, lamb=lamb)

    # ------------------------------------------------------------ checkpoints
    # A checkpoint's stateful part (megabert.checkpoint.manager): the states by parameter name.

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    def state_dict(self) -> Optional[dict]:
        """Collective over DP. On DP rank 0, which writes it, the states as a run without
        this flag saves them (megabert.checkpoint.optimizer_state): {"state": {name: {"step",
        "exp_avg", "exp_avg_sq"}}, "param_groups": [{..., "params": [names]}]}, whole
        TP-local tensors. The other DP ranks send their shards one bucket at a time, hold
        nothing more and return None."""
        ps, buffers = self.ps, self.buffers
        offsets = buffers.offsets
        state = self.optimizer.state
        index = {id(p): i for i, p in enumerate(self.params)}
        writer = ps.dp_rank == 0
        steps = torch.zeros(len(self.params), dtype=torch.float64, device=ps.device)
        pieces_of: dict[int, list[Piece]] = {}  # bucket -> this rank's pieces in it
        for piece in self.pieces:
            pieces_of.setdefault(id(buffers.bucket_of(piece.param)), []).append(piece)
            s = state.get(piece.tensor)
            if s:
                steps[index[id(piece.param)]] = float(s["step"])
        if ps.dp_size > 1:
            comm.all_reduce(steps, op=comm.ReduceOp.MAX, group=ps.dp_group)
        steps = steps.cpu()  # read per parameter below: one device sync, not one each
        names = {id(p): n for n, p in self.model.named_parameters()}
        # The writer's copy of the states: 8 bytes per parameter for the save's duration
        # (plain DP saves its states as they live), filled one bucket at a time. A
        # parameter never stepped (no gradient yet) has no state, as torch's optimizers keep none.
        by_name = {names[id(p)]: {"step": torch.tensor(float(steps[i]), dtype=torch.float32),
                                  **{k: torch.zeros(p.shape, dtype=torch.float32) for k in ELEMENT_STATES}}
                   for i, p in enumerate(self.params) if writer and steps[i] != 0}
        for bucket in buffers.buckets:
            start, n, shard = bucket.start, bucket.params_flat.numel(), bucket.param_shard.numel()
            lo = start + ps.dp_rank * shard
            for key in ELEMENT_STATES:
                mine = torch.zeros(shard, dtype=torch.float32, device=bucket.param_shard.device)
                for piece in pieces_of.get(id(bucket), []):
                    s = state.get(piece.tensor)
                    if s:
                        at = offsets[piece.param] + piece.lo - lo
                        mine[at:at + piece.hi - piece.lo] = s[key].reshape(-1)
                whole = torch.empty(n, dtype=torch.float32, device=mine.device) if writer else None
                if ps.dp_size == 1:
                    whole.copy_(mine)
                else:
                    comm.gather(mine, list(whole.chunk(ps.dp_size)) if writer else None, group=ps.dp_group)
                for p in bucket.params if writer else ():
                    if names[id(p)] in by_name:
                        o = offsets[p] - start
                        by_name[names[id(p)]][key].view(-1).copy_(whole[o:o + p.numel()])
        if not writer:
            return None
        groups = [{**{k: v for k, v in live.items() if k != "params"},
                   "params": [names[id(p)] for p in mg["params"]]}
                  for live, mg in zip(self.optimizer.param_groups, self.model_groups)]
        return {"state": by_name, "param_groups": groups}

    def load_state_dict(self, saved: dict) -> None:
        """This rank's pieces of a by-name state (saved with or without this flag, at any
        DP size; TP/PP resharding is the checkpoint reader's)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        order = [t for g in self.optimizer.param_groups for t in g["params"]]
        position = {id(t): i for i, t in enumerate(order)}
        state = {}
        for piece in self.pieces:
            s = saved["state"].get(names[id(piece.param)])
            if s is None:
                continue
            state[position[id(piece.tensor)]] = {
                "step": s["step"].clone() if torch.is_tensor(s["step"]) else s["step"],
                **{k: s[k].reshape(-1)[piece.lo:piece.hi].clone() for k in ELEMENT_STATES}}
        if len(saved["param_groups"]) != len(self.optimizer.param_groups):
            raise CheckpointError(f"the checkpoint's optimizer has {len(saved['param_groups'])} parameter groups, "
                                  f"this run's {len(self.optimizer.param_groups)}; start the optimizer fresh with "
                                  f"--finetune")
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [position[id(t)] for t in live["params"]]}
                  for g, live in zip(saved["param_groups"], self.optimizer.param_groups)]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
