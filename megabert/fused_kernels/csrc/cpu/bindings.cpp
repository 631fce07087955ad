// pybind11 module megabert.fused_kernels._cpu, built ahead of time by setup.py.
#include <torch/python.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace cpu = megabert::cpu;
  m.doc() = "megabert fused softmax and LayerNorm kernels for CPU (OpenMP across rows, vectorised rows)";
  m.def("isa", &cpu::isa, "Instruction set the kernels run with: avx512, avx2 or default.");
  m.def("scaled_masked_softmax_forward", &cpu::scaled_masked_softmax_forward, "softmax(scale * scores), masked",
        py::arg("scores"), py::arg("mask"), py::arg("scale"));
  m.def("scaled_masked_softmax_backward", &cpu::scaled_masked_softmax_backward, "grad of the scores",
        py::arg("grad_probs"), py::arg("probs"), py::arg("scale"));
  m.def("layer_norm_forward", &cpu::layer_norm_forward, "LayerNorm over the last dim -> (y, mean, rstd)",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("eps"));
  m.def("layer_norm_backward", &cpu::layer_norm_backward, "-> (grad_x, grad_weight, grad_bias)", py::arg("grad_y"),
        py::arg("x"), py::arg("weight"), py::arg("mean"), py::arg("rstd"));
}
