// The host codec's loops without torch: NVFP4/ufp4 (1x16 blocks or 16x16 tiles, per-tensor or per-scope scales,
// nearest or stochastic, an amax override) and MXFP4/MXFP8 encode and decode, parallel over blocks with
// fp4cpu::parallel_for. csrc/cpu/fp4_cpu.cpp binds them to torch (at::parallel_for, fp32/bf16/fp16 tensors);
// tests/emulation/isa_driver/driver.cpp runs them standalone (FP4_STANDALONE, serial, fp32), cross-built for aarch64.
// With `simd` set, the AVX-512 build runs its vector forms (nvfp4_avx512.h) and the AVX2, NEON and SVE builds the
// portable vector rows and MXFP4 blocks (nvfp4_rows.h); otherwise (and for what those leave out: partial blocks,
// MXFP8 off AVX-512) the scalar loops below, compiled for the build's target. Every path gives the same bytes.
#pragma once

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "fp4_codec.h"
#include "cpu/nvfp4_avx512.h"
#include "cpu/nvfp4_rows.h"
#include "cpu/parallel.h"

#if defined(__GNUC__) && !defined(__clang__)
#define FP4_CODEC_VEC_LOOP _Pragma("GCC ivdep")
#else
#define FP4_CODEC_VEC_LOOP
#endif

