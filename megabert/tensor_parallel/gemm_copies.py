"""16-bit copies of GEMM weights: what a layer multiplies by under --bf16 while its parameters
stay the fp32 masters.

megabert.training.precision.MasterWeights owns one GemmCopies for a model and hands it to the
layers that multiply by its weights (their `gemm_copies`), once; nothing is stashed on the
parameters. A layer with no copies (`gemm_copies` None: fp32, fp16, an engine that casts the
model itself, a model built for prediction) multiplies by its weight, which autocast casts at
each use.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch


class _GemmCopy(torch.autograd.Function):
    """(master [fp32], copy [its 16-bit copy]) -> copy, as autocast's cast of the master would
    give it, without casting.

    Forward: the cached copy as it is (autograd hands out a view of it that carries this
    node, so the cached tensor itself stays a plain tensor with no grad_fn and no
    requires_grad). Backward: grad.to(master.dtype) for the master and nothing for the copy,
    exactly the backward of autocast's cast (aten._to_copy's). The master's gradient then
    reaches it through autograd's own AccumulateGrad: summed first with its other uses in
    the same backward (the tied word embeddings' lookup), accumulated in its fp32 `.grad`,
    and every hook on the parameter (the DP reducers' post-accumulate hooks) fires once,
    as for any parameter."""

    @staticmethod
    def forward(ctx, master: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.master_dtype = master.dtype
        return copy

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.master_dtype), None


class GemmCopies:
    """A `dtype` copy of each of `masters` (no requires_grad), with the master's version
    counter when the copy was made: an in-place write to the master (a checkpoint load) bumps
    it, so a use in eager mode sees a stale copy and remakes it. Writes through another view
    of the master's storage (the distributed optimizer's) do not bump it: the owner refreshes
    those copies when the writes land."""

    def __init__(self, masters: list[torch.nn.Parameter], dtype: torch.dtype):
        self.dtype = dtype
        self.masters = masters
        self.copies = [torch.empty_like(w, dtype=dtype) for w in masters]
        self.versions = [-1] * len(masters)  # -1: not made yet
        self._index = {id(w): i for i, w in enumerate(masters)}

    @torch.no_grad()
    def refresh(self, params: Optional[Iterable[torch.nn.Parameter]] = None) -> None:
        """Rounds the masters (those among `params`; None: all) into their copies: one
        multi-tensor copy."""
        index = (range(len(self.masters)) if params is None else
                 [self._index[id(p)] for p in params if id(p) in self._index])
        masters, copies = [self.masters[i] for i in index], [self.copies[i] for i in index]
        if masters:
            torch._foreach_copy_(copies, masters)
        for i in index:
            self.versions[i] = self.masters[i]._version

    def refresh_stale(self) -> None:
        """Remakes the copies of masters written in place since their copy was made."""
        stale = [w for w, v in zip(self.masters, self.versions) if v != w._version]
        if stale:
            self.refresh(stale)

    def copy_of(self, master: torch.Tensor) -> torch.Tensor:
        """`master`'s current copy (the cached tensor itself, no autograd node)."""
        i = self._index.get(id(master))
        if i is None:
            raise ValueError(f"no {_name(self.dtype)} GEMM copy of this {tuple(master.shape)} parameter: "
                             "it joined the model after its MasterWeights were made; make them "
                             "once the model is complete")
        if not torch.compiler.is_compiling() and self.versions[i] != master._version:
            self.refresh([master])
        return self.copies[i]

    def __repr__(self) -> str:
        return f"GemmCopies({len(self.masters)} weights, {_name(self.dtype)})"


def gemm_weight(weight: torch.Tensor, copies: Optional[GemmCopies]) -> torch.Tensor:
    """What the GEMM multiplies by.
    - `copies` None (no precision object keeps copies for this layer) or autocast off (fp32
      maths stays fp32: predictions or an export after a --bf16 run): `weight` itself.
    - Under autocast in the copies' dtype: `weight`'s copy, in eager mode remade first when
      stale; its gradient goes to `weight` as autocast's cast's would (_GemmCopy). Traced by
      torch.compile without the staleness check (a compiled graph cannot read a version
      counter): the compiled layers read the copies as graph inputs, kept current by their
      owner (MasterWeights: after each optimizer step and before each step).
    - Under autocast in another 16-bit dtype: an error (copies are made for the run's dtype)."""
    device = weight.device.type
    if copies is None or not torch.is_autocast_enabled(device):
        return weight
    if torch.get_autocast_dtype(device) != copies.dtype:
        raise ValueError(f"autocast runs in {_name(torch.get_autocast_dtype(device))} but this layer's GEMM "
                         f"copies are {_name(copies.dtype)}: run the model under the autocast dtype its "
                         "MasterWeights were made for, or close them first")
    copy = copies.copy_of(weight)
    if not (weight.requires_grad and torch.is_grad_enabled()):
        return copy
    return _GemmCopy.apply(weight, copy)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
