"""One training step of the embedding task when the global batch's negatives span more
than one forward pass: the gradient cache (Gao et al. 2021, "Scaling Deep Contrastive
Learning Batch Size under Memory Limited Setup"; the GradCache library).

What a micro-batch and the global batch mean here: the global batch is the contrastive
batch, always. Every query is scored against the positives and hard negatives of the whole
global batch: every DP rank's and every micro-batch's. A micro-batch (and, with
--embedding-chunk-size N, each chunk of N examples of it) is only how many examples a rank
takes through the model at once, that is, how much activation memory a step holds. With one
micro-batch per rank and no chunk size, a step is one forward with its graph, the loss and
one backward (ContrastiveObjective computes the loss directly). Otherwise (gradient
accumulation, or a chunk size), GradientCacheRunner runs the step in three passes:

1. every piece (micro-batch or chunk) forward without a graph, in training mode, its
   embeddings kept: [pieces x n, T, h] floats, no activations;
2. the loss over them all (the DP all-gather included) and its gradient with respect to
   the embeddings;
3. every piece forward again, with its graph, and backward from the cached gradient of its
   embeddings: the surrogate loss sum(embeddings * cached gradient), whose parameter
   gradient is the piece's share of the loss's. One piece's graph is alive at a time.

Pass 3 must reproduce pass 1's embeddings exactly, dropout included: DropoutReplay records
every RNG stream before each piece's forward in pass 1 and restores it before the same
piece's forward in pass 3 (as GradCache's RandContext). The loss and the gradients then
equal those of one forward over every piece with its graph kept.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Optional

import torch

from megabert.errors import ConfigError
from megabert.parallel import ParallelState
from megabert.tasks.embeddings.loss import Matryoshka, contrastive_loss
from megabert.tensor_parallel.random import RNGStatesTracker

EMBEDDING_FIELDS = ("input_ids", "token_type_ids", "attention_mask", "text_mask")


class ContrastiveObjective:
    """The embedding task's `TrainingTask.output_loss`: an EmbeddingOutput -> (loss, {"contrastive_loss"}).
    Directly the InfoNCE loss of the output's examples against the global batch; inside a
    gradient-cache step, the surrogate of the next piece (pass 3 above), its metric the
    step's loss.

    `dataset`: the name of the training file the current global batch comes from, when
    there are several (megabert.tasks.embeddings.sampling sets it as it hands out the
    step's first micro-batch); the step's loss is then also logged as
    contrastive_loss_NAME."""

    def __init__(self, temperature: float, dp_group, matryoshka: Optional[Matryoshka] = None):
        self.temperature, self.dp_group, self.matryoshka = temperature, dp_group, matryoshka
        self.cached: Optional[deque] = None  # (gradient [n, T, h], weight) per piece, in order
        self.step_loss: Optional[torch.Tensor] = None
        self.dataset: Optional[str] = None

    def loss(self, embeddings: torch.Tensor, text_mask: Optional[torch.Tensor]) -> torch.Tensor:
        return contrastive_loss(embeddings, text_mask, temperature=self.temperature, dp_group=self.dp_group,
                                matryoshka=self.matryoshka)

    def metrics(self, loss: torch.Tensor) -> dict:
        if self.dataset is None:
            return {"contrastive_loss": loss}
        return {"contrastive_loss": loss, f"contrastive_loss_{self.dataset}": loss}

    def __call__(self, out) -> tuple[torch.Tensor, dict]:
        if self.cached is None:
            loss = self.loss(out.embeddings, out.text_mask)
            return loss, self.metrics(loss)
        grad, weight = self.cached.popleft()
        # The runners divide each piece's loss by the number of pieces (a mean over
        # micro-batches); `weight` (that number) undoes it: the pieces' gradients add up.
        surrogate = (out.embeddings * grad).sum() * weight
        return surrogate, self.metrics(self.step_loss)

    def loss_and_gradients(self, embeddings: list[torch.Tensor], masks: list[Optional[torch.Tensor]]
                           ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Pass 2: the loss over every piece's embeddings and its gradient per piece."""
        leaf = torch.cat(embeddings).detach().requires_grad_(True)
        mask = None if masks[0] is None else torch.cat(masks)
        loss = self.loss(leaf, mask)
        loss.backward()
        return loss.detach(), list(leaf.grad.split([e.size(0) for e in embeddings]))


class DropoutReplay:
    """Every RNG stream a forward draws dropout masks from (the default CPU generator, the
    device's, the model's per-TP-rank tracker), recorded before each forward of a model
    chunk in one pass and restored before the same forward in the next. Forwards are told
    apart by (chunk, how many forwards of that chunk came before in the pass): every
    schedule, sequential, 1F1B or interleaved, takes a chunk's pieces in order."""

    def __init__(self, tracker: RNGStatesTracker, device: torch.device):
        self.tracker, self.device = tracker, device
        self.states: dict[tuple[int, int], tuple] = {}
        self.replaying = False
        self._seen: dict[int, int] = {}

    def start_pass(self, replay: bool) -> None:
        self.replaying, self._seen = replay, {}

    def before_forward(self, v: int) -> None:
        key = (v, self._seen.get(v, 0))
        self._seen[v] = key[1] + 1
        if not self.replaying:
            cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
            self.states[key] = (torch.get_rng_state(), cuda, self.tracker.get_states())
            return
        cpu, cuda, tracked = self.states[key]
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)
        self.tracker.set_states(tracked)


