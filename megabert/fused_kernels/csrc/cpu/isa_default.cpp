// Row kernels for the compiler's baseline instruction set (x86-64 SSE2, aarch64 NEON):
// the fallback on any CPU, and what the other architectures run.
#include "kernel_table.h"

#define MEGABERT_ISA isa_default
#define MEGABERT_VEC_BYTES 16
#define MEGABERT_ISA_NAME "default"
#include "row_kernels.h"

namespace megabert {
namespace cpu {
const KernelTable* default_table() { return &isa_default::kTable; }
}  // namespace cpu
}  // namespace megabert
