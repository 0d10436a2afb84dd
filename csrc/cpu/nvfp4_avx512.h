// AVX-512 kernels for the hot NVFP4 paths (1x16 blocks, fp32, round to nearest). They produce the same
// bytes as the scalar rules in fp4_codec.h (tests compare them with the switch set_avx512(False)).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "fp4_codec.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FP4_HAVE_AVX512 1
#include <immintrin.h>
#else
#define FP4_HAVE_AVX512 0
#endif

namespace fp4cpu {

inline std::atomic<bool>& avx512_enabled() {
  static std::atomic<bool> on{FP4_HAVE_AVX512 != 0};
  return on;
}
inline bool have_avx512() { return avx512_enabled().load(std::memory_order_relaxed); }
inline bool set_avx512(bool on) {
  avx512_enabled().store(on && FP4_HAVE_AVX512 != 0);
  return have_avx512();
}

#if FP4_HAVE_AVX512

// Magnitude+sign E2M1 codes of 16 scaled values y (nearest, ties to even): the integer rounding of
// fp4::e2m1_encode_mag on every lane.
static inline __m512i e2m1_codes16(__m512 y) {
  const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i yi = _mm512_castps_si512(y);
  const __m512 a = _mm512_min_ps(_mm512_castsi512_ps(_mm512_and_si512(yi, absmask)), _mm512_set1_ps(6.0f));
  const __m512i ai = _mm512_castps_si512(a);
  // a < 1: round(a * 2) on the integer grid, ties to even
  const __m512i sub = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(2.0f)),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // a >= 1: round the fp32 pattern to one mantissa bit, ties to even
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(ai, 22), _mm512_set1_epi32(1));
  __m512i nrm = _mm512_add_epi32(_mm512_add_epi32(ai, _mm512_set1_epi32(0x1FFFFF)), lsb);
  nrm = _mm512_sub_epi32(_mm512_srli_epi32(nrm, 22), _mm512_set1_epi32(126 << 1));
  const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.0f), _CMP_LT_OQ);
  __m512i mag = _mm512_mask_blend_epi32(small, nrm, sub);
  mag = _mm512_min_epi32(mag, _mm512_set1_epi32(7));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(yi, 28), _mm512_set1_epi32(8));
  return _mm512_or_si512(mag, sign);
}

// 16 codes (int32 lanes, 0..15) -> 8 packed bytes, element 2i in the low nibble.
static inline uint64_t pack16(__m512i codes) {
  const __m128i b = _mm512_cvtepi32_epi8(codes);  // 16 bytes
  const __m128i lo = _mm_and_si128(b, _mm_set1_epi16(0x00FF));
  const __m128i hi = _mm_srli_epi16(b, 8);
  const __m128i w = _mm_or_si128(lo, _mm_slli_epi16(hi, 4));  // 8 words, each < 256
  return (uint64_t)_mm_cvtsi128_si64(_mm_packus_epi16(w, w));
}

// Horizontal max of 16 blocks at once: returns lane b = max over v[b][0..15].
static inline __m512 block_max16(const __m512* v) {
  // transpose-tree: pairwise combine with shuffles so each step halves the number of vectors
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    // lanes (0..7 of a ; 8..15 of a) vs b: max of a.lo/a.hi pairs interleaved per 128-bit lane
    const __m512 x = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 y = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    t[i] = _mm512_max_ps(x, y);  // [a:8 partial maxes in lanes 0-7][b: 8 in lanes 8-15]
  }
  for (int i = 0; i < 4; ++i) {
    const __m512 a = t[2 * i], b = t[2 * i + 1];
    const __m512 x = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 y = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    u[i] = _mm512_max_ps(x, y);  // per 128-bit lane: 4 partial maxes of one block; lanes = blocks a0,a1,b0,b1...
  }
  for (int i = 0; i < 2; ++i) {
    const __m512 a = u[2 * i], b = u[2 * i + 1];
    const __m512 x = _mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 y = _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    w[i] = _mm512_max_ps(x, y);
  }
  const __m512 x = _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0));
  const __m512 y = _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1));
  return _mm512_max_ps(x, y);  // lanes hold the 16 block maxes in a fixed permuted order
}

#endif  // FP4_HAVE_AVX512