def split_batch(batch: dict, size: int) -> list[dict]:
    """A micro-batch cut into chunks of `size` examples (the fields the model reads)."""
    n = batch["input_ids"].size(0)
    return [{k: batch[k][i:i + size] for k in EMBEDDING_FIELDS if k in batch} for i in range(0, n, size)]


class GradientCacheRunner:
    """Runs a step's micro-batches as the three passes above through `inner`, a runner of
    the model (sequential, or the pipeline schedule) built for pieces of `piece_size`
    examples. Stands in for the strategy's runner: `forward_backward` and `forward_only`.
    `reducer`: the strategy's overlapped DP reduction, whose count of backward passes per
    step is the number of pieces, not of micro-batches."""

    keeps_grads = False  # a runner's flag (training.strategy): the strategy sets .grad to None before a step

    def __init__(self, inner, model, objective: ContrastiveObjective, ps: ParallelState, *, piece_size: int,
                 reducer=None):
        self.inner, self.model, self.objective, self.ps = inner, model, objective, ps
        self.piece_size, self.reducer = piece_size, reducer

    @property
    def task(self):
        return self.inner.task

    def forward_backward(self, batches: list[dict], loss_scale: float = 1.0) -> list[dict]:
        pieces = [p for b in batches for p in split_batch(b, self.piece_size)]
        replay = DropoutReplay(self.model.rng, self.ps.device)
        self.model.dropout_replay = replay
        try:
            replay.start_pass(replay=False)
            # Training mode (dropout on), no graph: the runner's forward_only is no_grad and
            # leaves the mode as it is.
            outs = self.inner.forward_only(pieces, lambda out: (out.embeddings, out.text_mask))
            if outs:  # the stage that holds the loss (the last; every rank with PP = 1)
                loss, grads = self.objective.loss_and_gradients([o[0] for o in outs], [o[1] for o in outs])
                self.objective.step_loss = loss
                self.objective.cached = deque((g, len(pieces)) for g in grads)
            else:
                self.objective.cached = deque()
            replay.start_pass(replay=True)
            if self.reducer is not None:
                # NOTE: the strategy started the reduction for len(batches) backward passes;
                # pass 3 makes one per piece. Nothing has reached .grad yet (passes 1-2 touch
                # no parameter gradient), so starting it again for the pieces loses nothing.
                self.reducer.start(len(pieces))
            metrics = self.inner.forward_backward(pieces, loss_scale)
        finally:
            self.model.dropout_replay = None
            self.objective.cached, self.objective.step_loss = None, None
        return metrics

    def forward_only(self, batches: list[dict], output_fn: Callable[[Any], Any]) -> list:
        return self.inner.forward_only(batches, output_fn)


def check_chunk_size(micro_batch_size: int, chunk_size: Optional[int]) -> None:
    if chunk_size is not None and micro_batch_size % chunk_size:
        raise ConfigError(f"--embedding-chunk-size {chunk_size} must divide --micro-batch-size {micro_batch_size}")


def check_cache_layout(deepspeed: bool) -> None:
    if deepspeed:
        raise ConfigError("--deepspeed runs the embedding task with one micro-batch per rank and no "
                          "--embedding-chunk-size (its engine steps per micro-batch, the gradient cache backpropagates "
                          "per chunk); set --global-batch-size to --micro-batch-size x data-parallel ranks, or drop "
                          "--deepspeed")
