// The SIMD layer (simd.h, which includes this file on AArch64 without SVE) on Advanced SIMD (NEON): a 16-element
// block is four 128-bit registers.
//
// Decode is two byte-table lookups (tbl) per block: every decoded value of the step is a bf16-exact fp32
// (4-bit grid value times an E4M3 scale), so a table row is two 16-byte planes, the low and high byte of the
// bf16 half, and the low half of each fp32 is zero. The encoder reads a block de-interleaved (ld4: register k
// holds elements k, k+4, k+8, k+12), so the nibbles pack with three shift-inserts and one narrowing.
#pragma once

#include <arm_neon.h>
#include <stdint.h>

#include "fp4_codec.h"

namespace fp4simd {

struct F16 {
  float32x4_t v[4];
};
struct U16 {
  uint32x4_t v[4];
};
using Part = uint32x4_t;  // a partial block maximum (4 lanes)

#define FP4_SIMD_MAP_F(name, expr) \
  FP4_SIMD_FN F16 name(F16 a, F16 b) { \
    F16 r; \
    for (int k = 0; k < 4; ++k) r.v[k] = expr; \
    return r; \
  }
#define FP4_SIMD_MAP_U(name, expr) \
  FP4_SIMD_FN U16 name(U16 a, U16 b) { \
    U16 r; \
    for (int k = 0; k < 4; ++k) r.v[k] = expr; \
    return r; \
  }

FP4_SIMD_MAP_F(add, vaddq_f32(a.v[k], b.v[k]))
FP4_SIMD_MAP_F(sub, vsubq_f32(a.v[k], b.v[k]))
FP4_SIMD_MAP_F(mul, vmulq_f32(a.v[k], b.v[k]))
FP4_SIMD_MAP_F(div, vdivq_f32(a.v[k], b.v[k]))
FP4_SIMD_MAP_F(min, vminq_f32(a.v[k], b.v[k]))  // FMIN: NaN in, NaN out
FP4_SIMD_MAP_F(max, vmaxq_f32(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(iand, vandq_u32(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(ior, vorrq_u32(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(ixor, veorq_u32(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(iadd, vaddq_u32(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(isub, vsubq_u32(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(imul, vmulq_u32(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(umax, vmaxq_u32(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(umin, vminq_u32(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(ieq, vceqq_u32(a.v[k], b.v[k]))
FP4_SIMD_MAP_U(isub_sat, vqsubq_u32(a.v[k], b.v[k]))  // unsigned, saturating at 0
FP4_SIMD_MAP_U(smax, vreinterpretq_u32_s32(vmaxq_s32(vreinterpretq_s32_u32(a.v[k]), vreinterpretq_s32_u32(b.v[k]))))
#undef FP4_SIMD_MAP_F
#undef FP4_SIMD_MAP_U

FP4_SIMD_FN F16 splat(float x) {
  const float32x4_t s = vdupq_n_f32(x);
  return F16{{s, s, s, s}};
}
FP4_SIMD_FN U16 splat_u(uint32_t x) {
  const uint32x4_t s = vdupq_n_u32(x);
  return U16{{s, s, s, s}};
}
FP4_SIMD_FN F16 mul(F16 a, float s) {
  F16 r;
  for (int k = 0; k < 4; ++k) r.v[k] = vmulq_n_f32(a.v[k], s);
  return r;
}
FP4_SIMD_FN F16 sqrt(F16 a) {
  F16 r;
  for (int k = 0; k < 4; ++k) r.v[k] = vsqrtq_f32(a.v[k]);
  return r;
}
FP4_SIMD_FN F16 abs(F16 a) {  // FABS: clears the sign bit, NaN included
  F16 r;
  for (int k = 0; k < 4; ++k) r.v[k] = vabsq_f32(a.v[k]);
  return r;
}
FP4_SIMD_FN F16 neg(F16 a) {
  F16 r;
  for (int k = 0; k < 4; ++k) r.v[k] = vnegq_f32(a.v[k]);
  return r;
}
FP4_SIMD_FN U16 bits(F16 a) {
  U16 r;
  for (int k = 0; k < 4; ++k) r.v[k] = vreinterpretq_u32_f32(a.v[k]);
  return r;
}
FP4_SIMD_FN F16 from_bits(U16 a) {
  F16 r;
  for (int k = 0; k < 4; ++k) r.v[k] = vreinterpretq_f32_u32(a.v[k]);
  return r;
}
template <int S>
FP4_SIMD_FN U16 shr(U16 a) {
  U16 r;
  for (int k = 0; k < 4; ++k) r.v[k] = vshrq_n_u32(a.v[k], S);
  return r;
}
template <int S>
FP4_SIMD_FN U16 shl(U16 a) {
  U16 r;
  for (int k = 0; k < 4; ++k) r.v[k] = vshlq_n_u32(a.v[k], S);
  return r;
}
// a + (b >> S): one USRA per register
template <int S>
FP4_SIMD_FN U16 shr_add(U16 a, U16 b) {
  U16 r;
  for (int k = 0; k < 4; ++k) r.v[k] = vsraq_n_u32(a.v[k], b.v[k], S);
  return r;
}
FP4_SIMD_FN U16 lt(F16 a, F16 b) {
  U16 r;
  for (int k = 0; k < 4; ++k) r.v[k] = vcltq_f32(a.v[k], b.v[k]);
  return r;
}
FP4_SIMD_FN U16 select(U16 mask, U16 x, U16 y) {
  U16 r;
  for (int k = 0; k < 4; ++k) r.v[k] = vbslq_u32(mask.v[k], x.v[k], y.v[k]);
  return r;
}
template <int N>
FP4_SIMD_FN U16 fix_trunc(F16 a) {
  U16 r;
  for (int k = 0; k < 4; ++k) r.v[k] = vreinterpretq_u32_s32(vcvtq_n_s32_f32(a.v[k], N));
  return r;
}
// (int32)rint(a), ties to even (FCVTNS)
FP4_SIMD_FN U16 to_int_rne(F16 a) {
  U16 r;
  for (int k = 0; k < 4; ++k) r.v[k] = vreinterpretq_u32_s32(vcvtnq_s32_f32(a.v[k]));
  return r;
}
FP4_SIMD_FN F16 to_float(U16 a) {  // lanes as int32
  F16 r;
  for (int k = 0; k < 4; ++k) r.v[k] = vcvtq_f32_s32(vreinterpretq_s32_u32(a.v[k]));
  return r;
}

// ---- memory ---------------------------------------------------------------------------------------------

// Loads and stores of whole blocks as register pairs (LDP/STP): the four-register LD1/ST1 forms tie the block
// to four consecutive registers, which GCC pays for with moves (and spills, for ST1).
FP4_SIMD_FN F16 load(const float* p) {
  return F16{{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}};
}
FP4_SIMD_FN void store(float* p, F16 a) {
  for (int k = 0; k < 4; ++k) vst1q_f32(p + 4 * k, a.v[k]);
}
FP4_SIMD_FN U16 load_u(const uint32_t* p) {
  const uint32x4x4_t x = vld1q_u32_x4(p);
  return U16{{x.val[0], x.val[1], x.val[2], x.val[3]}};
}
FP4_SIMD_FN F16 load_bf16(const uint16_t* p) {
  const uint16x8_t lo = vld1q_u16(p), hi = vld1q_u16(p + 8);
  return F16{{vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(lo), 16)),
              vreinterpretq_f32_u32(vshll_high_n_u16(lo, 16)),
              vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(hi), 16)),
              vreinterpretq_f32_u32(vshll_high_n_u16(hi, 16))}};
}
// fp4master::to_bf16 on 16 lanes: (b + 0x7FFF + lsb) >> 16, a NaN gives 0x7FC0
FP4_SIMD_FN void store_bf16(uint16_t* p, F16 a) {
  uint16x4_t h[4];
  for (int k = 0; k < 4; ++k) {
    const uint32x4_t b = vreinterpretq_u32_f32(a.v[k]);
    const uint32x4_t r = vaddq_u32(vaddq_u32(b, vdupq_n_u32(0x7FFFu)), vandq_u32(vshrq_n_u32(b, 16), vdupq_n_u32(1)));
    const uint16x4_t ok = vmovn_u32(vceqq_f32(a.v[k], a.v[k]));
    h[k] = vbsl_u16(ok, vshrn_n_u32(r, 16), vdup_n_u16(0x7FC0));
  }
  vst1q_u16(p, vcombine_u16(h[0], h[1]));
  vst1q_u16(p + 8, vcombine_u16(h[2], h[3]));
}
// The low byte of each lane (values 0..255) as 16 bytes, element order.
FP4_SIMD_FN void store_bytes(uint8_t* p, U16 a) {
  const uint16x8_t lo = vcombine_u16(vmovn_u32(a.v[0]), vmovn_u32(a.v[1]));
  const uint16x8_t hi = vcombine_u16(vmovn_u32(a.v[2]), vmovn_u32(a.v[3]));
  vst1q_u8(p, vcombine_u8(vmovn_u16(lo), vmovn_u16(hi)));
}

// ---- horizontal maxima ----------------------------------------------------------------------------------

// 16 unsigned patterns folded to 4 lanes (three vertical maxima); block_maxima finishes four blocks at once
// with three pairwise maxima (UMAXP) instead of one across-lanes reduction per block.
FP4_SIMD_FN Part max_bits(U16 a) { return vmaxq_u32(vmaxq_u32(a.v[0], a.v[1]), vmaxq_u32(a.v[2], a.v[3])); }
FP4_SIMD_FN void block_maxima(Part p0, Part p1, Part p2, Part p3, uint32_t* out4) {
  vst1q_u32(out4, vpmaxq_u32(vpmaxq_u32(p0, p1), vpmaxq_u32(p2, p3)));
}
FP4_SIMD_FN uint32_t hmax(U16 a) { return vmaxvq_u32(max_bits(a)); }

// ---- decode: 4-bit codes through a 16-entry table ---------------------------------------------------------

// 256 rows (one per E4M3 scale code) of 16 values, each exactly representable in bf16. A row is two byte
// planes, the low and the high byte of each value's bf16 half, 32 bytes loaded with one instruction.
struct Lut256 {
  alignas(64) uint8_t row[256][32];
};
FP4_SIMD_FN void set_row(Lut256& t, int s, const float* v16) {
  for (int k = 0; k < 16; ++k) {
    const uint32_t b = fp4::f2u(v16[k]) >> 16;
    t.row[s][k] = (uint8_t)b;
    t.row[s][16 + k] = (uint8_t)(b >> 8);
  }
}
// The values of 16 codes c (one a byte) in row s, element order.
FP4_SIMD_FN F16 lut_codes(const Lut256& t, unsigned s, uint8x16_t c) {
  const uint8x16x2_t planes = vld1q_u8_x2(t.row[s]);
  const uint8x16_t lo = vqtbl1q_u8(planes.val[0], c), hi = vqtbl1q_u8(planes.val[1], c);
  const uint16x8_t h0 = vreinterpretq_u16_u8(vzip1q_u8(lo, hi)), h1 = vreinterpretq_u16_u8(vzip2q_u8(lo, hi));
  return F16{{vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h0), 16)),
              vreinterpretq_f32_u32(vshll_high_n_u16(h0, 16)),
              vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h1), 16)),
              vreinterpretq_f32_u32(vshll_high_n_u16(h1, 16))}};
}
// The values of row s at 16 codes packed two a byte (element 2i in the low nibble of byte i), element order.
FP4_SIMD_FN F16 lut(const Lut256& t, unsigned s, const uint8_t* packed8) {
  const uint8x16_t q = vcombine_u8(vld1_u8(packed8), vdup_n_u8(0));
  return lut_codes(t, s, vzip1q_u8(vandq_u8(q, vdupq_n_u8(15)), vshrq_n_u8(q, 4)));
}

// ---- encode: the encoder's lane order and the nibble packing -------------------------------------------

// Register k, lane i holds element 4i + k.
FP4_SIMD_FN F16 load_enc(const float* p) {
  const float32x4x4_t x = vld4q_f32(p);
  return F16{{x.val[0], x.val[1], x.val[2], x.val[3]}};
}
FP4_SIMD_FN U16 enc_index() {
  U16 r;
  for (int k = 0; k < 4; ++k) {
    const uint32_t e[4] = {(uint32_t)k, (uint32_t)(4 + k), (uint32_t)(8 + k), (uint32_t)(12 + k)};
    r.v[k] = vld1q_u32(e);
  }
  return r;
}
// Codes 0..15 in the encoder's order -> 8 bytes: byte 2i = c[4i] | c[4i+1] << 4, byte 2i+1 = c[4i+2] | c[4i+3] << 4.
FP4_SIMD_FN void store_codes(uint8_t* out8, U16 c) {
  const uint32x4_t b01 = vsliq_n_u32(c.v[0], c.v[1], 4), b23 = vsliq_n_u32(c.v[2], c.v[3], 4);
  vst1_u8(out8, vreinterpret_u8_u16(vmovn_u32(vsliq_n_u32(b01, b23, 8))));
}

}  // namespace fp4simd
