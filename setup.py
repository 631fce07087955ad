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
# No -std: torch's BuildExtension adds the standard its headers need (C++20 for torch
# 2.13, whose headers warn under C++17).
CXX_FLAGS = ["-O3"]


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


KERNELS = ("megabert", "fused_kernels", "csrc")


def kernel_extensions():
    """Fused softmax / LayerNorm kernels (megabert/fused_kernels/csrc): the CPU module
    always, the CUDA module when torch has CUDA and nvcc is found."""
    omp_compile, omp_link = _openmp_flags()
    # No -march: the wheel may run on another CPU. The row kernels are compiled once per
    # instruction set (isa_*.cpp, with `#pragma GCC target`) and picked at run time.
    # -ffp-contract=fast lets those files fuse multiply-adds, which an ISO -std=c++NN
    # (as torch passes) turns off. -fno-trapping-math / -fno-math-errno (as torch's own
    # build): without them GCC will not if-convert the selects in the exp polynomial or
    # vectorise sqrt below AVX-512, and the softmax row loop stays scalar on AVX2 CPUs.
    cpu = cpp_extension.CppExtension(
        "megabert.fused_kernels._cpu",
        sources=[_src(*KERNELS, "cpu", f) for f in
                 ("bindings.cpp", "ops.cpp", "isa_default.cpp", "isa_avx2.cpp", "isa_avx512.cpp")],
        extra_compile_args={"cxx": CXX_FLAGS + omp_compile + ["-ffp-contract=fast", "-fno-trapping-math",
                                                              "-fno-math-errno"]},
        extra_link_args=omp_link,
    )
    if not _cuda_buildable():
        print("megabert: building the CPU kernels only (torch has no CUDA or nvcc was not found)")
        return [cpu]
    cuda = cpp_extension.CUDAExtension(
        "megabert.fused_kernels._cuda",
        sources=[_src(*KERNELS, "cuda", f) for f in ("bindings.cpp", "softmax.cu", "layer_norm.cu")],
        # --use_fast_math: __expf in the softmax (as Megatron's kernels); the LayerNorm
        # uses rsqrtf either way. Architectures come from TORCH_CUDA_ARCH_LIST or the GPU.
        extra_compile_args={"cxx": CXX_FLAGS, "nvcc": ["-O3", "--use_fast_math", "-lineinfo"]},
    )
    return [cpu, cuda]


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
