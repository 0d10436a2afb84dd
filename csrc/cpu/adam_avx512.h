// AVX-512 inner loop of the fused FP4AdamW step (csrc/cpu/adam_cpu.cpp): one chunk of 1024 elements.
// Same operations in the same order as the scalar path and fp4offload/optim/reference_step.py; every
// lane rounds as the scalar rule in fp4_codec.h does (integer round-to-nearest-even on the fp32 pattern,
// decode through a per-block 16-entry table and a permute).
#pragma once

#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "fp4_codec.h"
#include "cpu/nvfp4_avx512.h"

namespace fp4adam {

constexpr int kChunk = 1024;           // elements per fp32 chunk scale (reference_step.CHUNK)
constexpr int64_t kSegment = 1 << 20;  // elements per segment / stochastic-rounding stream (reference_step.SEGMENT)

struct Scalars {
  float b1, omb1, b2, omb2, eps, decay, step_size, rsbc2;
  bool weight_decay;
};

struct ChunkArgs {
  int64_t n;
  float* param;
  uint8_t *m_codes, *m_scales, *v_codes, *v_scales;
  float *m_ts, *v_ts;
  Scalars s;
  bool maximize, v_nvfp4, m_stochastic;
  uint32_t seed, stream0;
  uint16_t* bf16_out;
};

#if FP4_HAVE_AVX512

static inline __m512 load_grad16(const float* g, int64_t i, __mmask16 mk) { return _mm512_maskz_loadu_ps(mk, g + i); }
static inline __m512 load_grad16(const uint16_t* g, int64_t i, __mmask16 mk) {
  const __m256i h = _mm256_maskz_loadu_epi16(mk, g + i);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 codes of one block (8 bytes) -> the values of `table` (already multiplied by the block and chunk scales).
static inline __m512 decode16(const uint8_t* codes8, __m512 table) {
  const __m128i nib = _mm_set1_epi8(0x0F);
  const __m128i bytes = _mm_loadl_epi64((const __m128i*)codes8);
  const __m128i c = _mm_unpacklo_epi8(_mm_and_si128(bytes, nib), _mm_and_si128(_mm_srli_epi16(bytes, 4), nib));
  return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(c), table);
}

// bf16 bits of 16 floats, round to nearest even; NaN -> 0x7FC0 (as c10::BFloat16).
static inline __m256i to_bf16x16(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

static inline __m512i fmix32x16(__m512i h) {
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0x85EBCA6Bu));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32((int)0xC2B2AE35u));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

// fp4::sr_bits(key, index0 + lane) for 16 lanes.
static inline __m512i sr_bits16(uint32_t key, uint32_t index0) {
  const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32((int)index0),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m512i h = _mm512_add_epi32(_mm512_mullo_epi32(idx, _mm512_set1_epi32((int)0x9E3779B1u)),
                                     _mm512_set1_epi32((int)key));
  return fmix32x16(h);
}

// fp4::e2m1_encode(y, stochastic=true, rnd) on 16 lanes.
static inline __m512i e2m1_codes16_sr(__m512 y, __m512i rnd) {
  const __m512i yi = _mm512_castps_si512(y);
  const __m512 a = _mm512_min_ps(_mm512_castsi512_ps(_mm512_and_si512(yi, _mm512_set1_epi32(0x7FFFFFFF))),
                                 _mm512_set1_ps(6.0f));
  const __m512i ai = _mm512_castps_si512(a);
  const __m512i sub = _mm512_cvttps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(2.0f)));
  const __m512i nrm = _mm512_sub_epi32(_mm512_srli_epi32(ai, 22), _mm512_set1_epi32(126 << 1));
  const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.0f), _CMP_LT_OQ);
  const __m512i lo = _mm512_min_epi32(_mm512_mask_blend_epi32(small, nrm, sub), _mm512_set1_epi32(7));
  const __m512 mags = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512 inv = _mm512_setr_ps(33554432.0f, 33554432.0f, 33554432.0f, 33554432.0f, 16777216.0f, 16777216.0f,
                                    8388608.0f, 8388608.0f, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512 frac24 = _mm512_mul_ps(_mm512_sub_ps(a, _mm512_permutexvar_ps(lo, mags)), _mm512_permutexvar_ps(lo, inv));
  const __m512 r = _mm512_cvtepi32_ps(_mm512_srli_epi32(rnd, 8));
  const __mmask16 up = _mm512_cmp_ps_mask(frac24, r, _CMP_GT_OQ) & _mm512_cmplt_epi32_mask(lo, _mm512_set1_epi32(7));
  const __m512i mag = _mm512_mask_add_epi32(lo, up, lo, _mm512_set1_epi32(1));
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(yi, 28), _mm512_set1_epi32(8));
  return _mm512_or_si512(mag, sign);
}

