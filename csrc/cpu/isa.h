// Which vector path this build of a CPU extension carries, and the run-time switch to its scalar path.
//
// fp4offload builds each CPU extension once per instruction set, each with its own target flags and module
// name (fp4offload/_ops/cpu_isa.py): FP4_CPU_ISA_ID numbers the build, as the rows of FP4_CPU_ISAS do (isas.h,
// generated from fp4offload/_config/isas.py).
// The AVX-512 build runs the hand-scheduled kernels (nvfp4_avx512.h, adam_avx512.h); the NEON and AVX2 builds
// run the optimizer step written on the project's SIMD layer (simd.h, simd_neon.h / simd_avx2.h, adam_simd.h);
// the SVE build takes the NEON layer for the step too; the portable vector path (adam_chunk.h), vectorized by
// the compiler for the target, runs a partial last chunk; every build keeps the scalar path, which tests select with set_simd(false) to compare the two.
#pragma once

#include <atomic>

#include "cpu/isas.h"

#ifndef FP4_CPU_ISA_ID
#define FP4_CPU_ISA_ID 0
#endif
// The build has a vector step: the SIMD-layer step on NEON, SVE (through the NEON layer) and AVX2.
#ifndef FP4_CPU_VEC
#define FP4_CPU_VEC 0
#endif

namespace fp4cpu {

// The name of the build's path.
#define FP4_ISA_NAME_OF(name, id) FP4_CPU_ISA_ID == id ? #name:
constexpr const char* kIsa = FP4_CPU_ISAS(FP4_ISA_NAME_OF) "unknown";
#undef FP4_ISA_NAME_OF

// Whether the build has a vector path at all (the scalar build has none).
constexpr bool kHasSimd =
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VBMI__) && defined(__BMI2__)
    true;
#else
    FP4_CPU_VEC != 0;
#endif

inline std::atomic<bool>& simd_enabled() {
  static std::atomic<bool> on{kHasSimd};
  return on;
}
inline bool have_simd() { return simd_enabled().load(std::memory_order_relaxed); }
inline bool set_simd(bool on) {
  simd_enabled().store(on && kHasSimd);
  return have_simd();
}

}  // namespace fp4cpu
