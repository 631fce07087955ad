// pybind11 module megabert.fused_kernels._cpu, built ahead of time by setup.py.
#include "../bind_kernel_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() =
      "megabert fused softmax, LayerNorm and dropout + residual add kernels for CPU (OpenMP across rows, "
      "vectorised rows)";
  megabert::def_kernel_ops(m, megabert::cpu::kernel_ops());
  m.def("dropout_add_forward", &megabert::cpu::dropout_add_forward,
        "residual + dropout(x) -> (out, keep mask); the mask from Philox4x32-10 keyed by seed", pybind11::arg("x"),
        pybind11::arg("residual"), pybind11::arg("p"), pybind11::arg("seed"));
  m.def("dropout_backward", &megabert::cpu::dropout_backward, "grad of dropout's input: mask * grad / (1 - p)",
        pybind11::arg("grad"), pybind11::arg("mask"), pybind11::arg("p"));
  m.def("isa", &megabert::cpu::isa, "Instruction set the kernels run with: avx512, avx2 or default.");
}