namespace fp4codec {

using fp4::kMxBlock;
using fp4::kNvBlock;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

using fp4cpu::amax_rows;
using fp4cpu::decode_row;
using fp4cpu::encode_row;
using fp4cpu::encode_tile;
using fp4cpu::load;

// Geometry shared by encode and decode: 1x16 blocks of the flat tensor, or 16x16 tiles of (rows, cols).
struct NvGeom {
  int64_t rows, cols, n, tile, rp, cp, R, C, nb, per, nscopes;
  NvGeom(int64_t rows_, int64_t cols_, int64_t tile_, int64_t scope) : rows(rows_), cols(cols_), tile(tile_) {
    n = rows * cols;
    rp = ceil_div(rows, 16) * 16;
    cp = ceil_div(cols, 16) * 16;
    R = rp / 16;
    C = cp / 16;
    nb = tile == 16 ? R * C : ceil_div(n, kNvBlock);
    per = (tile == 16 || !scope) ? std::max<int64_t>(nb, 1) : scope / kNvBlock;
    nscopes = std::max<int64_t>(ceil_div(nb, per), 1);
  }
  int64_t data_bytes() const { return tile == 16 ? rp * cp / 2 : nb * (kNvBlock / 2); }
};

template <typename T>
void nvfp4_encode_impl(const T* x, const NvGeom& g, bool ufp4, bool stochastic, uint32_t seed, uint32_t stream,
                       bool propagate, const float* amax_in, bool simd, uint8_t* data, uint8_t* scales,
                       std::vector<float>& s_dec_out, int64_t& nonfinite) {
  const float elem_max = ufp4 ? fp4::kUfp4Max : fp4::kE2M1Max;
  const bool tiled = g.tile == 16;
  std::vector<float> amax_b(g.nb);
  std::vector<int32_t> bad_b(g.nb);
  auto block_amax = [&](int64_t b) {  // per-block finite amax and non-finite count
    if (tiled) {
      const int64_t r0 = (b / g.C) * 16, c0 = (b % g.C) * 16;
      const int nrows = (int)std::max<int64_t>(std::min<int64_t>(16, g.rows - r0), 0);
      const int cnt = (int)std::max<int64_t>(std::min<int64_t>(16, g.cols - c0), 0);
      amax_rows(x + r0 * g.cols + c0, g.cols, nrows, cnt, simd, amax_b[b], bad_b[b]);
    } else {
      const int64_t i0 = b * kNvBlock;
      amax_rows(x + i0, 0, 1, (int)std::min<int64_t>(kNvBlock, g.n - i0), simd, amax_b[b], bad_b[b]);
    }
  };
  auto amax_range = [&](int64_t b0, int64_t b1) {  // block_amax on [b0, b1), 16 whole 1x16 blocks at a time
    int64_t b = b0;
#if FP4_HAVE_AVX512
    if (simd && !tiled)
      for (; b + 16 <= b1 && (b + 16) * kNvBlock <= g.n; b += 16)
        fp4cpu::amax_blocks16(x + b * kNvBlock, amax_b.data() + b, bad_b.data() + b);
#endif
    for (; b < b1; ++b) block_amax(b);
  };
  std::vector<fp4::TensorScale> ts(g.nscopes);
  auto encode_block = [&](int64_t b) {  // block scale, codes, packing
    const fp4::TensorScale& s = ts[b / g.per];
    float k;
    bool live;
    const uint8_t sc = fp4::block_scale(amax_b[b], bad_b[b] != 0, elem_max, s, k, live);
    scales[b] = bad_b[b] ? fp4::kE4M3NaN : sc;  // a caller without propagate raises, and drops all of this
    if (!tiled) {
      const int64_t i0 = b * kNvBlock;
      uint8_t* out = data + b * (kNvBlock / 2);
      if (!live) {
        memset(out, 0, kNvBlock / 2);
        return;
      }
      const uint32_t key = stochastic ? fp4::sr_key(seed, stream, (uint32_t)((uint64_t)i0 >> 32)) : 0u;
      encode_row(x + i0, (int)std::min<int64_t>(kNvBlock, g.n - i0), k, ufp4, stochastic, key, (uint64_t)i0, simd,
                 out);
    } else {
      encode_tile(x, g.rows, g.cols, g.cp, (b / g.C) * 16, (b % g.C) * 16, k, live, ufp4, stochastic, seed, stream,
                  simd, data);
    }
  };
  // blocks [b0, b1): 1x16 blocks four at a time where all four are whole and live (one pack, one store)
  auto encode_blocks = [&](int64_t b0, int64_t b1) {
    int64_t b = b0;
#if FP4_HAVE_AVX512
    if (simd && !tiled) {
      for (; b < b1 && b % 16; ++b) encode_block(b);
      // 16 blocks of one scope at a time: their scales in vector form, codes four blocks to a pack
      for (; b + 16 <= b1 && (b + 16) * kNvBlock <= g.n; b += 16) {
        int32_t anybad = 0;
        for (int q = 0; q < 16; ++q) anybad |= bad_b[b + q];
        const int64_t sc0 = b / g.per;
        if (anybad || (b + 15) / g.per != sc0) {
          for (int q = 0; q < 16; ++q) encode_block(b + q);
          continue;
        }
        const fp4::TensorScale& s = ts[sc0];
        alignas(64) float kb[16];
        const uint32_t live = fp4cpu::block_scales16(
            _mm512_loadu_ps(amax_b.data() + b), _mm512_set1_ps(elem_max), _mm512_set1_ps(s.enc),
            _mm512_set1_ps(s.dec), (__mmask16)0xFFFF, 16, scales + b, kb);
        const int64_t i0 = b * kNvBlock;
        const uint32_t key = stochastic ? fp4::sr_key(seed, stream, (uint32_t)((uint64_t)i0 >> 32)) : 0u;
        for (int q = 0; q < 16; q += 4) {
          const int64_t iq = i0 + q * kNvBlock;
          if (((live >> q) & 0xF) == 0xF) {
            fp4cpu::encode_rows4(x + iq, kb + q, ufp4, stochastic, key, (uint32_t)iq, data + iq / 2);
            continue;
          }
          for (int j = q; j < q + 4; ++j) {
            const int64_t ij = i0 + j * kNvBlock;
            if ((live >> j) & 1)
              encode_row(x + ij, (int)kNvBlock, kb[j], ufp4, stochastic, key, (uint64_t)ij, true, data + ij / 2);
            else
              memset(data + ij / 2, 0, kNvBlock / 2);
          }
        }
      }
      for (; b + 4 <= b1 && (b + 4) * kNvBlock <= g.n; b += 4) {
        float k[4];
        bool all_live = true;
        for (int q = 0; q < 4; ++q) {
          bool live;
          scales[b + q] = fp4::block_scale(amax_b[b + q], bad_b[b + q] != 0, elem_max, ts[(b + q) / g.per], k[q],
                                           live);
          all_live = all_live && live;
        }
        if (!all_live) {
          for (int q = 0; q < 4; ++q) encode_block(b + q);
          continue;
        }
        const int64_t i0 = b * kNvBlock;
        const uint32_t key = stochastic ? fp4::sr_key(seed, stream, (uint32_t)((uint64_t)i0 >> 32)) : 0u;
        fp4cpu::encode_rows4(x + i0, k, ufp4, stochastic, key, (uint32_t)i0, data + b * (kNvBlock / 2));
      }
    }
#endif
    for (; b < b1; ++b) encode_block(b);
  };
  s_dec_out.resize(g.nscopes);
  if (amax_in) {  // the tensor scales are given: one pass, each block encoded right after its amax (in L1)
    for (int64_t s = 0; s < g.nscopes; ++s) {
      ts[s] = fp4::tensor_scale(amax_in[s], elem_max);
      s_dec_out[s] = ts[s].dec;
    }
    fp4cpu::parallel_for(0, g.nb, tiled ? 16 : 1024, [&](int64_t b0, int64_t b1) {
      const int64_t step = tiled ? 8 : 64;  // a few KiB of blocks: their amax, then their codes (from L1)
      for (int64_t c0 = b0; c0 < b1; c0 += step) {
        const int64_t c1 = std::min(b1, c0 + step);
        amax_range(c0, c1);
        encode_blocks(c0, c1);
      }
    });
    nonfinite = 0;
    for (int64_t b = 0; b < g.nb; ++b) nonfinite += bad_b[b];
    return;
  }
  // pass 1: every block's amax, for the scopes' amax
  fp4cpu::parallel_for(0, g.nb, tiled ? 64 : 2048, [&](int64_t b0, int64_t b1) { amax_range(b0, b1); });
  std::vector<float> amax_s(g.nscopes, 0.0f);
  int64_t bad_total = 0;
  for (int64_t b = 0; b < g.nb; ++b) {
    float& m = amax_s[b / g.per];
    m = fp4::fmax_(m, amax_b[b]);
    bad_total += bad_b[b];
  }
  nonfinite = bad_total;
  if (bad_total && !propagate) return;  // the caller raises; nothing else to do
  for (int64_t s = 0; s < g.nscopes; ++s) {
    ts[s] = fp4::tensor_scale(amax_s[s], elem_max);
    s_dec_out[s] = ts[s].dec;
  }
  // pass 2
  fp4cpu::parallel_for(0, g.nb, tiled ? 16 : 1024, [&](int64_t b0, int64_t b1) { encode_blocks(b0, b1); });
}


template <typename T>
void nvfp4_decode_impl(const uint8_t* data, const uint8_t* scales, const float* s_dec, const NvGeom& g, bool ufp4,
                       bool simd, T* out) {
  if (g.tile == 16) {
    fp4cpu::parallel_for(0, g.R * g.C, 16, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r0 = (t / g.C) * 16, c0 = (t % g.C) * 16;
        const int cnt = (int)std::max<int64_t>(std::min<int64_t>(16, g.cols - c0), 0);
        const float sv = fp4::e4m3_value(scales[t]);
        for (int64_t r = r0; r < std::min<int64_t>(r0 + 16, g.rows); ++r)
          decode_row(data + (r * g.cp + c0) / 2, ufp4, sv, s_dec[0], cnt, simd, out + r * g.cols + c0);
      }
    });
    return;
  }
  fp4cpu::parallel_for(0, g.nb, 2048, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i0 = b * kNvBlock;
      decode_row(data + b * (kNvBlock / 2), ufp4, fp4::e4m3_value(scales[b]), s_dec[b / g.per],
                 (int)std::min<int64_t>(kNvBlock, g.n - i0), simd, out + i0);
    }
  });
}


