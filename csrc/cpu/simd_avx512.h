// The SIMD layer (simd.h, which includes this file in x86 builds with AVX-512 F/BW/VL/DQ/VBMI and BMI2) on
// AVX-512: a 16-element block is one 512-bit register.
//
// Decode is one lane permute (vpermps reads the low 4 bits of each index) of a 16-value table row, the row a
// whole register; the 16 indices come from the 8 code bytes by one multishift (each lane's nibble moved to its
// low bits). Comparisons give AVX-512 masks, widened to all-ones-or-zero lanes so that masks stay U16 values as
// the interface has them; select is one bitwise ternary operation. The encoder reads a block in element order; a
// pair of codes joins in its 64-bit lane and one truncating narrowing packs the 8 bytes.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "fp4_codec.h"

namespace fp4simd {

struct F16 {
  __m512 v;
};
struct U16 {
  __m512i v;
};
using Part = __m512i;  // a block's 16 patterns, folded by block_maxima

#define FP4_SIMD_MAP_F(name, expr) \
  FP4_SIMD_FN F16 name(F16 a, F16 b) { return F16{expr}; }
#define FP4_SIMD_MAP_U(name, expr) \
  FP4_SIMD_FN U16 name(U16 a, U16 b) { return U16{expr}; }

FP4_SIMD_MAP_F(add, _mm512_add_ps(a.v, b.v))
FP4_SIMD_MAP_F(sub, _mm512_sub_ps(a.v, b.v))
FP4_SIMD_MAP_F(mul, _mm512_mul_ps(a.v, b.v))
FP4_SIMD_MAP_F(div, _mm512_div_ps(a.v, b.v))
// vminps returns its second operand when either is NaN or both are zeros, so the two operand orders differ only
// there: their OR is the NaN (a NaN ORed with any pattern stays a NaN) or -0 for min(-0, +0), as FMIN gives.
FP4_SIMD_MAP_F(min, _mm512_or_ps(_mm512_min_ps(a.v, b.v), _mm512_min_ps(b.v, a.v)))
// min with a constant k (neither NaN nor zero): vminps(k, a) returns a when a is a NaN, so one instruction
#define FP4_SIMD_HAS_MIN_K 1
FP4_SIMD_FN F16 min(F16 a, float k) { return F16{_mm512_min_ps(_mm512_set1_ps(k), a.v)}; }
// max: the AND of both orders gives +0 for max(-0, +0); an unordered pair gives all ones (a NaN), the bits the
// AVX2 layer gives
FP4_SIMD_FN F16 max(F16 a, F16 b) {
  const __m512 r = _mm512_and_ps(_mm512_max_ps(a.v, b.v), _mm512_max_ps(b.v, a.v));
  return F16{_mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(a.v, b.v, _CMP_UNORD_Q),
                                _mm512_castsi512_ps(_mm512_set1_epi32(-1)))};
}
FP4_SIMD_MAP_U(iand, _mm512_and_si512(a.v, b.v))
FP4_SIMD_MAP_U(ior, _mm512_or_si512(a.v, b.v))
FP4_SIMD_MAP_U(ixor, _mm512_xor_si512(a.v, b.v))
FP4_SIMD_MAP_U(iadd, _mm512_add_epi32(a.v, b.v))
FP4_SIMD_MAP_U(isub, _mm512_sub_epi32(a.v, b.v))
FP4_SIMD_MAP_U(imul, _mm512_mullo_epi32(a.v, b.v))
FP4_SIMD_MAP_U(umax, _mm512_max_epu32(a.v, b.v))
FP4_SIMD_MAP_U(umin, _mm512_min_epu32(a.v, b.v))
FP4_SIMD_MAP_U(smax, _mm512_max_epi32(a.v, b.v))
FP4_SIMD_MAP_U(ieq, _mm512_movm_epi32(_mm512_cmpeq_epi32_mask(a.v, b.v)))
// unsigned a - b saturating at 0: max(a, b) - b (no 32-bit saturating subtract)
FP4_SIMD_MAP_U(isub_sat, _mm512_sub_epi32(_mm512_max_epu32(a.v, b.v), b.v))
#undef FP4_SIMD_MAP_F
#undef FP4_SIMD_MAP_U

FP4_SIMD_FN F16 splat(float x) { return F16{_mm512_set1_ps(x)}; }
FP4_SIMD_FN U16 splat_u(uint32_t x) { return U16{_mm512_set1_epi32((int)x)}; }
FP4_SIMD_FN F16 mul(F16 a, float s) { return F16{_mm512_mul_ps(a.v, _mm512_set1_ps(s))}; }
FP4_SIMD_FN F16 sqrt(F16 a) { return F16{_mm512_sqrt_ps(a.v)}; }
FP4_SIMD_FN F16 abs(F16 a) {  // clears the sign bit, NaN included
  return F16{_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(0x7FFFFFFF)))};
}
FP4_SIMD_FN F16 neg(F16 a) {
  return F16{_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32((int)0x80000000u)))};
}
FP4_SIMD_FN U16 bits(F16 a) { return U16{_mm512_castps_si512(a.v)}; }
FP4_SIMD_FN F16 from_bits(U16 a) { return F16{_mm512_castsi512_ps(a.v)}; }
template <int S>
FP4_SIMD_FN U16 shr(U16 a) {
  return U16{_mm512_srli_epi32(a.v, S)};
}
template <int S>
FP4_SIMD_FN U16 shl(U16 a) {
  return U16{_mm512_slli_epi32(a.v, S)};
}
template <int S>
FP4_SIMD_FN U16 shr_add(U16 a, U16 b) {
  return U16{_mm512_add_epi32(a.v, _mm512_srli_epi32(b.v, S))};
}
FP4_SIMD_FN U16 lt(F16 a, F16 b) { return U16{_mm512_movm_epi32(_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ))}; }
// The bitwise select (mask ? x : y, bit by bit): one ternary-logic instruction, truth table 0xCA.
FP4_SIMD_FN U16 select(U16 mask, U16 x, U16 y) { return U16{_mm512_ternarylogic_epi32(mask.v, x.v, y.v, 0xCA)}; }
// a * 2^N is exact (a power-of-two scale that stays in range), then truncation; a * 2^N must fit an int32
template <int N>
FP4_SIMD_FN U16 fix_trunc(F16 a) {
  return U16{_mm512_cvttps_epi32(_mm512_mul_ps(a.v, _mm512_set1_ps((float)(1u << N))))};
}
// (int32)rint(a): the conversion rounds by MXCSR, nearest even unless a caller changed it
FP4_SIMD_FN U16 to_int_rne(F16 a) { return U16{_mm512_cvtps_epi32(a.v)}; }
FP4_SIMD_FN F16 to_float(U16 a) { return F16{_mm512_cvtepi32_ps(a.v)}; }  // lanes as int32

