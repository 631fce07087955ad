// pybind11 module megabert.fused_kernels._cpu, built ahead of time by setup.py.
#include "../bind_kernel_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megabert fused softmax and LayerNorm kernels for CPU (OpenMP across rows, vectorised rows)";
  megabert::def_kernel_ops(m, megabert::cpu::kernel_ops());
  m.def("isa", &megabert::cpu::isa, "Instruction set the kernels run with: avx512, avx2 or default.");
}