template <typename T>
void mx_encode_impl(const T* x, int64_t n, bool fp8, bool floor_mode, bool stochastic, uint32_t seed,
                    uint32_t stream, bool propagate, bool simd, uint8_t* data, uint8_t* scales, int64_t& nonfinite) {
  const int64_t nb = ceil_div(n, kMxBlock);
  std::vector<int64_t> bad_per_block(nb);
  fp4cpu::parallel_for(0, nb, 1024, [&](int64_t b0, int64_t b1) {
    float v[kMxBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i0 = b * kMxBlock;
      const int cnt = (int)std::min<int64_t>(kMxBlock, n - i0);
#if FP4_HAVE_AVX512
      if (simd) {
        const uint32_t k = stochastic ? fp4::sr_key(seed, stream, (uint32_t)((uint64_t)i0 >> 32)) : 0u;
        bad_per_block[b] = fp4cpu::mx_block32(x + i0, cnt, fp8, floor_mode, propagate, stochastic, k, (uint32_t)i0,
                                              scales + b, data + (fp8 ? i0 : i0 / 2));
        continue;
      }
#elif FP4_CPU_VEC
      if (simd && !fp8 && cnt == kMxBlock) {
        const uint32_t k = stochastic ? fp4::sr_key(seed, stream, (uint32_t)((uint64_t)i0 >> 32)) : 0u;
        bad_per_block[b] = stochastic ? fp4cpu::vrow::mx4_block32<true>(x + i0, floor_mode, propagate, k, (uint32_t)i0,
                                                                        scales + b, data + i0 / 2)
                                      : fp4cpu::vrow::mx4_block32<false>(x + i0, floor_mode, propagate, k,
                                                                         (uint32_t)i0, scales + b, data + i0 / 2);
        continue;
      }
#endif
      float m = 0.0f;
      int64_t bad = 0;
      for (int j = 0; j < kMxBlock; ++j) {
        v[j] = j < cnt ? load(x, i0 + j) : 0.0f;
        const bool fin = fp4::is_finite(v[j]);
        bad += fin ? 0 : 1;
        m = fp4::fmax_(m, fin ? fp4::fabs_(v[j]) : 0.0f);
      }
      bad_per_block[b] = bad;
      const int32_t e = fp8 ? fp4::mx_exponent(m, 0x600000u, 8, floor_mode) : fp4::mx_exponent(m, 0x400000u, 2, floor_mode);
      scales[b] = bad ? (propagate ? fp4::kE8M0NaN : (uint8_t)(e + 127)) : (uint8_t)(e + 127);
      const float inv = fp4::pow2(-e);
      const uint32_t key = stochastic ? fp4::sr_key(seed, stream, (uint32_t)((uint64_t)i0 >> 32)) : 0u;
      if (fp8) {
        uint8_t* out = data + i0;
        for (int j = 0; j < kMxBlock; ++j) out[j] = bad ? 0 : fp4::e4m3_encode(v[j] * inv);
      } else {
        uint8_t* out = data + i0 / 2;
        for (int j = 0; j < kMxBlock; j += 2) {
          uint8_t c0 = 0, c1 = 0;
          if (!bad) {
            c0 = fp4::e2m1_encode(v[j] * inv, stochastic, stochastic ? fp4::sr_bits(key, (uint64_t)(i0 + j)) : 0u);
            c1 = fp4::e2m1_encode(v[j + 1] * inv, stochastic,
                                  stochastic ? fp4::sr_bits(key, (uint64_t)(i0 + j + 1)) : 0u);
          }
          out[j / 2] = fp4::pack2(c0, c1);
        }
      }
    }
  });
  nonfinite = 0;
  for (int64_t b = 0; b < nb; ++b) nonfinite += bad_per_block[b];
}


