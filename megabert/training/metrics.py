"""Throughput accounting and rank-0 logging: a progress bar on a terminal, plain lines
otherwise, JSONL for machines, TensorBoard for people."""
from __future__ import annotations

import json
import logging
import os
import resource
import sys
from typing import Optional

import torch


logger = logging.getLogger("megabert")

# Dense bf16/fp16 tensor-core peaks in TFLOP/s (vendor data sheets, SXM parts).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "GH200": 989.0, "A100": 312.0, "A800": 312.0, "H800": 989.0,
               "L40S": 362.0, "L40": 181.0, "L4": 121.0, "A10": 125.0, "V100": 125.0, "B200": 2250.0}


def device_peak_tflops(device: torch.device) -> Optional[float]:
    """The device's dense half-precision peak, or None where it is not known (CPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key]
    return None


def peak_memory_gb(device: torch.device | str) -> float:
    """Peak memory of this process in GB (1e9 bytes), the figure the layout planner predicts.

    GPU: the caching allocator's high-water mark of allocated tensors on `device`
    (`torch.cuda.max_memory_allocated`; reserved-but-free cache is not counted).
    CPU: the peak resident set size of this process (`ru_maxrss`), which includes the
    Python interpreter, torch's libraries and allocator slack, not only tensors.
    NOTE: Linux reports ru_maxrss in KiB, macOS in bytes."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 1e9 if sys.platform == "darwin" else maxrss * 1024 / 1e9


def configure_process_logging(is_logging_rank: bool) -> None:
    """Rank 0 logs at INFO and shows warnings as plain `warning: ...` lines; other ranks
    stay quiet (N copies of every line help nobody) but still print errors."""
    import warnings

    logging.basicConfig(level=logging.INFO if is_logging_rank else logging.ERROR,
                        format="%(asctime)s %(levelname)s %(message)s")
    if is_logging_rank:
        warnings.formatwarning = lambda message, category, *args, **kwargs: f"warning: {message}\n"
    else:
        warnings.simplefilter("ignore")


class MetricsLogger:
    """Only rank 0 writes. `log()` takes plain floats."""

    def __init__(self, *, enabled: bool, train_iters: int, start_iteration: int, metrics_file: Optional[str] = None,
                 tensorboard_dir: Optional[str] = None):
        self.enabled = enabled
        self._bar = self._jsonl = self._tb = None
        if not enabled:
            return
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=train_iters, initial=start_iteration, unit="it", dynamic_ncols=True)
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self._jsonl = open(metrics_file, "a", buffering=1)
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(tensorboard_dir)

    def log(self, iteration: int, metrics: dict, *, advance: int = 1, record: Optional[dict] = None) -> None:
        """`record`: more fields for the JSONL line only (breakdowns too long for the console)."""
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"iteration": iteration, **metrics, **(record or {})}) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(f"train/{k}", v, iteration)
        text = " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        if self._bar is not None:
            self._bar.update(advance)
            self._bar.set_postfix_str(text, refresh=True)
        else:
            print(f"iteration {iteration} | {text}", flush=True)

    def event(self, iteration: int, message: str, scalars: Optional[dict] = None,
              record: Optional[dict] = None) -> None:
        """A message (evaluation, save, stop); `record` also goes to the JSONL file."""
        if not self.enabled:
            return
        if self._jsonl is not None and record:
            self._jsonl.write(json.dumps({"iteration": iteration, **record}) + "\n")
        if self._tb is not None and scalars:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, iteration)
        (self._bar.write if self._bar is not None else print)(message)

    def close(self) -> None:
        for h in (self._bar, self._jsonl, self._tb):
            if h is not None:
                h.close()
