// The fused FP4AdamW step on CPU: one pass per chunk of 1024 elements that decodes m and sqrt(v), updates
// the fp32 master weight, re-encodes m (NVFP4) and sqrt(v) (ufp4), and optionally writes a bf16 copy of
// the new weight. The operation order is the one in fp4offload/optim/reference_step.py (normative);
// every scalar rule comes from csrc/fp4_codec.h, so the bytes equal the torch reference's.
//
// Parallel over chunks with at::parallel_for (OpenMP). The AVX-512 path (adam_avx512.h) and the scalar
// path give the same bits; set_avx512(False) selects the scalar path for tests.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include "fp4_codec.h"
#include "cpu/nvfp4_avx512.h"
#include "cpu/adam_avx512.h"
#include "cpu/nvfp4_rows.h"

namespace {

using fp4adam::ChunkArgs;
using fp4adam::kChunk;
using fp4adam::kSegment;
using fp4adam::Scalars;

// ---- scalar path ------------------------------------------------------------------------------------

inline float load_grad(const float* g, int64_t i) { return g[i]; }
inline float load_grad(const uint16_t* g, int64_t i) { return fp4::u2f((uint32_t)g[i] << 16); }

inline uint16_t to_bf16(float x) {  // round to nearest even; NaN -> 0x7FC0 (as c10::BFloat16)
  const uint32_t b = fp4::f2u(x);
  if ((b & 0x7F800000u) == 0x7F800000u && (b & 0x7FFFFFu)) return (uint16_t)0x7FC0;
  return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// Decodes one packed 1x16 chunk of `cnt` elements into out[0..cnt), zeros after it up to the block end.
inline void decode_chunk_scalar(const uint8_t* codes, const uint8_t* scales, float s_dec, int cnt, bool unsigned_,
                                float* out) {
  const int nb = (cnt + 15) / 16;
  for (int b = 0; b < nb; ++b) {
    const float sv = fp4::e4m3_value(scales[b]);
    for (int j = 0; j < 16; ++j) {
      const int i = b * 16 + j;
      const uint8_t c = (codes[i >> 1] >> ((i & 1) * 4)) & 0xF;
      const float val = unsigned_ ? fp4::ufp4_value(c) : fp4::e2m1_value(c);
      out[i] = i < cnt ? (val * sv) * s_dec : 0.0f;
    }
  }
}

// Encodes x[0..16*nb) (zeros past cnt) as one chunk: one fp32 scale, E4M3 scale per 16, codes.
// Non-finite values (only from overflow) are left out of the amax and their block is written as zeros,
// as the reference does with nonfinite='propagate' off.
inline void encode_chunk_scalar(const float* x, int cnt, bool unsigned_, bool stochastic, uint32_t key,
                                uint32_t index0, uint8_t* codes, uint8_t* scales, float* s_dec_out) {
  const int nb = (cnt + 15) / 16;
  const float elem_max = unsigned_ ? fp4::kUfp4Max : fp4::kE2M1Max;
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
    const uint8_t sc = fp4::block_scale_code(amax_b[b], elem_max, ts.enc);
    scales[b] = sc;
    const bool live = sc != 0 && !bad_b[b];
    const float k = live ? fp4::block_encode_scale(sc, ts.dec) : 0.0f;
    uint8_t c[16];
    for (int j = 0; j < 16; ++j) {
      if (!live) {
        c[j] = 0;
        continue;
      }
      const float y = x[b * 16 + j] * k;
      if (unsigned_) {
        c[j] = fp4::ufp4_encode(fp4::fabs_(y));
      } else {
        const uint32_t rnd = stochastic ? fp4::sr_bits(key, (uint64_t)(index0 + b * 16 + j)) : 0u;
        c[j] = fp4::e2m1_encode(y, stochastic, rnd);
      }
    }
    for (int j = 0; j < 8; ++j) codes[b * 8 + j] = (uint8_t)(c[2 * j] | (c[2 * j + 1] << 4));
  }
}

template <typename G>
void chunk_scalar(const ChunkArgs& a, const G* grad, int64_t c) {
  const Scalars& s = a.s;
  const int64_t i0 = c * kChunk;
  const int cnt = (int)std::min<int64_t>(kChunk, a.n - i0);
  const int nb = (cnt + 15) / 16;
  float mbuf[kChunk], ubuf[kChunk];
  decode_chunk_scalar(a.m_codes + i0 / 2, a.m_scales + i0 / 16, a.m_ts[c], cnt, false, mbuf);
  decode_chunk_scalar(a.v_codes + i0 / 2, a.v_scales + i0 / 16, a.v_ts[c], cnt, !a.v_nvfp4, ubuf);
  for (int j = 0; j < cnt; ++j) {
    const int64_t i = i0 + j;
    float g = load_grad(grad, i);
    if (a.maximize) g = -g;
    float p = a.param[i];
    if (s.weight_decay) p = p * s.decay;
    const float m = (mbuf[j] * s.b1) + (g * s.omb1);
    const float vo = a.v_nvfp4 ? ubuf[j] : ubuf[j] * ubuf[j];
    const float v = (vo * s.b2) + ((g * g) * s.omb2);
    const float u = std::sqrt(v);
    const float d = (u * s.rsbc2) + s.eps;
    p = p - ((m / d) * s.step_size);
    a.param[i] = p;
    if (a.bf16_out) a.bf16_out[i] = to_bf16(p);
    mbuf[j] = m;
    ubuf[j] = a.v_nvfp4 ? v : u;
  }
  for (int j = cnt; j < nb * 16; ++j) mbuf[j] = ubuf[j] = 0.0f;
  const int64_t seg = i0 / kSegment;
  const uint32_t key = a.m_stochastic ? fp4::sr_key(a.seed, (uint32_t)(a.stream0 + seg), 0u) : 0u;
  const uint32_t index0 = (uint32_t)(i0 - seg * kSegment);
  encode_chunk_scalar(mbuf, cnt, false, a.m_stochastic, key, index0, a.m_codes + i0 / 2, a.m_scales + i0 / 16,
                      &a.m_ts[c]);
  encode_chunk_scalar(ubuf, cnt, !a.v_nvfp4, false, 0u, 0u, a.v_codes + i0 / 2, a.v_scales + i0 / 16, &a.v_ts[c]);
}

uint8_t* u8ptr(torch::Tensor& t, const char* name, int64_t need) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == torch::kUInt8,
              "fused_step: ", name, " must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(t.numel() == need, "fused_step: ", name, " has ", t.numel(), " bytes, expected ", need);
  return t.data_ptr<uint8_t>();
}

