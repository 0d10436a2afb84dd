// AVX-512 building blocks for the NVFP4 and MX paths (round to nearest and stochastic rounding; fp32, bf16 and fp16
// sources). They produce the same bytes as the scalar rules in fp4_codec.h (tests compare both with the switch
// set_simd(False)).
#pragma once

#include <algorithm>
#include <atomic>
#include <vector>

#if !defined(FP4_STANDALONE)  // the torch extensions (the standalone driver has no AVX-512 code and no torch)
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#endif

#include "fp4_codec.h"
#include "cpu/isa.h"

// The AVX-512 paths use F, BW, VL, DQ (vrangeps), VBMI (vpermb, vpmultishiftqb) and BMI2 (pdep).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__AVX512VBMI__) && defined(__BMI2__) && !defined(FP4_STANDALONE)
#define FP4_HAVE_AVX512 1
#include <immintrin.h>
#else
#define FP4_HAVE_AVX512 0
#endif

namespace fp4cpu {

// The AVX-512 paths run in the AVX-512 build while its vector path is on (isa.h).
inline bool have_avx512() { return FP4_HAVE_AVX512 != 0 && have_simd(); }

#if FP4_HAVE_AVX512

#define FP4_INLINE static inline __attribute__((always_inline))

// E2M1 magnitude codes, round to nearest even, of a = min(|y|, 6) (a finite): the integer rounding of the
// fp32 pattern for a >= 1 (the "- (126 << 1)" folded into the rounding constant), rint(2a) below 1.
FP4_INLINE __m512i e2m1_mag16(__m512 a) {
  const __m512i ai = _mm512_castps_si512(a);
  const __m512i sub = _mm512_cvt_roundps_epi32(_mm512_add_ps(a, a), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(ai, 22), _mm512_set1_epi32(1));
  const __m512i nrm = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(ai, _mm512_set1_epi32(0x1FFFFF - (252 << 22))), lsb), 22);
  const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.0f), _CMP_LT_OQ);
  return _mm512_mask_blend_epi32(small, nrm, sub);  // <= 7 since a <= 6
}

// Magnitude+sign E2M1 codes of 16 scaled values y (nearest, ties to even): fp4::e2m1_encode on every lane
// whose y is not NaN (the callers encode finite blocks only).
FP4_INLINE __m512i e2m1_codes16(__m512 y) {
  const __m512 a = _mm512_range_ps(y, _mm512_set1_ps(fp4::kE2M1Max), 0x0A);  // min(|y|, 6), sign cleared
  // mag | ((y >> 28) & 8)
  return _mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(y), 28), _mm512_set1_epi32(8), e2m1_mag16(a),
                                   0xEA);
}

// fp4::sr_bits on 16 consecutive element indices idx0 .. idx0 + 15 (idx0 is the low 32 bits; blocks never
// straddle 2^32, so the lanes do not wrap). (idx0 + k) * G + key = (idx0 * G + key) + k * G modulo 2^32, so
// the per-lane multiply is a broadcast and an add of the constant k * G.
static inline __m512i sr_bits16(uint32_t key, uint32_t idx0) {
  constexpr uint32_t G = 0x9E3779B1u;
  const __m512i kg = _mm512_setr_epi32(0, (int)G, (int)(2 * G), (int)(3 * G), (int)(4 * G), (int)(5 * G),
                                       (int)(6 * G), (int)(7 * G), (int)(8 * G), (int)(9 * G), (int)(10 * G),
                                       (int)(11 * G), (int)(12 * G), (int)(13 * G), (int)(14 * G), (int)(15 * G));
  __m512i h = _mm512_add_epi32(_mm512_set1_epi32((int)(idx0 * G + key)), kg);
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0x85EBCA6Bu));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0xC2B2AE35u));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

