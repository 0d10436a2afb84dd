// One chunk of the fused FP4AdamW step on the host, without torch: the argument block, the scalar path, the
// portable vector path, and the compact masters' rebuild and write-back. csrc/cpu/adam_cpu.cpp drives these
// over a tensor with at::parallel_for; tests/emulation/isa_driver/driver.cpp drives the same code standalone, cross-built
// for aarch64 and run under qemu.
//
// Two paths, one rule set (csrc/fp4_codec.h, csrc/master_bits.h):
//   * chunk_scalar: the rules element by element; the oracle of the other paths.
//   * chunk_vec: the same operations in the same order, written as branch-free loops over 16-element blocks and
//     1024-element chunks that the compiler vectorizes for the target it is built for (AVX2, NEON, SVE at any
//     vector length). The vector builds run the SIMD-layer step of adam_simd.h and come here for a partial
//     last chunk. Decoding is bit arithmetic on the code (no table gathers), block maxima are integer maxima of
//     the fp32 patterns, and every rounding is an integer operation on the pattern or a plain IEEE operation, so
//     the bits do not depend on the vector width. Build without fast math and with -ffp-contract=off.
// The AVX-512 path (adam_avx512.h) is hand-scheduled; all three give the same bits.
#pragma once

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "fp4_codec.h"
#include "master_bits.h"

#if defined(__GNUC__) && !defined(__clang__)
#define FP4_VEC_LOOP _Pragma("GCC ivdep")
#else
#define FP4_VEC_LOOP
#endif

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
  bool maximize, m_stochastic, v_stochastic;
  int v_kind;  // the v state's grid: a kernel id of FP4_V_GRIDS (grids.h)
  uint32_t seed, stream0;
  uint16_t* bf16_out;
  bool gscaled;  // multiply each gradient by gscale in fp32 as it is read (an engine's clipping factor)
  float gscale;
};

// The stochastic-rounding keys of m and sqrt(v) for the segment holding element i0.
inline uint32_t m_key(const ChunkArgs& a, int64_t i0) {
  return a.m_stochastic ? fp4::sr_key(a.seed, (uint32_t)(a.stream0 + i0 / kSegment), 0u) : 0u;
}
inline uint32_t v_key(const ChunkArgs& a, int64_t i0) {
  return a.v_stochastic ? fp4::sr_key(a.seed ^ fp4::kVSeedXor, (uint32_t)(a.stream0 + i0 / kSegment), 0u) : 0u;
}

// ---- scalar path ------------------------------------------------------------------------------------

inline float load_grad(const float* g, int64_t i) { return g[i]; }
inline float load_grad(const uint16_t* g, int64_t i) { return fp4::u2f((uint32_t)g[i] << 16); }

// Decodes one packed 1x16 chunk of `cnt` elements into out[0..cnt), zeros after it up to the block end.
// mbits 0 with 4-bit codes: E2M1; else the unsigned grid of cbits-bit codes with mbits mantissa bits
// (fp4::ugrid_value).
inline void decode_chunk_scalar(const uint8_t* codes, const uint8_t* scales, float s_dec, int cnt, int mbits,
                                float* out, int cbits = 4) {
  const int nb = (cnt + 15) / 16;
  const bool ugrid = mbits || cbits != 4;
  for (int b = 0; b < nb; ++b) {
    const float sv = fp4::e4m3_value(scales[b]);
    for (int j = 0; j < 16; ++j) {
      const int i = b * 16 + j;
      const uint8_t c = cbits == 2 ? fp4::code2_at(codes, i) : fp4::code_at(codes, i);
      const float val = ugrid ? fp4::ugrid_value(c, mbits, cbits) : fp4::e2m1_value(c);
      out[i] = i < cnt ? (val * sv) * s_dec : 0.0f;
    }
  }
}