// fp4::ufp4_encode(|y|) on 16 lanes.
static inline __m512i ufp4_codes16(__m512 y) {
  const __m512 a = _mm512_min_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(y),
                                                                      _mm512_set1_epi32(0x7FFFFFFF))),
                                 _mm512_set1_ps(fp4::kUfp4Max));
  const __m512i ai = _mm512_castps_si512(a);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(ai, 22), _mm512_set1_epi32(1));
  __m512i c = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(ai, _mm512_set1_epi32(0x1FFFFF)), lsb), 22);
  c = _mm512_min_epi32(_mm512_sub_epi32(c, _mm512_set1_epi32(120 << 1)), _mm512_set1_epi32(15));
  const __mmask16 tiny = _mm512_cmp_ps_mask(a, _mm512_set1_ps(fp4::kUfp4Min), _CMP_LT_OQ);
  return _mm512_maskz_mov_epi32((__mmask16)~tiny, c);
}

// Encodes buf[0..16*nb) as one chunk (see encode_chunk_scalar in adam_cpu.cpp for the rules).
static inline void encode_chunk_avx512(const float* buf, int nb, bool unsigned_, bool stochastic, uint32_t key,
                                       uint32_t index0, uint8_t* codes, uint8_t* scales, float* s_dec_out) {
  const float elem_max = unsigned_ ? fp4::kUfp4Max : fp4::kE2M1Max;
  const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF), expmask = _mm512_set1_epi32(0x7F800000);
  float amax_b[kChunk / 16];
  uint16_t bad_b[kChunk / 16];
  __m512 amax_v = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const __m512i v = _mm512_loadu_si512(buf + b * 16);
    const __mmask16 nonfin = _mm512_cmpeq_epi32_mask(_mm512_and_si512(v, expmask), expmask);
    const __m512 a = _mm512_castsi512_ps(_mm512_maskz_and_epi32((__mmask16)~nonfin, v, absmask));
    amax_v = _mm512_max_ps(amax_v, a);
    amax_b[b] = _mm512_reduce_max_ps(a);
    bad_b[b] = nonfin;
  }
  const fp4::TensorScale ts = fp4::tensor_scale(_mm512_reduce_max_ps(amax_v), elem_max);
  *s_dec_out = ts.dec;
  for (int b = 0; b < nb; ++b) {
    const uint8_t sc = fp4::block_scale_code(amax_b[b], elem_max, ts.enc);
    scales[b] = sc;
    uint64_t packed = 0;
    if (sc != 0 && !bad_b[b]) {
      const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(buf + b * 16), _mm512_set1_ps(fp4::block_encode_scale(sc, ts.dec)));
      __m512i c;
      if (unsigned_)
        c = ufp4_codes16(y);
      else if (stochastic)
        c = e2m1_codes16_sr(y, sr_bits16(key, index0 + (uint32_t)(b * 16)));
      else
        c = fp4cpu::e2m1_codes16(y);
      packed = fp4cpu::pack16(c);
    }
    memcpy(codes + b * 8, &packed, 8);
  }
}