// One AdamW step over a flat fp32 tensor (a whole parameter or a segment of one that starts at a segment
// boundary) with packed states; everything is updated in place.
//
// With w_data / w_scales, the step also writes the NVFP4 16x16 working copy of the new weight, viewed as
// (w_rows, w_cols) with w_cols a multiple of 64 (so a band of 16 rows is whole chunks): threads take whole
// bands, update a group of bands' chunks, then encode those bands' tiles while they are still in cache,
// with the tensor scale of `w_amax` (fp4::tensor_scale(w_amax, 6)), exactly as the codec encodes with that
// amax override. Returns {finite amax of the new weight (NaN if any element is not finite), s_dec}; a
// caller whose amax grew past w_amax re-encodes (the tiles above w_amax saturated).
std::vector<double> fused_step(torch::Tensor param, torch::Tensor grad, torch::Tensor m_codes, torch::Tensor m_scales,
                torch::Tensor m_ts, torch::Tensor v_codes, torch::Tensor v_scales, torch::Tensor v_ts, double b1,
                double omb1, double b2, double omb2, double eps, double decay, double step_size, double rsbc2,
                bool weight_decay, bool maximize, bool v_nvfp4, bool m_stochastic, int64_t seed, int64_t stream0,
                c10::optional<torch::Tensor> bf16_out, c10::optional<torch::Tensor> w_data,
                c10::optional<torch::Tensor> w_scales, int64_t w_rows, int64_t w_cols, double w_amax) {
  TORCH_CHECK(param.device().is_cpu() && param.is_contiguous() && param.scalar_type() == torch::kFloat32,
              "fused_step: param must be a contiguous fp32 CPU tensor");
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() &&
                  (grad.scalar_type() == torch::kFloat32 || grad.scalar_type() == torch::kBFloat16),
              "fused_step: grad must be a contiguous fp32 or bf16 CPU tensor");
  const int64_t n = param.numel();
  TORCH_CHECK(grad.numel() == n, "fused_step: grad has ", grad.numel(), " elements, param ", n);
  if (n == 0) return {0.0, 0.0};
  const int64_t nb = (n + 15) / 16, nchunks = (n + kChunk - 1) / kChunk;
  ChunkArgs a;
  a.n = n;
  a.param = param.data_ptr<float>();
  a.m_codes = u8ptr(m_codes, "m_codes", nb * 8);
  a.m_scales = u8ptr(m_scales, "m_scales", nb);
  a.m_ts = reinterpret_cast<float*>(u8ptr(m_ts, "m_tscale", nchunks * 4));
  a.v_codes = u8ptr(v_codes, "v_codes", nb * 8);
  a.v_scales = u8ptr(v_scales, "v_scales", nb);
  a.v_ts = reinterpret_cast<float*>(u8ptr(v_ts, "v_tscale", nchunks * 4));
  a.s = Scalars{(float)b1, (float)omb1, (float)b2, (float)omb2, (float)eps, (float)decay, (float)step_size,
                (float)rsbc2, weight_decay};
  a.maximize = maximize;
  a.v_nvfp4 = v_nvfp4;
  a.m_stochastic = m_stochastic;
  a.seed = (uint32_t)seed;
  a.stream0 = (uint32_t)stream0;
  a.bf16_out = nullptr;
  if (bf16_out.has_value() && bf16_out->defined()) {
    TORCH_CHECK(bf16_out->is_contiguous() && bf16_out->scalar_type() == torch::kBFloat16 && bf16_out->numel() == n,
                "fused_step: bf16_out must be a contiguous bf16 tensor of the param's size");
    a.bf16_out = reinterpret_cast<uint16_t*>(bf16_out->data_ptr<at::BFloat16>());
  }
  const bool simd = fp4cpu::have_avx512();
  const bool bf16_grad = grad.scalar_type() == torch::kBFloat16;
  const float* gf = bf16_grad ? nullptr : grad.data_ptr<float>();
  const uint16_t* gb = bf16_grad ? reinterpret_cast<const uint16_t*>(grad.data_ptr<at::BFloat16>()) : nullptr;
  auto step_chunks = [&](int64_t c0, int64_t c1) {
    if (simd) {  // chunks pipelined: the encode of chunk c-1 runs inside the update loop of chunk c
      if (bf16_grad)
        fp4adam::step_range_avx512(a, gb, c0, c1);
      else
        fp4adam::step_range_avx512(a, gf, c0, c1);
      return;
    }
    for (int64_t c = c0; c < c1; ++c) {
      if (bf16_grad)
        chunk_scalar(a, gb, c);
      else
        chunk_scalar(a, gf, c);
    }
  };
  const bool want_w = w_data.has_value() && w_data->defined();
  if (!want_w) {
    at::parallel_for(0, nchunks, 8, step_chunks);
    return {0.0, 0.0};
  }
  TORCH_CHECK(w_scales.has_value() && w_scales->defined(), "fused_step: w_data needs w_scales");
  TORCH_CHECK(w_rows > 0 && w_cols > 0 && w_cols % 64 == 0 && w_rows * w_cols == n,
              "fused_step: the NVFP4 working copy needs (w_rows, w_cols) covering the param with w_cols % 64 == 0");
  TORCH_CHECK(std::isfinite(w_amax) && w_amax >= 0, "fused_step: w_amax must be finite and >= 0");
  const int64_t nbands = (w_rows + 15) / 16, band = 16 * w_cols, C = w_cols / 16;
  uint8_t* wd = u8ptr(*w_data, "w_data", nbands * band / 2);
  uint8_t* ws = u8ptr(*w_scales, "w_scales", nbands * C);
  const fp4::TensorScale ts = fp4::tensor_scale((float)w_amax, fp4::kE2M1Max);
  // bands per group: about 32 chunks (128 KiB of fp32 weight, inside L2) between a band's update and its encode
  const int64_t group = std::max<int64_t>(1, 32 * kChunk / band);
  float amax_all = 0.0f;
  int64_t bad_all = 0;
  std::mutex mu;
  at::parallel_for(0, nbands, group, [&](int64_t b0, int64_t b1) {
    float amax = 0.0f;
    int64_t bad = 0;
    for (int64_t g0 = b0; g0 < b1; g0 += group) {
      const int64_t g1 = std::min(b1, g0 + group);
      step_chunks(g0 * band / kChunk, std::min(nchunks, (g1 * band + kChunk - 1) / kChunk));
      for (int64_t t = g0 * C; t < g1 * C; ++t) {
        const int64_t r0 = (t / C) * 16, c0 = (t % C) * 16;
        float amax_b;
        int32_t bad_b;
        fp4cpu::amax_rows(a.param + r0 * w_cols + c0, w_cols, (int)std::min<int64_t>(16, w_rows - r0), 16, simd,
                          amax_b, bad_b);
        const uint8_t sc = fp4::block_scale_code(amax_b, fp4::kE2M1Max, ts.enc);
        const bool live = sc != 0 && bad_b == 0;
        ws[t] = sc;
        fp4cpu::encode_tile(a.param, w_rows, w_cols, w_cols, r0, c0,
                            live ? fp4::block_encode_scale(sc, ts.dec) : 0.0f, live, false, false, 0u, 0u, simd, wd);
        amax = fp4::fmax_(amax, amax_b);
        bad += bad_b;
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    amax_all = fp4::fmax_(amax_all, amax);
    bad_all += bad;
  });
  return {bad_all ? std::nan("") : (double)amax_all, (double)ts.dec};
}

// True when every element of a fp32/bf16/fp16 CPU tensor is finite.
bool all_finite(torch::Tensor t) {
  TORCH_CHECK(t.device().is_cpu(), "all_finite: expects a CPU tensor");
  auto x = t.contiguous();
  const int64_t n = x.numel();
  if (n == 0) return true;
  std::atomic<bool> ok{true};
  if (x.scalar_type() == torch::kFloat32) {
    const uint32_t* p = reinterpret_cast<const uint32_t*>(x.data_ptr<float>());
    at::parallel_for(0, n, 1 << 16, [&](int64_t i0, int64_t i1) {
      uint32_t acc = 0;  // all-ones exponent found?
      for (int64_t i = i0; i < i1; ++i) acc |= ((p[i] & 0x7F800000u) == 0x7F800000u);
      if (acc) ok = false;
    });
  } else if (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf) {
    const uint16_t mask = x.scalar_type() == torch::kBFloat16 ? 0x7F80 : 0x7C00;
    const uint16_t* p = reinterpret_cast<const uint16_t*>(x.data_ptr());
    at::parallel_for(0, n, 1 << 16, [&](int64_t i0, int64_t i1) {
      uint32_t acc = 0;
      for (int64_t i = i0; i < i1; ++i) acc |= ((p[i] & mask) == mask);
      if (acc) ok = false;
    });
  } else {
    return torch::isfinite(x).all().item<bool>();
  }
  return ok.load();
}

bool have_avx512() { return fp4cpu::have_avx512(); }
bool set_avx512(bool on) { return fp4cpu::set_avx512(on); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_step", &fused_step, "fused FP4AdamW step on packed states (CPU)", py::arg("param"), py::arg("grad"),
        py::arg("m_codes"), py::arg("m_scales"), py::arg("m_tscale"), py::arg("v_codes"), py::arg("v_scales"),
        py::arg("v_tscale"), py::arg("b1"), py::arg("omb1"), py::arg("b2"), py::arg("omb2"), py::arg("eps"),
        py::arg("decay"), py::arg("step_size"), py::arg("rsbc2"), py::arg("weight_decay"), py::arg("maximize"),
        py::arg("v_nvfp4"), py::arg("m_stochastic"), py::arg("seed"), py::arg("stream0"),
        py::arg("bf16_out") = py::none(), py::arg("w_data") = py::none(), py::arg("w_scales") = py::none(),
        py::arg("w_rows") = 0, py::arg("w_cols") = 0, py::arg("w_amax") = 0.0);
  m.def("all_finite", &all_finite, "whether every element is finite");
  m.def("have_avx512", &have_avx512, "whether the AVX-512 path is compiled in and enabled");
  m.def("set_avx512", &set_avx512, "enable/disable the AVX-512 path; returns the state");
}