// Stochastic E2M1 codes of 16 scaled values (fp4::e2m1_encode_mag_sr on every lane, sign from y): the
// fixed-point grid position X plus the top 22 random bits, shifted down by 22. Lanes where y is not finite
// get junk codes; the callers zero those blocks.
static inline __m512i e2m1_codes16_sr(__m512 y, __m512i rnd) {
  const __m512 a = _mm512_range_ps(y, _mm512_set1_ps(6.0f), 0x0A);  // min(|y|, 6), sign cleared
  const __m512i nrm = _mm512_sub_epi32(_mm512_castps_si512(a), _mm512_set1_epi32(126 << 23));
  const __m512i sub = _mm512_cvttps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(8388608.0f)));
  const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.0f), _CMP_LT_OQ);
  const __m512i x = _mm512_mask_blend_epi32(small, nrm, sub);
  const __m512i mag = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_srli_epi32(rnd, 10)), 22);
  // mag | ((y >> 28) & 8)
  return _mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_castps_si512(y), 28), _mm512_set1_epi32(8), mag, 0xEA);
}

// ---- the packed layout, SIMD form -------------------------------------------------------------------
//
// The rule of fp4_codec.h's "packed layout" section (element 2i in bits 0-3 of byte i, element 2i+1 in
// bits 4-7) on vectors of codes, one int32 lane a code. Every AVX-512 path packs and unpacks through these
// three; tests compare them with the scalar fp4::pack_codes / fp4::code_at (set_avx512(False)).

// 16 codes (int32 lanes holding 0..15, nothing above bit 3) -> 8 packed bytes as a little-endian word.
// Each 64-bit lane holds the pair (element 2i, element 2i+1): shifting it right by 28 brings the odd code
// next to the even one, and vpmovqb keeps the low byte of each pair.
FP4_INLINE uint64_t pack16(__m512i codes) {
  const __m512i pairs = _mm512_or_si512(codes, _mm512_srli_epi64(codes, 28));
  return (uint64_t)_mm_cvtsi128_si64(_mm512_cvtepi64_epi8(pairs));
}

// 4 vectors of 16 codes (as for pack16; blocks b..b+3) -> 32 packed bytes, pack16 of each in turn, in the
// low 256 bits. packus twice gives bytes [blk0 4L..4L+3, blk1 .., blk2 .., blk3 ..] per 128-bit lane L;
// maddubs merges neighbour pairs into one byte per word; vpermb puts the words' low bytes in order.
FP4_INLINE __m256i pack64(__m512i c0, __m512i c1, __m512i c2, __m512i c3) {
  const __m512i p = _mm512_packus_epi16(_mm512_packus_epi32(c0, c1), _mm512_packus_epi32(c2, c3));
  const __m512i w = _mm512_maddubs_epi16(p, _mm512_set1_epi16(0x1001));
  // output byte 8k + j (block k, byte j) <- word (16*(j>>1) + 4k + 2*(j&1)) / 2 -> its byte index
  const __m512i idx = _mm512_set_epi64(0, 0, 0, 0, 0x3E3C2E2C1E1C0E0CLL, 0x3A382A281A180A08LL,
                                       0x3634262416140604LL, 0x3230222012100200LL);
  return _mm512_castsi512_si256(_mm512_permutexvar_epi8(idx, w));
}

// 8 packed bytes -> 16 int32 lanes, lane j holding the code of element j in bits 0-3. The bits above are
// those of the next codes: _mm512_permutexvar_ps/_epi32 read only bits 0-3 of an index, so a lookup in a
// 16-entry table takes the lanes as they are (mask with 0xF for the bare codes). One broadcast and one
// multishift: dword k (qword k/2, byte 4*(k%2)) takes the 8 bits at offset 4k of its qword.
FP4_INLINE __m512i unpack16(const uint8_t* in) {
  uint64_t w;
  memcpy(&w, in, 8);
  const __m512i sel = _mm512_set_epi64(0x0000003C00000038LL, 0x0000003400000030LL, 0x0000002C00000028LL,
                                       0x0000002400000020LL, 0x0000001C00000018LL, 0x0000001400000010LL,
                                       0x0000000C00000008LL, 0x0000000400000000LL);
  return _mm512_multishift_epi64_epi8(sel, _mm512_set1_epi64((long long)w));
}