// Encodes x[0..16*nb) (zeros past cnt) as one chunk: one fp32 scale, E4M3 scale per 16, codes.
// Non-finite values (only from overflow) are left out of the amax and their block is written as zeros,
// as the reference does with nonfinite='propagate' off.
inline void encode_chunk_scalar(const float* x, int cnt, int mbits, bool stochastic, uint32_t key, uint32_t index0,
                                uint8_t* codes, uint8_t* scales, float* s_dec_out, int cbits = 4) {
  const int nb = (cnt + 15) / 16;
  const bool ugrid = mbits || cbits != 4;
  const float elem_max = fp4::grid_max(mbits, cbits);
  float amax_b[kChunk / 16];
  bool bad_b[kChunk / 16];
  float amax = 0.0f;
  for (int b = 0; b < nb; ++b) {
    float m = 0.0f;
    bool bad = false;
    for (int j = 0; j < 16; ++j) {
      const float v = x[b * 16 + j];
      const bool fin = fp4::is_finite(v);
      bad |= !fin;
      m = fp4::fmax_(m, fin ? fp4::fabs_(v) : 0.0f);
    }
    amax_b[b] = m;
    bad_b[b] = bad;
    amax = fp4::fmax_(amax, m);
  }
  const fp4::TensorScale ts = fp4::tensor_scale(amax, elem_max);
  *s_dec_out = ts.dec;
  for (int b = 0; b < nb; ++b) {
    float k;
    bool live;
    scales[b] = fp4::block_scale(amax_b[b], bad_b[b], elem_max, ts, k, live);
    uint8_t c[16];
    for (int j = 0; j < 16; ++j) {
      if (!live) {
        c[j] = 0;
        continue;
      }
      const float y = x[b * 16 + j] * k;
      const uint32_t rnd = stochastic ? fp4::sr_bits(key, (uint64_t)(index0 + b * 16 + j)) : 0u;
      if (ugrid)
        c[j] = stochastic ? fp4::ugrid_encode_sr(fp4::fabs_(y), rnd, mbits, cbits)
                          : fp4::ugrid_encode(fp4::fabs_(y), mbits, cbits);
      else
        c[j] = fp4::e2m1_encode(y, stochastic, rnd);
    }
    if (cbits == 2)
      fp4::pack_codes2(c, 16, codes + b * 4);
    else
      fp4::pack_codes(c, 16, codes + b * 8);
  }
}

// The update of one element (reference_step.py's order). u_old is the decoded sqrt(v) (or v itself when v_nv).
inline void update_one(const Scalars& s, bool maximize, bool v_nv, float g, float& p, float mo, float uo, float& m,
                       float& ustore) {
  if (maximize) g = -g;  // (the caller applied the gradient scale)
  if (s.weight_decay) p = p * s.decay;
  m = (mo * s.b1) + (g * s.omb1);
  const float vo = v_nv ? uo : uo * uo;
  const float v = (vo * s.b2) + ((g * g) * s.omb2);
  const float u = std::sqrt(v);
  const float d = (u * s.rsbc2) + s.eps;
  p = p - ((m / d) * s.step_size);
  ustore = v_nv ? v : u;
}

