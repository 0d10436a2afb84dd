// AVX-512 inner loop of the fused FP4AdamW step (csrc/cpu/adam_cpu.cpp): one chunk of 1024 elements.
// Same operations in the same order as the scalar path and fp4offload/_optim/reference_step.py; every
// lane rounds as the scalar rule in fp4_codec.h does (integer round-to-nearest-even on the fp32 pattern,
// decode through a per-block 16-entry table and a permute).
#pragma once

#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "fp4_codec.h"
#include "cpu/adam_chunk.h"
#include "cpu/nvfp4_avx512.h"

namespace fp4adam {

constexpr int64_t kPrefetch = 4096;    // software prefetch distance in elements

#if FP4_HAVE_AVX512

static inline __m512 load_grad16(const float* g, int64_t i, __mmask16 mk) { return _mm512_maskz_loadu_ps(mk, g + i); }
static inline __m512 load_grad16(const uint16_t* g, int64_t i, __mmask16 mk) {
  const __m256i h = _mm256_maskz_loadu_epi16(mk, g + i);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
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

// fp4::ugrid_encode(|y|, MB) on 16 lanes: |y| clamped to the grid's top, the pattern rounded to MB mantissa
// bits (ties to even) less (bias << MB); below the grid's smallest value code 0.
template <int MB>
static inline __m512i ugrid_codes16(__m512 y) {
  constexpr int kShift = 23 - MB;
  const __m512 a = _mm512_min_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(y),
                                                                      _mm512_set1_epi32(0x7FFFFFFF))),
                                 _mm512_set1_ps(fp4::ugrid_max(MB)));
  const __m512i ai = _mm512_castps_si512(a);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(ai, kShift), _mm512_set1_epi32(1));
  __m512i c = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(ai, _mm512_set1_epi32((1 << (kShift - 1)) - 1)), lsb),
                                kShift);
  c = _mm512_min_epi32(_mm512_sub_epi32(c, _mm512_set1_epi32((int)(fp4::ugrid_bias(MB) << MB))), _mm512_set1_epi32(15));
  const __mmask16 tiny = _mm512_cmp_ps_mask(a, _mm512_set1_ps(fp4::ugrid_min(MB)), _CMP_LT_OQ);
  return _mm512_maskz_mov_epi32((__mmask16)~tiny, c);
}

// Encodes buf[0..16*nb) (zeros past the data) as one chunk: one fp32 scale, an E4M3 scale per 16 elements,
// codes. Same rules as encode_chunk_scalar in adam_cpu.cpp, 16 blocks at a time.
// MB 0: E2M1 codes; else the unsigned grid with that many mantissa bits.
template <int MB>
static inline void encode_chunk_avx512(const float* buf, int nb, bool stochastic, uint32_t key, uint32_t index0,
                                       uint8_t* codes, uint8_t* scales, float* s_dec_out) {
  const float elem_max = fp4::grid_max(MB);
  const __m512i absmask = _mm512_set1_epi32(0x7FFFFFFF), expmask = _mm512_set1_epi32(0x7F800000);
  const int ngroups = (nb + 15) / 16;
  alignas(64) float amax_b[kChunk / 16];
  uint16_t bad_g[kChunk / 256];
  __m512 amax_v = _mm512_setzero_ps();
  for (int q = 0; q < ngroups; ++q) {
    __m512 a[16];
    uint32_t bad = 0;
    for (int j = 0; j < 16; ++j) {
      const int b = q * 16 + j;
      if (b < nb) {
        const __m512i v = _mm512_load_si512(buf + b * 16);
        const __mmask16 nonfin = _mm512_cmpeq_epi32_mask(_mm512_and_si512(v, expmask), expmask);
        a[j] = _mm512_castsi512_ps(_mm512_maskz_and_epi32((__mmask16)~nonfin, v, absmask));
        bad |= (uint32_t)(nonfin != 0) << j;
      } else {
        a[j] = _mm512_setzero_ps();
      }
    }
    const __m512 mx = fp4cpu::block_max16x16(a);
    _mm512_store_ps(amax_b + q * 16, mx);
    amax_v = _mm512_max_ps(amax_v, mx);
    bad_g[q] = (uint16_t)bad;
  }
  const fp4::TensorScale ts = fp4::tensor_scale(_mm512_reduce_max_ps(amax_v), elem_max);
  *s_dec_out = ts.dec;
  const __m512 vmax = _mm512_set1_ps(elem_max), venc = _mm512_set1_ps(ts.enc), vdec = _mm512_set1_ps(ts.dec);
  for (int q = 0; q < ngroups; ++q) {
    alignas(64) float kb[16];
    const __mmask16 live = fp4cpu::block_scales16(_mm512_load_ps(amax_b + q * 16), vmax, venc, vdec, (__mmask16)~bad_g[q],
                                          std::min(16, nb - q * 16), scales + q * 16, kb);
    const int cnt = std::min(16, nb - q * 16);
    for (int j = 0; j < cnt; ++j) {
      const int b = q * 16 + j;
      uint64_t packed = 0;
      if ((live >> j) & 1) {
        const __m512 y = _mm512_mul_ps(_mm512_load_ps(buf + b * 16), _mm512_set1_ps(kb[j]));
        __m512i c;
        const uint32_t i16 = index0 + (uint32_t)(b * 16);
        if constexpr (MB > 0)
          c = stochastic ? fp4cpu::ugrid_codes16_sr<MB>(y, fp4cpu::sr_bits16(key, i16)) : ugrid_codes16<MB>(y);
        else
          c = stochastic ? fp4cpu::e2m1_codes16_sr(y, fp4cpu::sr_bits16(key, i16)) : fp4cpu::e2m1_codes16(y);
        packed = fp4cpu::pack16(c);
      }
      memcpy(codes + b * 8, &packed, 8);
    }
  }
}

