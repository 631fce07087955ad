"""The training loop: train() -> train_step() -> strategy.train_step().

The loop knows nothing of BERT, pipelines or DeepSpeed: a Strategy (megabert.training.
strategy) runs one global batch and applies the update. One optimizer step consumes one
global batch of `BatchLayout.num_micro_batches` micro-batches per data-parallel rank.
"""
from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megabert.config import TrainConfig
from megabert.data.packing import packing_stats
from megabert.optim import LRSchedule
from megabert.parallel import comm
from megabert.parallel.comm import LABELS, CommLedger
from megabert.parallel.layout import BatchLayout
from megabert.checkpoint.manager import CheckpointManager
from megabert.checkpoint.run_state import TrainingState
from megabert.training.metrics import MetricsLogger, device_peak_tflops, peak_memory_gb
from megabert.training.step_metrics import IntervalMetrics
from megabert.training.strategy import LOSS_SHARES, Counts, Metrics, StepResult, Strategy

logger = logging.getLogger(__name__)


@dataclass
class Batches:
    """Training micro-batches (endless, positioned at the consumed samples of the run) and,
    optionally, a factory of fresh validation iterators."""

    train: Iterator[dict]
    valid: Optional[Callable[[], Iterator[dict]]] = None


class Trainer:
    def __init__(self, strategy: Strategy, data: Batches, cfg: TrainConfig, batch: BatchLayout,
                 schedule: LRSchedule, *, checkpoint: CheckpointManager, state: Optional[TrainingState] = None,
                 flops_per_sample: Optional[float] = None, checkpoint_extra: Optional[dict] = None):
        self.strategy, self.data, self.cfg, self.batch, self.schedule = strategy, data, cfg, batch, schedule
        self.ps = strategy.ps
        self.checkpoint = checkpoint  # saves what the run's checkpoints hold (--save)
        self.state = state or TrainingState()
        self.flops_per_sample, self.peak = flops_per_sample, device_peak_tflops(self.ps.device)
        self.checkpoint_extra = checkpoint_extra or {}
        self.stop_requested = False
        self.step_packing: Optional[torch.Tensor] = None
        self.interval = IntervalMetrics()
        # Called with the iteration after each step's logging and evaluation, before a save
        # (a task's own evaluation: the embedding task's --eval-interval).
        self.step_hooks: list[Callable[[int], None]] = []
        # Bytes each rank sends per training step, by group (megabert.parallel.comm).
        self.ledger = CommLedger.for_state(self.ps)
        self.log = MetricsLogger(enabled=self.ps.is_logging_rank, train_iters=cfg.train_iters,
                                 start_iteration=self.state.iteration, metrics_file=cfg.metrics_file,
                                 tensorboard_dir=cfg.tensorboard_dir)

    # ------------------------------------------------------------------ loop

    def train(self) -> TrainingState:
        """Runs until --train-iters (counted from the start of training) or SIGTERM."""
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.strategy.model.train()
        last_log_time, last_log_iter = time.perf_counter(), self.state.iteration
        since_log = torch.zeros(4, dtype=torch.int64)  # packed rows: [samples, real tokens, rows, row slots]
        try:
            while self.state.iteration < self.cfg.train_iters:
                self.train_step()
                packed = self.step_packing
                self.state.iteration += 1
                # The schedule counts samples: a packed step consumes the samples of its rows.
                self.state.consumed_samples += self.batch.global_batch_size if packed is None else int(packed[0])
                if packed is not None:
                    since_log += packed
                it = self.state.iteration
                logging_step = it % self.cfg.log_interval == 0 or it == self.cfg.train_iters
                if logging_step:
                    metrics = self.flush_metrics()  # the interval's one wait for the device
                    log_fields = self.strategy.runner.task.log_fields
                    if log_fields is not None:
                        metrics.update(log_fields(self.state.consumed_samples))
                    now = time.perf_counter()
                    metrics.update(self._throughput((now - last_log_time) / (it - last_log_iter),
                                                    since_log if packed is not None else None, it - last_log_iter))
                    since_log.zero_()
                    largest, by_group = self._largest_rank(steps=it - last_log_iter)
                    metrics.update(largest)
                    self.log.log(it, metrics, advance=it - last_log_iter, record={"comm_gb_by_group": by_group})
                    last_log_time, last_log_iter = now, it
                if self.data.valid is not None and self.cfg.eval_interval and it % self.cfg.eval_interval == 0:
                    self._report_eval(it)
                for hook in self.step_hooks:
                    hook(it)
                # Ranks agree on stopping with one all-reduce per logging step, not per step.
                if logging_step and self._should_stop():
                    self.log.event(it, f"SIGTERM received: saving at iteration {it} and exiting")
                    self.save()
                    self.strategy.settle()
                    return self.state
                if self.cfg.exit_interval and it % self.cfg.exit_interval == 0 and it < self.cfg.train_iters:
                    self.log.event(it, f"--exit-interval {self.cfg.exit_interval}: saving at iteration {it} and exiting")
                    self.save()
                    self.strategy.settle()
                    return self.state
                if self.cfg.save and self.cfg.save_interval and it % self.cfg.save_interval == 0:
                    self.save()
            if self.cfg.save and (not self.cfg.save_interval or self.state.iteration % self.cfg.save_interval):
                self.save()
            self.strategy.settle()
            return self.state
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.log.close()

    def train_step(self) -> StepResult:
        """One optimizer step. What it leaves on the device (losses, gradient norm, skip flag)
        is read by flush_metrics, on logging steps: the step itself waits for the device only
        where fp16's overflow check or a foreach optimizer's non-finite check must
        (megabert.training.strategy.LocalStrategy). `step_packing` is then [samples, real
        tokens, rows, row slots] of the global batch when its rows are packed, else None."""
        # Steps skipped for fp16 overflow do not advance the LR schedule (as Megatron).
        lr = self.schedule.apply(self.strategy.lr_optimizer, self.state.iteration - self.state.skipped_iterations + 1)
        batches = [next(self.data.train) for _ in range(self.batch.num_micro_batches)]
        self.step_packing = packing_stats(batches)  # read on the host, before the batches go to the device
        batches = [self._to_device(b) for b in batches]
        with self.ledger.recording():  # counts every collective of the step, loss averaging included
            self._share_loss_counts(batches)
            result = self.strategy.train_step(batches)
        if result.overflow:
            self.state.skipped_iterations += 1
        self.interval.add(result, lr)
        return result

    def flush_metrics(self) -> dict:
        """The steps since the last call, read to the host: each loss's mean over them (and
        over data-parallel ranks), the last step's lr, grad_norm and loss_scale, and
        `skipped` (how many of them made no update) when any was. Collective."""
        interval, self.interval = self.interval, IntervalMetrics()
        if interval.last is None:
            return {}
        means = interval.means()
        with self.ledger.recording():
            out = {**self._reduce([means] if means else []), "lr": interval.lr}
        norm = interval.last.grad_norm
        out["grad_norm"] = float(norm) if norm is not None else float("nan")
        if interval.last.loss_scale is not None:
            out["loss_scale"] = interval.last.loss_scale
        nonfinite = interval.nonfinite_steps()
        if nonfinite:
            logger.warning("the gradient norm was not finite at %d of the last %d steps: their updates were skipped",
                           nonfinite, interval.steps)
        if interval.overflows + nonfinite:
            out["skipped"] = interval.overflows + nonfinite
        return out

    def _share_loss_counts(self, batches: list[dict]) -> None:
        """TrainingTask.loss_counts: each micro-batch gets the global batch's item counts per loss,
        divided by micro-batches x dp_size (see TrainingTask). One small all-reduce over DP, no host sync."""
        task = self.strategy.runner.task
        if task.loss_counts is None:
            return
        totals = torch.stack([task.loss_counts(b) for b in batches]).sum(0).to(torch.float64)
        if self.ps.dp_size > 1:
            comm.all_reduce(totals, group=self.ps.dp_group)
        shares = (totals.clamp(min=1) / (len(batches) * self.ps.dp_size)).to(torch.float32)
        for b in batches:
            b[LOSS_SHARES] = shares

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> dict:
        """Mean losses and the task's ratios (accuracies) over the first `eval_iters` global
        batches of the valid split: the same samples at every evaluation, so points on the
        curve are comparable."""
        batches = self.data.valid()
        output_fn = self.strategy.runner.task.eval_metrics
        outputs: list[tuple[Metrics, Counts]] = []
        for _ in range(self.cfg.eval_iters):
            group = []
            for _ in range(self.batch.num_micro_batches):
                try:
                    group.append(self._to_device(next(batches)))
                except StopIteration:
                    break
            if not group:
                break
            outputs += self.strategy.forward_only(group, output_fn)
        return self._reduce([m for m, _ in outputs], [c for _, c in outputs])

    def _report_eval(self, it: int) -> None:
        result = self.evaluate()
        text = " | ".join(f"valid {k} {v:.4f}" for k, v in result.items())
        self.log.event(it, f"iteration {it} | {text}", {f"valid/{k}": v for k, v in result.items()},
                       record={f"valid_{k}": v for k, v in result.items()})

    # ------------------------------------------------------------------ helpers

    def close(self) -> None:
        self.strategy.close()

    def save(self) -> None:
        if self.cfg.save:
            self.checkpoint.save(self.cfg.save, self.state, extra=self.checkpoint_extra,
                                 keep_last=self.cfg.keep_last_checkpoints)

    def _on_sigterm(self, signum, frame) -> None:
        # SLURM sends SIGTERM before preemption: finish the step, save, exit cleanly.
        self.stop_requested = True

    def _should_stop(self) -> bool:
        flag = torch.tensor([1.0 if self.stop_requested else 0.0], device=self.ps.device)
        if self.ps.world_size > 1:  # every rank must stop at the same iteration
            comm.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _to_device(self, batch: dict) -> dict:
        device = self.ps.device
        if device.type != "cuda":
            return {k: v.to(device) for k, v in batch.items()}
        # From pageable memory the driver stages a host-to-device copy itself and may wait for
        # the stream to drain first, so a non_blocking copy would stall the launch queue;
        # batches built on the host after the DataLoader's pinning (packed rows, their label
        # slots) are pinned here.
        return {k: (v.pin_memory() if v.device.type == "cpu" and not v.is_pinned() else v).to(device, non_blocking=True)
                for k, v in batch.items()}

    def _reduce(self, metrics: list[Metrics], counts: Optional[list[Counts]] = None) -> dict:
        """Means over micro-batches and data-parallel ranks, and for counts ({name: [hits,
        total]}) the ratio of their sums over both, so an accuracy weighs every item alike.
        Only the last pipeline stage computes them; it shares the result with the other
        stages (logging is on rank 0)."""
        keys = sorted(metrics[0]) if metrics else []
        if keys:
            values = torch.stack([torch.stack([m[k].float() for m in metrics]).mean() for k in keys])
            if self.ps.dp_size > 1:
                comm.all_reduce(values, group=self.ps.dp_group)
                values /= self.ps.dp_size
            result = dict(zip(keys, values.tolist()))
        else:
            result = {}
        result.update(self._ratios(counts or []))
        if self.ps.pp_size > 1:
            box = [result]
            comm.broadcast_object_list(box, src=self.ps.last_stage_rank, group=self.ps.pp_group)
            result = box[0]
        return result

    def _ratios(self, counts: list[Counts]) -> dict:
        """{name: sum of hits / sum of totals} over micro-batches and data-parallel ranks.
        int64 sums stay exact however many tokens an evaluation covers (fp32 would not past
        2**24). A name with nothing counted (total 0) is left out rather than logged as NaN."""
        keys = sorted(counts[0]) if counts else []
        if not keys:
            return {}
        sums = torch.stack([torch.stack([c[k] for c in counts]).sum(dim=0) for k in keys]).long()  # [keys, 2]
        if self.ps.dp_size > 1:
            comm.all_reduce(sums, group=self.ps.dp_group)
        return {k: hits / total for k, (hits, total) in zip(keys, sums.tolist()) if total > 0}

    def _largest_rank(self, steps: int) -> tuple[dict, dict]:
        """({mem_peak_gb, comm_gb}, {group: GB}) of the largest ranks, on logging steps.

        mem_peak_gb: the largest per-rank peak (GPU allocated, or CPU RSS): the rank that runs
        out of memory first is the one a layout has to fit. comm_gb: the bytes (1e9) the
        busiest rank sent per training step since the last logging step, in the ledger's
        unit (megabert.parallel.comm), with that rank's split by group. One all-gather of
        a few float64 per rank, on logging steps only, outside the ledger."""
        sent = self.ledger.take()
        row = [peak_memory_gb(self.ps.device), sum(sent.values())] + [sent.get(k, 0.0) for k in LABELS]
        local = torch.tensor(row, dtype=torch.float64, device=self.ps.device)
        rows = [local]
        if self.ps.world_size > 1:
            rows = [torch.empty_like(local) for _ in range(self.ps.world_size)]
            comm.all_gather(rows, local)
        table = torch.stack(rows).tolist()
        busiest = max(table, key=lambda r: r[1])
        per_step = 1e9 * max(steps, 1)
        by_group = {k: v / per_step for k, v in zip(LABELS, busiest[2:]) if v}
        return {"mem_peak_gb": max(r[0] for r in table), "comm_gb": busiest[1] / per_step}, by_group

    def _throughput(self, seconds_per_iter: float, packed: Optional[torch.Tensor] = None, steps: int = 1) -> dict:
        """Samples/s (and TFLOP/s, MFU); `packed`: [samples, real tokens, rows, row slots] of the last
        `steps` steps when rows are packed, which adds real_token_share (real tokens / row
        slots, 0-1), samples_per_row and real_tokens_per_sec. The FLOPs count rows: a row
        costs the same packed or not."""
        rows = self.batch.global_batch_size
        samples = rows if packed is None else int(packed[0]) / steps
        out = {"samples_per_sec": samples / seconds_per_iter, "iteration_time_s": seconds_per_iter}
        if packed is not None:
            real, slots = int(packed[1]), int(packed[3])
            out.update(real_token_share=real / slots, samples_per_row=int(packed[0]) / int(packed[2]),
                       real_tokens_per_sec=real / steps / seconds_per_iter)
        if self.flops_per_sample:
            tflops = self.flops_per_sample * rows / seconds_per_iter / self.ps.world_size / 1e12
            out["tflops"] = tflops
            if self.peak:
                out["mfu"] = tflops / self.peak
        return out