template <typename G>
inline void chunk_avx512(const ChunkArgs& a, const G* grad, int64_t c) {
  const Scalars& s = a.s;
  const int64_t i0 = c * kChunk;
  const int cnt = (int)std::min<int64_t>(kChunk, a.n - i0);
  const int nb = (cnt + 15) / 16;
  alignas(64) float mbuf[kChunk], ubuf[kChunk];
  const __m512 e2m1_tab = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f,
                                         -2.0f, -3.0f, -4.0f, -6.0f);
  __m512 ufp4_tab;
  {
    alignas(64) float t[16];
    for (int k = 0; k < 16; ++k) t[k] = fp4::ufp4_value((uint8_t)k);
    ufp4_tab = _mm512_load_ps(t);
  }
  const __m512 v_tab = a.v_nvfp4 ? e2m1_tab : ufp4_tab;
  const uint8_t* mc = a.m_codes + i0 / 2;
  const uint8_t* ms = a.m_scales + i0 / 16;
  const uint8_t* vc = a.v_codes + i0 / 2;
  const uint8_t* vs = a.v_scales + i0 / 16;
  const __m512 msd = _mm512_set1_ps(a.m_ts[c]), vsd = _mm512_set1_ps(a.v_ts[c]);
  const __m512 b1 = _mm512_set1_ps(s.b1), omb1 = _mm512_set1_ps(s.omb1), b2 = _mm512_set1_ps(s.b2),
               omb2 = _mm512_set1_ps(s.omb2), eps = _mm512_set1_ps(s.eps), decay = _mm512_set1_ps(s.decay),
               step = _mm512_set1_ps(s.step_size), rsbc2 = _mm512_set1_ps(s.rsbc2);
  const __m512i signbit = _mm512_set1_epi32((int)0x80000000u);
  for (int b = 0; b < nb; ++b) {
    const int64_t i = i0 + b * 16;
    const int left = cnt - b * 16;
    const __mmask16 mk = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    const __m512 mt = _mm512_mul_ps(_mm512_mul_ps(e2m1_tab, _mm512_set1_ps(fp4::e4m3_value(ms[b]))), msd);
    const __m512 vt = _mm512_mul_ps(_mm512_mul_ps(v_tab, _mm512_set1_ps(fp4::e4m3_value(vs[b]))), vsd);
    const __m512 mo = decode16(mc + b * 8, mt);
    const __m512 uo = decode16(vc + b * 8, vt);
    __m512 g = load_grad16(grad, i, mk);
    if (a.maximize) g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), signbit));
    __m512 p = _mm512_maskz_loadu_ps(mk, a.param + i);
    if (s.weight_decay) p = _mm512_mul_ps(p, decay);
    const __m512 m = _mm512_add_ps(_mm512_mul_ps(mo, b1), _mm512_mul_ps(g, omb1));
    const __m512 vo = a.v_nvfp4 ? uo : _mm512_mul_ps(uo, uo);
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(vo, b2), _mm512_mul_ps(_mm512_mul_ps(g, g), omb2));
    const __m512 u = _mm512_sqrt_ps(v);
    const __m512 d = _mm512_add_ps(_mm512_mul_ps(u, rsbc2), eps);
    p = _mm512_sub_ps(p, _mm512_mul_ps(_mm512_div_ps(m, d), step));
    _mm512_mask_storeu_ps(a.param + i, mk, p);
    if (a.bf16_out) _mm256_mask_storeu_epi16(a.bf16_out + i, mk, to_bf16x16(p));
    _mm512_store_ps(mbuf + b * 16, _mm512_maskz_mov_ps(mk, m));
    _mm512_store_ps(ubuf + b * 16, _mm512_maskz_mov_ps(mk, a.v_nvfp4 ? v : u));
  }
  const int64_t seg = i0 / kSegment;
  const uint32_t key = a.m_stochastic ? fp4::sr_key(a.seed, (uint32_t)(a.stream0 + seg), 0u) : 0u;
  const uint32_t index0 = (uint32_t)(i0 - seg * kSegment);
  encode_chunk_avx512(mbuf, nb, false, a.m_stochastic, key, index0, a.m_codes + i0 / 2, a.m_scales + i0 / 16,
                      &a.m_ts[c]);
  encode_chunk_avx512(ubuf, nb, !a.v_nvfp4, false, 0u, 0u, a.v_codes + i0 / 2, a.v_scales + i0 / 16, &a.v_ts[c]);
}

#else

template <typename G>
inline void chunk_avx512(const ChunkArgs&, const G*, int64_t) {}  // never called: have_avx512() is false

#endif  // FP4_HAVE_AVX512

}  // namespace fp4adam