template <typename G>
void chunk_scalar(const ChunkArgs& a, const G* grad, int64_t c) {
  const int64_t i0 = c * kChunk;
  const int cnt = (int)std::min<int64_t>(kChunk, a.n - i0);
  const int nb = (cnt + 15) / 16;
  float mbuf[kChunk], ubuf[kChunk];
  const int vmb = fp4::v_mbits(a.v_kind), vcb = fp4::v_cbits(a.v_kind);
  const bool v_nv = vmb == 0 && vcb == 4;
  uint8_t* vcodes = a.v_codes + i0 * vcb / 8;
  decode_chunk_scalar(a.m_codes + i0 / 2, a.m_scales + i0 / 16, a.m_ts[c], cnt, 0, mbuf);
  decode_chunk_scalar(vcodes, a.v_scales + i0 / 16, a.v_ts[c], cnt, vmb, ubuf, vcb);
  for (int j = 0; j < cnt; ++j) {
    const int64_t i = i0 + j;
    float p = a.param[i];
    const float g = a.gscaled ? load_grad(grad, i) * a.gscale : load_grad(grad, i);
    update_one(a.s, a.maximize, v_nv, g, p, mbuf[j], ubuf[j], mbuf[j], ubuf[j]);
    a.param[i] = p;
    if (a.bf16_out) a.bf16_out[i] = fp4master::to_bf16(p);
  }
  for (int j = cnt; j < nb * 16; ++j) mbuf[j] = ubuf[j] = 0.0f;
  const uint32_t index0 = (uint32_t)(i0 % kSegment);
  encode_chunk_scalar(mbuf, cnt, 0, a.m_stochastic, m_key(a, i0), index0, a.m_codes + i0 / 2, a.m_scales + i0 / 16,
                      &a.m_ts[c]);
  encode_chunk_scalar(ubuf, cnt, vmb, a.v_stochastic, v_key(a, i0), index0, vcodes, a.v_scales + i0 / 16, &a.v_ts[c],
                      vcb);
}

// ---- portable vector path ---------------------------------------------------------------------------
//
// Each loop below has a fixed trip count (16, or a chunk of whole blocks), no branches in its body, and unit
// stride, so GCC's vectorizer turns it into whole-vector code for the target of the translation unit.

