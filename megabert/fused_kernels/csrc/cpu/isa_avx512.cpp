// Row kernels compiled for AVX-512 (F, BW, VL, DQ: x86-64-v4), picked at run time by
// ops.cpp only when the CPU and OS support it. 512-bit vectors are asked for
// explicitly: GCC's generic tuning otherwise stays at 256 bits.
#include "kernel_table.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2,prefer-vector-width=512")
#define MEGABERT_ISA isa_avx512
#define MEGABERT_VEC_BYTES 64
#define MEGABERT_ISA_NAME "avx512"
#include "row_kernels.h"
#pragma GCC pop_options
#endif

namespace megabert {
namespace cpu {
#ifdef MEGABERT_ISA
const KernelTable* avx512_table() { return &isa_avx512::kTable; }
#else
const KernelTable* avx512_table() { return nullptr; }
#endif
}  // namespace cpu
}  // namespace megabert
