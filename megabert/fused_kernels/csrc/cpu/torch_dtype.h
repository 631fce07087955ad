// The kernels' Dtype of a torch tensor, for the torch-facing files (ops.cpp, attention.cpp);
// kernel_table.h stays free of torch headers (see its NOTE).
#pragma once

#include <ATen/core/Tensor.h>

#include "kernel_table.h"

namespace megabert {
namespace cpu {

// kFloat, kBFloat16 or kDouble; any other dtype is an error that names `what`.
Dtype kernel_dtype(const at::Tensor& t, const char* what);

}  // namespace cpu
}  // namespace megabert