namespace vec {

// fp32 pattern of E2M1 code c (sign in bit 3): mag 0, 0.5, then exponent (mag >> 1) + 126 with mantissa bit mag & 1.
static inline uint32_t e2m1_bits(uint32_t c) {
  const uint32_t mag = c & 7u;
  const uint32_t nrm = (((mag >> 1) + 126u) << 23) | ((mag & 1u) << 22);
  const uint32_t low = mag == 1u ? 0x3F000000u : 0u;
  return (mag >= 2u ? nrm : low) | ((c & 8u) << 28);
}

// fp32 pattern of unsigned-grid code c with MB mantissa bits and CB-bit codes (fp4::ugrid_value).
template <int MB, int CB = 4>
static inline uint32_t ugrid_bits(uint32_t c) {
  return (((c >> MB) + fp4::ugrid_bias(MB, CB)) << 23) | ((c & ((1u << MB) - 1u)) << (23 - MB));
}

// Whether MB mantissa bits with CB-bit codes is an unsigned grid (not E2M1).
template <int MB, int CB>
constexpr bool kUgrid = MB != 0 || CB != 4;

// out[i] = (value(code_i) * scale_b) * s_dec over nb whole blocks (decode_chunk_scalar's rule; the caller zeroes
// what lies past the data). A block's 16 codes are two little-endian words; code j of a word is bits 4j..4j+3.
// 2-bit codes (CB 2): one word a block, code j in bits 2j..2j+1.
template <int MB, int CB = 4>
static inline void decode_chunk(const uint8_t* __restrict codes, const uint8_t* __restrict scales, float s_dec, int nb,
                                float* __restrict out) {
  float sv[kChunk / 16];
  for (int b = 0; b < nb; ++b) sv[b] = fp4::e4m3_value(scales[b]);
  if (CB == 2) {
    for (int b = 0; b < nb; ++b) {
      uint32_t w;
      memcpy(&w, codes + b * 4, 4);
      const float s = sv[b];
      FP4_VEC_LOOP
      for (int j = 0; j < 16; ++j) out[b * 16 + j] = (fp4::u2f(ugrid_bits<MB, CB>(fp4::code2_of(w, j))) * s) * s_dec;
    }
    return;
  }
  for (int b = 0; b < nb; ++b) {
    uint32_t lo, hi;
    memcpy(&lo, codes + b * 8, 4);
    memcpy(&hi, codes + b * 8 + 4, 4);
    const float s = sv[b];
    FP4_VEC_LOOP
    for (int j = 0; j < 8; ++j) {
      const uint32_t c0 = (lo >> (4 * j)) & 15u, c1 = (hi >> (4 * j)) & 15u;
      out[b * 16 + j] = (fp4::u2f(MB ? ugrid_bits<MB>(c0) : e2m1_bits(c0)) * s) * s_dec;
      out[b * 16 + 8 + j] = (fp4::u2f(MB ? ugrid_bits<MB>(c1) : e2m1_bits(c1)) * s) * s_dec;
    }
  }
}

// fp4::e4m3_encode(a) for a >= 0 (not NaN), as a select of both roundings.
static inline uint32_t e4m3_code_pos(float x) {
  const float a = fp4::fmin_(x, fp4::kE4M3Max);
  const uint32_t ab = fp4::f2u(a);
  const int32_t sub = (int32_t)__builtin_rintf(a * 512.0f);
  const int32_t nrm = (int32_t)((ab + 0x7FFFFu + ((ab >> 20) & 1u)) >> 20) - (120 << 3);
  const int32_t c = a < 0.015625f ? sub : nrm;
  return (uint32_t)(c > 0x7E ? 0x7E : c);
}

// fp4::e4m3_value(c) for codes 0..0x7E.
static inline float e4m3_value_pos(uint32_t c) {
  const uint32_t e = c >> 3, m = c & 7u;
  const float sub = (float)(int32_t)m * 0.001953125f;
  const float nrm = fp4::u2f(((e + 120u) << 23) | (m << 20));
  return e == 0 ? sub : nrm;
}

// The code of the scaled value y: E2M1 (MB 0 with 4-bit codes, sign kept) or the unsigned grid of CB-bit codes,
// nearest or stochastic (rnd).
template <int MB, bool SR, int CB = 4>
static inline uint32_t code_of(float y, uint32_t rnd) {
  const uint32_t yb = fp4::f2u(y);
  if (!kUgrid<MB, CB>) {
    const float a = fp4::fmin_(fp4::u2f(yb & 0x7FFFFFFFu), fp4::kE2M1Max);
    const uint32_t ab = fp4::f2u(a);
    uint32_t mag;
    if (SR) {  // both sides computed, then selected: a select, not a branch, for the vectorizer
      const int32_t sub = (int32_t)(a * 8388608.0f);  // a <= 6: in range
      const int32_t nrm = (int32_t)(ab - (126u << 23));
      mag = (uint32_t)(((a < 1.0f ? sub : nrm) + (int32_t)(rnd >> 10)) >> 22);
    } else {
      const int32_t sub = (int32_t)__builtin_rintf(a * 2.0f);
      const int32_t nrm = (int32_t)((ab + 0x1FFFFFu + ((ab >> 22) & 1u)) >> 22) - (126 << 1);
      mag = (uint32_t)(a < 1.0f ? sub : nrm);
    }
    return mag | ((yb >> 28) & 8u);
  }
  constexpr int kShift = 23 - MB;
  const float a = fp4::fmin_(fp4::u2f(yb & 0x7FFFFFFFu), fp4::ugrid_max(MB));
  const uint32_t ab = fp4::f2u(a);
  int32_t c;
  if (SR)
    c = ((int32_t)(ab - (fp4::ugrid_bias(MB, CB) << 23)) + (int32_t)(rnd >> (32 - kShift))) >> kShift;
  else
    c = (int32_t)((ab + ((1u << (kShift - 1)) - 1u) + ((ab >> kShift) & 1u)) >> kShift) -
        (int32_t)(fp4::ugrid_bias(MB, CB) << MB);
  return a < fp4::ugrid_min(MB, CB) ? 0u : (uint32_t)c;
}

// Encodes buf[0..16*nb) (zeros past the data) as one chunk: encode_chunk_scalar's rules, loop by loop.
template <int MB, bool SR, int CB = 4>
static inline void encode_chunk(const float* __restrict buf, int nb, uint32_t key, uint32_t index0,
                                uint8_t* __restrict codes, uint8_t* __restrict scales, float* s_dec_out) {
  const float elem_max = fp4::grid_max(MB, CB);
  uint32_t amax_bits[kChunk / 16];
  for (int b = 0; b < nb; ++b) {  // |x| as patterns: the integer max is the float max for values >= +0
    uint32_t m = 0;
    FP4_VEC_LOOP
    for (int j = 0; j < 16; ++j) m = std::max(m, fp4::f2u(buf[b * 16 + j]) & 0x7FFFFFFFu);
    amax_bits[b] = m;
  }
  uint32_t all = 0;
  for (int b = 0; b < nb; ++b) all = std::max(all, amax_bits[b]);
  if (all >= 0x7F800000u) {  // a non-finite value (only after an overflow): the scalar rules, which drop its block
    encode_chunk_scalar(buf, nb * 16, MB, SR, key, index0, codes, scales, s_dec_out, CB);
    return;
  }
  const fp4::TensorScale ts = fp4::tensor_scale(fp4::u2f(all), elem_max);
  *s_dec_out = ts.dec;
  float kb[kChunk / 16];
  uint32_t live_b[kChunk / 16];
  FP4_VEC_LOOP
  for (int b = 0; b < nb; ++b) {  // fp4::block_scale on every block: code, live, multiplier
    const uint32_t sc = e4m3_code_pos(fp4::fmin_((fp4::u2f(amax_bits[b]) / elem_max) * ts.enc, fp4::kE4M3Max));
    const uint32_t live = sc != 0u;
    const float k = fp4::fmin_(1.0f / (e4m3_value_pos(sc) * ts.dec), fp4::kF32Max);
    kb[b] = live ? k : 0.0f;
    live_b[b] = live ? 0xFu : 0u;
    scales[b] = (uint8_t)sc;
  }
  alignas(64) uint32_t c[kChunk];
  for (int b = 0; b < nb; ++b) {
    const float k = kb[b];
    const uint32_t lv = live_b[b];
    const uint32_t base = key + (index0 + (uint32_t)(b * 16)) * 0x9E3779B1u;
    FP4_VEC_LOOP
    for (int j = 0; j < 16; ++j) {
      const float y = buf[b * 16 + j] * k;
      const uint32_t rnd = SR ? fp4::fmix32(base + (uint32_t)j * 0x9E3779B1u) : 0u;  // fp4::sr_bits(key, index)
      c[b * 16 + j] = code_of<MB, SR, CB>(y, rnd) & lv;
    }
  }
  if (CB == 2) {
    FP4_VEC_LOOP
    for (int j = 0; j < nb * 4; ++j)
      codes[j] = fp4::pack4x2(c[4 * j], c[4 * j + 1], c[4 * j + 2], c[4 * j + 3]);
    return;
  }
  FP4_VEC_LOOP
  for (int j = 0; j < nb * 8; ++j) codes[j] = (uint8_t)(c[2 * j] | (c[2 * j + 1] << 4));
}

template <typename G>
static inline float grad_value(const G* g, int64_t i) {
  return load_grad(g, i);
}

template <typename G, int VMB, int VCB, bool WD, bool MAX, bool BF16, bool GS>
static inline void update(const ChunkArgs& a, const G* __restrict grad, int64_t i0, int n16, float* __restrict mbuf,
                          float* __restrict ubuf) {
  constexpr bool VNv = !kUgrid<VMB, VCB>;
  const Scalars s = a.s;
  const float gs = a.gscale;
  float* __restrict param = a.param + i0;
  uint16_t* __restrict bf = BF16 ? a.bf16_out + i0 : nullptr;
  const G* __restrict g0 = grad + i0;
  FP4_VEC_LOOP
  for (int j = 0; j < n16; ++j) {
    float g = grad_value(g0, j);
    if (GS) g = g * gs;
    if (MAX) g = -g;
    float p = param[j];
    if (WD) p = p * s.decay;
    const float m = (mbuf[j] * s.b1) + (g * s.omb1);
    const float vo = VNv ? ubuf[j] : ubuf[j] * ubuf[j];
    const float v = (vo * s.b2) + ((g * g) * s.omb2);
    const float u = std::sqrt(v);
    const float d = (u * s.rsbc2) + s.eps;
    p = p - ((m / d) * s.step_size);
    param[j] = p;
    if (BF16) bf[j] = fp4master::to_bf16(p);
    mbuf[j] = m;
    ubuf[j] = VNv ? v : u;
  }
}

// VMB, VCB: the mantissa and code bits of the v state's grid (0 and 4: v itself in NVFP4).
template <typename G, int VMB, int VCB, bool SR, bool VSR, bool WD, bool MAX, bool BF16>
void chunk(const ChunkArgs& a, const G* grad, int64_t c) {
  const int64_t i0 = c * kChunk;
  const int cnt = (int)std::min<int64_t>(kChunk, a.n - i0);
  const int nb = (cnt + 15) / 16;
  alignas(64) float mbuf[kChunk], ubuf[kChunk];
  decode_chunk<0>(a.m_codes + i0 / 2, a.m_scales + i0 / 16, a.m_ts[c], nb, mbuf);
  decode_chunk<VMB, VCB>(a.v_codes + i0 * VCB / 8, a.v_scales + i0 / 16, a.v_ts[c], nb, ubuf);
  if (cnt == kChunk) {
    if (a.gscaled)
      update<G, VMB, VCB, WD, MAX, BF16, true>(a, grad, i0, kChunk, mbuf, ubuf);
    else
      update<G, VMB, VCB, WD, MAX, BF16, false>(a, grad, i0, kChunk, mbuf, ubuf);
  } else {
    if (a.gscaled)
      update<G, VMB, VCB, WD, MAX, BF16, true>(a, grad, i0, cnt, mbuf, ubuf);
    else
      update<G, VMB, VCB, WD, MAX, BF16, false>(a, grad, i0, cnt, mbuf, ubuf);
    for (int j = cnt; j < nb * 16; ++j) mbuf[j] = ubuf[j] = 0.0f;
  }
  const uint32_t index0 = (uint32_t)(i0 % kSegment);
  encode_chunk<0, SR>(mbuf, nb, m_key(a, i0), index0, a.m_codes + i0 / 2, a.m_scales + i0 / 16, &a.m_ts[c]);
  encode_chunk<VMB, VSR, VCB>(ubuf, nb, v_key(a, i0), index0, a.v_codes + i0 * VCB / 8, a.v_scales + i0 / 16, &a.v_ts[c]);
}

template <typename G, int VMB, int VCB, bool SR, bool VSR, bool WD, bool MAX>
void range_flags(const ChunkArgs& a, const G* grad, int64_t c0, int64_t c1) {
  if (a.bf16_out)
    for (int64_t c = c0; c < c1; ++c) chunk<G, VMB, VCB, SR, VSR, WD, MAX, true>(a, grad, c);
  else
    for (int64_t c = c0; c < c1; ++c) chunk<G, VMB, VCB, SR, VSR, WD, MAX, false>(a, grad, c);
}

template <typename G, int VMB, int VCB, bool SR, bool VSR>
void range_rounding(const ChunkArgs& a, const G* grad, int64_t c0, int64_t c1) {
  const int f = (a.s.weight_decay ? 2 : 0) | (a.maximize ? 1 : 0);
  switch (f) {
    case 0: return range_flags<G, VMB, VCB, SR, VSR, false, false>(a, grad, c0, c1);
    case 1: return range_flags<G, VMB, VCB, SR, VSR, false, true>(a, grad, c0, c1);
    case 2: return range_flags<G, VMB, VCB, SR, VSR, true, false>(a, grad, c0, c1);
    default: return range_flags<G, VMB, VCB, SR, VSR, true, true>(a, grad, c0, c1);
  }
}

template <typename G, int VMB, int VCB>
void range_v(const ChunkArgs& a, const G* grad, int64_t c0, int64_t c1) {
  switch ((a.m_stochastic ? 2 : 0) | (a.v_stochastic ? 1 : 0)) {
    case 0: return range_rounding<G, VMB, VCB, false, false>(a, grad, c0, c1);
    case 1: return range_rounding<G, VMB, VCB, false, true>(a, grad, c0, c1);
    case 2: return range_rounding<G, VMB, VCB, true, false>(a, grad, c0, c1);
    default: return range_rounding<G, VMB, VCB, true, true>(a, grad, c0, c1);
  }
}

}  // namespace vec

