"""Whether and where setup.py builds the CUDA kernels: plain Python, no torch import, so
setup.py loads it by path before anything is built and tests check it without a toolkit.

A CUDA build needs a CUDA torch and a *complete* toolkit: `bin/nvcc` and the runtime
headers under one CUDA_HOME. torch guesses CUDA_HOME as the folder above the `nvcc` on
PATH, which is wrong when that `nvcc` is a wrapper script (as on machines whose PATH holds
/usr/local/bin/nvcc -> exec /usr/local/cuda-13.0/bin/nvcc): the build then dies on a
missing cuda_runtime_api.h and used to take the CPU kernels down with it. Here the wrapper
is followed to the toolkit it runs; when no complete toolkit is found the reason is one
line and the CPU build goes on (MEGABERT_CUDA=require makes it an error).
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Mapping, Optional

# sm_80 (A100), sm_90 (H100/H200), and PTX of sm_90 that newer GPUs JIT-compile. torch's
# builder needs a list when no GPU is visible (a build node, a container): without one it
# raises IndexError.
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"
HEADER = os.path.join("include", "cuda_runtime_api.h")


@dataclass(frozen=True)
class CudaPlan:
    """build: whether to build the CUDA extension; cuda_home and arch_list to build it
    with; reason: why not (one line), or what was chosen."""

    build: bool
    reason: str
    cuda_home: Optional[str] = None
    arch_list: Optional[str] = None


def missing_parts(home: str) -> list[str]:
    """What a toolkit folder lacks of what the build needs ([] when complete)."""
    return [part for part in (os.path.join("bin", "nvcc"), HEADER) if not os.path.isfile(os.path.join(home, part))]


def nvcc_target(nvcc: str) -> str:
    """The nvcc a wrapper script runs (its first absolute .../bin/nvcc), else `nvcc` itself."""
    try:
        with open(nvcc, "rb") as f:
            head = f.read(4096)
    except OSError:
        return nvcc
    if not head.startswith(b"#!"):
        return os.path.realpath(nvcc)  # a binary (or a symlink to one)
    for match in re.finditer(rb"(/[^\s'\"]+/bin/nvcc)\b", head):
        target = match.group(1).decode(errors="replace")
        if os.path.isfile(target) and os.path.realpath(target) != os.path.realpath(nvcc):
            return target
    return nvcc


def plan_cuda_build(env: Mapping[str, str], torch_cuda: Optional[str], torch_cuda_home: Optional[str] = None,
                    nvcc_on_path: Optional[str] = None, standard_homes: tuple[str, ...] = ()) -> CudaPlan:
    """The decision, from the environment (CUDA_HOME / CUDA_PATH, TORCH_CUDA_ARCH_LIST,
    MEGABERT_NO_CUDA_EXT), torch's CUDA version and its own CUDA_HOME guess, the nvcc on
    PATH and CUDA's standard install folders."""
    if env.get("MEGABERT_NO_CUDA_EXT") == "1":
        return CudaPlan(False, "MEGABERT_NO_CUDA_EXT=1")
    if not torch_cuda:
        return CudaPlan(False, "this torch has no CUDA (a CPU build)")
    arch = env.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCH_LIST
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):  # the user's choice: used as given, or explained, never replaced silently
            missing = missing_parts(env[var])
            if missing:
                return CudaPlan(False, f"{var}={env[var]} is not a complete CUDA toolkit (no "
                                       f"{' or '.join(missing)}); point {var} at the toolkit (e.g. "
                                       f"/usr/local/cuda-{'.'.join(torch_cuda.split('.')[:2])})")
            return CudaPlan(True, f"{var}={env[var]}", env[var], arch)
    candidates = []
    if nvcc_on_path:
        candidates.append(os.path.dirname(os.path.dirname(nvcc_target(nvcc_on_path))))
    if torch_cuda_home:
        candidates.append(torch_cuda_home)
    candidates += list(standard_homes)
    for home in candidates:
        if not missing_parts(home):
            return CudaPlan(True, f"the toolkit in {home}", home, arch)
    if not candidates:
        return CudaPlan(False, "no nvcc on PATH and no CUDA toolkit in the standard folders; set CUDA_HOME")
    return CudaPlan(False, f"no complete CUDA toolkit (bin/nvcc and {HEADER}) in {', '.join(dict.fromkeys(candidates))}"
                           f"; set CUDA_HOME to one")


def standard_homes(torch_cuda: Optional[str]) -> tuple[str, ...]:
    """CUDA's standard install folders on Linux, the one matching torch's CUDA first."""
    homes = []
    if torch_cuda:
        homes.append(f"/usr/local/cuda-{'.'.join(torch_cuda.split('.')[:2])}")
    homes.append("/usr/local/cuda")
    return tuple(h for h in homes if os.path.isdir(h))


def which_nvcc() -> Optional[str]:
    return shutil.which("nvcc")
