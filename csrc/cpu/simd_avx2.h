// The SIMD layer (simd.h, which includes this file in x86 builds with AVX2 and without AVX-512) on AVX2: a
// 16-element block is two 256-bit registers.
//
// Decode looks a 16-value table row up with two lane permutes (vpermps, which reads the low 3 bits of each index)
// and a blend on bit 3 of the code, each lane's nibble shifted into place by a per-lane shift. The encoder reads
// a block in element order; the codes pack with one saturating pack, one multiply-add (pairs of codes into bytes)
// and one byte shuffle.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "fp4_codec.h"

namespace fp4simd {

struct F16 {
  __m256 v[2];
};
struct U16 {
  __m256i v[2];
};
using Part = __m256i;  // a partial block maximum (8 lanes)

#define FP4_SIMD_MAP_F(name, expr) \
  FP4_SIMD_FN F16 name(F16 a, F16 b) { \
    F16 r; \
    for (int k = 0; k < 2; ++k) r.v[k] = expr; \
    return r; \
  }
#define FP4_SIMD_MAP_U(name, expr) \
  FP4_SIMD_FN U16 name(U16 a, U16 b) { \
    U16 r; \
    for (int k = 0; k < 2; ++k) r.v[k] = expr; \
    return r; \
  }

FP4_SIMD_MAP_F(add, _mm256_add_ps(a.v[k], b.v[k]))
FP4_SIMD_MAP_F(sub, _mm256_sub_ps(a.v[k], b.v[k]))
FP4_SIMD_MAP_F(mul, _mm256_mul_ps(a.v[k], b.v[k]))
FP4_SIMD_MAP_F(div, _mm256_div_ps(a.v[k], b.v[k]))
// vminps returns its second operand when either is NaN or both are zeros, so the two operand orders differ only
// there: their OR is the NaN (a NaN ORed with any pattern stays a NaN) or -0 for min(-0, +0), as FMIN gives.
FP4_SIMD_MAP_F(min, _mm256_or_ps(_mm256_min_ps(a.v[k], b.v[k]), _mm256_min_ps(b.v[k], a.v[k])))
// min with a constant k (neither NaN nor zero): vminps(k, a) returns a when a is a NaN, so one instruction
#define FP4_SIMD_HAS_MIN_K 1
FP4_SIMD_FN F16 min(F16 a, float k) {
  const __m256 s = _mm256_set1_ps(k);
  return F16{{_mm256_min_ps(s, a.v[0]), _mm256_min_ps(s, a.v[1])}};
}
// max: the AND of both orders gives +0 for max(-0, +0); an unordered pair gives all ones (a NaN)
FP4_SIMD_MAP_F(max, _mm256_or_ps(_mm256_and_ps(_mm256_max_ps(a.v[k], b.v[k]), _mm256_max_ps(b.v[k], a.v[k])),
                                 _mm256_cmp_ps(a.v[k], b.v[k], _CMP_UNORD_Q)))
FP4_SIMD_MAP_U(iand, _mm256_and_si256(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(ior, _mm256_or_si256(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(ixor, _mm256_xor_si256(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(iadd, _mm256_add_epi32(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(isub, _mm256_sub_epi32(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(imul, _mm256_mullo_epi32(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(umax, _mm256_max_epu32(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(umin, _mm256_min_epu32(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(smax, _mm256_max_epi32(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(ieq, _mm256_cmpeq_epi32(a.v[k], b.v[k]))
// unsigned a - b saturating at 0: max(a, b) - b (AVX2 has no 32-bit saturating subtract)
FP4_SIMD_MAP_U(isub_sat, _mm256_sub_epi32(_mm256_max_epu32(a.v[k], b.v[k]), b.v[k]))
#undef FP4_SIMD_MAP_F
#undef FP4_SIMD_MAP_U

FP4_SIMD_FN F16 splat(float x) {
  const __m256 s = _mm256_set1_ps(x);
  return F16{{s, s}};
}
FP4_SIMD_FN U16 splat_u(uint32_t x) {
  const __m256i s = _mm256_set1_epi32((int)x);
  return U16{{s, s}};
}
FP4_SIMD_FN F16 mul(F16 a, float s) {
  const __m256 b = _mm256_set1_ps(s);
  return F16{{_mm256_mul_ps(a.v[0], b), _mm256_mul_ps(a.v[1], b)}};
}
FP4_SIMD_FN F16 sqrt(F16 a) { return F16{{_mm256_sqrt_ps(a.v[0]), _mm256_sqrt_ps(a.v[1])}}; }
FP4_SIMD_FN F16 abs(F16 a) {  // clears the sign bit, NaN included
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return F16{{_mm256_and_ps(a.v[0], m), _mm256_and_ps(a.v[1], m)}};
}
FP4_SIMD_FN F16 neg(F16 a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
  return F16{{_mm256_xor_ps(a.v[0], m), _mm256_xor_ps(a.v[1], m)}};
}
FP4_SIMD_FN U16 bits(F16 a) { return U16{{_mm256_castps_si256(a.v[0]), _mm256_castps_si256(a.v[1])}}; }
FP4_SIMD_FN F16 from_bits(U16 a) { return F16{{_mm256_castsi256_ps(a.v[0]), _mm256_castsi256_ps(a.v[1])}}; }
template <int S>
FP4_SIMD_FN U16 shr(U16 a) {
  return U16{{_mm256_srli_epi32(a.v[0], S), _mm256_srli_epi32(a.v[1], S)}};
}
template <int S>
FP4_SIMD_FN U16 shl(U16 a) {
  return U16{{_mm256_slli_epi32(a.v[0], S), _mm256_slli_epi32(a.v[1], S)}};
}
template <int S>
FP4_SIMD_FN U16 shr_add(U16 a, U16 b) {
  return U16{{_mm256_add_epi32(a.v[0], _mm256_srli_epi32(b.v[0], S)),
              _mm256_add_epi32(a.v[1], _mm256_srli_epi32(b.v[1], S))}};
}
FP4_SIMD_FN U16 lt(F16 a, F16 b) {
  return U16{{_mm256_castps_si256(_mm256_cmp_ps(a.v[0], b.v[0], _CMP_LT_OQ)),
              _mm256_castps_si256(_mm256_cmp_ps(a.v[1], b.v[1], _CMP_LT_OQ))}};
}
// One blend per register, by each lane's top bit: the bitwise select for the all-ones-or-zero lanes of a mask
// (what lt and ieq give).
FP4_SIMD_FN U16 select(U16 mask, U16 x, U16 y) {
  U16 r;
  for (int k = 0; k < 2; ++k)
    r.v[k] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(y.v[k]), _mm256_castsi256_ps(x.v[k]),
                                                  _mm256_castsi256_ps(mask.v[k])));
  return r;
}
// a * 2^N is exact (a power-of-two scale that stays in range), then truncation; a * 2^N must fit an int32
template <int N>
FP4_SIMD_FN U16 fix_trunc(F16 a) {
  const __m256 s = _mm256_set1_ps((float)(1u << N));
  return U16{{_mm256_cvttps_epi32(_mm256_mul_ps(a.v[0], s)), _mm256_cvttps_epi32(_mm256_mul_ps(a.v[1], s))}};
}
// (int32)rint(a): the conversion rounds by MXCSR, nearest even unless a caller changed it
FP4_SIMD_FN U16 to_int_rne(F16 a) { return U16{{_mm256_cvtps_epi32(a.v[0]), _mm256_cvtps_epi32(a.v[1])}}; }
FP4_SIMD_FN F16 to_float(U16 a) {  // lanes as int32
  return F16{{_mm256_cvtepi32_ps(a.v[0]), _mm256_cvtepi32_ps(a.v[1])}};
}

// ---- memory ---------------------------------------------------------------------------------------------

FP4_SIMD_FN F16 load(const float* p) { return F16{{_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}}; }
FP4_SIMD_FN void store(float* p, F16 a) {
  _mm256_storeu_ps(p, a.v[0]);
  _mm256_storeu_ps(p + 8, a.v[1]);
}
FP4_SIMD_FN U16 load_u(const uint32_t* p) {
  return U16{{_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)(p + 8))}};
}
FP4_SIMD_FN F16 load_bf16(const uint16_t* p) {
  const __m256i lo = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  const __m256i hi = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 8)));
  return F16{{_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))}};
}
// fp4master::to_bf16 on 16 lanes: (b + 0x7FFF + lsb) >> 16, a NaN gives 0x7FC0
FP4_SIMD_FN void store_bf16(uint16_t* p, F16 a) {
  __m256i h[2];
  for (int k = 0; k < 2; ++k) {
    const __m256i b = _mm256_castps_si256(a.v[k]);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256 nan = _mm256_cmp_ps(a.v[k], a.v[k], _CMP_UNORD_Q);
    h[k] = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), nan));
  }
  // the pack works per 128-bit half (elements 0-3, 8-11, 4-7, 12-15); the 64-bit permute restores the order
  _mm256_storeu_si256((__m256i*)p, _mm256_permute4x64_epi64(_mm256_packus_epi32(h[0], h[1]), 0xD8));
}
// The low byte of each lane (values 0..255) as 16 bytes, element order.
FP4_SIMD_FN void store_bytes(uint8_t* p, U16 a) {
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(a.v[0], a.v[1]), 0xD8);
  _mm_storeu_si128((__m128i*)p, _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}

// ---- horizontal maxima ----------------------------------------------------------------------------------

// 16 unsigned patterns folded to 8 lanes; block_maxima finishes four blocks at once: two rounds of unpacks and
// vertical maxima leave each block's maximum of each 128-bit half in one lane, a last maximum joins the halves.
FP4_SIMD_FN Part max_bits(U16 a) { return _mm256_max_epu32(a.v[0], a.v[1]); }
FP4_SIMD_FN void block_maxima(Part p0, Part p1, Part p2, Part p3, uint32_t* out4) {
  const __m256i a = _mm256_max_epu32(_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1));
  const __m256i b = _mm256_max_epu32(_mm256_unpacklo_epi32(p2, p3), _mm256_unpackhi_epi32(p2, p3));
  const __m256i c = _mm256_max_epu32(_mm256_unpacklo_epi64(a, b), _mm256_unpackhi_epi64(a, b));
  _mm_storeu_si128((__m128i*)out4, _mm_max_epu32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)));
}
FP4_SIMD_FN uint32_t hmax(U16 a) {
  const __m256i m = max_bits(a);
  __m128i x = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0x4E));
  x = _mm_max_epu32(x, _mm_shuffle_epi32(x, 0xB1));
  return (uint32_t)_mm_cvtsi128_si32(x);
}

// ---- decode: 4-bit codes through a 16-entry table ---------------------------------------------------------

// 256 rows (one per E4M3 scale code) of 16 fp32 values, a row one cache line.
struct Lut256 {
  alignas(64) float row[256][16];
};
FP4_SIMD_FN void set_row(Lut256& t, int s, const float* v16) {
  for (int k = 0; k < 16; ++k) t.row[s][k] = v16[k];
}
// The values of row s at 16 codes packed two a byte (element 2i in the low nibble of byte i), element order.
// Register k holds elements 8k..8k+7, the nibbles of the k-th 32-bit word d: lane j's index is d >> 4j (vpermps
// reads its bits 0-2), and the index shifted left by 28 is the blend's mask (bit 3 of the nibble on top).
FP4_SIMD_FN F16 lut(const Lut256& t, unsigned s, const uint8_t* packed8) {
  const __m256 lo = _mm256_load_ps(t.row[s]), hi = _mm256_load_ps(t.row[s] + 8);
  const __m256i nibble = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  F16 r;
  for (int k = 0; k < 2; ++k) {
    uint32_t w;
    memcpy(&w, packed8 + 4 * k, 4);
    const __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32((int)w), nibble);
    r.v[k] = _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                              _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
  }
  return r;
}

// ---- encode: the encoder's lane order and the nibble packing -------------------------------------------

// The encoder reads blocks in element order.
FP4_SIMD_FN F16 load_enc(const float* p) { return load(p); }
FP4_SIMD_FN U16 enc_index() {
  return U16{{_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)}};
}
// Codes 0..15, element order -> 8 bytes, byte i = c[2i] | c[2i+1] << 4. The pack to 16-bit words keeps each
// pair in one 32-bit lane (halves: codes 0-3 8-11 | 4-7 12-15), the multiply-add joins a pair into a byte, the
// shuffle gathers the bytes of each half and one 16-bit unpack interleaves the halves.
FP4_SIMD_FN void store_codes(uint8_t* out8, U16 c) {
  const __m256i w = _mm256_packus_epi32(c.v[0], c.v[1]);
  const __m256i b = _mm256_madd_epi16(w, _mm256_set1_epi32(0x00100001));  // c[2i] * 1 + c[2i+1] * 16
  const __m256i g = _mm256_shuffle_epi8(b, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                            -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                                            -1, -1, -1, -1));
  _mm_storel_epi64((__m128i*)out8, _mm_unpacklo_epi16(_mm256_castsi256_si128(g), _mm256_extracti128_si256(g, 1)));
}

}  // namespace fp4simd
