// Row kernels compiled for AVX2 + FMA (x86-64-v3), picked at run time by ops.cpp only
// when the CPU reports both: setup.py passes no -march, so nothing else in the
// library assumes them.
#include "kernel_table.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi2")
#define MEGABERT_ISA isa_avx2
#define MEGABERT_VEC_BYTES 32
#define MEGABERT_ISA_NAME "avx2"
#include "row_kernels.h"
#pragma GCC pop_options
#endif

namespace megabert {
namespace cpu {
#ifdef MEGABERT_ISA
const KernelTable* avx2_table() { return &isa_avx2::kTable; }
#else
const KernelTable* avx2_table() { return nullptr; }
#endif
}  // namespace cpu
}  // namespace megabert
