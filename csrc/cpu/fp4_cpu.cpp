// CPU kernels for fp4offload: loops around csrc/fp4_codec.h, parallel over blocks with at::parallel_for
// (OpenMP in torch's CPU builds). Hot paths (NVFP4 1x16 encode/decode of fp32) have AVX-512 versions
// in nvfp4_avx512.h; everything else is the scalar rule, which the compiler vectorizes where it can.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "fp4_codec.h"
#include "cpu/nvfp4_avx512.h"

namespace {

using fp4::kMxBlock;
using fp4::kNvBlock;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename T>
inline float load(const T* p, int64_t i) { return static_cast<float>(p[i]); }

// Per-block finite amax and non-finite count over the flat tensor (tile == 1).
template <typename T>
void flat_block_amax(const T* x, int64_t n, int64_t block, float* amax_b, int32_t* bad_b) {
  const int64_t nb = ceil_div(n, block);
  at::parallel_for(0, nb, 2048, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i0 = b * block, i1 = std::min(i0 + block, n);
      float m = 0.0f;
      int32_t bad = 0;
      for (int64_t i = i0; i < i1; ++i) {
        const float v = load(x, i);
        const bool fin = fp4::is_finite(v);
        bad += fin ? 0 : 1;
        m = fp4::fmax_(m, fin ? fp4::fabs_(v) : 0.0f);
      }
      amax_b[b] = m;
      bad_b[b] = bad;
    }
  });
}

// Per-tile finite amax over the (rows, cols) view (tile == 16).
template <typename T>
void tile_amax(const T* x, int64_t rows, int64_t cols, int64_t R, int64_t C, float* amax_b, int32_t* bad_b) {
  at::parallel_for(0, R * C, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t tr = t / C, tc = t % C;
      float m = 0.0f;
      int32_t bad = 0;
      for (int64_t r = tr * 16; r < std::min(tr * 16 + 16, rows); ++r)
        for (int64_t c = tc * 16; c < std::min(tc * 16 + 16, cols); ++c) {
          const float v = load(x, r * cols + c);
          const bool fin = fp4::is_finite(v);
          bad += fin ? 0 : 1;
          m = fp4::fmax_(m, fin ? fp4::fabs_(v) : 0.0f);
        }
      amax_b[t] = m;
      bad_b[t] = bad;
    }
  });
}

// Encodes `count` source values (already loaded into v[]) with one block multiplier into codes.
inline void encode_run(const float* v, int count, float s_enc_b, bool ufp4, bool stochastic, uint32_t key,
                       uint64_t index0, uint8_t* codes) {
  for (int j = 0; j < count; ++j) {
    const float y = v[j] * s_enc_b;
    if (ufp4) {
      codes[j] = fp4::ufp4_encode(fp4::fabs_(y));
    } else {
      const uint32_t rnd = stochastic ? fp4::sr_bits(key, index0 + j) : 0u;
      codes[j] = fp4::e2m1_encode(y, stochastic, rnd);
    }
  }
}

