"""The key figures of `make bench-gpu`'s logs, for its JSON summary (tools/gpu/bench_gpu.py).

Each parser reads the lines one benchmark prints (its own format, see the script) and
returns what it found; a line it does not know is skipped, so a changed format costs the
figure, never the run. Plain Python, tested on captured lines without a GPU.
"""
from __future__ import annotations

import re
from typing import Iterable, Optional

_PYTEST = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")
# bench/kernels.py: "softmax   [8,12,128,128]      bfloat16       0.05 ..."
_KERNEL = re.compile(r"^(softmax|layernorm)\s+(\[[\d,]+\])\s+(\w+)\s+([\d.]+)")
_BANDWIDTH = re.compile(r"^\s+.*GB/s")
# bench/gpu_bert_large.py, per phase and side: phase, side, seq/s, real tokens/s, real share,
# samples/row, TFLOP/s, MFU, vs transformers, peak GB:
# "1      megabert-packed     1102.4      134512      97.1%        1.13     266.0   26.9%      1.49x    14.20"
_BERT = re.compile(r"^([12])\s+(megabert(?:-[a-z]+)*|transformers)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%\s+([\d.]+)\s+"
                   r"([\d.]+)\s+([\d.]+%|n/a)\s+([\d.]+x|n/a)\s+([\d.]+|n/a)\s*$")
# its kernel breakdown: "1      megabert     66.80     30.12 45.1%  ..." (wall, then ms and share of
# GEMM, attention, norm/elementwise, optimizer, other, idle)
_PAIR = r"\s+([\d.]+)\s+([\d.]+)%"
_BREAKDOWN = re.compile(r"^([12])\s+(megabert(?:-[a-z]+)*|transformers)\s+([\d.]+)" + _PAIR * 6 + r"\s*$")
BREAKDOWN_PARTS = ("gemm", "attention", "norm_elementwise", "optimizer", "other", "idle")
# the phase (BERT) or the sequence length (ModernBERT), then the figures
_SYNCS = re.compile(r"^host syncs (\d+) (\S+): ([\d.]+) per step \((\d+) in (\d+) steps")
_ISSUE = re.compile(r"^host issue (\d) (\S+): ([\d.]+) ms of ([\d.]+) ms a step")
_RECOMPILES = re.compile(r"^recompiles (\d+): (\d+) graphs compiled and (\d+) graph breaks after warm-up \((.*)\)")
# issue 41's targets (bench/gpu_bert_large.py prints them beside the figures)
TARGET_MFU, TARGET_VS_TRANSFORMERS, MOONSHOT_MFU = 0.45, 1.8, 0.55
# bench/gpu_modernbert.py: seq, side, seq/s, real tokens/s, real share, TFLOP/s, MFU, vs
# transformers-sdpa, peak GB:
# "1024   megabert                        95.2       73112      74.9%     123.4   12.5%              2.10x    20.11"
_MB_SIDE = r"(megabert|transformers-sdpa|transformers-fa2)"
_MODERNBERT = re.compile(r"^(\d+)\s+" + _MB_SIDE + r"\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%\s+([\d.]+)\s+([\d.]+%|n/a)\s+"
                         r"([\d.]+x|n/a)\s+([\d.]+|n/a)\s*$")
_MB_BREAKDOWN = re.compile(r"^(\d+)\s+" + _MB_SIDE + r"\s+([\d.]+)" + _PAIR * 6 + r"\s*$")
_MB_RATIO = re.compile(r"^ratio (\d+) megabert/(\S+): ([\d.]+)x real tokens/s")
_MB_ATTENTION = re.compile(r"^transformers attention: (.*) ran; flash_attention_2 (available|not available)")
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


def bert_large(lines: Iterable[str]) -> dict:
    """bench/gpu_bert_large.py's figures: `throughput` (phase, side, seq/s, real tokens/s, the
    rows' real-token share, samples per row, TFLOP/s and MFU of real tokens (None when the peak
    is unknown), ratio of real tokens/s to transformers, peak GB), `breakdown` (ms per step of
    the step's wall, each kind of kernel and the idle time), `host_syncs` (per step, for the
    megabert sides on CUDA), `host_issue` (ms of each step the host took to issue it, against
    the step's wall), `recompiles` (per phase) and `targets`: per phase, the best megabert side
    against issue 41's targets."""
    out: dict = {"throughput": [], "breakdown": [], "host_syncs": [], "host_issue": [], "recompiles": []}
    for line in lines:
        if m := _BERT.match(line):
            out["throughput"].append({
                "phase": int(m.group(1)), "side": m.group(2), "seq_per_s": float(m.group(3)),
                "real_tokens_per_s": float(m.group(4)), "real_token_share": _share(m.group(5)),
                "samples_per_row": float(m.group(6)), "tflops": float(m.group(7)), "mfu": _share(m.group(8)),
                "vs_transformers": None if m.group(9) == "n/a" else float(m.group(9).rstrip("x")),
                "peak_gb": None if m.group(10) == "n/a" else float(m.group(10))})
        elif m := _BREAKDOWN.match(line):
            ms = [float(m.group(i)) for i in range(4, 16, 2)]
            out["breakdown"].append({"phase": int(m.group(1)), "side": m.group(2), "wall_ms": float(m.group(3)),
                                     **{f"{k}_ms": v for k, v in zip(BREAKDOWN_PARTS, ms)}})
        elif m := _SYNCS.match(line):
            out["host_syncs"].append({"phase": int(m.group(1)), "side": m.group(2), "per_step": float(m.group(3)),
                                      "count": int(m.group(4)), "steps": int(m.group(5))})
        elif m := _ISSUE.match(line):
            out["host_issue"].append({"phase": int(m.group(1)), "side": m.group(2), "issue_ms": float(m.group(3)),
                                      "wall_ms": float(m.group(4))})
        elif m := _RECOMPILES.match(line):
            out["recompiles"].append({"phase": int(m.group(1)), "graphs_compiled": int(m.group(2)),
                                      "graph_breaks": int(m.group(3)), "mode": m.group(4)})
    out["targets"] = targets(out["throughput"])
    return out