struct Tables {
  // scaled[mb][s]: the values of grid mb (0: E2M1, else the unsigned grid of mb mantissa bits) times the block
  // scale e4m3_value(s). The products are exact (values of at most 5 significant bits times scales of at most 4, far
  // from under/overflow; a NaN scale gives NaN rows), so (value * scale) * s_dec of the rule is one multiply of a row
  // by s_dec.
  alignas(64) float scaled[FP4_V_MBITS_MAX + 1][256][16];
  Tables() {
    for (int mb = 0; mb <= FP4_V_MBITS_MAX; ++mb)
      for (int s = 0; s < 256; ++s)
        for (int k = 0; k < 16; ++k)
          scaled[mb][s][k] = (mb ? fp4::ugrid_value((uint8_t)k, mb) : fp4::e2m1_value((uint8_t)k)) *
                             fp4::e4m3_value((uint8_t)s);
  }
};

inline const Tables& tables() {
  static const Tables t;
  return t;
}

// ---- the pipelined step ----------------------------------------------------------------------------
//
// Per chunk: (1) the update loop decodes m and sqrt(v), steps the weights and leaves the new m and u (or v)
// in a buffer; (2) "pass 1" takes the block maxima with a transpose tree, the chunk's tensor scale and the
// 64 block scales and multipliers; (3) "pass 2" turns the buffer into codes. Pass 2 of chunk c-1 runs inside
// the update loop of chunk c, 4 blocks at a time, so the shuffle/integer work of the encode overlaps the
// divide/sqrt-bound update (the divider is not pipelined and sits idle during a separate encode loop).
//
// Fast-path conditions, checked in pass 1: every value of the buffer is finite and, for the second moment,
// has its sign bit clear. Otherwise (only after an overflow or a non-finite gradient) the chunk's state is
// encoded at once by encode_chunk_avx512 above, which implements every rule of the scalar path.

// What pass 2 encodes (its MB): m, E2M1 codes with their sign; else a v state (the grid's mantissa bits: 0 is
// E2M1 of values >= +0).
constexpr int kSignedE2M1 = -1;

// Codes of y >= +0 (finite) on the unsigned grid with MB mantissa bits: 0 below the grid (the rounded code is
// then <= 0: clamp at 0), else the pattern rounded to MB mantissa bits minus (bias << MB); y <= the grid's top
// keeps it <= 15.
template <int MB>
FP4_INLINE __m512i ugrid_codes16_pos(__m512 y) {
  constexpr int kShift = 23 - MB;
  const __m512i ai = _mm512_castps_si512(_mm512_min_ps(y, _mm512_set1_ps(fp4::ugrid_max(MB))));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(ai, kShift), _mm512_set1_epi32(1));
  const __m512i c = _mm512_srai_epi32(
      _mm512_add_epi32(_mm512_add_epi32(ai, _mm512_set1_epi32((int)(((1u << (kShift - 1)) - 1u) -
                                                                    (fp4::ugrid_bias(MB) << 23)))),
                       lsb),
      kShift);
  return _mm512_max_epi32(c, _mm512_setzero_si512());
}