#endif  // FP4_HAVE_AVX512

#if FP4_HAVE_AVX512

// 16 values (the first `cnt` from p, the rest 0) as fp32 lanes. bf16 and fp16 widen exactly.
static inline __m512 load16(const float* p, int cnt) {
  return _mm512_maskz_loadu_ps((__mmask16)((1u << cnt) - 1), p);
}
static inline __m512 load16(const c10::BFloat16* p, int cnt) {
  const __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << cnt) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline __m512 load16(const c10::Half* p, int cnt) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << cnt) - 1), p));
}

// Store the first `cnt` lanes, rounding to the destination dtype as torch does (nearest even).
static inline void store16(float* p, __m512 v, int cnt) {
  _mm512_mask_storeu_ps(p, (__mmask16)((1u << cnt) - 1), v);
}
static inline void store16(c10::BFloat16* p, __m512 v, int cnt) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, (__mmask16)((1u << cnt) - 1), _mm512_cvtepi32_epi16(r));
}
static inline void store16(c10::Half* p, __m512 v, int cnt) {
  _mm256_mask_storeu_epi16(p, (__mmask16)((1u << cnt) - 1), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// Finite amax and non-finite count over `nrows` rows of `cnt` values, `stride` elements apart.
template <typename T>
static inline void amax_rows16(const T* p, int64_t stride, int nrows, int cnt, float& amax, int32_t& bad) {
  const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF), expmask = _mm512_set1_epi32(0x7F800000);
  __m512 m = _mm512_setzero_ps();
  int32_t nb = 0;
  for (int r = 0; r < nrows; ++r) {
    const __m512i v = _mm512_castps_si512(load16(p + r * stride, cnt));
    const __mmask16 nonfin = _mm512_cmpeq_epi32_mask(_mm512_and_si512(v, expmask), expmask);
    m = _mm512_max_ps(m, _mm512_castsi512_ps(_mm512_maskz_and_epi32((__mmask16)~nonfin, v, absmask)));
    nb += __builtin_popcount((unsigned)nonfin);
  }
  amax = _mm512_reduce_max_ps(m);
  bad = nb;
}

// Lane b = max over the 16 lanes of v[b], for 16 vectors (a transpose tree: 15 max + 30 shuffles instead of
// 16 horizontal reductions). Max is exact, so any order of comparisons gives the same result.
static inline __m512 block_max16x16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) {  // t[i]: lanes 0-7 partial maxes of v[2i], lanes 8-15 of v[2i+1]
    const __m512 x = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 y = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2));
    t[i] = _mm512_max_ps(x, y);
  }
  for (int i = 0; i < 4; ++i) {  // u[i]: 128-bit lane q holds 4 partial maxes of block 4i + q
    const __m512 x = _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 y = _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1));
    u[i] = _mm512_max_ps(x, y);
  }
  for (int i = 0; i < 2; ++i) {  // w[i]: lane q, elements 0-1 block 8i + q, elements 2-3 block 8i + 4 + q
    const __m512 x = _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 y = _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2));
    w[i] = _mm512_max_ps(x, y);
  }
  const __m512 x = _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0));
  const __m512 y = _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1));
  const __m512 r = _mm512_max_ps(x, y);  // element 4q + j holds block 4j + q
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// fp4::e4m3_encode(x) for 16 lanes of x >= 0 (not NaN).
static inline __m512i e4m3_codes16_pos(__m512 x) {
  const __m512 a = _mm512_min_ps(x, _mm512_set1_ps(fp4::kE4M3Max));
  const __m512i ai = _mm512_castps_si512(a);
  const __m512i sub = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(512.0f)),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(ai, 20), _mm512_set1_epi32(1));
  __m512i nrm = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(ai, _mm512_set1_epi32(0x7FFFF)), lsb), 20);
  nrm = _mm512_sub_epi32(nrm, _mm512_set1_epi32(120 << 3));
  const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ);
  return _mm512_min_epi32(_mm512_mask_blend_epi32(small, nrm, sub), _mm512_set1_epi32(0x7E));
}