// Pass 1 + 2 of NVFP4 1x16 encode of fp32, nearest rounding.
inline void nvfp4_encode_f32_avx512(const float* x, int64_t n, int64_t scope, bool propagate, uint8_t* data,
                                    uint8_t* scales, std::vector<float>& s_dec_out, int64_t& nonfinite) {
#if FP4_HAVE_AVX512
  const int64_t nb = (n + 15) / 16;
  const int64_t per = scope ? scope / 16 : std::max<int64_t>(nb, 1);
  const int64_t nscopes = std::max<int64_t>((nb + per - 1) / per, 1);
  std::vector<float> amax_b(nb);
  std::vector<uint8_t> bad_b(nb);
  const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i expmask = _mm512_set1_epi32(0x7F800000);
  std::atomic<int64_t> bad_count{0};
  // pass 1: block amax over finite values, count of non-finite values
  at::parallel_for(0, nb, 4096, [&](int64_t b0, int64_t b1) {
    int64_t bad_local = 0;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i0 = b * 16;
      const int cnt = (int)std::min<int64_t>(16, n - i0);
      const __mmask16 lm = cnt == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cnt) - 1);
      const __m512i v = _mm512_maskz_loadu_epi32(lm, x + i0);
      const __mmask16 nonfin = _mm512_cmpeq_epi32_mask(_mm512_and_si512(v, expmask), expmask);
      const __m512 a = _mm512_castsi512_ps(_mm512_maskz_and_epi32((__mmask16)~nonfin, v, absmask));
      amax_b[b] = _mm512_reduce_max_ps(a);
      const int nbad = __builtin_popcount((unsigned)nonfin);
      bad_b[b] = (uint8_t)(nbad != 0);
      bad_local += nbad;
    }
    bad_count += bad_local;
  });
  nonfinite = bad_count.load();
  if (nonfinite && !propagate) return;
  std::vector<float> amax_s(nscopes, 0.0f);
  for (int64_t b = 0; b < nb; ++b) amax_s[b / per] = fp4::fmax_(amax_s[b / per], amax_b[b]);
  std::vector<fp4::TensorScale> ts(nscopes);
  s_dec_out.resize(nscopes);
  for (int64_t s = 0; s < nscopes; ++s) {
    ts[s] = fp4::tensor_scale(amax_s[s], fp4::kE2M1Max);
    s_dec_out[s] = ts[s].dec;
  }
  // pass 2: block scales and codes
  at::parallel_for(0, nb, 4096, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const fp4::TensorScale& s = ts[b / per];
      uint8_t sc = fp4::block_scale_code(amax_b[b], fp4::kE2M1Max, s.enc);
      const bool live = sc != 0 && !bad_b[b];
      if (bad_b[b]) sc = fp4::kE4M3NaN;
      scales[b] = sc;
      uint64_t packed = 0;
      if (live) {
        const float k = fp4::block_encode_scale(sc, s.dec);
        const int64_t i0 = b * 16;
        const int cnt = (int)std::min<int64_t>(16, n - i0);
        const __mmask16 lm = cnt == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cnt) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(lm, x + i0);
        packed = pack16(e2m1_codes16(_mm512_mul_ps(v, _mm512_set1_ps(k))));
      }
      memcpy(data + b * 8, &packed, 8);
    }
  });
#else
  (void)x; (void)n; (void)scope; (void)propagate; (void)data; (void)scales; (void)s_dec_out; (void)nonfinite;
#endif
}

inline void nvfp4_decode_f32_avx512(const uint8_t* data, const uint8_t* scales, const float* s_dec, int64_t n,
                                    int64_t scope, float* out) {
#if FP4_HAVE_AVX512
  const int64_t nb = (n + 15) / 16;
  const int64_t per = scope ? scope / 16 : std::max<int64_t>(nb, 1);
  const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                                      -2.0f, -3.0f, -4.0f, -6.0f);
  const __m128i nib = _mm_set1_epi8(0x0F);
  at::parallel_for(0, nb, 4096, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const __m512 t = _mm512_mul_ps(_mm512_mul_ps(table, _mm512_set1_ps(fp4::e4m3_value(scales[b]))),
                                     _mm512_set1_ps(s_dec[b / per]));
      const __m128i bytes = _mm_loadl_epi64((const __m128i*)(data + b * 8));
      const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(bytes, nib), _mm_and_si128(_mm_srli_epi16(bytes, 4), nib));
      const __m512 v = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), t);
      const int64_t i0 = b * 16;
      const int cnt = (int)std::min<int64_t>(16, n - i0);
      if (cnt == 16)
        _mm512_storeu_ps(out + i0, v);
      else
        _mm512_mask_storeu_ps(out + i0, (__mmask16)((1u << cnt) - 1), v);
    }
  });
#else
  (void)data; (void)scales; (void)s_dec; (void)n; (void)scope; (void)out;
#endif
}

}  // namespace fp4cpu