// Pending pass-2 work of one chunk buffer (block multipliers already known).
struct EncJob {
  alignas(64) float kb[kChunk / 16];
  const float* buf;
  uint8_t* codes;
  uint64_t live;  // bit b: block b's scale is not 0
  int nb;         // 0: nothing pending
  uint32_t key, index0;
};

// The codes of block b of a pass-2 job on grid MB (above), nearest or stochastic (SR).
template <int MB, bool SR>
FP4_INLINE __m512i enc_codes16(const EncJob& j, int b) {
  const __m512 x = _mm512_load_ps(j.buf + b * 16);
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(j.kb[b]));
  if constexpr (SR) {
    const __m512i rnd = fp4cpu::sr_bits16(j.key, j.index0 + (uint32_t)(b * 16));
    if constexpr (MB > 0) return fp4cpu::ugrid_codes16_sr<MB>(y, rnd);
    return fp4cpu::e2m1_codes16_sr(y, rnd);
  }
  if constexpr (MB > 0) return ugrid_codes16_pos<MB>(y);
  if constexpr (MB == 0)  // y >= +0: the magnitude is the code
    return fp4cpu::e2m1_mag16(_mm512_range_ps(y, _mm512_set1_ps(fp4::kE2M1Max), 0x0A));
  return fp4cpu::e2m1_codes16(y);
}

// Pass 2 of blocks b..b+3 (b a multiple of 4, b < j.nb).
template <int MB, bool SR>
FP4_INLINE void enc4(const EncJob& j, int b) {
  const __m256i packed = fp4cpu::pack64(enc_codes16<MB, SR>(j, b), enc_codes16<MB, SR>(j, b + 1),
                                        enc_codes16<MB, SR>(j, b + 2), enc_codes16<MB, SR>(j, b + 3));
  const uint32_t live4 = (uint32_t)(j.live >> b) & 0xF;
  const int left = j.nb - b;
  const uint32_t have4 = left >= 4 ? 0xFu : ((1u << left) - 1);
  if (live4 == 0xF && have4 == 0xF) {
    _mm256_storeu_si256((__m256i*)(j.codes + b * 8), packed);
  } else {  // dead blocks get zero codes; blocks past the chunk are not written
    const __mmask32 keep = (__mmask32)(_pdep_u32(live4, 0x01010101u) * 0xFFu);
    const __mmask32 have = (__mmask32)(_pdep_u32(have4, 0x01010101u) * 0xFFu);
    _mm256_mask_storeu_epi8(j.codes + b * 8, have, _mm256_maskz_mov_epi8(keep, packed));
  }
}

