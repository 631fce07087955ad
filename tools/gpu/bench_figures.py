"""The key figures of `make bench-gpu`'s logs, for its JSON summary (tools/gpu/bench_gpu.py).

Each parser reads the lines one benchmark prints (its own format, see the script) and
returns what it found; a line it does not know is skipped, so a changed format costs the
figure, never the run. Plain Python, tested on captured lines without a GPU.
"""
from __future__ import annotations

import re
from typing import Iterable

_PYTEST = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")
# bench/kernels.py: "softmax   [8,12,128,128]      bfloat16       0.05 ..."
_KERNEL = re.compile(r"^(softmax|layernorm)\s+(\[[\d,]+\])\s+(\w+)\s+([\d.]+)")
_BANDWIDTH = re.compile(r"^\s+.*GB/s")
# bench/gpu_bert_large.py: "1        megabert          812.3     201.1   20.3%            1.25x"
_BERT = re.compile(r"^([12])\s+(megabert|transformers)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+%|n/a)\s+([\d.]+)x")
# bench/gpu_varlen_attention.py:
# "padded, 82.8% real     0.1      varlen         208.2     212.4   21.5%     1.11x"
_VARLEN = re.compile(r"^(padded|full), ([\d.]+)% real\s+([\d.]+)\s+(varlen|sdpa)\s+([\d.]+)\s+([\d.]+)\s+"
                     r"([\d.]+%|n/a)\s+([\d.]+)x")
# bench/memory.py: "bert-base  single             1        3.21          3.05      1.05 ..."
_MEMORY = re.compile(r"^(bert-[\w-]+)\s+(\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)")


def pytest_counts(lines: Iterable[str]) -> dict[str, int]:
    """{'passed': N, 'skipped': M, ...} from pytest's summary line (the last one that has counts)."""
    counts: dict[str, int] = {}
    for line in lines:
        found = _PYTEST.findall(line)
        if found and (" in " in line or line.startswith("=")):
            counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in found}
    return counts


def kernel_times(lines: Iterable[str]) -> list[dict]:
    """One entry per (op, shape, dtype): our forward+backward median in ms, and the achieved
    bandwidth line that follows it on a GPU."""
    rows: list[dict] = []
    for line in lines:
        if m := _KERNEL.match(line):
            rows.append({"op": m.group(1), "shape": m.group(2), "dtype": m.group(3), "ours_ms": float(m.group(4))})
        elif rows and _BANDWIDTH.match(line) and "bandwidth" not in rows[-1]:
            rows[-1]["bandwidth"] = line.strip()
    return rows


def bert_large(lines: Iterable[str]) -> list[dict]:
    """Phase, side, sequences/s, TFLOP/s, MFU (None when the peak is unknown), ratio to transformers."""
    rows = []
    for line in lines:
        if m := _BERT.match(line):
            mfu = None if m.group(5) == "n/a" else float(m.group(5).rstrip("%")) / 100
            rows.append({"phase": int(m.group(1)), "side": m.group(2), "seq_per_s": float(m.group(3)),
                         "tflops": float(m.group(4)), "mfu": mfu, "vs_transformers": float(m.group(6))})
    return rows


def varlen_attention(lines: Iterable[str]) -> list[dict]:
    """Data (padded or full) and its share of real tokens, attention dropout, side (varlen or
    sdpa), sequences/s, TFLOP/s, MFU, ratio to sdpa."""
    rows = []
    for line in lines:
        if m := _VARLEN.match(line):
            mfu = None if m.group(7) == "n/a" else float(m.group(7).rstrip("%")) / 100
            rows.append({"data": m.group(1), "real_tokens": float(m.group(2)) / 100,
                         "attention_dropout": float(m.group(3)), "side": m.group(4), "seq_per_s": float(m.group(5)),
                         "tflops": float(m.group(6)), "mfu": mfu, "vs_sdpa": float(m.group(8))})
    return rows


def memory(lines: Iterable[str]) -> list[dict]:
    """Measured and predicted peak GB per (model, layout) that ran."""
    return [{"model": m.group(1), "layout": m.group(2), "world": int(m.group(3)), "measured_gb": float(m.group(4)),
             "predicted_gb": float(m.group(5)), "measured_over_predicted": float(m.group(6))}
            for m in (_MEMORY.match(line) for line in lines) if m]
