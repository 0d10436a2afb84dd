// The project's own SIMD layer: 16-element blocks of fp32 values (F16) and of 32-bit patterns (U16), with the
// operations the optimizer step of adam_simd.h is written against. One implementation per instruction set, each
// in its own file (simd_neon.h, simd_avx2.h, simd_avx512.h; an SVE one would sit beside them); a build includes
// this header and gets the one for its target, or none (FP4_SIMD_LAYER 0: the build keeps the portable path of
// adam_chunk.h).
//
// The interface every implementation provides (namespace fp4simd):
//   F16, U16                 16 fp32 / uint32 lanes (the implementation's registers: four on NEON, two on AVX2,
//                            one on AVX-512)
//   splat, splat_u           one value in every lane
//   load, store, load_u      16 consecutive values, element order
//   load_bf16, store_bf16    bf16 <-> fp32 (widening is exact; narrowing rounds to nearest even, NaN -> 0x7FC0)
//   store_bytes              the low byte of each lane, 16 bytes
//   add sub mul div sqrt     IEEE single operations, one rounding each (no contraction); mul(F16, float) too
//   min, max, abs, neg       fp32; min/max of a NaN operand give NaN
//   min(a, k)                min(a, splat(k)) for a constant k that is neither NaN nor zero (a layer may have a
//                            cheaper form; the default below is that expression)
//   bits, from_bits          reinterpret
//   iand ior ixor iadd isub imul umax umin smax ieq, isub_sat (unsigned, saturating at 0)
//   shr<S>, shl<S>, shr_add<S>(a, b) = a + (b >> S)      logical shifts
//   lt(a, b), select(mask, x, y)                         all-ones where a < b (fp32); bitwise select, for masks
//                                                        whose lanes are all ones or zero (lt's and ieq's)
//   fix_trunc<N>(a), to_int_rne(a), to_float(u)          (int32)trunc(a * 2^N); (int32)rint(a); int32 -> fp32
//   Part, max_bits, block_maxima, hmax                   block maxima of patterns (unsigned), four blocks at once
//   Lut256, set_row, lut     decode: 16 packed 4-bit codes through one of 256 rows of 16 bf16-exact values
//   load_enc, enc_index      the encoder's lane order: a block loaded in that order, and each lane's element
//   store_codes              16 codes (0..15, encoder's lane order) packed into 8 bytes (fp4_codec.h layout)
#pragma once

#define FP4_SIMD_FN static inline __attribute__((always_inline))

// The SVE build takes the NEON layer too: every SVE core has Advanced SIMD, and on the 128-bit SVE of Grace's
// Neoverse V2 a NEON register is as wide as an SVE one; an SVE layer would pay off on wider vectors only.
#if defined(__aarch64__) && defined(__ARM_NEON)
#include "cpu/simd_neon.h"
#define FP4_SIMD_LAYER 1
#elif defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__AVX512VBMI__) && defined(__BMI2__)
#include "cpu/simd_avx512.h"
#define FP4_SIMD_LAYER 1
#define FP4_SIMD_AVX512 1
#elif defined(__x86_64__) && defined(__AVX2__) && !defined(__AVX512F__)
#include "cpu/simd_avx2.h"
#define FP4_SIMD_LAYER 1
#else
#define FP4_SIMD_LAYER 0
#endif
#ifndef FP4_SIMD_AVX512
#define FP4_SIMD_AVX512 0
#endif

#if FP4_SIMD_LAYER && !FP4_SIMD_HAS_MIN_K
namespace fp4simd {
FP4_SIMD_FN F16 min(F16 a, float k) { return min(a, splat(k)); }
}  // namespace fp4simd
#endif