// Transpose-tree block maxima of 16 blocks on the fp32 patterns (unsigned max: the patterns of values >= +0
// order as the values, and any non-finite or sign-bit-set value ends up >= 0x7F800000). Signed data has its
// sign cleared first (not with vrangeps: its absolute max drops a NaN operand).
template <bool Signed>
static inline __m512i block_max_bits16(const __m512* v) {
  __m512i t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) {
    __m512 v0 = v[2 * i], v1 = v[2 * i + 1];
    if (Signed) {
      v0 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v0), _mm512_set1_epi32(0x7FFFFFFF)));
      v1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v1), _mm512_set1_epi32(0x7FFFFFFF)));
    }
    const __m512 x = _mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 y = _mm512_shuffle_f32x4(v0, v1, _MM_SHUFFLE(3, 2, 3, 2));
    t[i] = _mm512_max_epu32(_mm512_castps_si512(x), _mm512_castps_si512(y));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512i x = _mm512_shuffle_i32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i y = _mm512_shuffle_i32x4(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1));
    u[i] = _mm512_max_epu32(x, y);
  }
  for (int i = 0; i < 2; ++i) {
    const __m512 a = _mm512_castsi512_ps(u[2 * i]), b = _mm512_castsi512_ps(u[2 * i + 1]);
    const __m512i x = _mm512_castps_si512(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)));
    const __m512i y = _mm512_castps_si512(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    w[i] = _mm512_max_epu32(x, y);
  }
  const __m512 a = _mm512_castsi512_ps(w[0]), b = _mm512_castsi512_ps(w[1]);
  const __m512i x = _mm512_castps_si512(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
  const __m512i y = _mm512_castps_si512(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i r = _mm512_max_epu32(x, y);  // element 4q + j holds block 4j + q
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// Pass 1 of one chunk buffer. Returns false (nothing written) when the buffer leaves the fast path.
template <bool Signed>
static inline bool enc_prepare(const float* buf, int nb, float elem_max, uint8_t* scales, float* s_dec_out,
                               EncJob& j) {
  const int ngroups = (nb + 15) / 16;
  __m512i bm[kChunk / 256];
  __m512i all = _mm512_setzero_si512();
  for (int q = 0; q < ngroups; ++q) {
    __m512 v[16];
    for (int k = 0; k < 16; ++k) v[k] = q * 16 + k < nb ? _mm512_load_ps(buf + (q * 16 + k) * 16) : _mm512_setzero_ps();
    bm[q] = block_max_bits16<Signed>(v);
    all = _mm512_max_epu32(all, bm[q]);
  }
  if (_mm512_cmp_epu32_mask(all, _mm512_set1_epi32(0x7F800000), _MM_CMPINT_NLT)) return false;
  const fp4::TensorScale ts = fp4::tensor_scale(_mm512_reduce_max_ps(_mm512_castsi512_ps(all)), elem_max);
  *s_dec_out = ts.dec;
  const __m512 vmax = _mm512_set1_ps(elem_max), venc = _mm512_set1_ps(ts.enc), vdec = _mm512_set1_ps(ts.dec);
  uint64_t live = 0;
  for (int q = 0; q < ngroups; ++q) {
    const __mmask16 lv = fp4cpu::block_scales16(_mm512_castsi512_ps(bm[q]), vmax, venc, vdec, (__mmask16)0xFFFF,
                                        std::min(16, nb - q * 16), scales + q * 16, j.kb + q * 16);
    live |= (uint64_t)lv << (q * 16);
  }
  j.live = live;
  j.buf = buf;
  j.nb = nb;
  return true;
}

// The update of blocks b..b+nblk-1 of chunk c (all full blocks when Tail is false). VMB: the mantissa bits of the v
// state's grid (0: v itself in NVFP4).
template <typename G, int VMB, bool Tail>
FP4_INLINE void update_blocks(const ChunkArgs& a, const G* grad, int64_t i0, int cnt, int b, int nblk,
                                 const uint8_t* mc, const uint8_t* ms, const uint8_t* vc, const uint8_t* vs,
                                 __m512 msd, __m512 vsd, float* mbuf, float* ubuf) {
  constexpr bool VNv = VMB == 0;
  const Tables& tab = tables();
  const Scalars& s = a.s;
  const __m512 b1 = _mm512_set1_ps(s.b1), omb1 = _mm512_set1_ps(s.omb1), b2 = _mm512_set1_ps(s.b2),
               omb2 = _mm512_set1_ps(s.omb2), eps = _mm512_set1_ps(s.eps), decay = _mm512_set1_ps(s.decay),
               step = _mm512_set1_ps(s.step_size), rsbc2 = _mm512_set1_ps(s.rsbc2);
  const __m512i signbit = _mm512_set1_epi32((int)0x80000000u);
  for (int k = 0; k < nblk; ++k, ++b) {
    const int64_t i = i0 + b * 16;
    __mmask16 mk = 0xFFFF;
    if (Tail) {
      const int left = cnt - b * 16;
      mk = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
    }
    const __m512 mt = _mm512_mul_ps(_mm512_load_ps(tab.scaled[0][ms[b]]), msd);
    const __m512 vt = _mm512_mul_ps(_mm512_load_ps(tab.scaled[VMB][vs[b]]), vsd);
    const __m512 mo = _mm512_permutexvar_ps(fp4cpu::unpack16(mc + b * 8), mt);
    const __m512 uo = _mm512_permutexvar_ps(fp4cpu::unpack16(vc + b * 8), vt);
    __m512 g = load_grad16(grad, i, mk);
    if (a.gscaled) g = _mm512_mul_ps(g, _mm512_set1_ps(a.gscale));
    if (a.maximize) g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), signbit));
    __m512 p = Tail ? _mm512_maskz_loadu_ps(mk, a.param + i) : _mm512_loadu_ps(a.param + i);
    if (s.weight_decay) p = _mm512_mul_ps(p, decay);
    const __m512 m = _mm512_add_ps(_mm512_mul_ps(mo, b1), _mm512_mul_ps(g, omb1));
    const __m512 vo = VNv ? uo : _mm512_mul_ps(uo, uo);
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(vo, b2), _mm512_mul_ps(_mm512_mul_ps(g, g), omb2));
    const __m512 u = _mm512_sqrt_ps(v);
    const __m512 d = _mm512_add_ps(_mm512_mul_ps(u, rsbc2), eps);
    p = _mm512_sub_ps(p, _mm512_mul_ps(_mm512_div_ps(m, d), step));
    if (Tail) {
      _mm512_mask_storeu_ps(a.param + i, mk, p);
      if (a.bf16_out) _mm256_mask_storeu_epi16(a.bf16_out + i, mk, to_bf16x16(p));
      _mm512_store_ps(mbuf + b * 16, _mm512_maskz_mov_ps(mk, m));
      _mm512_store_ps(ubuf + b * 16, _mm512_maskz_mov_ps(mk, VNv ? v : u));
    } else {
      _mm512_storeu_ps(a.param + i, p);
      if (a.bf16_out) _mm256_storeu_si256((__m256i*)(a.bf16_out + i), to_bf16x16(p));
      _mm512_store_ps(mbuf + b * 16, m);
      _mm512_store_ps(ubuf + b * 16, VNv ? v : u);
    }
  }
}