// ---- memory ---------------------------------------------------------------------------------------------

FP4_SIMD_FN F16 load(const float* p) { return F16{_mm512_loadu_ps(p)}; }
FP4_SIMD_FN void store(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
FP4_SIMD_FN U16 load_u(const uint32_t* p) { return U16{_mm512_loadu_si512((const void*)p)}; }
FP4_SIMD_FN F16 load_bf16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return F16{_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
// fp4master::to_bf16 on 16 lanes: (b + 0x7FFF + lsb) >> 16, a NaN gives 0x7FC0; every lane then fits 16 bits,
// so the truncating narrowing (vpmovdw) is exact
FP4_SIMD_FN void store_bf16(uint16_t* p, F16 a) {
  const __m512i b = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(r));
}
// The low byte of each lane (values 0..255) as 16 bytes, element order.
FP4_SIMD_FN void store_bytes(uint8_t* p, U16 a) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(a.v)); }

// ---- horizontal maxima ----------------------------------------------------------------------------------

// A block's patterns as they are; block_maxima finishes four blocks at once: two rounds of unpacks and vertical
// maxima leave each block's maximum of each 128-bit quarter in one lane, two more maxima join the quarters.
FP4_SIMD_FN Part max_bits(U16 a) { return a.v; }
FP4_SIMD_FN void block_maxima(Part p0, Part p1, Part p2, Part p3, uint32_t* out4) {
  const __m512i a = _mm512_max_epu32(_mm512_unpacklo_epi32(p0, p1), _mm512_unpackhi_epi32(p0, p1));
  const __m512i b = _mm512_max_epu32(_mm512_unpacklo_epi32(p2, p3), _mm512_unpackhi_epi32(p2, p3));
  const __m512i c = _mm512_max_epu32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
  const __m256i d = _mm256_max_epu32(_mm512_castsi512_si256(c), _mm512_extracti64x4_epi64(c, 1));
  _mm_storeu_si128((__m128i*)out4, _mm_max_epu32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1)));
}
FP4_SIMD_FN uint32_t hmax(U16 a) { return _mm512_reduce_max_epu32(a.v); }

// ---- decode: 4-bit codes through a 16-entry table ---------------------------------------------------------

// 256 rows (one per E4M3 scale code) of 16 fp32 values, a row one cache line.
struct Lut256 {
  alignas(64) float row[256][16];
};
FP4_SIMD_FN void set_row(Lut256& t, int s, const float* v16) {
  for (int k = 0; k < 16; ++k) t.row[s][k] = v16[k];
}
// The values of row s at 16 codes packed two a byte (element 2i in the low nibble of byte i), element order.
// The 8 bytes sit in every 64-bit lane; the multishift gives the low byte of 32-bit lane j the 8 bits from bit 4j
// of its 64-bit lane's copy (bits 0-3: code j), and vpermps reads those 4 bits.
FP4_SIMD_FN F16 lut(const Lut256& t, unsigned s, const uint8_t* packed8) {
  int64_t w;
  memcpy(&w, packed8, 8);
  const __m512i ctrl = _mm512_set_epi64(0x3C00000038LL, 0x3400000030LL, 0x2C00000028LL, 0x2400000020LL,
                                        0x1C00000018LL, 0x1400000010LL, 0x0C00000008LL, 0x0400000000LL);
  const __m512i idx = _mm512_multishift_epi64_epi8(ctrl, _mm512_set1_epi64(w));
  return F16{_mm512_permutexvar_ps(idx, _mm512_load_ps(t.row[s]))};
}

// ---- encode: the encoder's lane order and the nibble packing -------------------------------------------

// The encoder reads blocks in element order.
FP4_SIMD_FN F16 load_enc(const float* p) { return load(p); }
FP4_SIMD_FN U16 enc_index() {
  return U16{_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)};
}
// Codes 0..15, element order -> 8 bytes, byte i = c[2i] | c[2i+1] << 4: 64-bit lane i holds c[2i] | c[2i+1] << 32,
// so (q | q >> 28) has the byte in its low 8 bits, and the truncating narrowing (vpmovqb) keeps those.
FP4_SIMD_FN void store_codes(uint8_t* out8, U16 c) {
  const __m512i q = _mm512_or_si512(c.v, _mm512_srli_epi64(c.v, 28));
  _mm_storel_epi64((__m128i*)out8, _mm512_cvtepi64_epi8(q));
}

}  // namespace fp4simd