template <typename T>
void nvfp4_encode_impl(const T* x, int64_t rows, int64_t cols, int64_t tile, int64_t scope, bool ufp4,
                       bool stochastic, uint32_t seed, uint32_t stream, bool propagate, const float* amax_in,
                       uint8_t* data, uint8_t* scales, std::vector<float>& s_dec_out, int64_t& nonfinite) {
  const int64_t n = rows * cols;
  const float elem_max = ufp4 ? fp4::kUfp4Max : fp4::kE2M1Max;
  const bool tiled = tile == 16;
  const int64_t rp = ceil_div(rows, 16) * 16, cp = ceil_div(cols, 16) * 16;
  const int64_t R = rp / 16, C = cp / 16;
  const int64_t nb = tiled ? R * C : ceil_div(n, kNvBlock);
  const int64_t per = tiled ? std::max<int64_t>(nb, 1) : (scope ? scope / kNvBlock : std::max<int64_t>(nb, 1));
  const int64_t nscopes = std::max<int64_t>(ceil_div(nb, per), 1);

  std::vector<float> amax_b(nb);
  std::vector<int32_t> bad_b(nb);
  if (tiled)
    tile_amax(x, rows, cols, R, C, amax_b.data(), bad_b.data());
  else
    flat_block_amax(x, n, kNvBlock, amax_b.data(), bad_b.data());

  std::vector<float> amax_s(nscopes, 0.0f);
  int64_t bad_total = 0;
  for (int64_t b = 0; b < nb; ++b) {
    float& m = amax_s[b / per];
    m = fp4::fmax_(m, amax_b[b]);
    bad_total += bad_b[b];
  }
  nonfinite = bad_total;
  if (bad_total && !propagate) return;  // the caller raises; nothing else to do
  if (amax_in)
    for (int64_t s = 0; s < nscopes; ++s) amax_s[s] = amax_in[s];
  std::vector<fp4::TensorScale> ts(nscopes);
  s_dec_out.resize(nscopes);
  for (int64_t s = 0; s < nscopes; ++s) {
    ts[s] = fp4::tensor_scale(amax_s[s], elem_max);
    s_dec_out[s] = ts[s].dec;
  }

  at::parallel_for(0, nb, tiled ? 16 : 1024, [&](int64_t b0, int64_t b1) {
    float v[16];
    uint8_t codes[16];
    for (int64_t b = b0; b < b1; ++b) {
      const fp4::TensorScale& s = ts[b / per];
      uint8_t sc = fp4::block_scale_code(amax_b[b], elem_max, s.enc);
      const bool live = sc != 0 && bad_b[b] == 0;
      const float s_enc_b = live ? fp4::block_encode_scale(sc, s.dec) : 0.0f;
      if (bad_b[b]) sc = fp4::kE4M3NaN;  // propagate (raise returned above)
      scales[b] = sc;
      if (!tiled) {
        const int64_t i0 = b * kNvBlock;
        const int cnt = (int)std::min<int64_t>(kNvBlock, n - i0);
        uint8_t* out = data + b * (kNvBlock / 2);
        if (!live) {
          memset(out, 0, kNvBlock / 2);
          continue;
        }
        for (int j = 0; j < 16; ++j) v[j] = j < cnt ? load(x, i0 + j) : 0.0f;
        const uint32_t key = stochastic ? fp4::sr_key(seed, stream, (uint32_t)((uint64_t)i0 >> 32)) : 0u;
        encode_run(v, 16, s_enc_b, ufp4, stochastic, key, (uint64_t)i0, codes);
        for (int j = 0; j < 8; ++j) out[j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
      } else {
        const int64_t tr = b / C, tc = b % C;
        for (int64_t r = tr * 16; r < tr * 16 + 16; ++r) {
          const int64_t pos = r * cp + tc * 16;  // padded row-major position of the tile row
          uint8_t* out = data + pos / 2;
          if (!live) {
            memset(out, 0, 8);
            continue;
          }
          for (int j = 0; j < 16; ++j) {
            const int64_t c = tc * 16 + j;
            v[j] = (r < rows && c < cols) ? load(x, r * cols + c) : 0.0f;
          }
          const uint32_t key = stochastic ? fp4::sr_key(seed, stream, (uint32_t)((uint64_t)pos >> 32)) : 0u;
          encode_run(v, 16, s_enc_b, ufp4, stochastic, key, (uint64_t)pos, codes);
          for (int j = 0; j < 8; ++j) out[j] = (uint8_t)(codes[2 * j] | (codes[2 * j + 1] << 4));
        }
      }
    }
  });
}

std::vector<torch::Tensor> nvfp4_encode(torch::Tensor x, int64_t rows, int64_t cols, int64_t tile, int64_t scope,
                                        bool ufp4, bool stochastic, int64_t seed, int64_t stream, bool propagate,
                                        c10::optional<torch::Tensor> amax) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "nvfp4_encode: x must be a contiguous CPU tensor");
  const int64_t n = rows * cols;
  TORCH_CHECK(x.numel() == n, "nvfp4_encode: rows * cols != numel");
  const bool tiled = tile == 16;
  const int64_t rp = ceil_div(rows, 16) * 16, cp = ceil_div(cols, 16) * 16;
  const int64_t nb = tiled ? (rp / 16) * (cp / 16) : ceil_div(n, kNvBlock);
  const int64_t nbytes = tiled ? rp * cp / 2 : nb * (kNvBlock / 2);
  auto u8 = torch::TensorOptions().dtype(torch::kUInt8);
  auto data = torch::empty({nbytes}, u8);
  auto scales = torch::empty({nb}, u8);
  std::vector<float> s_dec;
  int64_t nonfinite = 0;
  const uint32_t sd = (uint32_t)seed, st = (uint32_t)stream;
  const int64_t nscopes = tiled ? 1 : std::max<int64_t>(ceil_div(nb, scope ? scope / kNvBlock : std::max<int64_t>(nb, 1)), 1);
  const float* amax_in = nullptr;
  if (amax.has_value()) {
    TORCH_CHECK(amax->scalar_type() == torch::kFloat32 && amax->is_contiguous() && amax->numel() == nscopes,
                "nvfp4_encode: amax must be a contiguous fp32 tensor with one value per scope (", nscopes, ")");
    amax_in = amax->data_ptr<float>();
  }
  if (x.scalar_type() == torch::kFloat32 && !tiled && !stochastic && !ufp4 && !amax_in && fp4cpu::have_avx512()) {
    fp4cpu::nvfp4_encode_f32_avx512(x.data_ptr<float>(), n, scope, propagate, data.data_ptr<uint8_t>(),
                                    scales.data_ptr<uint8_t>(), s_dec, nonfinite);
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "nvfp4_encode", [&] {
      nvfp4_encode_impl<scalar_t>(x.data_ptr<scalar_t>(), rows, cols, tile, scope, ufp4, stochastic, sd, st,
                                  propagate, amax_in, data.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), s_dec,
                                  nonfinite);
    });
  }
  auto ts = torch::from_blob(s_dec.data(), {(int64_t)s_dec.size()}, torch::kFloat32).clone();
  return {data, scales, ts, torch::scalar_tensor(nonfinite, torch::kInt64)};
}