// Steps chunks [c0, c1) on one thread. SR / VSR: m / the second moment rounded stochastically.
template <typename G, int VMB, bool SR, bool VSR>
inline void step_range_impl(const ChunkArgs& a, const G* grad, int64_t c0, int64_t c1) {
  const float u_max = fp4::grid_max(VMB);
  alignas(64) float mbuf[2][kChunk], ubuf[2][kChunk];
  EncJob jm[2], ju[2];
  jm[0].nb = jm[1].nb = ju[0].nb = ju[1].nb = 0;
  for (int64_t c = c0; c < c1; ++c) {
    const int x = (int)(c & 1);
    EncJob &pm = jm[x ^ 1], &pu = ju[x ^ 1];  // chunk c-1's pending pass 2
    const int64_t i0 = c * kChunk;
    const int cnt = (int)std::min<int64_t>(kChunk, a.n - i0);
    const int nb = (cnt + 15) / 16;
    const uint8_t* mc = a.m_codes + i0 / 2;
    const uint8_t* ms = a.m_scales + i0 / 16;
    const uint8_t* vc = a.v_codes + i0 / 2;
    const uint8_t* vs = a.v_scales + i0 / 16;
    const __m512 msd = _mm512_set1_ps(a.m_ts[c]), vsd = _mm512_set1_ps(a.v_ts[c]);
    const int nfull = cnt / 16;
    int b = 0;
    for (; b + 4 <= nfull; b += 4) {
      {  // stream the inputs kPrefetch elements ahead (the hardware prefetcher alone leaves it latency-bound)
        const int64_t pi = i0 + b * 16 + kPrefetch;
        if (pi < a.n) {
          const char* pp = (const char*)(a.param + pi);
          const char* gp = (const char*)(grad + pi);
          for (int o = 0; o < 256; o += 64) _mm_prefetch(pp + o, _MM_HINT_T0);
          for (int o = 0; o < 64 * (int)sizeof(G); o += 64) _mm_prefetch(gp + o, _MM_HINT_T0);
          if ((b & 4) == 0) {
            _mm_prefetch((const char*)(a.m_codes + pi / 2), _MM_HINT_T0);
            _mm_prefetch((const char*)(a.v_codes + pi / 2), _MM_HINT_T0);
          }
        }
      }
      update_blocks<G, VMB, false>(a, grad, i0, cnt, b, 4, mc, ms, vc, vs, msd, vsd, mbuf[x], ubuf[x]);
      if (b < pm.nb) enc4<kSignedE2M1, SR>(pm, b);
      if (b < pu.nb) enc4<VMB, VSR>(pu, b);
    }
    if (b < nb) update_blocks<G, VMB, true>(a, grad, i0, cnt, b, nb - b, mc, ms, vc, vs, msd, vsd, mbuf[x], ubuf[x]);
    for (; b < pm.nb; b += 4) enc4<kSignedE2M1, SR>(pm, b);
    for (int bb = (nfull / 4) * 4; bb < pu.nb; bb += 4) enc4<VMB, VSR>(pu, bb);
    pm.nb = pu.nb = 0;
    // pass 1 of chunk c
    const int64_t seg = i0 / kSegment;
    const uint32_t key = SR ? fp4::sr_key(a.seed, (uint32_t)(a.stream0 + seg), 0u) : 0u;
    const uint32_t vkey = VSR ? fp4::sr_key(a.seed ^ fp4::kVSeedXor, (uint32_t)(a.stream0 + seg), 0u) : 0u;
    const uint32_t index0 = (uint32_t)(i0 - seg * kSegment);
    EncJob &nm = jm[x], &nu = ju[x];
    if (enc_prepare<true>(mbuf[x], nb, fp4::kE2M1Max, a.m_scales + i0 / 16, &a.m_ts[c], nm)) {
      nm.codes = a.m_codes + i0 / 2;
      nm.key = key;
      nm.index0 = index0;
    } else {
      nm.nb = 0;
      encode_chunk_avx512<0>(mbuf[x], nb, SR, key, index0, a.m_codes + i0 / 2, a.m_scales + i0 / 16, &a.m_ts[c]);
    }
    if (enc_prepare<false>(ubuf[x], nb, u_max, a.v_scales + i0 / 16, &a.v_ts[c], nu)) {
      nu.codes = a.v_codes + i0 / 2;
      nu.key = vkey;
      nu.index0 = index0;
    } else {
      nu.nb = 0;
      encode_chunk_avx512<VMB>(ubuf[x], nb, VSR, vkey, index0, a.v_codes + i0 / 2, a.v_scales + i0 / 16, &a.v_ts[c]);
    }
  }
  // the last chunk's pass 2
  const int x = (int)((c1 - 1) & 1);
  for (int b = 0; b < jm[x].nb; b += 4) enc4<kSignedE2M1, SR>(jm[x], b);
  for (int b = 0; b < ju[x].nb; b += 4) enc4<VMB, VSR>(ju[x], b);
}