// Chunks [c0, c1) on the portable vector path, instantiated per grid of FP4_V_GRIDS by its mantissa and code bits.
template <typename G>
void step_range_vec(const ChunkArgs& a, const G* grad, int64_t c0, int64_t c1) {
#define FP4_V_CASE(name, id, mbits, block, cbits) \
  case id: return vec::range_v<G, mbits, cbits>(a, grad, c0, c1);
  switch (a.v_kind) { FP4_V_GRIDS(FP4_V_CASE) }
#undef FP4_V_CASE
}

template <typename G>
void step_range_scalar(const ChunkArgs& a, const G* grad, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; ++c) chunk_scalar(a, grad, c);
}

// ---- compact masters (fp4offload/_optim/master.py, normative) -----------------------------------------
//
// A group of elements [e0, e1) of a bf16 parameter `hi` is rebuilt into fp32 patterns bb[0..e1-e0), stepped
// like an fp32 master, and written back. Split (mode 1) keeps the int16 residual `lo` and the sorted positions
// `odd` (k: the first position >= e0; advanced past the group); bf16 (mode 2) rounds stochastically.

inline void master_rebuild(int mode, const uint16_t* hp, const int16_t* lp, const int64_t*& k, const int64_t* kend,
                           int64_t e0, int64_t e1, uint32_t* bb) {
  if (mode == 1) {
    for (int64_t i = e0; i < e1; ++i) {
      const bool is_odd = k < kend && *k == i;
      k += is_odd;
      bb[i - e0] = fp4master::split_join(hp[i], lp[i], is_odd);
    }
  } else {
    FP4_VEC_LOOP
    for (int64_t i = e0; i < e1; ++i) bb[i - e0] = (uint32_t)hp[i] << 16;
  }
}

// Split: the residuals of the group into lo (the parameter's bf16 half was written by the step's bf16 copy),
// and the positions that became odd appended to `odd_out`. bf16: hp from bb, rounded with the step's bits.
inline void master_store(int mode, const uint32_t* bb, int64_t e0, int64_t e1, uint32_t seed, uint32_t stream0,
                         uint16_t* hp, int16_t* lp, std::vector<int64_t>& odd_out) {
  if (mode == 1) {
    for (int64_t i = e0; i < e1; ++i) {
      bool o;
      lp[i] = fp4master::split_residual(bb[i - e0], o);
      if (o) odd_out.push_back(i);
    }
    return;
  }
  int64_t seg = -1;
  uint32_t key = 0;
  for (int64_t i = e0; i < e1; ++i) {
    if (i / kSegment != seg) {
      seg = i / kSegment;
      key = fp4::sr_key(seed, (uint32_t)(stream0 + seg), 1u);
    }
    hp[i] = fp4master::bf16_stochastic(bb[i - e0], fp4::sr_bits(key, (uint64_t)(i - seg * kSegment)) >> 16);
  }
}

}  // namespace fp4adam