template <typename T>
void nvfp4_decode_impl(const uint8_t* data, const uint8_t* scales, const float* s_dec, int64_t rows, int64_t cols,
                       int64_t tile, int64_t scope, bool ufp4, T* out) {
  const int64_t n = rows * cols;
  float table[16];
  for (int c = 0; c < 16; ++c) table[c] = ufp4 ? fp4::ufp4_value((uint8_t)c) : fp4::e2m1_value((uint8_t)c);
  if (tile == 16) {
    const int64_t cp = ceil_div(cols, 16) * 16, C = cp / 16;
    const float sd = s_dec[0];
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t pos = r * cp + c;
          const uint8_t code = (data[pos >> 1] >> ((pos & 1) * 4)) & 0xF;
          const float sv = fp4::e4m3_value(scales[(r / 16) * C + c / 16]);
          out[r * cols + c] = static_cast<T>((table[code] * sv) * sd);
        }
    });
    return;
  }
  const int64_t nb = ceil_div(n, kNvBlock);
  const int64_t per = scope ? scope / kNvBlock : std::max<int64_t>(nb, 1);
  at::parallel_for(0, nb, 2048, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float sv = fp4::e4m3_value(scales[b]);
      const float sd = s_dec[b / per];
      const int64_t i0 = b * kNvBlock;
      const int cnt = (int)std::min<int64_t>(kNvBlock, n - i0);
      const uint8_t* in = data + b * (kNvBlock / 2);
      for (int j = 0; j < cnt; ++j) {
        const uint8_t code = (in[j >> 1] >> ((j & 1) * 4)) & 0xF;
        out[i0 + j] = static_cast<T>((table[code] * sv) * sd);
      }
    }
  });
}

torch::Tensor nvfp4_decode(torch::Tensor data, torch::Tensor scales, torch::Tensor tensor_scale, int64_t rows,
                           int64_t cols, int64_t tile, int64_t scope, bool ufp4, at::ScalarType out_dtype) {
  const int64_t n = rows * cols;
  auto out = torch::empty({n}, torch::TensorOptions().dtype(out_dtype));
  if (n == 0) return out;
  auto ts = tensor_scale.to(torch::kFloat32).contiguous();
  if (out_dtype == torch::kFloat32 && tile == 1 && !ufp4 && fp4cpu::have_avx512()) {
    fp4cpu::nvfp4_decode_f32_avx512(data.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), ts.data_ptr<float>(), n,
                                    scope, out.data_ptr<float>());
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_dtype, "nvfp4_decode", [&] {
    nvfp4_decode_impl<scalar_t>(data.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), ts.data_ptr<float>(), rows,
                                cols, tile, scope, ufp4, out.data_ptr<scalar_t>());
  });
  return out;
}