template <typename T>
void mx_decode_impl(const uint8_t* data, const uint8_t* scales, int64_t n, bool fp8, T* out) {
  const int64_t nb = ceil_div(n, kMxBlock);
  const bool simd = fp4cpu::have_avx512();
  fp4cpu::parallel_for(0, nb, 1024, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float sv = fp4::e8m0_value(scales[b]);
      const int64_t i0 = b * kMxBlock;
      const int cnt = (int)std::min<int64_t>(kMxBlock, n - i0);
#if FP4_HAVE_AVX512
      if (simd) {
        fp4cpu::mx_decode32(data + (fp8 ? i0 : i0 / 2), fp8, sv, cnt, out + i0);
        continue;
      }
#endif
      for (int j = 0; j < cnt; ++j) {
        const float e = fp8 ? fp4::e4m3_value(data[i0 + j]) : fp4::e2m1_value(fp4::code_at(data, i0 + j));
        out[i0 + j] = static_cast<T>(e * sv);
      }
    }
  });
}


// int2 (fp4_codec.h): 1x16 blocks, one fp32 tensor scale, codes four a byte. Pass 1 takes every block's finite amax
// (amax_rows, vectorized where the build has it), pass 2 scales, rounds and packs each block; the inner loops are
// branch-free over the 16 elements, for the compiler to vectorize.
template <typename T>
void int2_encode_impl(const T* x, int64_t n, bool stochastic, uint32_t seed, uint32_t stream, bool propagate,
                      bool simd, uint8_t* data, uint8_t* scales, float& s_dec_out, int64_t& nonfinite) {
  const int64_t nb = ceil_div(n, kNvBlock);
  std::vector<float> amax_b(nb);
  std::vector<int32_t> bad_b(nb);
  fp4cpu::parallel_for(0, nb, 2048, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      amax_rows(x + b * kNvBlock, 0, 1, (int)std::min<int64_t>(kNvBlock, n - b * kNvBlock), simd, amax_b[b], bad_b[b]);
  });
  float amax = 0.0f;
  nonfinite = 0;
  for (int64_t b = 0; b < nb; ++b) {
    amax = fp4::fmax_(amax, amax_b[b]);
    nonfinite += bad_b[b];
  }
  const fp4::TensorScale ts = fp4::tensor_scale(amax, fp4::kInt2Max);
  s_dec_out = ts.dec;
  if (nonfinite && !propagate) return;  // the caller raises
  fp4cpu::parallel_for(0, nb, 1024, [&](int64_t b0, int64_t b1) {
    float v[kNvBlock];
    uint8_t c[kNvBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i0 = b * kNvBlock;
      uint8_t* out = data + b * (kNvBlock / 4);
      const uint8_t sc = amax_b[b] > 0.0f && !bad_b[b] ? fp4::int2_scale_code(amax_b[b], ts.enc) : 0;
      if (sc == 0) {  // all zero, non-finite, or far below the tensor's amax: a dead block
        scales[b] = bad_b[b] ? fp4::kE4M3NaN : 0;
        memset(out, fp4::kInt2DeadByte, kNvBlock / 4);
        continue;
      }
      scales[b] = sc;
      const float k = fp4::block_encode_scale(sc, ts.dec);
      const int cnt = (int)std::min<int64_t>(kNvBlock, n - i0);
      if (cnt == kNvBlock) {
        FP4_CODEC_VEC_LOOP
        for (int j = 0; j < kNvBlock; ++j) v[j] = load(x, i0 + j) * k;
      } else {
        for (int j = 0; j < kNvBlock; ++j) v[j] = j < cnt ? load(x, i0 + j) * k : 0.0f;
      }
      if (stochastic) {
        const uint32_t key = fp4::sr_key(seed, stream, (uint32_t)((uint64_t)i0 >> 32)), base = (uint32_t)i0;
        FP4_CODEC_VEC_LOOP
        for (int j = 0; j < kNvBlock; ++j) c[j] = fp4::int2_encode(v[j], true, fp4::sr_bits(key, base + (uint32_t)j));
      } else {
        FP4_CODEC_VEC_LOOP
        for (int j = 0; j < kNvBlock; ++j) c[j] = fp4::int2_encode(v[j], false, 0u);
      }
      fp4::pack_codes2(c, kNvBlock, out);
    }
  });
}

template <typename T>
void int2_decode_impl(const uint8_t* data, const uint8_t* scales, float s_dec, int64_t n, T* out) {
  const int64_t nb = ceil_div(n, kNvBlock);
  fp4cpu::parallel_for(0, nb, 2048, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float d = fp4::e4m3_value(scales[b]) * s_dec;
      const int64_t i0 = b * kNvBlock;
      const int cnt = (int)std::min<int64_t>(kNvBlock, n - i0);
      for (int j = 0; j < cnt; ++j) out[i0 + j] = static_cast<T>(fp4::int2_level(fp4::code2_at(data, i0 + j)) * d);
    }
  });
}

}  // namespace fp4codec
