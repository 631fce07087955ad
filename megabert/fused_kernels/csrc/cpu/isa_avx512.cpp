// Row kernels compiled for AVX-512 (F, BW, VL, DQ: x86-64-v4), picked at run time by
// ops.cpp only when the CPU and OS support it. 512-bit vectors are asked for
// explicitly: GCC's generic tuning otherwise stays at 256 bits.
#define MEGABERT_ISA isa_avx512
#define MEGABERT_ISA_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2,prefer-vector-width=512"
#define MEGABERT_VEC_BYTES 64
#define MEGABERT_ISA_NAME "avx512"
#define MEGABERT_TABLE_FN avx512_table
#include "isa_x86.h"