template <typename T>
void mx_encode_impl(const T* x, int64_t n, bool fp8, bool floor_mode, bool stochastic, uint32_t seed,
                    uint32_t stream, bool propagate, uint8_t* data, uint8_t* scales, int64_t& nonfinite) {
  const int64_t nb = ceil_div(n, kMxBlock);
  std::vector<int64_t> bad_per_block(nb);
  at::parallel_for(0, nb, 1024, [&](int64_t b0, int64_t b1) {
    float v[kMxBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t i0 = b * kMxBlock;
      const int cnt = (int)std::min<int64_t>(kMxBlock, n - i0);
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
          out[j / 2] = (uint8_t)(c0 | (c1 << 4));
        }
      }
    }
  });
  nonfinite = 0;
  for (int64_t b = 0; b < nb; ++b) nonfinite += bad_per_block[b];
}

std::vector<torch::Tensor> mx_encode(torch::Tensor x, bool fp8, bool floor_mode, bool stochastic, int64_t seed,
                                     int64_t stream, bool propagate) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "mx_encode: x must be a contiguous CPU tensor");
  const int64_t n = x.numel();
  const int64_t nb = ceil_div(n, kMxBlock);
  auto u8 = torch::TensorOptions().dtype(torch::kUInt8);
  auto data = torch::empty({fp8 ? nb * kMxBlock : nb * kMxBlock / 2}, u8);
  auto scales = torch::empty({nb}, u8);
  int64_t nonfinite = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mx_encode", [&] {
    mx_encode_impl<scalar_t>(x.data_ptr<scalar_t>(), n, fp8, floor_mode, stochastic, (uint32_t)seed, (uint32_t)stream,
                             propagate, data.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), nonfinite);
  });
  return {data, scales, torch::scalar_tensor(nonfinite, torch::kInt64)};
}

template <typename T>
void mx_decode_impl(const uint8_t* data, const uint8_t* scales, int64_t n, bool fp8, T* out) {
  const int64_t nb = ceil_div(n, kMxBlock);
  at::parallel_for(0, nb, 1024, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float sv = fp4::e8m0_value(scales[b]);
      const int64_t i0 = b * kMxBlock;
      const int cnt = (int)std::min<int64_t>(kMxBlock, n - i0);
      for (int j = 0; j < cnt; ++j) {
        const float e = fp8 ? fp4::e4m3_value(data[i0 + j]) : fp4::e2m1_value((data[(i0 + j) >> 1] >> (((i0 + j) & 1) * 4)) & 0xF);
        out[i0 + j] = static_cast<T>(e * sv);
      }
    }
  });
}

torch::Tensor mx_decode(torch::Tensor data, torch::Tensor scales, int64_t numel, bool fp8, at::ScalarType out_dtype) {
  auto out = torch::empty({numel}, torch::TensorOptions().dtype(out_dtype));
  if (numel == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out_dtype, "mx_decode", [&] {
    mx_decode_impl<scalar_t>(data.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), numel, fp8,
                             out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("nvfp4_encode", &nvfp4_encode, "NVFP4/ufp4 encode (CPU)");
  m.def("nvfp4_decode", &nvfp4_decode, "NVFP4/ufp4 decode (CPU)");
  m.def("mx_encode", &mx_encode, "MXFP4/MXFP8 encode (CPU)");
  m.def("mx_decode", &mx_decode, "MXFP4/MXFP8 decode (CPU)");
  m.def("have_avx512", &fp4cpu::have_avx512, "whether the AVX-512 paths are compiled in and enabled");
  m.def("set_avx512", &fp4cpu::set_avx512, "enable/disable the AVX-512 paths (tests compare both); returns the state");
}
