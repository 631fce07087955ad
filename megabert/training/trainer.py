"""The training loop: train() -> train_step() -> forward_backward().

Task specifics come in as a `loss_fn(model, batch) -> (loss, {name: scalar tensor})`;
the loop knows nothing of BERT. One optimizer step consumes one global batch:
`global_batch / (micro_batch x dp)` micro-batches per DP rank, gradients accumulated,
then reduced and applied once. With pipeline parallelism a `PipelineSchedule` runs the
micro-batches instead (1F1B or interleaved) and the last stage's loss metrics are
shared with the other stages for logging.
"""
from __future__ import annotations

import logging
import signal
import time
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megabert.config import OptimConfig, TrainConfig
from megabert.optim import LRSchedule
from megabert.parallel import ParallelState
from megabert.training import deepspeed_engine
from megabert.training.checkpointing import TrainingState, save_checkpoint
from megabert.training.grads import (average_data_parallel_grads, clip_grads, grad_norm,
                                     sync_sequence_parallel_grads, sync_tied_embedding_grads)
from megabert.training.metrics import MetricsLogger, device_peak_tflops
from megabert.training.precision import DynamicLossScaler, autocast

logger = logging.getLogger(__name__)
LossFn = Callable[[torch.nn.Module, dict], tuple[torch.Tensor, dict]]


