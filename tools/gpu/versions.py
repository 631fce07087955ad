"""`make bench-gpu`'s versions step: one JSON line with torch, CUDA, the GPU, its driver, nvcc
and whether megabert's CUDA kernels loaded (and why not). Run by .venv's python."""
import json
import shutil
import subprocess

import torch

import megabert.fused_kernels as fk


def first_line(cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[-1] if out else None


gpu = torch.cuda.is_available()
print(json.dumps({
    "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": gpu,
    "gpu": torch.cuda.get_device_name(0) if gpu else None,
    "capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if gpu else None,
    "driver": first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
              if shutil.which("nvidia-smi") else None,
    "nvcc": first_line(["nvcc", "--version"]) if shutil.which("nvcc") else None,
    "cuda_kernels": fk.is_available("cuda"), "cuda_kernels_error": fk.load_error("cuda"),
}))
