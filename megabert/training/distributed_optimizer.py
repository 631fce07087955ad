"""The distributed optimizer (--use-distributed-optimizer, Megatron-LM's flag): optimizer
states sharded over data parallelism, gradients reduce-scattered while backward runs,
parameters all-gathered while the next forward runs.

Per step: backward fills the contiguous gradient buffer, and each bucket is
reduce-scattered as soon as its last micro-batch's gradients are in
(megabert.training.sharded_buffers); each DP rank then holds the averaged gradients of
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

import logging
import math
from typing import Optional

import torch

from megabert.config import OptimConfig
from megabert.errors import CheckpointError
from megabert.optim import Lamb, build_optimizer, param_groups
from megabert.parallel import ParallelState, comm
from megabert.parallel.param_spec import spec_of
from megabert.optim.clip import clipped_step
from megabert.training.grads import grad_norm, sync_sequence_parallel_grads, sync_tied_embedding_grads
from megabert.training.precision import DynamicLossScaler
from megabert.training.sharded_buffers import Piece, ShardedBuffers
from megabert.training.strategy import LocalStrategy, StepResult

logger = logging.getLogger(__name__)

# The optimizers' per-element states (AdamW's and LAMB's, torch's names); "step" is a scalar.
ELEMENT_STATES = ("exp_avg", "exp_avg_sq")


class ShardedLamb(Lamb):
    """LAMB over pieces of parameters: a trust ratio needs the norms of the whole
    parameter, so the pieces' squared norms are summed per parameter over the DP ranks
    (and over TP for split parameters), all groups in one reduction per step."""

    def bind(self, pieces: list[Piece], params: list[torch.nn.Parameter], ps: ParallelState) -> None:
        index = {id(p): i for i, p in enumerate(params)}
        self._parent = {id(piece.tensor): index[id(piece.param)] for piece in pieces}
        self._split = torch.tensor([spec_of(p).is_tensor_parallel for p in params], device=ps.device)
        self._n, self._ps = len(params), ps

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        work = [(group, self._updates(group)) for group in self.param_groups]
        work = [(g, w) for g, w in work if w is not None]
        # [2, n_params] float64: squares of ||w|| and ||update|| per whole parameter. A
        # piece's norm squared in float64 is exact, so a parameter held whole by one
        # rank gets the very norm plain LAMB computes.
        sums = torch.zeros(2, self._n, dtype=torch.float64, device=self._ps.device)
        for _, (params, updates, fp32_params) in work:
            idx = torch.tensor([self._parent[id(p)] for p in params], device=sums.device)
            sums[0].index_add_(0, idx, torch.stack(torch._foreach_norm(fp32_params, 2, dtype=torch.float32))
                               .double().square())
            sums[1].index_add_(0, idx, torch.stack(torch._foreach_norm(updates, 2)).double().square())
        ps = self._ps
        if ps.dp_size > 1:
            comm.all_reduce(sums, group=ps.dp_group)  # every rank calls it, with or without pieces
        if ps.tp_size > 1 and bool(self._split.any()):
            split = sums[:, self._split]
            comm.all_reduce(split, group=ps.tp_group)
            sums[:, self._split] = split
        norms = sums.sqrt().float()
        for group, (params, updates, _) in work:
            idx = torch.tensor([self._parent[id(p)] for p in params], device=norms.device)
            self._apply(group, params, updates, norms[0, idx], norms[1, idx])
        return loss


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
        self.optimizer = build_optimizer(model, cfg, ps.tp_group, groups=groups, lamb=ShardedLamb)
        if isinstance(self.optimizer, ShardedLamb):
            self.optimizer.bind(self.pieces, self.params, ps)

    # ------------------------------------------------------------ checkpoints

    def state_by_name(self) -> Optional[dict]:
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

    def load_state_by_name(self, saved: dict) -> None:
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


class DistributedOptimizerStrategy(LocalStrategy):
    """LocalStrategy's update with the distributed optimizer: the reductions, the loss
    scaler, the norm and the clipping act on this rank's shards (the pieces)."""

    def __init__(self, model, dist_opt: DistributedOptimizer, ps, runner, *, scaler: Optional[DynamicLossScaler],
                 clip_grad: float):
        super().__init__(model, dist_opt.optimizer, ps, runner, scaler=scaler, clip_grad=clip_grad,
                         reducer=dist_opt.buffers)
        self.dist_opt = dist_opt

    def train_step(self, batches: list[dict]) -> StepResult:
        buffers, pieces, ps = self.reducer, self.dist_opt.tensors, self.ps
        scale = self.scaler.scale if self.scaler else 1.0
        buffers.start(len(batches))
        metrics = self.runner.forward_backward(batches, scale)
        buffers.finish()  # the reduce-scatters, issued during the last micro-batch's backward
        # The shards of the sums over TP and over the embedding group: every TP rank and
        # both embedding stages lay their buffers out alike, so shard i is the same
        # elements on each.
        sync_sequence_parallel_grads(pieces, ps)
        sync_tied_embedding_grads(pieces, ps)
        if self.scaler is not None:
            if self.scaler.found_overflow(pieces, ps.device):  # over the world: every shard
                self.scaler.update(overflow=True)
                self.optimizer.zero_grad(set_to_none=True)
                return StepResult(metrics, float("nan"), skipped=True, loss_scale=scale)
            self.scaler.unscale_(pieces)
        norm = grad_norm(pieces, ps, dp_sharded=True)
        norm_value = norm.item()
        if not math.isfinite(norm_value):
            logger.warning("gradient norm is %s; step skipped", norm_value)
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(metrics, norm_value, skipped=True, loss_scale=scale if self.scaler else None)
        clipped_step(self.optimizer, pieces, self.clip_grad, norm)
        buffers.gather_params()  # with --overlap-param-gather, waited for by the next forward
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        return StepResult(metrics, norm_value, loss_scale=scale if self.scaler else None)

    def forward_only(self, batches, output_fn):
        self.reducer.wait_params()
        return super().forward_only(batches, output_fn)

    def settle(self) -> None:
        # The last step's parameter all-gathers are otherwise issued as forward waits for
        # them: a rank with no batch to predict would leave the others waiting.
        self.reducer.wait_params()

    def cpu_state_dict(self, keep: bool) -> dict:
        self.reducer.wait_params()
        return super().cpu_state_dict(keep)

    def optimizer_state(self) -> dict:
        return self.dist_opt.state_by_name()  # collective: save_checkpoint calls it on every rank

    def load_optimizer_state(self, path: str, payload: dict, state) -> None:
        if payload.get("optimizer") is None:
            raise CheckpointError(f"{path} holds no optimizer state (saved with DeepSpeed?); add --deepspeed "
                                  f"or start the optimizer fresh with --finetune")
        self.dist_opt.load_state_by_name(payload["optimizer"])


def build_distributed_optimizer_strategy(model: torch.nn.Module, ps: ParallelState, cfg: OptimConfig, runner, *,
                                         bucket_elements: int, overlap_param_gather: bool, fp16: bool,
                                         clip_grad: float) -> DistributedOptimizerStrategy:
    params = [p for p in model.parameters() if p.requires_grad]
    # The pipeline's tied word embeddings get a bucket of their own: the first and the last
    # stage then shard them alike and can sum their shards over the embedding group.
    isolate = (lambda p: spec_of(p).placement == "tied") if ps.pp_size > 1 else (lambda p: False)
    buffers = ShardedBuffers(params, ps, bucket_elements, isolate=isolate, overlap_param_gather=overlap_param_gather)
    buffers.install_forward_hooks(model)
    dist_opt = DistributedOptimizer(model, cfg, ps, buffers)
    scaler = DynamicLossScaler(cfg) if fp16 else None
    return DistributedOptimizerStrategy(model, dist_opt, ps, runner, scaler=scaler, clip_grad=clip_grad)