template <typename G, int VMB>
inline void step_range_mb(const ChunkArgs& a, const G* grad, int64_t c0, int64_t c1) {
  switch ((a.m_stochastic ? 2 : 0) | (a.v_stochastic ? 1 : 0)) {
    case 0: return step_range_impl<G, VMB, false, false>(a, grad, c0, c1);
    case 1: return step_range_impl<G, VMB, false, true>(a, grad, c0, c1);
    case 2: return step_range_impl<G, VMB, true, false>(a, grad, c0, c1);
    default: return step_range_impl<G, VMB, true, true>(a, grad, c0, c1);
  }
}

// Chunks [c0, c1) of a grid of 4-bit codes on the hand-scheduled step; a grid of 2-bit codes takes the SIMD-layer
// step on AVX-512 (adam_simd.h, included first by adam_cpu.cpp), else the portable vector path (the same bytes on
// every path).
template <typename G, int MB, int CB>
inline void step_range_grid(const ChunkArgs& a, const G* grad, int64_t c0, int64_t c1) {
  if constexpr (CB == 4) {
    step_range_mb<G, MB>(a, grad, c0, c1);
  } else {
#if defined(FP4_SIMD_STEP) && FP4_SIMD_STEP
    simd_step::range_v<G, MB, CB>(a, grad, c0, c1);
#else
    vec::range_v<G, MB, CB>(a, grad, c0, c1);
#endif
  }
}

// Chunks [c0, c1), instantiated per grid of FP4_V_GRIDS by its mantissa and code bits.
template <typename G>
inline void step_range_avx512(const ChunkArgs& a, const G* grad, int64_t c0, int64_t c1) {
  if (c0 >= c1) return;
#define FP4_V_CASE(name, id, mbits, block, cbits) \
  case id: return step_range_grid<G, mbits, cbits>(a, grad, c0, c1);
  switch (a.v_kind) { FP4_V_GRIDS(FP4_V_CASE) }
#undef FP4_V_CASE
}

#else

template <typename G>
inline void step_range_avx512(const ChunkArgs&, const G*, int64_t, int64_t) {}  // never called: have_avx512() is false

#endif  // FP4_HAVE_AVX512

}  // namespace fp4adam
