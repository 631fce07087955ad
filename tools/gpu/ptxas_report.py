"""Registers and spills per kernel and architecture, read from `nvcc -Xptxas -v` output.

ptxas prints, for every kernel it assembles:

    ptxas info    : Compiling entry function '_ZN8megabert...' for 'sm_80'
    ptxas info    : Function properties for _ZN8megabert...
        0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info    : Used 40 registers, used 1 barriers, 392 bytes cmem[0]

Plain Python with no torch import: tools/gpu/cuda_check.py prints the table, the tests
read a captured sample.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Iterable, Optional

_ENTRY = re.compile(r"ptxas info\s*: Compiling entry function '([^']+)' for '(sm_\w+)'")
_PROPS = re.compile(r"ptxas info\s*: Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"ptxas info\s*: Used (\d+) registers")


@dataclass(frozen=True)
class KernelUsage:
    """One kernel compiled for one architecture."""

    mangled: str
    arch: str
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def parse_ptxas(lines: Iterable[str]) -> list[KernelUsage]:
    """Every entry function in ptxas -v output, in the order ptxas printed them.

    NOTE: "Function properties" also appears for non-entry (noinline) device functions;
    only those of the entry being compiled are attached to it.
    """
    found: list[KernelUsage] = []
    entry: Optional[tuple[str, str]] = None
    frame = (0, 0, 0)
    in_entry_props = False
    for line in lines:
        if m := _ENTRY.search(line):
            entry, frame, in_entry_props = (m.group(1), m.group(2)), (0, 0, 0), False
        elif m := _PROPS.search(line):
            in_entry_props = entry is not None and m.group(1) == entry[0]
        elif (m := _FRAME.search(line)) and in_entry_props:
            frame = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
            in_entry_props = False
        elif (m := _USED.search(line)) and entry is not None:
            found.append(KernelUsage(entry[0], entry[1], int(m.group(1)), *frame))
            entry = None
    return found


def demangle(names: list[str]) -> dict[str, str]:
    """Readable names through c++filt where it is installed (else the mangled ones)."""
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=False).stdout
    readable = out.splitlines()
    return dict(zip(names, readable)) if len(readable) == len(names) else {n: n for n in names}


def short_name(demangled: str) -> str:
    """`megabert::cuda::(anonymous namespace)::softmax_fwd_kernel<float, 7, 4>(...)`
    -> `softmax_fwd_kernel<float, 7, 4>`: the template arguments tell the variants apart."""
    head = demangled = demangled.replace("(anonymous namespace)::", "")
    depth = 0
    for i, ch in enumerate(demangled):  # cut the parameter list: the first '(' outside <>
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0:
            head = demangled[:i]
            break
    depth, cut = 0, 0
    for i, ch in enumerate(head):  # drop namespaces: the last '::' outside <>
        depth += (ch == "<") - (ch == ">")
        if depth == 0 and head.startswith("::", i):
            cut = i + 2
    return head[cut:].replace("c10::BFloat16", "bf16").replace("c10::Half", "fp16")


def short_names(usages: list[KernelUsage]) -> dict[str, str]:
    """Mangled name -> short readable name, for every kernel in `usages`."""
    return {mangled: short_name(readable) for mangled, readable in demangle(sorted({u.mangled for u in usages})).items()}


def table(usages: list[KernelUsage]) -> str:
    """One row per kernel, per architecture its registers and spill stores/loads in bytes."""
    names = short_names(usages)
    archs = sorted({u.arch for u in usages}, key=lambda a: int(re.sub(r"\D", "", a) or 0))
    by_kernel: dict[str, dict[str, KernelUsage]] = {}
    for u in usages:
        by_kernel.setdefault(names[u.mangled], {})[u.arch] = u
    width = max([len("kernel")] + [len(k) for k in by_kernel])
    head = f"{'kernel':{width}}" + "".join(f" | {a + ' regs':>9} {'spill st/ld B':>13}" for a in archs)
    rows = [head, "-" * len(head)]
    for kernel in sorted(by_kernel):
        cells = []
        for a in archs:
            u = by_kernel[kernel].get(a)
            cells.append(f" | {'-':>9} {'-':>13}" if u is None else
                         f" | {u.registers:9d} {f'{u.spill_stores}/{u.spill_loads}':>13}")
        rows.append(f"{kernel:{width}}" + "".join(cells))
    return "\n".join(rows)