// fp4::e4m3_value(code) for 16 lanes of codes 0..0x7E.
static inline __m512 e4m3_values16_pos(__m512i c) {
  const __m512i e = _mm512_srli_epi32(c, 3), m = _mm512_and_si512(c, _mm512_set1_epi32(7));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(0.001953125f));
  const __m512i nrm = _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23),
                                      _mm512_slli_epi32(m, 20));
  const __mmask16 is_sub = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
  return _mm512_mask_blend_ps(is_sub, _mm512_castsi512_ps(nrm), sub);
}

// The E4M3 scales of 16 blocks, E4M3(min((amax_b / elem_max) * s_enc, 448)), stored for the first `cnt`
// blocks; kb[b] = 1 / (scale * s_dec) clamped as fp4::block_encode_scale does, 0 where the block is dead
// (a zero scale, or not in `ok`). Returns the live blocks.
static inline __mmask16 block_scales16(__m512 amax16, __m512 vmax, __m512 venc, __m512 vdec, __mmask16 ok, int cnt,
                                       uint8_t* scales, float* kb) {
  const __m512i sc = e4m3_codes16_pos(_mm512_mul_ps(_mm512_div_ps(amax16, vmax), venc));
  const __mmask16 live = _mm512_cmpneq_epi32_mask(sc, _mm512_setzero_si512()) & ok;
  const __m512 k = _mm512_maskz_div_ps(live, _mm512_set1_ps(1.0f), _mm512_mul_ps(e4m3_values16_pos(sc), vdec));
  _mm512_store_ps(kb, _mm512_min_ps(k, _mm512_set1_ps(fp4::kF32Max)));
  const __m128i sc8 = _mm512_cvtepi32_epi8(sc);
  if (cnt == 16)
    _mm_storeu_si128((__m128i*)scales, sc8);
  else
    _mm_mask_storeu_epi8(scales, (__mmask16)((1u << cnt) - 1), sc8);
  return live;
}

// Finite amax and non-finite count of each of 16 consecutive whole 1x16 blocks at p (amax_rows16 on each,
// with one transpose tree instead of 16 horizontal reductions).
template <typename T>
static inline void amax_blocks16(const T* p, float* amax, int32_t* bad) {
  const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF), expmask = _mm512_set1_epi32(0x7F800000);
  __m512 a[16];
  for (int j = 0; j < 16; ++j) {
    const __m512i v = _mm512_castps_si512(load16(p + 16 * j, 16));
    const __mmask16 nonfin = _mm512_cmpeq_epi32_mask(_mm512_and_si512(v, expmask), expmask);
    a[j] = _mm512_castsi512_ps(_mm512_maskz_and_epi32((__mmask16)~nonfin, v, absmask));
    bad[j] = __builtin_popcount((unsigned)nonfin);
  }
  _mm512_storeu_ps(amax, block_max16x16(a));
}

// ufp4 codes of 16 scaled values: |y| clamped to 1.5, below 2^-7 -> code 0, else one mantissa bit, ties to even.
static inline __m512i ufp4_codes16(__m512 y) {
  const __m512 a = _mm512_min_ps(_mm512_abs_ps(y), _mm512_set1_ps(1.5f));
  const __m512i ai = _mm512_castps_si512(a);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(ai, 22), _mm512_set1_epi32(1));
  __m512i c = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(ai, _mm512_set1_epi32(0x1FFFFF)), lsb), 22);
  c = _mm512_sub_epi32(c, _mm512_set1_epi32(120 << 1));
  const __mmask16 tiny = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.0078125f), _CMP_LT_OQ);
  c = _mm512_mask_blend_epi32(tiny, c, _mm512_setzero_si512());
  return _mm512_min_epi32(_mm512_max_epi32(c, _mm512_setzero_si512()), _mm512_set1_epi32(15));
}

