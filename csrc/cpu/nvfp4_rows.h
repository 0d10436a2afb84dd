// Row-level NVFP4/ufp4 helpers shared by the codec (codec_impl.h) and the fused optimizer step
// (adam_cpu.cpp, which encodes the NVFP4 16x16 working copy of the weight band by band): the scalar rule of
// fp4_codec.h, or when `simd` is set its AVX-512 form (nvfp4_avx512.h) in the AVX-512 build and its portable
// vector form (below, written for the compiler's vectorizer, as adam_chunk.h) in the AVX2, NEON and SVE builds;
// all give the same bytes. The portable form also encodes the codec's whole MXFP4 blocks (vrow::mx4_block32).
#pragma once

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>

#include "fp4_codec.h"
#include "cpu/adam_chunk.h"
#include "cpu/nvfp4_avx512.h"

namespace fp4cpu {

template <typename T>
inline float load(const T* p, int64_t i) { return static_cast<float>(p[i]); }

#if FP4_CPU_VEC
namespace vrow {

// N whole values (a row of 16, an MX block of 32): the finite amax (as the patterns' integer max) and the
// non-finite count.
template <int N, typename T>
inline void amax_n(const T* p, float& amax, int32_t& bad) {
  uint32_t m = 0, nb = 0;
  FP4_VEC_LOOP
  for (int j = 0; j < N; ++j) {
    const uint32_t u = fp4::f2u(load(p, j)) & 0x7FFFFFFFu;
    const uint32_t fin = u < 0x7F800000u;
    nb += 1u - fin;
    const uint32_t v = u & (0u - fin);  // a mask, not a select: GCC vectorizes this max reduction, not the other
    m = m > v ? m : v;
  }
  amax = fp4::u2f(m);
  bad = (int32_t)nb;
}

// N whole values times k as codes (E2M1 with sign, or the unsigned grid with MB mantissa bits), nearest or
// stochastic with fp4::sr_bits(key, idx0 + j) (the hash on every lane: (idx0 + j) * G + key is base + j * G),
// packed into N / 2 bytes.
template <int N, int MB, bool SR, typename T>
inline void encode_n(const T* p, float k, uint32_t key, uint32_t idx0, uint8_t* out) {
  uint32_t c[N];
  const uint32_t base = key + idx0 * 0x9E3779B1u;
  FP4_VEC_LOOP
  for (int j = 0; j < N; ++j) {
    const uint32_t rnd = SR ? fp4::fmix32(base + (uint32_t)j * 0x9E3779B1u) : 0u;
    c[j] = fp4adam::vec::code_of<MB, SR>(load(p, j) * k, rnd);
  }
  for (int j = 0; j < N / 2; ++j) out[j] = (uint8_t)(c[2 * j] | (c[2 * j + 1] << 4));
}

// 8 packed bytes of a row of 16 -> (value * scale_b) * s_dec, the first cnt stored.
template <int MB, typename T>
inline void decode16(const uint8_t* in, float scale_b, float s_dec, int cnt, T* out) {
  uint32_t lo, hi;
  memcpy(&lo, in, 4);
  memcpy(&hi, in + 4, 4);
  float v[16];
  FP4_VEC_LOOP
  for (int j = 0; j < 8; ++j) {
    const uint32_t c0 = (lo >> (4 * j)) & 15u, c1 = (hi >> (4 * j)) & 15u;
    v[j] = (fp4::u2f(MB ? fp4adam::vec::ugrid_bits<MB>(c0) : fp4adam::vec::e2m1_bits(c0)) * scale_b) * s_dec;
    v[8 + j] = (fp4::u2f(MB ? fp4adam::vec::ugrid_bits<MB>(c1) : fp4adam::vec::e2m1_bits(c1)) * scale_b) * s_dec;
  }
  for (int j = 0; j < cnt; ++j) out[j] = static_cast<T>(v[j]);
}

// A whole MX block of 32 as MXFP4 (codec_impl.h's mx_encode_impl rules): the non-finite count, the E8M0 scale at
// *scale and 16 packed bytes at out (zeros for a block with a non-finite value).
template <bool SR, typename T>
inline int32_t mx4_block32(const T* p, bool floor_mode, bool propagate, uint32_t key, uint32_t idx0, uint8_t* scale,
                           uint8_t* out) {
  float amax;
  int32_t bad;
  amax_n<fp4::kMxBlock>(p, amax, bad);
  const int32_t e = fp4::mx_exponent(amax, 0x400000u, 2, floor_mode);
  *scale = (bad && propagate) ? fp4::kE8M0NaN : (uint8_t)(e + 127);
  if (bad)
    memset(out, 0, fp4::kMxBlock / 2);
  else
    encode_n<fp4::kMxBlock, 0, SR>(p, fp4::pow2(-e), key, idx0, out);
  return bad;
}

}  // namespace vrow
#endif  // FP4_CPU_VEC

// Finite amax and non-finite count over `nrows` rows of `cnt` (<= 16) values, `stride` elements apart.
template <typename T>
inline void amax_rows(const T* p, int64_t stride, int nrows, int cnt, bool simd, float& amax, int32_t& bad) {
#if FP4_HAVE_AVX512
  if (simd) return fp4cpu::amax_rows16(p, stride, nrows, cnt, amax, bad);
#elif FP4_CPU_VEC
  if (simd && nrows == 1 && cnt == 16) return vrow::amax_n<16>(p, amax, bad);
#endif
  float m = 0.0f;
  int32_t nb = 0;
  for (int r = 0; r < nrows; ++r)
    for (int j = 0; j < cnt; ++j) {
      const float v = load(p + r * stride, j);
      const bool fin = fp4::is_finite(v);
      nb += fin ? 0 : 1;
      m = fp4::fmax_(m, fin ? fp4::fabs_(v) : 0.0f);
    }
  amax = m;
  bad = nb;
}

// Codes of one row of 16 (the first `cnt` from p, the rest zero) times the block multiplier k, packed.
template <typename T>
inline void encode_row(const T* p, int cnt, float k, bool ufp4, bool stochastic, uint32_t key, uint64_t index0,
                       bool simd, uint8_t* out) {
#if FP4_HAVE_AVX512
  if (simd) return fp4cpu::encode_row16(p, cnt, k, ufp4, stochastic, key, (uint32_t)index0, out);
#elif FP4_CPU_VEC
  if (simd && cnt == 16) {
    const uint32_t i0 = (uint32_t)index0;
    if (ufp4)
      return stochastic ? vrow::encode_n<16, 1, true>(p, k, key, i0, out)
                        : vrow::encode_n<16, 1, false>(p, k, key, i0, out);
    return stochastic ? vrow::encode_n<16, 0, true>(p, k, key, i0, out)
                      : vrow::encode_n<16, 0, false>(p, k, key, i0, out);
  }
#endif
  uint8_t codes[16];
  for (int j = 0; j < 16; ++j) {
    const float y = (j < cnt ? load(p, j) : 0.0f) * k;
    if (ufp4)
      codes[j] = stochastic ? fp4::ufp4_encode_sr(fp4::fabs_(y), fp4::sr_bits(key, index0 + j))
                            : fp4::ufp4_encode(fp4::fabs_(y));
    else
      codes[j] = fp4::e2m1_encode(y, stochastic, stochastic ? fp4::sr_bits(key, index0 + j) : 0u);
  }
  fp4::pack_codes(codes, 16, out);
}

template <typename T>
inline void decode_row(const uint8_t* in, bool ufp4, float scale_b, float s_dec, int cnt, bool simd, T* out) {
#if FP4_HAVE_AVX512
  if (simd) return fp4cpu::decode_row16(in, fp4cpu::decode_table16(ufp4, scale_b, s_dec), cnt, out);
#elif FP4_CPU_VEC
  if (simd) return ufp4 ? vrow::decode16<1>(in, scale_b, s_dec, cnt, out) : vrow::decode16<0>(in, scale_b, s_dec, cnt, out);
#endif
  for (int j = 0; j < cnt; ++j) {
    const uint8_t code = fp4::code_at(in, j);
    const float v = ufp4 ? fp4::ufp4_value(code) : fp4::e2m1_value(code);
    out[j] = static_cast<T>((v * scale_b) * s_dec);
  }
}

#if FP4_HAVE_AVX512
// Four consecutive 1x16 blocks at p (64 values, all present) times their multipliers k[0..3], packed into the
// 32 bytes at out: encode_row on each block, with one pack for the four.
template <typename T>
inline void encode_rows4(const T* p, const float* k, bool ufp4, bool stochastic, uint32_t key, uint32_t idx0,
                         uint8_t* out) {
  __m512i c[4];
  for (int q = 0; q < 4; ++q) {
    const __m512 y = _mm512_mul_ps(load16(p + 16 * q, 16), _mm512_set1_ps(k[q]));
    c[q] = nv_codes16(y, ufp4, stochastic, key, idx0 + 16 * q);
  }
  _mm256_storeu_si256((__m256i*)out, pack64(c[0], c[1], c[2], c[3]));
}
#endif

#if FP4_HAVE_AVX512
// Rows r..r+3 of a live 16x16 tile (16 values each, from column c0 of rows `cols` apart) times the multiplier vk,
// packed together: encode_row on each, its codes at the padded position (r + q) * cp + c0.
template <bool UFP4, bool SR, typename T>
inline void encode_tile_rows4(const T* x, int64_t cols, int64_t cp, int64_t r, int64_t c0, __m512 vk, uint32_t seed,
                              uint32_t stream, uint8_t* data) {
  __m512i c[4];
  for (int q = 0; q < 4; ++q) {
    const int64_t pos = (r + q) * cp + c0;
    const uint32_t key = SR ? fp4::sr_key(seed, stream, (uint32_t)((uint64_t)pos >> 32)) : 0u;
    c[q] = nv_codes16(_mm512_mul_ps(load16(x + (r + q) * cols + c0, 16), vk), UFP4, SR, key, (uint32_t)pos);
  }
  alignas(32) uint64_t w[4];
  _mm256_store_si256((__m256i*)w, pack64(c[0], c[1], c[2], c[3]));
  for (int q = 0; q < 4; ++q) memcpy(data + ((r + q) * cp + c0) / 2, &w[q], 8);
}
#endif

// One 16x16 tile of a (rows, cols) matrix whose codes sit at padded row-major positions r * cp + c: rows
// r0..r0+15 from column c0, times the block multiplier k; rows past `rows` and dead tiles (`live` false) are
// zero codes.
template <typename T>
inline void encode_tile(const T* x, int64_t rows, int64_t cols, int64_t cp, int64_t r0, int64_t c0, float k,
                        bool live, bool ufp4, bool stochastic, uint32_t seed, uint32_t stream, bool simd,
                        uint8_t* data) {
  const int cnt = (int)std::max<int64_t>(std::min<int64_t>(16, cols - c0), 0);
  int64_t r = r0;
#if FP4_HAVE_AVX512
  if (simd && live && cnt == 16) {  // 4 rows at a time, packed together, one loop per kind of code
    const int64_t r1 = std::min<int64_t>(r0 + 16, rows);
    const __m512 vk = _mm512_set1_ps(k);
    auto rows4 = [&](auto ufp4_c, auto sr_c) {
      for (; r + 4 <= r1; r += 4)
        encode_tile_rows4<decltype(ufp4_c)::value, decltype(sr_c)::value>(x, cols, cp, r, c0, vk, seed, stream, data);
    };
    const std::true_type yes{};
    const std::false_type no{};
    if (ufp4)
      stochastic ? rows4(yes, yes) : rows4(yes, no);
    else
      stochastic ? rows4(no, yes) : rows4(no, no);
  }
#endif
  for (; r < r0 + 16; ++r) {
    const int64_t pos = r * cp + c0;
    uint8_t* out = data + pos / 2;
    if (!live || r >= rows) {
      memset(out, 0, 8);
      continue;
    }
    const uint32_t key = stochastic ? fp4::sr_key(seed, stream, (uint32_t)((uint64_t)pos >> 32)) : 0u;
    encode_row(x + r * cols + c0, cnt, k, ufp4, stochastic, key, (uint64_t)pos, simd, out);
  }
}

}  // namespace fp4cpu