class Trainer:
    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ps: ParallelState,
                 train: TrainConfig, optim: OptimConfig, loss_fn: LossFn, train_batches: Iterator[dict],
                 valid_batches: Optional[Callable[[], Iterator[dict]]] = None, engine=None,
                 state: Optional[TrainingState] = None, scaler: Optional[DynamicLossScaler] = None,
                 flops_per_sample: Optional[float] = None, checkpoint_extra: Optional[dict] = None,
                 pipeline=None):
        self.model, self.optimizer, self.ps, self.engine = model, optimizer, ps, engine
        self.pipeline = pipeline  # a PipelineSchedule when pp_size > 1
        self.cfg, self.optim_cfg, self.loss_fn = train, optim, loss_fn
        self.train_batches, self.valid_batches = train_batches, valid_batches
        self.state = state or TrainingState()
        self.global_batch = train.global_batch_size or train.micro_batch_size * ps.dp_size
        self.num_micro = self.global_batch // (train.micro_batch_size * ps.dp_size)
        if ps.pp_size > 1 and (pipeline is None or pipeline.num_micro != self.num_micro):
            raise ValueError("pipeline parallelism needs a PipelineSchedule built for "
                             f"{self.num_micro} micro-batches per step")
        self.schedule = LRSchedule(optim, train.train_iters)
        self.scaler = scaler if scaler is not None else (DynamicLossScaler(optim) if train.fp16 and engine is None
                                                          else None)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.flops_per_sample, self.peak = flops_per_sample, device_peak_tflops(ps.device)
        self.checkpoint_extra = checkpoint_extra or {}
        self.stop_requested = False
        self.log = MetricsLogger(enabled=ps.is_logging_rank, train_iters=train.train_iters,
                                 start_iteration=self.state.iteration, metrics_file=train.metrics_file,
                                 tensorboard_dir=train.tensorboard_dir)

    # ------------------------------------------------------------------ loop

    def train(self) -> TrainingState:
        """Runs until --train-iters (counted from the start of training) or SIGTERM."""
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.model.train()
        last_log_time, last_log_iter = time.perf_counter(), self.state.iteration
        try:
            while self.state.iteration < self.cfg.train_iters:
                metrics = self.train_step()
                self.state.iteration += 1
                self.state.consumed_samples += self.global_batch
                it = self.state.iteration
                if it % self.cfg.log_interval == 0 or it == self.cfg.train_iters:
                    now = time.perf_counter()
                    metrics.update(self._throughput((now - last_log_time) / (it - last_log_iter)))
                    self.log.log(it, metrics, advance=it - last_log_iter)
                    last_log_time, last_log_iter = now, it
                if self.valid_batches is not None and self.cfg.eval_interval and it % self.cfg.eval_interval == 0:
                    self._report_eval(it)
                if self._should_stop():
                    self.log.event(it, f"SIGTERM received: saving at iteration {it} and exiting")
                    self.save()
                    return self.state
                if self.cfg.exit_interval and it % self.cfg.exit_interval == 0 and it < self.cfg.train_iters:
                    self.log.event(it, f"--exit-interval {self.cfg.exit_interval}: saving at iteration {it} and exiting")
                    self.save()
                    return self.state
                if self.cfg.save and self.cfg.save_interval and it % self.cfg.save_interval == 0:
                    self.save()
            if self.cfg.save and (not self.cfg.save_interval or self.state.iteration % self.cfg.save_interval):
                self.save()
            return self.state
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.log.close()

    def train_step(self) -> dict:
        lr = self.schedule.apply(self.engine.optimizer if self.engine else self.optimizer, self.state.iteration + 1)
        if self.engine is not None:
            return self._deepspeed_step(lr)
        self.optimizer.zero_grad(set_to_none=True)
        loss_scale = self.scaler.scale if self.scaler else 1.0
        metrics = self.forward_backward(loss_scale)
        # Gradient sync is explicit: once per global batch, after all micro-batches.
        sync_sequence_parallel_grads(self.params, self.ps)
        sync_tied_embedding_grads(self.params, self.ps)
        average_data_parallel_grads(self.params, self.ps)
        out = {**metrics, "lr": lr}
        if self.scaler is not None:
            out["loss_scale"] = self.scaler.scale
            if self.scaler.found_overflow(self.params, self.ps.device):
                self.scaler.update(overflow=True)
                self.optimizer.zero_grad(set_to_none=True)
                return {**out, "grad_norm": float("nan"), "skipped": 1}
            self.scaler.unscale_(self.params)
        norm = grad_norm(self.params, self.ps)
        if not torch.isfinite(torch.tensor(norm)):
            # bf16/fp32 have no scaler to absorb this: skip rather than write NaN weights.
            logger.warning("iteration %d: gradient norm is %s; step skipped", self.state.iteration + 1, norm)
            self.optimizer.zero_grad(set_to_none=True)
            return {**out, "grad_norm": norm, "skipped": 1}
        clip_grads(self.params, self.optim_cfg.clip_grad, norm)
        self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        return {**out, "grad_norm": norm}

    def forward_backward(self, loss_scale: float = 1.0) -> dict:
        """All micro-batches of one global batch; returns the DP-averaged loss metrics."""
        sums: dict[str, torch.Tensor] = {}
        if self.pipeline is not None:
            batches = [self._to_device(next(self.train_batches)) for _ in range(self.num_micro)]
            for metrics in self.pipeline.forward_backward(batches, loss_scale):
                self._accumulate(sums, metrics)
            return self._share_from_last_stage(self._reduce_metrics(sums, self.num_micro))
        for _ in range(self.num_micro):
            batch = self._to_device(next(self.train_batches))
            with autocast(self.ps.device, self.cfg.bf16, self.cfg.fp16):
                loss, metrics = self.loss_fn(self.model, batch)
            # Each micro-batch loss is a mean; dividing by their number makes the
            # accumulated gradient the mean over the global batch.
            (loss * (loss_scale / self.num_micro)).backward()
            self._accumulate(sums, metrics)
        return self._reduce_metrics(sums, self.num_micro)

    def _deepspeed_step(self, lr: float) -> dict:
        sums: dict[str, torch.Tensor] = {}
        skipped_before = getattr(self.engine, "skipped_steps", 0)
        own_norm = None
        if self.pipeline is not None:
            # The schedule runs backward itself; DeepSpeed reduces and steps afterwards.
            scale = float(getattr(self.engine.optimizer, "loss_scale", 1.0)) if self.cfg.fp16 else 1.0
            metrics = self.forward_backward(scale)
            sync_tied_embedding_grads(self.params, self.ps)
            deepspeed_engine.reduce_gradients(self.engine, self.cfg.zero_stage)
            self.engine.step()
            out = {**metrics, "lr": lr}
        else:
            for i in range(self.num_micro):
                batch = self._to_device(next(self.train_batches))
                loss, metrics = self.loss_fn(self.engine, batch)
                self.engine.backward(loss)  # scaled by 1/gradient_accumulation_steps inside
                if i == self.num_micro - 1:
                    own_norm = self._norm_without_zero()  # reduced by the boundary backward
                self.engine.step()  # a real step only at the accumulation boundary
                self._accumulate(sums, metrics)
            out = {**self._reduce_metrics(sums, self.num_micro), "lr": lr}
        norm = self.engine.get_global_grad_norm()
        norm = norm if norm is not None else own_norm
        out["grad_norm"] = float(norm) if norm is not None else float("nan")
        if self.cfg.fp16:
            out["loss_scale"] = float(getattr(self.engine.optimizer, "loss_scale", float("nan")))
        if getattr(self.engine, "skipped_steps", 0) > skipped_before:
            out["skipped"] = 1
        return out

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean losses over the first `eval_iters` global batches of the valid split: the
        same samples at every evaluation, so points on the curve are comparable."""
        module = self.engine if self.engine is not None else self.model
        module.eval()
        sums: dict[str, torch.Tensor] = {}
        batches = self.valid_batches()
        if self.pipeline is not None:
            return self._evaluate_pipeline(batches)
        n = 0
        try:
            for _ in range(self.cfg.eval_iters * self.num_micro):
                batch = self._to_device(next(batches))
                with autocast(self.ps.device, self.cfg.bf16, self.cfg.fp16):
                    _, metrics = self.loss_fn(module, batch)
                self._accumulate(sums, metrics)
                n += 1
        except StopIteration:
            pass
        finally:
            module.train()
        return self._reduce_metrics(sums, max(n, 1))

    def _evaluate_pipeline(self, batches: Iterator[dict]) -> dict:
        # Every stage reads the same valid batches, so all stop at the same point.
        sums: dict[str, torch.Tensor] = {}
        n = 0
        self.model.eval()
        try:
            for _ in range(self.cfg.eval_iters):
                group = []
                for _ in range(self.num_micro):
                    try:
                        group.append(self._to_device(next(batches)))
                    except StopIteration:
                        break
                if not group:
                    break
                for metrics in self.pipeline.forward_only(group):
                    self._accumulate(sums, metrics)
                n += len(group)
        finally:
            self.model.train()
        return self._share_from_last_stage(self._reduce_metrics(sums, max(n, 1)))

    def _share_from_last_stage(self, metrics: dict) -> dict:
        """Only the last pipeline stage computes losses; logging happens on rank 0."""
        if self.ps.pp_size == 1:
            return metrics
        box = [metrics]
        dist.broadcast_object_list(box, src=self.ps.last_stage_rank, group=self.ps.pp_group)
        return box[0]

    def _norm_without_zero(self) -> Optional[float]:
        # DeepSpeed without ZeRO in fp32 clips but does not report the norm; the reduced
        # gradients are still in .grad here, so take it ourselves (after unscaling: fp32).
        if self.cfg.zero_stage == 0 and not (self.cfg.fp16 or self.cfg.bf16):
            return grad_norm(self.params, self.ps)
        return None

    def _report_eval(self, it: int) -> None:
        result = self.evaluate()
        text = " | ".join(f"valid {k} {v:.4f}" for k, v in result.items())
        self.log.event(it, f"iteration {it} | {text}", {f"valid/{k}": v for k, v in result.items()},
                       record={f"valid_{k}": v for k, v in result.items()})

    # ------------------------------------------------------------------ helpers

    def close(self) -> None:
        """Releases the DeepSpeed engine (its hooks, ZeRO-3 partition state and comm
        buffers) before the process groups go away, so the process exits cleanly."""
        if self.engine is not None:
            self.engine.destroy()
            self.engine = None

    def save(self) -> None:
        if not self.cfg.save:
            return
        save_checkpoint(self.cfg.save, self.state, self.model, self.optimizer, self.ps, scaler=self.scaler,
                        extra=self.checkpoint_extra, keep_last=self.cfg.keep_last_checkpoints, engine=self.engine)

    def _on_sigterm(self, signum, frame) -> None:
        # SLURM sends SIGTERM before preemption: finish the step, save, exit cleanly.
        self.stop_requested = True

    def _should_stop(self) -> bool:
        flag = torch.tensor([1.0 if self.stop_requested else 0.0], device=self.ps.device)
        if self.ps.world_size > 1:  # every rank must stop at the same iteration
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.ps.device, non_blocking=True) for k, v in batch.items()}

    @staticmethod
    def _accumulate(sums: dict, metrics: dict) -> None:
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v.detach().float()

    def _reduce_metrics(self, sums: dict, count: int) -> dict:
        if not sums:
            return {}
        keys = sorted(sums)
        values = torch.stack([torch.as_tensor(sums[k], device=self.ps.device).float() for k in keys]) / count
        if self.ps.dp_size > 1:
            dist.all_reduce(values, group=self.ps.dp_group)
            values /= self.ps.dp_size
        return {k: v.item() for k, v in zip(keys, values)}

    def _throughput(self, seconds_per_iter: float) -> dict:
        out = {"samples_per_sec": self.global_batch / seconds_per_iter, "iteration_time_s": seconds_per_iter}
        if self.flops_per_sample:
            tflops = self.flops_per_sample * self.global_batch / seconds_per_iter / self.ps.world_size / 1e12
            out["tflops"] = tflops
            if self.peak:
                out["mfu"] = tflops / self.peak
        return out