// Stochastic codes of 16 scaled values on the unsigned grid with MB mantissa bits (fp4::ugrid_encode_sr on
// every lane): |y| clamped to the grid's top, the pattern less (bias << 23) plus the top 23 - MB random bits,
// shifted down by 23 - MB; below the grid's smallest value code 0. MB 1 is ufp4.
template <int MB>
static inline __m512i ugrid_codes16_sr(__m512 y, __m512i rnd) {
  constexpr int kShift = 23 - MB;
  const __m512 a = _mm512_min_ps(_mm512_abs_ps(y), _mm512_set1_ps(fp4::ugrid_max(MB)));
  const __m512i x = _mm512_sub_epi32(_mm512_castps_si512(a), _mm512_set1_epi32((int)(fp4::ugrid_bias(MB) << 23)));
  const __m512i c = _mm512_srai_epi32(_mm512_add_epi32(x, _mm512_srli_epi32(rnd, 32 - kShift)), kShift);
  const __mmask16 tiny = _mm512_cmp_ps_mask(a, _mm512_set1_ps(fp4::ugrid_min(MB)), _CMP_LT_OQ);
  return _mm512_maskz_mov_epi32((__mmask16)~tiny, c);
}

static inline __m512i ufp4_codes16_sr(__m512 y, __m512i rnd) { return ugrid_codes16_sr<1>(y, rnd); }

// NVFP4 or ufp4 codes of 16 scaled values, nearest or stochastic (bits sr_bits(key, idx0 + j)).
FP4_INLINE __m512i nv_codes16(__m512 y, bool ufp4, bool stochastic, uint32_t key, uint32_t idx0) {
  if (ufp4) return stochastic ? ufp4_codes16_sr(y, sr_bits16(key, idx0)) : ufp4_codes16(y);
  return stochastic ? e2m1_codes16_sr(y, sr_bits16(key, idx0)) : e2m1_codes16(y);
}

// E4M3 codes of 16 values (nearest even, saturating at 448, sign kept), as int32 lanes.
static inline __m512i e4m3_codes16(__m512 y) {
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(y), 24), _mm512_set1_epi32(0x80));
  return _mm512_or_si512(e4m3_codes16_pos(_mm512_abs_ps(y)), sign);
}

// fp32 values of 16 E4M3 codes (int32 lanes): normal, subnormal (m * 2^-9) and NaN (0x7F/0xFF).
static inline __m512 e4m3_values16(__m512i c) {
  const __m512i e = _mm512_and_si512(_mm512_srli_epi32(c, 3), _mm512_set1_epi32(0xF));
  const __m512i m = _mm512_and_si512(c, _mm512_set1_epi32(7));
  const __m512i nrm = _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23),
                                      _mm512_slli_epi32(m, 20));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(0.001953125f));
  const __mmask16 is_sub = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
  __m512 mag = _mm512_mask_blend_ps(is_sub, _mm512_castsi512_ps(nrm), sub);
  const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(c, _mm512_set1_epi32(0x7F)), _mm512_set1_epi32(0x7F));
  mag = _mm512_mask_blend_ps(nan, mag, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000)));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
}

// NVFP4 (or ufp4) codes of 16 values times the block multiplier k, packed into 8 bytes; stochastic rounding
// draws from sr_bits(key, idx0 + j).
template <typename T>
static inline void encode_row16(const T* p, int cnt, float k, bool ufp4, bool stochastic, uint32_t key, uint32_t idx0,
                                uint8_t* out) {
  const __m512 y = _mm512_mul_ps(load16(p, cnt), _mm512_set1_ps(k));
  const __m512i codes = nv_codes16(y, ufp4, stochastic, key, idx0);
  const uint64_t packed = pack16(codes);
  memcpy(out, &packed, 8);
}

// Decode 8 packed bytes through a 16-entry table (value(code) * scale_b * s_dec, computed as the rule says).
template <typename T>
static inline void decode_row16(const uint8_t* in, __m512 table, int cnt, T* out) {
  store16(out, _mm512_permutexvar_ps(unpack16(in), table), cnt);
}

