"""`make cuda-check`: build the CUDA kernels for sm_80 and sm_90 on a machine without a GPU,
warnings as errors, and report registers and spills per kernel.

Run by the side venv's python (.venv-cuda, a CUDA torch; the Makefile creates it). The
build is megabert's own setup.py in a fresh copy of the sources under build/cuda-check/,
so the CPU extensions of .venv's editable install are never touched, and every run
compiles every kernel (ptxas reports only what it assembles). It fails, with one line
last, on a compile error, a warning (MEGABERT_CUDA_WERROR=1), an extension that does not
import, or any register spill: a spill is local-memory traffic on every access of the
spilled values, which these register-resident kernels are written to avoid, so there is
no allowlist.

    .venv-cuda/bin/python tools/gpu/cuda_check.py
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from typing import Iterable

from ptxas_report import parse_ptxas, short_names, table

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

WORK = os.path.join(ROOT, "build", "cuda-check")
# What setup.py reads; megabert/ without compiled modules or caches.
TREE = ("setup.py", "pyproject.toml", "README.md", "megabert")
REQUIRED_ARCHS = ("sm_80", "sm_90")


def fail(message: str) -> None:
    sys.exit(f"cuda-check: {message}")


def copy_sources(dest: str) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    ignore = shutil.ignore_patterns("*.so", "__pycache__", "*.pyc")
    for name in TREE:
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dest, name), ignore=ignore)
        else:
            shutil.copy2(src, dest)


def build_env() -> dict[str, str]:
    # By path, as setup.py reads it: plain Python, so no megabert install (nor its torch) is needed.
    spec = importlib.util.spec_from_file_location("cuda_toolkit", os.path.join(ROOT, "megabert", "fused_kernels",
                                                                               "cuda_toolkit.py"))
    cuda_toolkit = importlib.util.module_from_spec(spec)
    sys.modules["cuda_toolkit"] = cuda_toolkit  # its dataclasses look their module up while built
    spec.loader.exec_module(cuda_toolkit)
    DEFAULT_ARCH_LIST = cuda_toolkit.DEFAULT_ARCH_LIST

    env = dict(os.environ)
    env["MEGABERT_CUDA"] = "require"  # no silent fall back to the CPU kernels here
    env["MEGABERT_CUDA_WERROR"] = "1"
    env.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    # nvcc appends these to every call: ptxas's per-kernel resource report.
    env["NVCC_APPEND_FLAGS"] = (env.get("NVCC_APPEND_FLAGS", "") + " -Xptxas -v").strip()
    return env


def build(src: str, log_path: str, env: dict[str, str]) -> int:
    with open(log_path, "w") as log:
        return subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=src, env=env,
                              stdout=log, stderr=subprocess.STDOUT, check=False).returncode


# gcc `f.cpp:3:5: error: ...`, nvcc `f.cu(3): warning #177-D: ...`, ptxas `ptxas error   : ...`,
# ninja `FAILED: ...`; not the compile commands, which all carry `-Werror`.
DIAGNOSTIC = re.compile(r"\b(error|warning)( #\d+-D)?\s*:|^FAILED:", re.IGNORECASE)


def first_errors(lines: Iterable[str], limit: int = 15) -> list[str]:
    """The first compiler diagnostics of a build log."""
    return [line.rstrip() for line in lines if DIAGNOSTIC.search(line)][:limit]


def import_check(src: str) -> str:
    """Imports the built _cuda module in a fresh process (needs no GPU); '' when it loads."""
    built = glob.glob(os.path.join(src, "megabert", "fused_kernels", "_cuda*.so"))
    if not built:
        return "setup.py finished but built no megabert/fused_kernels/_cuda*.so"
    code = ("import importlib.util, sys, torch\n"
            "spec = importlib.util.spec_from_file_location('megabert.fused_kernels._cuda', sys.argv[1])\n"
            "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n")
    done = subprocess.run([sys.executable, "-c", code, built[0]], capture_output=True, text=True, check=False)
    return "" if done.returncode == 0 else (done.stderr.strip().splitlines() or ["exit code %d" % done.returncode])[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    import torch

    if not torch.version.cuda:
        fail(f"{sys.executable} has torch {torch.__version__} without CUDA; run `make cuda-check`, which makes "
             f".venv-cuda with a CUDA torch")
    env = build_env()
    src = os.path.join(WORK, "src")
    log_path = os.path.join(WORK, "build.log")
    copy_sources(src)
    print(f"cuda-check: torch {torch.__version__} (CUDA {torch.version.cuda}), TORCH_CUDA_ARCH_LIST="
          f"{env['TORCH_CUDA_ARCH_LIST']}, warnings as errors; building in {src} (log: {log_path})", flush=True)
    rc = build(src, log_path, env)
    if rc != 0:
        with open(log_path, errors="replace") as f:
            for line in first_errors(f):
                print(f"  {line}")
        fail(f"the CUDA build failed (exit code {rc}, a compile error or a warning under "
             f"MEGABERT_CUDA_WERROR=1); the lines above are from {log_path}, fix them and run it again")
    error = import_check(src)
    if error:
        fail(f"the built CUDA extension does not import: {error}")
    with open(log_path, errors="replace") as f:
        usages = parse_ptxas(f)
    archs = sorted({u.arch for u in usages})
    missing = [a for a in REQUIRED_ARCHS if a not in archs]
    if missing:
        fail(f"ptxas reported no kernels for {', '.join(missing)} (saw {', '.join(archs) or 'none'}); "
             f"is TORCH_CUDA_ARCH_LIST={env['TORCH_CUDA_ARCH_LIST']} meant? see {log_path}")
    print(table(usages))
    names = short_names(usages)
    spilled = sorted({f"{names[u.mangled]} on {u.arch} ({u.spill_stores}/{u.spill_loads} B)" for u in usages
                      if u.spills})
    if spilled:
        fail(f"{len(spilled)} kernel(s) spill registers to local memory: {'; '.join(spilled)}; "
             f"give them fewer values per thread (see the table above)")
    print(f"cuda-check: OK: {len({u.mangled for u in usages})} kernels on {', '.join(archs)}, no spills, "
          f"no warnings, the extension imports")


if __name__ == "__main__":
    main()
