// Row kernels compiled for AVX2 + FMA (x86-64-v3), picked at run time by ops.cpp only
// when the CPU reports both: setup.py passes no -march, so nothing else in the
// library assumes them.
#define MEGABERT_ISA isa_avx2
#define MEGABERT_ISA_TARGET "avx2,fma,f16c,bmi2"
#define MEGABERT_VEC_BYTES 32
#define MEGABERT_ISA_NAME "avx2"
#define MEGABERT_TABLE_FN avx2_table
#include "isa_x86.h"