static inline __m512 decode_table16(bool ufp4, float scale_b, float s_dec) {
  alignas(64) float t[16];
  for (int c = 0; c < 16; ++c) t[c] = ufp4 ? fp4::ufp4_value((uint8_t)c) : fp4::e2m1_value((uint8_t)c);
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(t), _mm512_set1_ps(scale_b)), _mm512_set1_ps(s_dec));
}

// One MX block of 32: returns the non-finite count; writes the E8M0 scale and the codes.
template <typename T>
static inline int mx_block32(const T* p, int cnt, bool fp8, bool floor_mode, bool propagate, bool stochastic,
                             uint32_t key, uint32_t idx0, uint8_t* scale, uint8_t* out) {
  const int c0 = cnt < 16 ? cnt : 16, c1 = cnt > 16 ? cnt - 16 : 0;
  const __m512 v0 = load16(p, c0), v1 = load16(p + 16, c1);
  const __m512i expmask = _mm512_set1_epi32(0x7F800000);
  const __mmask16 n0 = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v0), expmask), expmask);
  const __mmask16 n1 = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v1), expmask), expmask);
  const int bad = __builtin_popcount((unsigned)n0) + __builtin_popcount((unsigned)n1);
  const __m512 a = _mm512_max_ps(_mm512_mask_abs_ps(_mm512_setzero_ps(), (__mmask16)~n0, v0), _mm512_mask_abs_ps(_mm512_setzero_ps(), (__mmask16)~n1, v1));
  const float amax = _mm512_reduce_max_ps(a);
  const int32_t e = fp8 ? fp4::mx_exponent(amax, 0x600000u, 8, floor_mode) : fp4::mx_exponent(amax, 0x400000u, 2, floor_mode);
  *scale = (bad && propagate) ? fp4::kE8M0NaN : (uint8_t)(e + 127);
  if (bad) {
    memset(out, 0, fp8 ? 32 : 16);
    return bad;
  }
  const __m512 inv = _mm512_set1_ps(fp4::pow2(-e));
  if (fp8) {
    _mm_storeu_si128((__m128i*)out, _mm512_cvtepi32_epi8(e4m3_codes16(_mm512_mul_ps(v0, inv))));
    _mm_storeu_si128((__m128i*)(out + 16), _mm512_cvtepi32_epi8(e4m3_codes16(_mm512_mul_ps(v1, inv))));
  } else {
    const __m512 y0 = _mm512_mul_ps(v0, inv), y1 = _mm512_mul_ps(v1, inv);
    const uint64_t lo = pack16(stochastic ? e2m1_codes16_sr(y0, sr_bits16(key, idx0)) : e2m1_codes16(y0));
    const uint64_t hi = pack16(stochastic ? e2m1_codes16_sr(y1, sr_bits16(key, idx0 + 16)) : e2m1_codes16(y1));
    memcpy(out, &lo, 8);
    memcpy(out + 8, &hi, 8);
  }
  return 0;
}

// Decode one MX block of 32 (cnt valid) with scale value sv.
template <typename T>
static inline void mx_decode32(const uint8_t* in, bool fp8, float sv, int cnt, T* out) {
  const int c0 = cnt < 16 ? cnt : 16, c1 = cnt > 16 ? cnt - 16 : 0;
  const __m512 s = _mm512_set1_ps(sv);
  if (fp8) {
    const __m512 v0 = _mm512_mul_ps(e4m3_values16(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)in))), s);
    store16(out, v0, c0);
    if (c1) store16(out + 16, _mm512_mul_ps(e4m3_values16(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(in + 16)))), s), c1);
  } else {
    const __m512 table = _mm512_mul_ps(_mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f,
                                                      -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f), s);
    decode_row16(in, table, c0, out);
    if (c1) decode_row16(in + 8, table, c1, out + 16);
  }
}


#endif  // FP4_HAVE_AVX512

}  // namespace fp4cpu
