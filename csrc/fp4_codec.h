// fp4_codec.h: the scalar rules of docs/design.md section 3, the one source of the math.
//
// Every function is inline and usable from host and device code. The CPU kernels (csrc/cpu) and the
// CUDA kernels (csrc/cuda) are loops around these; fp4offload/formats/bits.py and reference.py
// implement the same rules with torch ops and serve as the oracle in tests.
//
// Build without fast math and without FMA contraction (-ffp-contract=off, nvcc --fmad=false): every
// multiply and divide below must round on its own, exactly as the reference does.
#pragma once

#include <stdint.h>
#include <string.h>

#include "grids.h"

#if defined(__CUDACC__)
#define FP4_HD __host__ __device__ __forceinline__
#else
#define FP4_HD static inline
#endif

namespace fp4 {

constexpr float kE2M1Max = 6.0f;
constexpr float kE4M3Max = 448.0f;
constexpr float kUfp4Max = 1.5f;
constexpr float kUfp4Min = 0.0078125f;  // 2^-7
constexpr float kF32Max = 3.40282346638528859812e+38f;
constexpr uint8_t kE4M3NaN = 0x7F;
constexpr uint8_t kE8M0NaN = 0xFF;
constexpr int kNvBlock = 16;
constexpr int kMxBlock = 32;

FP4_HD uint32_t f2u(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#endif
}

FP4_HD float u2f(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}

FP4_HD bool is_finite(float x) { return (f2u(x) & 0x7F800000u) != 0x7F800000u; }
FP4_HD float fabs_(float x) { return u2f(f2u(x) & 0x7FFFFFFFu); }
FP4_HD float fmin_(float a, float b) { return b < a ? b : a; }  // a is never NaN here
FP4_HD float fmax_(float a, float b) { return b > a ? b : a; }

// Round-half-to-even of a >= 0 to an integer, for a < 2^22 (the subnormal grids below).
FP4_HD int32_t rint_pos(float a) {
#if defined(__CUDA_ARCH__)
  return __float2int_rn(a);
#else
  return (int32_t)__builtin_rintf(a);  // default rounding mode: nearest, ties to even
#endif
}

// Round the fp32 pattern of a >= 0 to `mbits` mantissa bits, ties to even; returns (exp << mbits) | mant.
FP4_HD int32_t rne_mantissa(float a, int mbits) {
  const int shift = 23 - mbits;
  const uint32_t b = f2u(a);
  const uint32_t lsb = (b >> shift) & 1u;
  return (int32_t)((b + ((1u << (shift - 1)) - 1u) + lsb) >> shift);
}

// ---- E2M1 (3.1) ------------------------------------------------------------------------------------

FP4_HD float e2m1_value(uint8_t code) {
  const float mags[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = mags[code & 7];
  return (code & 8) ? -m : m;
}

// Magnitude code of a in [0, 6], nearest, ties to even code.
FP4_HD uint8_t e2m1_encode_mag(float a) {
  int32_t c = a < 1.0f ? rint_pos(a * 2.0f) : rne_mantissa(a, 1) - (126 << 1);
  return (uint8_t)(c > 7 ? 7 : c);
}

// Stochastic rounding (3.9) of a in [0, 6]: the position of a on the E2M1 grid as a fixed-point number
// with 22 fraction bits per grid step, X = (code below a) * 2^22 + floor(fraction * 2^22), plus the top 22
// random bits; the carry out of the fraction is the round-up (probability fraction, to within 2^-22).
// a >= 1: X is the fp32 pattern less (126 << 23) (one kept mantissa bit, so the 22 bits below it are the
// fraction); a < 1: the grid is k * 0.5 and X = trunc(a * 2^23). a = 6 has a zero fraction, so X + r < 8 * 2^22.
FP4_HD uint8_t e2m1_encode_mag_sr(float a, uint32_t rnd) {
  const int32_t x = a < 1.0f ? (int32_t)(a * 8388608.0f) : (int32_t)(f2u(a) - (126u << 23));
  return (uint8_t)((x + (int32_t)(rnd >> 10)) >> 22);
}

// Signed code of y (already scaled): clamp to +-6, sign from the sign bit (so -0 -> 8).
FP4_HD uint8_t e2m1_encode(float y, bool stochastic, uint32_t rnd) {
  const float a = fmin_(fabs_(y), kE2M1Max);
  const uint8_t mag = stochastic ? e2m1_encode_mag_sr(a, rnd) : e2m1_encode_mag(a);
  return (uint8_t)(mag | ((f2u(y) >> 28) & 8u));
}

// ---- E4M3 "fn" (bias 7, max 448, subnormals to 2^-9, 0x7F/0xFF NaN) --------------------------------

FP4_HD uint8_t e4m3_encode(float x) {  // nearest even, saturating, sign kept; x is not NaN
  const float a = fmin_(fabs_(x), kE4M3Max);
  int32_t c = a < 0.015625f ? rint_pos(a * 512.0f) : rne_mantissa(a, 3) - (120 << 3);
  if (c > 0x7E) c = 0x7E;
  return (uint8_t)(c | ((f2u(x) >> 24) & 0x80u));
}

FP4_HD float e4m3_value(uint8_t code) {
  const uint32_t e = (code >> 3) & 0xF, m = code & 7;
  float mag;
  if ((code & 0x7F) == 0x7F) {
    mag = u2f(0x7FC00000u);
  } else if (e == 0) {
    mag = (float)m * 0.001953125f;  // m * 2^-9, exact
  } else {
    mag = u2f(((e + 120u) << 23) | (m << 20));
  }
  return (code & 0x80) ? -mag : mag;
}

// ---- E8M0 -------------------------------------------------------------------------------------------

// Exact 2^k in fp32 for integer k in [-127, 127].
FP4_HD float pow2(int32_t k) { return k >= -126 ? u2f((uint32_t)(k + 127) << 23) : u2f(0x00400000u); }

FP4_HD float e8m0_value(uint8_t code) { return code == kE8M0NaN ? u2f(0x7FC00000u) : pow2((int32_t)code - 127); }

// Shared exponent for an MX block from the bits of amax (finite, >= 0). rceil: smallest e with
// amax <= elem_max * 2^e, elem_max = (1 + max_mant / 2^23) * 2^emax. floor: floor(log2 amax) - emax.
FP4_HD int32_t mx_exponent(float amax, uint32_t max_mant, int32_t emax, bool floor_mode) {
  const uint32_t b = f2u(amax);
  const int32_t exp = (int32_t)((b >> 23) & 0xFF);
  if (exp == 0) return -127;
  int32_t e = exp - 127 - emax;
  if (!floor_mode && (b & 0x7FFFFF) > max_mant) e += 1;
  return e < -127 ? -127 : (e > 127 ? 127 : e);
}

// ---- unsigned zero-free grids for u = sqrt(v) (3.7) ---------------------------------------------------
//
// `cbits`-bit codes (4 or 2) with `mbits` mantissa bits and nb = 2^cbits >> mbits binades, the top one [1, 2):
// code c = (e << mbits) | m is 2^(e - nb + 1) * (1 + m / 2^mbits). ufp4 (E3M1) is mbits 1: 2^-7 .. 1.5; ue2m2 is
// mbits 2: 2^-3 .. 1.75; the 2-bit ue2m0 is mbits 0: 1/8, 1/4, 1/2, 1. No zero: values below the grid take code
// 0, the smallest value.

FP4_HD uint32_t ugrid_bias(int mbits, int cbits = 4) {  // fp32 exponent field of binade 0
  return 128u - ((1u << cbits) >> mbits);
}
FP4_HD float ugrid_min(int mbits, int cbits = 4) { return u2f((uint32_t)ugrid_bias(mbits, cbits) << 23); }
FP4_HD float ugrid_max(int mbits) { return u2f((127u << 23) | (((1u << mbits) - 1u) << (23 - mbits))); }

FP4_HD float ugrid_value(uint8_t code, int mbits, int cbits = 4) {
  return u2f((((uint32_t)(code >> mbits) + ugrid_bias(mbits, cbits)) << 23) |
             ((uint32_t)(code & ((1u << mbits) - 1u)) << (23 - mbits)));
}

FP4_HD uint8_t ugrid_encode(float y, int mbits, int cbits = 4) {  // y >= 0, already scaled; nearest, ties to even
  const float a = fmin_(y, ugrid_max(mbits));
  if (a < ugrid_min(mbits, cbits)) return 0;
  const int32_t top = (1 << cbits) - 1;
  int32_t c = rne_mantissa(a, mbits) - (int32_t)(ugrid_bias(mbits, cbits) << mbits);
  return (uint8_t)(c > top ? top : c);
}

// Stochastic rounding (3.9) of y >= 0 (already scaled): X = pattern - (bias << 23) holds the code above
// 23 - mbits fraction bits (the rule of e2m1_encode_mag_sr above 1), and the top 23 - mbits random bits carry
// into it with probability equal to the fraction. Below the grid: code 0, as the nearest rule. The largest
// value has a zero fraction, so the code stays <= 2^cbits - 1.
FP4_HD uint8_t ugrid_encode_sr(float y, uint32_t rnd, int mbits, int cbits = 4) {
  const float a = fmin_(y, ugrid_max(mbits));
  if (a < ugrid_min(mbits, cbits)) return 0;
  const int shift = 23 - mbits;
  return (uint8_t)(((int32_t)(f2u(a) - (ugrid_bias(mbits, cbits) << 23)) + (int32_t)(rnd >> (32 - shift))) >>
                   shift);
}

FP4_HD float ufp4_value(uint8_t code) { return ugrid_value(code, 1); }
FP4_HD uint8_t ufp4_encode(float y) { return ugrid_encode(y, 1); }
FP4_HD uint8_t ufp4_encode_sr(float y, uint32_t rnd) { return ugrid_encode_sr(y, rnd, 1); }

// FP4AdamW's v state is one of the grids of FP4_V_GRIDS (grids.h, generated from fp4offload/_config/grids.py), by
// its kernel id (the fused steps' v_kind). The mantissa bits of v_kind's unsigned grid u = sqrt(v) is stored on; 0
// for v itself in NVFP4 (signed E2M1); -1 when v_kind names no grid.
#define FP4_V_MBITS_OF(name, id, mbits, block, cbits) v_kind == id ? mbits:
FP4_HD constexpr int v_mbits(int64_t v_kind) { return FP4_V_GRIDS(FP4_V_MBITS_OF) - 1; }
#undef FP4_V_MBITS_OF
// The bits of one code of v_kind's grid: 4 (two codes a byte) or 2 (four); 4 when v_kind names no grid.
#define FP4_V_CBITS_OF(name, id, mbits, block, cbits) v_kind == id ? cbits:
FP4_HD constexpr int v_cbits(int64_t v_kind) { return FP4_V_GRIDS(FP4_V_CBITS_OF) 4; }
#undef FP4_V_CBITS_OF
#define FP4_V_BLOCK_OF(name, id, mbits, block, cbits)                                                     \
  static_assert(block == kNvBlock && (cbits == 4 || cbits == 2) && mbits >= 0 && mbits < cbits, \
                "v grid " #name ": not a grid the kernels encode");
FP4_V_GRIDS(FP4_V_BLOCK_OF)
#undef FP4_V_BLOCK_OF
// The kernel ids by name (kV_ue2m2, ...), for code that names a grid.
#define FP4_V_ENUM_OF(name, id, mbits, block, cbits) kV_##name = id,
enum VKind { FP4_V_GRIDS(FP4_V_ENUM_OF) };
#undef FP4_V_ENUM_OF
// " <id> (<name>)" for every grid, for messages.
#define FP4_V_KIND_TEXT_OF(name, id, mbits, block, cbits) " " #id " (" #name ")"
#define FP4_V_KINDS_TEXT FP4_V_GRIDS(FP4_V_KIND_TEXT_OF)
// The largest element value of a grid: E2M1's 6 (mbits 0 with 4-bit codes) or the unsigned grid's.
FP4_HD float grid_max(int mbits, int cbits = 4) { return mbits == 0 && cbits == 4 ? kE2M1Max : ugrid_max(mbits); }

// FP4AdamW's sqrt(v) with v_rounding="stochastic" draws its bits as m does (sr_key(seed, stream, 0) of the same
// step and segment) from the seed XOR this constant, so the two states of an element get independent bits.
constexpr uint32_t kVSeedXor = 0x2545F491u;

// ---- NVFP4 / ufp4 scales (3.3) ----------------------------------------------------------------------

struct TensorScale {
  float enc, dec;
};

// elem_max is 6 (nvfp4) or 1.5 (ufp4); s_enc = elem_max * 448 / amax, s_dec = 1 / s_enc; amax 0 -> both 0.
FP4_HD TensorScale tensor_scale(float amax, float elem_max) {
  TensorScale s;
  if (amax > 0.0f) {
    s.enc = fmin_((elem_max * kE4M3Max) / amax, kF32Max);
    s.dec = 1.0f / s.enc;
  } else {  // an all-zero scope (or an amax override of 0): every block scale becomes 0
    s.enc = 0.0f;
    s.dec = 0.0f;
  }
  return s;
}

FP4_HD uint8_t block_scale_code(float amax_b, float elem_max, float s_enc) {
  return e4m3_encode(fmin_((amax_b / elem_max) * s_enc, kE4M3Max));
}

// Multiplier that maps a block's elements onto the element grid; 0 when the block scale is 0.
// Clamped to the largest finite fp32: with a clamped tensor scale the product scale_b * s_dec can be so
// small that its reciprocal overflows, and x * inf would turn zeros into NaN.
FP4_HD float block_encode_scale(uint8_t scale_code, float s_dec) {
  if (scale_code == 0) return 0.0f;
  return fmin_(1.0f / (e4m3_value(scale_code) * s_dec), kF32Max);
}

// A block's E4M3 scale code and its multiplier k; `live` is false and k is 0 for a dead block (a zero
// scale, or `bad`: non-finite values in it), whose codes are all zero.
FP4_HD uint8_t block_scale(float amax_b, bool bad, float elem_max, TensorScale s, float& k, bool& live) {
  const uint8_t sc = block_scale_code(amax_b, elem_max, s.enc);
  live = sc != 0 && !bad;
  k = live ? block_encode_scale(sc, s.dec) : 0.0f;
  return sc;
}

// ---- int2: 2-bit saved activations (docs/design.md 3.11) ------------------------------------------------
//
// Code c (0..3) is the odd level 2c - 3 (-3, -1, 1, 3) times its block's scale. Blocks of 16 elements carry an
// E4M3 scale under one fp32 tensor scale, as NVFP4 with an element maximum of 3, but the block scale is rounded
// up, not to nearest: no scaled element lies beyond the outer levels, so stochastic rounding between the two
// levels around it is unbiased. Codes are packed four a byte (pack_codes2's layout): 4 bytes a block.

constexpr float kInt2Max = 3.0f;

// The E4M3 scale code of a block with finite amax_b > 0: the smallest code whose value is at least the wanted
// scale (amax_b / 3) * s_enc. It is 0 (the block is stored as zeros) only when that product underflows fp32 to 0.
FP4_HD uint8_t int2_scale_code(float amax_b, float s_enc) {
  const float want = fmin_((amax_b / kInt2Max) * s_enc, kE4M3Max);
  uint8_t c = e4m3_encode(want);
  if (e4m3_value(c) < want && c < 0x7E) ++c;
  return c;
}

// The code of y = x * k (|y| <= 3 up to rounding; clamped): u = (y + 3) / 2 in [0, 3] sits between codes
// floor(u) and floor(u) + 1. Stochastic: up with probability frac(u) (the top 24 random bits against it);
// nearest: ties to the even code. Branch-free, for the host loops to vectorize.
FP4_HD uint8_t int2_encode(float y, bool stochastic, uint32_t rnd) {
  const float u = fmin_(fmax_((y + kInt2Max) * 0.5f, 0.0f), kInt2Max);
  const int32_t lo = (int32_t)u;
  const float frac = u - (float)lo;
  const int32_t up = stochastic ? (int32_t)((float)(int32_t)(rnd >> 8) * 5.9604644775390625e-08f < frac)
                                : ((int32_t)(frac > 0.5f) | ((int32_t)(frac == 0.5f) & lo));
  return (uint8_t)(lo + (up & 1));
}

// The level of a code: -3, -1, 1, 3.
FP4_HD float int2_level(uint8_t code) { return (float)(2 * (int32_t)(code & 3u) - 3); }

// Codes of a block with a zero or NaN scale: level 1 everywhere, so a zero block decodes to +0.
constexpr uint8_t kInt2DeadByte = 0xAA;

// ---- the packed layout: two 4-bit codes a byte ------------------------------------------------------
//
// E2M1 and ufp4 codes (0..15) are stored two a byte: element 2i in bits 0-3 of byte i, element 2i+1 in
// bits 4-7; an odd count ends with a byte whose high nibble is code 0. Four bytes read as a little-endian
// 32-bit word (x86 and CUDA devices are little-endian) hold elements 0..7 of the word, element j in bits
// 4j..4j+3. Every kernel packs and unpacks through these (the AVX-512 form of the same rule is the
// "packed layout" section of csrc/cpu/nvfp4_avx512.h; the torch form is formats/reference.py's
// pack_nibbles / unpack_nibbles).

// Code c (0..15; or a byte of two packed codes) moved to element j (0..7) of a packed word.
FP4_HD uint32_t word_slot(uint32_t c, int j) { return c << (4 * j); }

// The code of element j (0..7) of a packed word.
FP4_HD uint8_t word_code(uint32_t w, int j) { return (uint8_t)((w >> (4 * j)) & 0xFu); }

// One byte of two codes: c0 (the even element) low, c1 high.
FP4_HD uint8_t pack2(uint8_t c0, uint8_t c1) { return (uint8_t)(word_slot(c0, 0) | word_slot(c1, 1)); }

// The code of element i of a packed array.
FP4_HD uint8_t code_at(const uint8_t* packed, int64_t i) { return word_code(packed[i >> 1], (int)(i & 1)); }

// 2-bit codes (the 2-bit grid of FP4AdamW's v state, int2 activations) are stored four a byte, element 4i + k in bits
// 2k..2k+1 of byte i; a block of 16 is one little-endian 32-bit word, element j in bits 2j..2j+1 (formats/reference.py's
// pack_codes / unpack_codes with 2 bits). Every kernel packs and unpacks 2-bit codes through the helpers below.

// 2-bit code c moved to element j (0..15) of a packed word.
FP4_HD uint32_t code2_slot(uint32_t c, int j) { return c << (2 * j); }

// The 2-bit code of element j (0..15) of a packed word.
FP4_HD uint8_t code2_of(uint32_t w, int j) { return (uint8_t)((w >> (2 * j)) & 3u); }

// One byte of four 2-bit codes.
FP4_HD uint8_t pack4x2(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3) {
  return (uint8_t)(code2_slot(c0, 0) | code2_slot(c1, 1) | code2_slot(c2, 2) | code2_slot(c3, 3));
}

// The code of element i of a packed array of 2-bit codes.
FP4_HD uint8_t code2_at(const uint8_t* packed, int64_t i) { return code2_of(packed[i >> 2], (int)(i & 3)); }

// A byte of four 2-bit codes as the two bytes of the 4-bit layout holding the same four elements (low byte: elements
// 0 and 1, high byte: 2 and 3), and back. The host step decodes and encodes a 2-bit chunk through its 4-bit tables so.
FP4_HD uint16_t crumbs_to_nibbles(uint32_t b) {
  return (uint16_t)(((b & 3u) | ((b << 2) & 0x30u)) | ((((b >> 4) & 3u) | ((b >> 2) & 0x30u)) << 8));
}
FP4_HD uint8_t nibbles_to_crumbs(uint32_t lo, uint32_t hi) {
  return (uint8_t)((lo & 3u) | ((lo >> 2) & 0x0Cu) | ((hi & 3u) << 4) | ((hi << 2) & 0xC0u));
}

// n codes -> (n + 1) / 2 packed bytes.
FP4_HD void pack_codes(const uint8_t* codes, int n, uint8_t* out) {
  for (int j = 0; j + 1 < n; j += 2) out[j >> 1] = pack2(codes[j], codes[j + 1]);
  if (n & 1) out[n >> 1] = pack2(codes[n - 1], 0);
}

// n 2-bit codes (a multiple of 4) -> n / 4 packed bytes.
FP4_HD void pack_codes2(const uint8_t* codes, int n, uint8_t* out) {
  for (int j = 0; j < n; j += 4) out[j >> 2] = pack4x2(codes[j], codes[j + 1], codes[j + 2], codes[j + 3]);
}

// ---- counter-based random bits (3.9) ----------------------------------------------------------------

FP4_HD uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

FP4_HD uint32_t sr_key(uint32_t seed, uint32_t stream, uint32_t index_hi) {
  return fmix32((seed * 0x9E3779B9u) ^ fmix32(stream ^ (index_hi * 0x7FEB352Du)));
}

FP4_HD uint32_t sr_bits(uint32_t key, uint64_t index) { return fmix32((uint32_t)index * 0x9E3779B1u + key); }

}  // namespace fp4