def modernbert(lines: Iterable[str]) -> dict:
    """bench/gpu_modernbert.py's figures: `throughput` (seq, side, seq/s, real tokens/s, the
    rows' real-token share, TFLOP/s and MFU of real tokens (None when the peak is unknown),
    ratio of real tokens/s to transformers-sdpa, peak GB), `ratios` (megabert's real tokens/s
    over each transformers side's), `breakdown` (ms per step, as bert_large's), `host_syncs`
    (megabert's, on CUDA), `recompiles`, and which attention transformers ran
    (`transformers_attention`) and whether flash_attention_2 was there (`fa2_available`)."""
    out: dict = {"throughput": [], "ratios": [], "breakdown": [], "host_syncs": [], "recompiles": [],
                 "transformers_attention": None, "fa2_available": None}
    for line in lines:
        if m := _MODERNBERT.match(line):
            out["throughput"].append({
                "seq": int(m.group(1)), "side": m.group(2), "seq_per_s": float(m.group(3)),
                "real_tokens_per_s": float(m.group(4)), "real_token_share": _share(m.group(5)),
                "tflops": float(m.group(6)), "mfu": _share(m.group(7)),
                "vs_transformers_sdpa": None if m.group(8) == "n/a" else float(m.group(8).rstrip("x")),
                "peak_gb": None if m.group(9) == "n/a" else float(m.group(9))})
        elif m := _MB_BREAKDOWN.match(line):
            ms = [float(m.group(i)) for i in range(4, 16, 2)]
            out["breakdown"].append({"seq": int(m.group(1)), "side": m.group(2), "wall_ms": float(m.group(3)),
                                     **{f"{k}_ms": v for k, v in zip(BREAKDOWN_PARTS, ms)}})
        elif m := _MB_RATIO.match(line):
            out["ratios"].append({"seq": int(m.group(1)), "against": m.group(2), "megabert_over": float(m.group(3))})
        elif m := _MB_ATTENTION.match(line):
            out["transformers_attention"] = [a for a in m.group(1).split(", ") if a != "none"]
            out["fa2_available"] = m.group(2) == "available"
        elif m := _SYNCS.match(line):
            out["host_syncs"].append({"seq": int(m.group(1)), "side": m.group(2), "per_step": float(m.group(3)),
                                      "count": int(m.group(4)), "steps": int(m.group(5))})
        elif m := _RECOMPILES.match(line):
            out["recompiles"].append({"seq": int(m.group(1)), "graphs_compiled": int(m.group(2)),
                                      "graph_breaks": int(m.group(3)), "mode": m.group(4)})
    return out


def targets(rows: list[dict]) -> dict:
    """{phase: the best megabert side's MFU and ratio to transformers, and whether they meet
    the targets (None where a figure is missing)}."""
    out = {}
    for phase in sorted({r["phase"] for r in rows}):
        ours = [r for r in rows if r["phase"] == phase and r["side"] != "transformers"]
        if not ours:
            continue
        best = max(ours, key=lambda r: r["real_tokens_per_s"])
        mfu, ratio = best["mfu"], best["vs_transformers"]
        out[str(phase)] = {"side": best["side"], "mfu": mfu, "vs_transformers": ratio,
                           "mfu_target_met": None if mfu is None else mfu >= TARGET_MFU,
                           "moonshot_met": None if mfu is None else mfu >= MOONSHOT_MFU,
                           "ratio_target_met": None if ratio is None else ratio >= TARGET_VS_TRANSFORMERS}
    return out


def _share(cell: str):
    return None if cell == "n/a" else round(float(cell.rstrip("%")) / 100, 6)


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


# bench/gpu_optimizer_step.py: "fused AdamW            9.12      9.38        2.41        26.4%" (a piece,
# its ms, GB moved, ms at the copy bandwidth, the share of that bandwidth; nan where not counted)
_OPTIMIZER = re.compile(r"^(grad_norm|fused AdamW(?:, flat)?|guarded step|gemm copies|foreach AdamW|clip_grad_norm_|"
                        r"compiled AdamW, flat)\s+([\d.]+)\s+([\d.]+|nan)\s+([\d.]+|nan)\s+([\d.]+%|nan%)\s*$")


def optimizer_pieces(lines: Iterable[str]) -> list[dict]:
    """Each optimizer piece's ms per call, GB moved and share of the copy bandwidth (None: not counted)."""
    def number(text: str) -> Optional[float]:
        return None if text.startswith("nan") else float(text.rstrip("%"))

    rows = []
    for line in lines:
        if m := _OPTIMIZER.match(line):
            share = number(m.group(5))
            rows.append({"piece": m.group(1), "ms": float(m.group(2)), "gb_moved": number(m.group(3)),
                         "bandwidth_share": None if share is None else round(share / 100, 6)})
    return rows


def memory(lines: Iterable[str]) -> list[dict]:
    """Measured and predicted peak GB per (model, layout) that ran."""
    return [{"model": m.group(1), "layout": m.group(2), "world": int(m.group(3)), "measured_gb": float(m.group(4)),
             "predicted_gb": float(m.group(5)), "measured_over_predicted": float(m.group(6))}
            for m in (_MEMORY.match(line) for line in lines) if m]
