// Puts a backend's KernelOps on its pybind11 module, under the names megabert.ops calls.
#pragma once

#include <torch/csrc/utils/pybind.h>  // pybind11 with the at::Tensor casters (lighter than torch/python.h)

#include "kernel_ops.h"

namespace megabert {

inline void def_kernel_ops(pybind11::module_& m, const KernelOps& ops) {
  namespace py = pybind11;
  m.def("scaled_masked_softmax_forward", ops.scaled_masked_softmax_forward, "softmax(scale * scores), masked",
        py::arg("scores"), py::arg("mask"), py::arg("scale"));
  m.def("scaled_masked_softmax_backward", ops.scaled_masked_softmax_backward, "grad of the scores",
        py::arg("grad_probs"), py::arg("probs"), py::arg("scale"));
  if (ops.layer_norm_forward != nullptr) {  // CPU only (kernel_ops.h)
    m.def("layer_norm_forward", ops.layer_norm_forward, "LayerNorm over the last dim -> (y, mean, rstd)",
          py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("eps"));
    m.def("layer_norm_backward", ops.layer_norm_backward, "-> (grad_x, grad_weight, grad_bias)",
          py::arg("grad_y"), py::arg("x"), py::arg("weight"), py::arg("mean"), py::arg("rstd"));
  }
}

}  // namespace megabert
