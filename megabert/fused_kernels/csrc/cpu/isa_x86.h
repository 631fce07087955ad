// The body of each x86 instruction-set file (isa_avx2.cpp, isa_avx512.cpp): the row kernels
// compiled under that file's `GCC target`, and its table's accessor. The file defines, before
// including this one: MEGABERT_ISA (the namespace), MEGABERT_ISA_TARGET (GCC's target string),
// MEGABERT_VEC_BYTES, MEGABERT_ISA_NAME and MEGABERT_TABLE_FN (the accessor ops.cpp calls).
// Where GCC's target pragma is not available (another compiler or architecture) the accessor
// returns nullptr and ops.cpp picks the baseline kernels.
#include "kernel_table.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// _Pragma takes a string: the target is expanded first, then quoted into the pragma.
#define MEGABERT_PRAGMA(text) _Pragma(#text)
#define MEGABERT_TARGET(isa_target) MEGABERT_PRAGMA(GCC target(isa_target))
#pragma GCC push_options
MEGABERT_TARGET(MEGABERT_ISA_TARGET)
#include "row_kernels.h"
#pragma GCC pop_options
#define MEGABERT_ISA_BUILT 1
#endif

namespace megabert {
namespace cpu {
#ifdef MEGABERT_ISA_BUILT
const KernelTable* MEGABERT_TABLE_FN() { return &MEGABERT_ISA::kTable; }
#else
const KernelTable* MEGABERT_TABLE_FN() { return nullptr; }
#endif
}  // namespace cpu
}  // namespace megabert
