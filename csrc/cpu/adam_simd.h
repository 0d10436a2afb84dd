// The fused FP4AdamW chunk step written once against the SIMD layer (simd.h); the NEON and AVX2 builds run it in
// place of the portable vector path, and the AVX-512 build carries it beside its hand-scheduled step
// (FP4_AVX512_LAYER_STEP, adam_cpu.cpp). Same operations in the same order as chunk_scalar (adam_chunk.h), so the bytes
// are the scalar path's, which are reference_step.py's.
//
// Per chunk of 1024 elements:
//   update   decode m and sqrt(v) by table lookup (one bf16-exact row per block scale, times the chunk's
//            fp32 scale), step the weights, keep the new m and u (v for NVFP4 v) in a buffer and fold each
//            block's maximum of the patterns as it goes;
//   pass 1   the chunk's tensor scale, and the E4M3 scale and multiplier of 16 blocks at a time;
//   pass 2   codes by integer arithmetic on the fp32 patterns: every code is (X >> S) of a lane value X that
//            rounds in place (nearest even: + half - 1 + lsb; stochastic: + the top random bits), with the sign
//            of E2M1 added at bit S + 3 and the unsigned grids' bias subtracted with saturation (below the
//            grid: code 0); the encoder's lane order lets 16 codes pack with three shift-inserts.
// A grid of 2-bit codes (ue2m0) runs the same machinery: its 256 code bytes of a chunk are spread to nibbles before
// the update (expand2) and the nibbles folded back after the encode (compress2).
// Every v format and rounding, fp32 and bf16 gradients, the gradient scale, maximize, weight decay and the bf16
// copy (hence the compact masters) run here. A partial last chunk runs the portable path; a buffer with a
// non-finite value (only after an overflow) is encoded by the scalar rules, which drop its block, as the other
// paths do.
#pragma once

#include <stdint.h>
#include <string.h>

#include "cpu/adam_chunk.h"
#include "cpu/simd.h"

