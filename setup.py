"""Builds megabert's C++ (and, where possible, CUDA) extensions ahead of time.

A JIT build on first use is a known pain point of Megatron-LM (a cluster job
compiling on every node, racing on a shared cache), so everything is compiled
here, at install time. `make install` runs this with --no-build-isolation so the
extensions link against the torch that is already in the environment.
"""
import importlib.util
import os
import sys

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
# No -std: torch's BuildExtension adds the standard its headers need (C++20 for torch
# 2.13, whose headers warn under C++17). -g0 overrides the -g of Python's own CFLAGS: debug
# info for torch's headers is a fifth of the build's time (~16 of 80 CPU-seconds) and a
# larger .so, for line numbers nobody asked for; symbols stay.
CXX_FLAGS = ["-O3", "-g0"]


def _openmp_flags():
    # OpenMP parallelises across rows; torch's own build links libgomp on Linux.
    return (["-fopenmp"], ["-fopenmp"]) if os.name == "posix" else ([], [])


def _load_toolkit_module():
    """megabert/fused_kernels/cuda_toolkit.py by path: the package itself is not built yet."""
    spec = importlib.util.spec_from_file_location(
        "_megabert_cuda_toolkit", os.path.join(ROOT, "megabert", "fused_kernels", "cuda_toolkit.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def _cuda_plan():
    import torch

    toolkit = _load_toolkit_module()
    cuda = torch.version.cuda
    return toolkit.plan_cuda_build(os.environ, cuda, cpp_extension.CUDA_HOME, toolkit.which_nvcc(),
                                   toolkit.standard_homes(cuda))


def _require_cuda() -> bool:
    return os.environ.get("MEGABERT_CUDA") == "require"


def _say(message: str) -> None:
    # One line on stderr: pip shows it with -v, and `make install` prints the outcome
    # (fused kernels: cpu / cpu+cuda) after the build.
    sys.stderr.write(f"megabert: {message}\n")


def _src(*parts):
    return os.path.relpath(os.path.join(ROOT, *parts), ROOT)


KERNELS = ("megabert", "fused_kernels", "csrc")


def kernel_extensions():
    """Fused softmax / LayerNorm / RMSNorm / gated activation / RoPE / dropout + add / attention
    kernels (megabert/fused_kernels/csrc): the CPU module always; the CUDA module (the fused softmax) when
    torch has CUDA and nvcc is found."""
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
                 ("bindings.cpp", "ops.cpp", "attention.cpp", "isa_default.cpp", "isa_avx2.cpp", "isa_avx512.cpp")],
        extra_compile_args={"cxx": CXX_FLAGS + omp_compile + ["-ffp-contract=fast", "-fno-trapping-math",
                                                              "-fno-math-errno"]},
        extra_link_args=omp_link,
    )
    plan = _cuda_plan()
    if not plan.build:
        if _require_cuda():
            raise SystemExit(f"megabert: MEGABERT_CUDA=require, but the CUDA kernels cannot be built: {plan.reason}")
        _say(f"CPU kernels only: {plan.reason}")
        return [cpu]
    # torch read CUDA_HOME when cpp_extension was imported: set both to the toolkit found.
    os.environ["CUDA_HOME"] = cpp_extension.CUDA_HOME = plan.cuda_home
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", plan.arch_list)
    _say(f"building the CUDA kernels with {plan.reason} for TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")
    cxx, nvcc = list(CXX_FLAGS), ["-O3", "--use_fast_math", "-lineinfo"]
    if os.environ.get("MEGABERT_CUDA_WERROR") == "1":
        # `make cuda-check` (tools/gpu/cuda_check.py): a warning in our kernels, device or
        # host side, fails the build there instead of scrolling past in a GPU job's log.
        cxx += ["-Werror"]
        nvcc += ["-Werror", "all-warnings", "-Xcompiler", "-Werror"]
    cuda = cpp_extension.CUDAExtension(
        "megabert.fused_kernels._cuda",
        sources=[_src(*KERNELS, "cuda", f) for f in ("bindings.cpp", "softmax.cu")],
        # --use_fast_math: __expf in the softmax (as Megatron's kernels). Architectures come from TORCH_CUDA_ARCH_LIST or the GPU.
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
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


class BuildExtension(cpp_extension.BuildExtension):
    """Builds the CUDA extension last, and a failure there costs only the CUDA kernels:
    the CPU kernels and the data helpers are already built and install either way
    (MEGABERT_CUDA=require makes it an error)."""

    def build_extensions(self):
        self.extensions.sort(key=lambda ext: ext.name.endswith("._cuda"))
        super().build_extensions()

    def build_extension(self, ext):
        if not ext.name.endswith("._cuda"):
            return super().build_extension(ext)
        try:
            return super().build_extension(ext)
        except Exception as e:  # noqa: BLE001 - any compiler or toolkit failure: keep the CPU build
            if _require_cuda():
                raise
            first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
            _say(f"CUDA kernels not built ({first}); the CPU kernels are installed. MEGABERT_CUDA=require makes "
                 f"this an error; see docs/install-and-gpu-build.md")


setup(
    ext_modules=kernel_extensions() + data_extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