namespace fp4adam {

#if FP4_SIMD_LAYER && (FP4_CPU_VEC || FP4_SIMD_AVX512)
#define FP4_SIMD_STEP 1
namespace simd_step {

namespace S = fp4simd;
using S::F16;
using S::U16;

// Row s of a grid: its 16 values times e4m3_value(s). Exact (at most 9 significant bits, far from the fp32
// range's ends; a NaN scale gives a NaN row), so (value * scale) * s_dec is one multiply of a row by s_dec.
// grid[mb]: E2M1 (mb 0) or the unsigned grid of mb mantissa bits; grid2[mb]: the unsigned grid of 2-bit codes with
// mb mantissa bits (codes 0..3; the row's other entries are never looked up).
struct Luts {
  S::Lut256 grid[FP4_V_MBITS_MAX + 1];
  S::Lut256 grid2[2];
  Luts() {
    for (int s = 0; s < 256; ++s) {
      const float sv = fp4::e4m3_value((uint8_t)s);
      float a[16];
      for (int mb = 0; mb <= FP4_V_MBITS_MAX; ++mb) {
        for (int k = 0; k < 16; ++k) a[k] = (mb ? fp4::ugrid_value((uint8_t)k, mb) : fp4::e2m1_value((uint8_t)k)) * sv;
        S::set_row(grid[mb], s, a);
      }
      for (int mb = 0; mb < 2; ++mb) {
        for (int k = 0; k < 16; ++k) a[k] = k < 4 ? fp4::ugrid_value((uint8_t)k, mb, 2) * sv : 0.0f;
        S::set_row(grid2[mb], s, a);
      }
    }
  }
  const S::Lut256& rows(int mb, int cb) const { return cb == 2 ? grid2[mb] : grid[mb]; }
};
inline const Luts& luts() {
  static const Luts t;
  return t;
}

// A chunk's 2-bit codes (256 bytes, four a byte) as nibbles (512 bytes, two a byte: the 4-bit layout), and back
// (fp4_codec.h's crumbs_to_nibbles / nibbles_to_crumbs). Byte j of 2-bit codes holds elements 4j..4j+3; nibble
// bytes 2j and 2j+1 hold the same four.
static inline void expand2(const uint8_t* __restrict in, uint8_t* __restrict out) {
  FP4_VEC_LOOP
  for (int j = 0; j < kChunk / 4; ++j) {
    const uint16_t two = fp4::crumbs_to_nibbles(in[j]);
    out[2 * j] = (uint8_t)two;
    out[2 * j + 1] = (uint8_t)(two >> 8);
  }
}
static inline void compress2(const uint8_t* __restrict in, uint8_t* __restrict out) {
  FP4_VEC_LOOP
  for (int j = 0; j < kChunk / 4; ++j) out[j] = fp4::nibbles_to_crumbs(in[2 * j], in[2 * j + 1]);
}

FP4_SIMD_FN F16 load_grad16(const float* g) { return S::load(g); }
FP4_SIMD_FN F16 load_grad16(const uint16_t* g) { return S::load_bf16(g); }

// fp4::fmix32 on 16 lanes.
FP4_SIMD_FN U16 fmix32(U16 h) {
  h = S::ixor(h, S::shr<16>(h));
  h = S::imul(h, S::splat_u(0x85EBCA6Bu));
  h = S::ixor(h, S::shr<13>(h));
  h = S::imul(h, S::splat_u(0xC2B2AE35u));
  return S::ixor(h, S::shr<16>(h));
}

// ab + bit Sh of ab (the lsb that makes a round-half-up add round half to even): shift the bit to the top, add it back.
template <int Sh>
FP4_SIMD_FN U16 with_lsb(U16 ab) {
  return S::shr_add<31>(ab, S::shl<31 - Sh>(ab));
}

// The 16 codes of y (scaled) on grid MB with CB-bit codes (MB 0 with 4 bits: signed E2M1), nearest or stochastic
// with bits rnd (fp4_codec.h).
template <int MB, bool SR, int CB = 4>
FP4_SIMD_FN U16 codes(F16 y, U16 rnd) {
  if (MB == 0 && CB == 4) {
    const U16 yb = S::bits(y), mag = S::bits(S::abs(y));
    const F16 a = S::min(S::from_bits(mag), fp4::kE2M1Max);
    const U16 ab = S::bits(a);
    U16 x;
    if (SR) {  // a < 1: trunc(a * 2^23); else the pattern less (126 << 23), the larger of the two; then + rnd >> 10
      x = S::smax(S::fix_trunc<23>(S::min(a, 1.0f)), S::isub(ab, S::splat_u(126u << 23)));
      x = S::shr_add<10>(x, rnd);
    } else {  // a < 1: rint(a * 2) (the pattern of a + 2^22 counts halves); else the pattern rounded to 1 bit
      const U16 sub = S::shl<22>(S::bits(S::add(a, S::splat(4194304.0f))));
      const U16 nrm = S::iadd(with_lsb<22>(ab), S::splat_u(0x1FFFFFu - (252u << 22)));
      x = S::select(S::lt(a, S::splat(1.0f)), sub, nrm);
    }
    x = S::shr_add<6>(x, S::ixor(yb, mag));  // the sign: code bit 3
    return S::shr<22>(x);
  }
  constexpr int kShift = 23 - MB;
  // y >= 0. Subtracting the grid's bias saturates at 0 below its smallest value: code 0, as the rule says
  const U16 ab = S::bits(S::min(y, fp4::ugrid_max(MB)));
  U16 x;
  if (SR)
    x = S::shr_add<32 - kShift>(S::isub_sat(ab, S::splat_u(fp4::ugrid_bias(MB, CB) << 23)), rnd);
  else
    x = S::isub_sat(with_lsb<kShift>(ab), S::splat_u((fp4::ugrid_bias(MB, CB) << 23) - ((1u << (kShift - 1)) - 1u)));
  return S::shr<kShift>(x);
}

// Encodes one full chunk buffer whose block maxima (patterns of |x|) are bmax[64]: encode_chunk_scalar's rules.
// 2-bit codes (CB 2) are encoded as nibbles into a chunk buffer, then folded to four a byte (compress2).
template <int MB, bool SR, int CB = 4>
static inline void encode_chunk(const float* buf, const uint32_t* bmax, uint32_t key, uint32_t index0,
                                uint8_t* codes_final, uint8_t* scales, float* s_dec_out) {
  constexpr int nb = kChunk / 16;
  const float elem_max = fp4::grid_max(MB, CB);
  alignas(64) uint8_t nibbles[CB == 2 ? kChunk / 2 : 1];
  uint8_t* codes_out = CB == 2 ? nibbles : codes_final;
  U16 all = S::load_u(bmax);
  for (int q = 1; q < nb / 16; ++q) all = S::umax(all, S::load_u(bmax + 16 * q));
  const uint32_t amax = S::hmax(all);
  if (amax >= 0x7F800000u) {  // a non-finite value: the scalar rules, which drop its block
    encode_chunk_scalar(buf, kChunk, MB, SR, key, index0, codes_final, scales, s_dec_out, CB);
    return;
  }
  const fp4::TensorScale ts = fp4::tensor_scale(fp4::u2f(amax), elem_max);
  *s_dec_out = ts.dec;
  // pass 1: fp4::block_scale of 16 blocks at a time. x = (amax_b / elem_max) * enc, at most 448; its E4M3 code
  // rounds x * 2^9 to an integer below 2^-6, else the pattern to 3 mantissa bits (R), and the scale's value is
  // that rounding itself: code / 2^9, or R with the dropped bits cleared. The code is 0 (a dead block, k 0)
  // only on the first path.
  alignas(64) float kb[nb];
  for (int q = 0; q < nb / 16; ++q) {
    const F16 x = S::min(S::mul(S::div(S::from_bits(S::load_u(bmax + 16 * q)), S::splat(elem_max)), S::splat(ts.enc)),
                         fp4::kE4M3Max);
    const U16 sub = S::to_int_rne(S::mul(x, S::splat(512.0f)));
    const U16 r = S::iadd(with_lsb<20>(S::bits(x)), S::splat_u(0x7FFFFu));
    const U16 small = S::lt(x, S::splat(0.015625f));
    const U16 sc = S::select(small, sub, S::isub(S::shr<20>(r), S::splat_u(120u << 3)));
    const F16 val = S::from_bits(S::select(small, S::bits(S::mul(S::to_float(sub), S::splat(0.001953125f))),
                                           S::iand(r, S::splat_u(0xFFF00000u))));
    const F16 k = S::min(S::div(S::splat(1.0f), S::mul(val, S::splat(ts.dec))), fp4::kF32Max);
    S::store(kb + 16 * q, S::from_bits(S::select(S::ieq(sc, S::splat_u(0)), S::splat_u(0), S::bits(k))));
    S::store_bytes(scales + 16 * q, sc);
  }
  // pass 2: codes; a dead block (scale 0) is all zeros. h: the hash inputs of the block's elements
  // (fp4::sr_bits(key, index) = fmix32(key + index * 0x9E3779B1), index = index0 + 16 b + lane)
  U16 h = S::iadd(S::splat_u(key + index0 * 0x9E3779B1u), S::imul(S::enc_index(), S::splat_u(0x9E3779B1u)));
  const U16 h_step = S::splat_u(16u * 0x9E3779B1u);
  for (int b = 0; b < nb; ++b, h = S::iadd(h, h_step)) {
    if (MB == 0 && CB == 4 && scales[b] == 0) {  // (the unsigned grids give code 0 for y = 0 * x by themselves)
      memset(codes_out + b * 8, 0, 8);
      continue;
    }
    const F16 y = S::mul(S::load_enc(buf + b * 16), kb[b]);
    S::store_codes(codes_out + b * 8, codes<MB, SR, CB>(y, SR ? fmix32(h) : h));
  }
  if (CB == 2) compress2(nibbles, codes_final);
}

// The update of one full chunk: new weights (and their bf16 copy), the new m and u (v for NVFP4 v) in mbuf and
// ubuf, and each block's maximum pattern of |m| and of u in mmax and umax.
template <typename G, int VMB, int VCB, bool WD, bool BF16>
void update(const ChunkArgs& a, const G* grad, int64_t c, const S::Lut256& mrows, const S::Lut256& vrows,
            float* mbuf, float* ubuf, uint32_t* mmax, uint32_t* umax) {
  constexpr bool VNv = !vec::kUgrid<VMB, VCB>;
  const int64_t i0 = c * kChunk;
  alignas(64) uint8_t vnib[VCB == 2 ? kChunk / 2 : 1];
  if (VCB == 2) expand2(a.v_codes + i0 / 4, vnib);
  const uint8_t *mc = a.m_codes + i0 / 2, *ms = a.m_scales + i0 / 16, *vc = VCB == 2 ? vnib : a.v_codes + i0 / 2,
                *vs = a.v_scales + i0 / 16;
  const float msd = a.m_ts[c], vsd = a.v_ts[c];
  const Scalars s = a.s;
  const F16 b1 = S::splat(s.b1), omb1 = S::splat(s.omb1), b2 = S::splat(s.b2), omb2 = S::splat(s.omb2),
            eps = S::splat(s.eps), rsbc2 = S::splat(s.rsbc2), step = S::splat(s.step_size);
  float* param = a.param + i0;
  const G* g0 = grad + i0;
  uint16_t* bf = BF16 ? a.bf16_out + i0 : nullptr;
  const bool gscaled = a.gscaled, maximize = a.maximize;
  const float gscale = a.gscale;
  for (int b4 = 0; b4 < kChunk / 16; b4 += 4) {
    S::Part mp[4], up[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const int b = b4 + j;
      const F16 mo = S::mul(S::lut(mrows, ms[b], mc + b * 8), msd);
      const F16 uo = S::mul(S::lut(vrows, vs[b], vc + b * 8), vsd);
      F16 g = load_grad16(g0 + b * 16);
      if (gscaled) g = S::mul(g, gscale);
      if (maximize) g = S::neg(g);
      F16 p = S::load(param + b * 16);
      if (WD) p = S::mul(p, s.decay);
      const F16 m = S::add(S::mul(mo, b1), S::mul(g, omb1));
      const F16 vo = VNv ? uo : S::mul(uo, uo);
      const F16 v = S::add(S::mul(vo, b2), S::mul(S::mul(g, g), omb2));
      const F16 u = S::sqrt(v);
      const F16 d = S::add(S::mul(u, rsbc2), eps);
      p = S::sub(p, S::mul(S::div(m, d), step));
      const F16 un = VNv ? v : u;
      S::store(param + b * 16, p);
      if (BF16) S::store_bf16(bf + b * 16, p);
      S::store(mbuf + b * 16, m);
      S::store(ubuf + b * 16, un);
      // |m| as patterns; u (or v) as they are: a sign bit set, like any non-finite value, lands >= 0x7F800000
      mp[j] = S::max_bits(S::bits(S::abs(m)));
      up[j] = S::max_bits(S::bits(un));
    }
    S::block_maxima(mp[0], mp[1], mp[2], mp[3], mmax + b4);
    S::block_maxima(up[0], up[1], up[2], up[3], umax + b4);
  }
}

// VMB, VCB: the mantissa and code bits of the v state's grid (0 and 4: v itself in NVFP4).
template <typename G, int VMB, int VCB, bool SR, bool VSR>
void chunk(const ChunkArgs& a, const G* grad, int64_t c, const S::Lut256& mrows, const S::Lut256& vrows) {
  alignas(64) float mbuf[kChunk], ubuf[kChunk];
  alignas(64) uint32_t mmax[kChunk / 16], umax[kChunk / 16];
  switch ((a.s.weight_decay ? 2 : 0) | (a.bf16_out ? 1 : 0)) {
    case 0: update<G, VMB, VCB, false, false>(a, grad, c, mrows, vrows, mbuf, ubuf, mmax, umax); break;
    case 1: update<G, VMB, VCB, false, true>(a, grad, c, mrows, vrows, mbuf, ubuf, mmax, umax); break;
    case 2: update<G, VMB, VCB, true, false>(a, grad, c, mrows, vrows, mbuf, ubuf, mmax, umax); break;
    default: update<G, VMB, VCB, true, true>(a, grad, c, mrows, vrows, mbuf, ubuf, mmax, umax); break;
  }
  const int64_t i0 = c * kChunk;
  const uint32_t index0 = (uint32_t)(i0 % kSegment);
  encode_chunk<0, SR>(mbuf, mmax, m_key(a, i0), index0, a.m_codes + i0 / 2, a.m_scales + i0 / 16, &a.m_ts[c]);
  encode_chunk<VMB, VSR, VCB>(ubuf, umax, v_key(a, i0), index0, a.v_codes + i0 * VCB / 8, a.v_scales + i0 / 16,
                              &a.v_ts[c]);
}

template <typename G, int VMB, int VCB, bool SR, bool VSR>
void range(const ChunkArgs& a, const G* grad, int64_t c0, int64_t c1) {
  const Luts& t = luts();
  for (int64_t c = c0; c < c1; ++c) {
    if ((c + 1) * kChunk <= a.n)
      chunk<G, VMB, VCB, SR, VSR>(a, grad, c, t.grid[0], t.rows(VMB, VCB));
    else
      step_range_vec(a, grad, c, c + 1);  // the partial last chunk
  }
}

template <typename G, int VMB, int VCB>
void range_v(const ChunkArgs& a, const G* grad, int64_t c0, int64_t c1) {
  switch ((a.m_stochastic ? 2 : 0) | (a.v_stochastic ? 1 : 0)) {
    case 0: return range<G, VMB, VCB, false, false>(a, grad, c0, c1);
    case 1: return range<G, VMB, VCB, false, true>(a, grad, c0, c1);
    case 2: return range<G, VMB, VCB, true, false>(a, grad, c0, c1);
    default: return range<G, VMB, VCB, true, true>(a, grad, c0, c1);
  }
}

}  // namespace simd_step

// Chunks [c0, c1) on the SIMD-layer step, instantiated per grid of FP4_V_GRIDS by its mantissa and code bits.
template <typename G>
void step_range_simd(const ChunkArgs& a, const G* grad, int64_t c0, int64_t c1) {
#define FP4_V_CASE(name, id, mbits, block, cbits) \
  case id: return simd_step::range_v<G, mbits, cbits>(a, grad, c0, c1);
  switch (a.v_kind) { FP4_V_GRIDS(FP4_V_CASE) }
#undef FP4_V_CASE
}
#else
#define FP4_SIMD_STEP 0
#endif  // FP4_SIMD_LAYER && (FP4_CPU_VEC || FP4_SIMD_AVX512)

// The build's vector step: the SIMD-layer step where the layer has an implementation (NEON, AVX2, AVX-512), else
// the portable vector path.
template <typename G>
void step_range_fast(const ChunkArgs& a, const G* grad, int64_t c0, int64_t c1) {
#if FP4_SIMD_STEP
  step_range_simd(a, grad, c0, c1);
#else
  step_range_vec(a, grad, c0, c1);
#endif
}

}  // namespace fp4adam
