// The fused FP4AdamW step on CPU: one pass per chunk of 1024 elements that decodes m and sqrt(v), updates
// the fp32 master weight, re-encodes m (NVFP4) and sqrt(v) (on its grid, csrc/grids.h), and optionally writes a bf16
// copy of the new weight. The operation order is the one in fp4offload/_optim/reference_step.py (normative);
// every scalar rule comes from csrc/fp4_codec.h, so the bytes equal the torch reference's.
//
// Parallel over chunks with at::parallel_for (OpenMP). The chunk itself is one of four paths, all with the
// same bits: the AVX-512 kernels (adam_avx512.h; FP4_AVX512_LAYER_STEP=1 swaps in the SIMD-layer step) in the
// AVX-512 build, the step written on the SIMD layer (adam_simd.h) in the NEON, SVE and AVX2 builds (a partial last
// chunk on the portable path, adam_chunk.h), and the scalar path, which set_simd(False) selects for tests (isa.h).
#include "torch_ext.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#include "fp4_codec.h"
#include "master_bits.h"
#include "cpu/adam_chunk.h"
#include "cpu/adam_simd.h"
#include "cpu/nvfp4_avx512.h"
#include "cpu/adam_avx512.h"
#include "cpu/nvfp4_rows.h"

namespace {

using fp4adam::ChunkArgs;
using fp4adam::kChunk;
using fp4adam::kSegment;
using fp4adam::Scalars;
using fp4master::split_join;
using fp4master::split_residual;
using fp4master::to_bf16;

// The AVX-512 build's step: 0 the hand-scheduled kernel (adam_avx512.h), 1 the SIMD-layer step (adam_simd.h on
// simd_avx512.h). Both give the scalar path's bytes. On Zen 4 (16M parameters, 2 threads) they run within a few
// percent of each other, the hand-scheduled one slightly ahead, hence the default.
#ifndef FP4_AVX512_LAYER_STEP
#define FP4_AVX512_LAYER_STEP 0
#endif

// Chunks [c0, c1) of one thread on the build's fast path, or the scalar path when simd is off.
template <typename G>
void step_range(const ChunkArgs& a, const G* grad, int64_t c0, int64_t c1, bool simd) {
  if (c0 >= c1) return;
#if FP4_HAVE_AVX512 && FP4_AVX512_LAYER_STEP && FP4_SIMD_STEP
  if (simd) return fp4adam::step_range_fast(a, grad, c0, c1);  // the SIMD-layer step (simd_avx512.h)
#elif FP4_HAVE_AVX512
  if (simd) return fp4adam::step_range_avx512(a, grad, c0, c1);  // chunks pipelined (adam_avx512.h)
#elif FP4_CPU_VEC
  if (simd) return fp4adam::step_range_fast(a, grad, c0, c1);  // the SIMD-layer step (NEON, AVX2), else portable
#endif
  (void)simd;
  fp4adam::step_range_scalar(a, grad, c0, c1);
}

uint8_t* u8ptr(at::Tensor& t, const char* name, int64_t need) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kByte,
              "fused_step: ", name, " must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(t.numel() == need, "fused_step: ", name, " has ", t.numel(), " bytes, expected ", need);
  return t.data_ptr<uint8_t>();
}

// The packed states and the step's scalars of an n-element step, checked; no parameter, bf16 copy or gradient
// scale yet (the caller sets those).
ChunkArgs state_args(int64_t n, at::Tensor& m_codes, at::Tensor& m_scales, at::Tensor& m_ts,
                     at::Tensor& v_codes, at::Tensor& v_scales, at::Tensor& v_ts, double b1, double omb1,
                     double b2, double omb2, double eps, double decay, double step_size, double rsbc2,
                     bool weight_decay, bool maximize, int64_t v_kind, bool m_stochastic, bool v_stochastic,
                     int64_t seed, int64_t stream0) {
  const int64_t nb = (n + 15) / 16, nchunks = (n + kChunk - 1) / kChunk;
  ChunkArgs a;
  a.n = n;
  a.param = nullptr;
  a.m_codes = u8ptr(m_codes, "m_codes", nb * 8);
  a.m_scales = u8ptr(m_scales, "m_scales", nb);
  a.m_ts = reinterpret_cast<float*>(u8ptr(m_ts, "m_tscale", nchunks * 4));
  TORCH_CHECK(fp4::v_mbits(v_kind) >= 0, "fused_step: v_kind must be one of" FP4_V_KINDS_TEXT ", got ", v_kind);
  a.v_codes = u8ptr(v_codes, "v_codes", nb * 2 * fp4::v_cbits(v_kind));  // 16 codes of 4 or 2 bits a block
  a.v_scales = u8ptr(v_scales, "v_scales", nb);
  a.v_ts = reinterpret_cast<float*>(u8ptr(v_ts, "v_tscale", nchunks * 4));
  a.s = Scalars{(float)b1, (float)omb1, (float)b2, (float)omb2, (float)eps, (float)decay, (float)step_size,
                (float)rsbc2, weight_decay};
  a.maximize = maximize;
  a.v_kind = (int)v_kind;
  a.m_stochastic = m_stochastic;
  a.v_stochastic = v_stochastic;
  a.seed = (uint32_t)seed;
  a.stream0 = (uint32_t)stream0;
  a.bf16_out = nullptr;
  a.gscaled = false;
  a.gscale = 1.0f;
  return a;
}

// One AdamW step over a flat fp32 tensor (a whole parameter or a segment of one that starts at a segment
// boundary) with packed states; everything is updated in place.
//
// With w_data etc. (one entry per region), the step also writes NVFP4 16x16 copies of regions of the new
// weight: region r is the (w_rows[r], w_cols[r]) matrix at element w_offsets[r] of the flat param, encoded
// with the tensor scale of w_amax[r] (fp4::tensor_scale(w_amax, 6)), exactly as the codec encodes that
// matrix with that amax override. Each band of 16 rows is encoded by the thread that updated it, right
// after the update of its last chunk, while it is in cache; bands that straddle two threads' chunk ranges
// are encoded after the parallel loop. Returns {finite amax of the region's new values (NaN if one is not
// finite), s_dec} per region; a caller whose amax grew past w_amax re-encodes (those tiles saturated).
std::vector<double> fused_step(at::Tensor param, at::Tensor grad, at::Tensor m_codes, at::Tensor m_scales,
                at::Tensor m_ts, at::Tensor v_codes, at::Tensor v_scales, at::Tensor v_ts, double b1,
                double omb1, double b2, double omb2, double eps, double decay, double step_size, double rsbc2,
                bool weight_decay, bool maximize, int64_t v_kind, bool m_stochastic, int64_t seed, int64_t stream0,
                c10::optional<at::Tensor> bf16_out, std::vector<at::Tensor> w_data,
                std::vector<at::Tensor> w_scales, std::vector<int64_t> w_offsets, std::vector<int64_t> w_rows,
                std::vector<int64_t> w_cols, std::vector<double> w_amax, bool v_stochastic, double grad_scale) {
  TORCH_CHECK(param.device().is_cpu() && param.is_contiguous() && param.scalar_type() == at::kFloat,
              "fused_step: param must be a contiguous fp32 CPU tensor");
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() &&
                  (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16),
              "fused_step: grad must be a contiguous fp32 or bf16 CPU tensor");
  const int64_t n = param.numel();
  TORCH_CHECK(grad.numel() == n, "fused_step: grad has ", grad.numel(), " elements, param ", n);
  if (n == 0) return std::vector<double>(2 * w_data.size(), 0.0);
  ChunkArgs a = state_args(n, m_codes, m_scales, m_ts, v_codes, v_scales, v_ts, b1, omb1, b2, omb2, eps, decay,
                           step_size, rsbc2, weight_decay, maximize, v_kind, m_stochastic, v_stochastic, seed, stream0);
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  a.param = param.data_ptr<float>();
  TORCH_CHECK(std::isfinite(grad_scale) && grad_scale > 0, "fused_step: grad_scale must be finite and > 0");
  a.gscale = (float)grad_scale;
  a.gscaled = grad_scale != 1.0;
  a.bf16_out = nullptr;
  if (bf16_out.has_value() && bf16_out->defined()) {
    TORCH_CHECK(bf16_out->is_contiguous() && bf16_out->scalar_type() == at::kBFloat16 && bf16_out->numel() == n,
                "fused_step: bf16_out must be a contiguous bf16 tensor of the param's size");
    a.bf16_out = reinterpret_cast<uint16_t*>(bf16_out->data_ptr<at::BFloat16>());
  }
  const bool vec = fp4cpu::have_simd();
  const bool simd = fp4cpu::have_simd();  // the weight copy's encode: AVX-512, the portable rows, or scalar (nvfp4_rows.h)
  const bool bf16_grad = grad.scalar_type() == at::kBFloat16;
  const float* gf = bf16_grad ? nullptr : grad.data_ptr<float>();
  const uint16_t* gb = bf16_grad ? reinterpret_cast<const uint16_t*>(grad.data_ptr<at::BFloat16>()) : nullptr;
  auto step_chunks = [&](int64_t c0, int64_t c1) {
    if (bf16_grad)
      step_range(a, gb, c0, c1, vec);
    else
      step_range(a, gf, c0, c1, vec);
  };
  const size_t R = w_data.size();
  if (R == 0) {
    at::parallel_for(0, nchunks, 8, step_chunks);
    return {};
  }
  TORCH_CHECK(w_scales.size() == R && w_offsets.size() == R && w_rows.size() == R && w_cols.size() == R &&
                  w_amax.size() == R, "fused_step: the w_* lists must have one entry per region");
  struct Region {
    int64_t off, rows, cols, cp, C;
    uint8_t *data, *scales;
    fp4::TensorScale ts;
  };
  struct Band {
    int64_t start, end;  // flat elements [start, end)
    int32_t region, band;
  };
  std::vector<Region> regs(R);
  std::vector<Band> bands;
  int64_t prev_end = 0;
  for (size_t r = 0; r < R; ++r) {
    const int64_t off = w_offsets[r], rows = w_rows[r], cols = w_cols[r];
    TORCH_CHECK(rows > 0 && cols > 0 && off >= prev_end && off + rows * cols <= n,
                "fused_step: region ", r, " (offset ", off, ", ", rows, " x ", cols,
                ") must lie inside the param, after the previous region");
    TORCH_CHECK(std::isfinite(w_amax[r]) && w_amax[r] >= 0, "fused_step: w_amax must be finite and >= 0");
    prev_end = off + rows * cols;
    const int64_t rp = (rows + 15) / 16 * 16, cp = (cols + 15) / 16 * 16;
    regs[r] = Region{off, rows, cols, cp, cp / 16, u8ptr(w_data[r], "w_data", rp * cp / 2),
                     u8ptr(w_scales[r], "w_scales", rp / 16 * (cp / 16)),
                     fp4::tensor_scale((float)w_amax[r], fp4::kE2M1Max)};
    for (int64_t b = 0; b < rp / 16; ++b)
      bands.push_back(Band{off + 16 * b * cols, off + std::min(16 * (b + 1), rows) * cols, (int32_t)r, (int32_t)b});
  }
  const int64_t NB = (int64_t)bands.size();
  std::vector<float> band_amax(NB, 0.0f);
  std::vector<int32_t> band_bad(NB, 0);
  std::vector<uint8_t> done(NB, 0);
  auto encode_band = [&](int64_t i) {
    const Band& bd = bands[i];
    const Region& g = regs[bd.region];
    const float* x = a.param + g.off;
    const int64_t r0 = 16 * (int64_t)bd.band;
    float amax = 0.0f;
    int32_t bad = 0;
    for (int64_t t = 0; t < g.C; ++t) {
      const int64_t c0 = 16 * t;
      float amax_b;
      int32_t bad_b;
      fp4cpu::amax_rows(x + r0 * g.cols + c0, g.cols, (int)std::min<int64_t>(16, g.rows - r0),
                        (int)std::min<int64_t>(16, g.cols - c0), simd, amax_b, bad_b);
      float k;
      bool live;
      g.scales[bd.band * g.C + t] = fp4::block_scale(amax_b, bad_b != 0, fp4::kE2M1Max, g.ts, k, live);
      fp4cpu::encode_tile(x, g.rows, g.cols, g.cp, r0, c0, k, live, false, false, 0u, 0u, simd, g.data);
      amax = fp4::fmax_(amax, amax_b);
      bad += bad_b;
    }
    band_amax[i] = amax;
    band_bad[i] = bad;
    done[i] = 1;
  };
  constexpr int64_t kGroup = 32;  // chunks (128 KiB of fp32) between a band's update and its encode
  at::parallel_for(0, nchunks, 8, [&](int64_t c0, int64_t c1) {
    const int64_t lo = c0 * kChunk;
    int64_t i = std::lower_bound(bands.begin(), bands.end(), lo,
                                 [](const Band& bd, int64_t v) { return bd.start < v; }) - bands.begin();
    for (int64_t g0 = c0; g0 < c1; g0 += kGroup) {
      const int64_t g1 = std::min(c1, g0 + kGroup);
      step_chunks(g0, g1);
      const int64_t upto = std::min(g1 * kChunk, n);
      for (; i < NB && bands[i].end <= upto; ++i) encode_band(i);  // starts >= lo: all of it is this thread's
    }
  });
  at::parallel_for(0, NB, 1, [&](int64_t i0, int64_t i1) {  // the bands that straddle two threads' ranges
    for (int64_t i = i0; i < i1; ++i)
      if (!done[i]) encode_band(i);
  });
  std::vector<double> out(2 * R, 0.0);
  std::vector<int64_t> bad_r(R, 0);
  for (int64_t i = 0; i < NB; ++i) {
    const int r = bands[i].region;
    out[2 * r] = fp4::fmax_((float)out[2 * r], band_amax[i]);
    bad_r[r] += band_bad[i];
  }
  for (size_t r = 0; r < R; ++r) {
    if (bad_r[r]) out[2 * r] = std::nan("");
    out[2 * r + 1] = (double)regs[r].ts.dec;
  }
  return out;
}

// ---- compact master weights (fp4offload/_optim/master.py, normative) ---------------------------------

// One AdamW step over a flat bf16 parameter `hi` whose master is compact (mode 1: split, with the int16
// residual `lo` and the sorted int64 positions `odd`; mode 2: bf16 with stochastic rounding), with packed
// states; all updated in place. Returns the new `odd` (mode 1) or an empty tensor.
//
// Each thread rebuilds the fp32 master of a group of kGroup chunks into its own buffer, runs the same chunk
// step on it as fused_step does (so the bits equal the fp32-master step's), and writes the halves back while
// the group is in cache: one pass over memory, no fp32 copy of the parameter.
at::Tensor fused_step_master(at::Tensor hi, c10::optional<at::Tensor> lo, at::Tensor odd, at::Tensor grad,
                                at::Tensor m_codes, at::Tensor m_scales, at::Tensor m_ts, at::Tensor v_codes,
                                at::Tensor v_scales, at::Tensor v_ts, double b1, double omb1, double b2,
                                double omb2, double eps, double decay, double step_size, double rsbc2,
                                bool weight_decay, bool maximize, int64_t v_kind, bool m_stochastic, int64_t seed,
                                int64_t stream0, int64_t mode, bool v_stochastic) {
  TORCH_CHECK(mode == 1 || mode == 2, "fused_step_master: mode must be 1 (split) or 2 (bf16)");
  TORCH_CHECK(hi.device().is_cpu() && hi.is_contiguous() && hi.scalar_type() == at::kBFloat16,
              "fused_step_master: the parameter must be a contiguous bf16 CPU tensor");
  const int64_t n = hi.numel();
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.numel() == n &&
                  (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16),
              "fused_step_master: grad must be a contiguous fp32 or bf16 CPU tensor of the parameter's size");
  int16_t* lp = nullptr;
  if (mode == 1) {
    TORCH_CHECK(lo.has_value() && lo->defined() && lo->device().is_cpu() && lo->is_contiguous() &&
                    lo->scalar_type() == at::kShort && lo->numel() == n,
                "fused_step_master: split needs a contiguous int16 residual of the parameter's size");
    lp = lo->data_ptr<int16_t>();
  }
  TORCH_CHECK(odd.device().is_cpu() && odd.is_contiguous() && odd.scalar_type() == at::kLong && odd.dim() == 1,
              "fused_step_master: odd must be a contiguous 1-d int64 CPU tensor");
  const int64_t* op = odd.data_ptr<int64_t>();
  const int64_t nodd = odd.numel();
  for (int64_t k = 0; k < nodd; ++k)
    TORCH_CHECK(op[k] >= 0 && op[k] < n && (k == 0 || op[k] > op[k - 1]),
                "fused_step_master: odd must hold increasing positions inside the parameter");
  if (n == 0) return at::empty({0}, at::kLong);
  ChunkArgs a = state_args(n, m_codes, m_scales, m_ts, v_codes, v_scales, v_ts, b1, omb1, b2, omb2, eps, decay,
                           step_size, rsbc2, weight_decay, maximize, v_kind, m_stochastic, v_stochastic, seed, stream0);
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  uint16_t* hp = reinterpret_cast<uint16_t*>(hi.data_ptr<at::BFloat16>());
  a.bf16_out = mode == 1 ? hp : nullptr;  // split: the step writes rne(new master) into the parameter itself
  const bool simd = fp4cpu::have_simd();
  const bool bf16_grad = grad.scalar_type() == at::kBFloat16;
  const float* gf = bf16_grad ? nullptr : grad.data_ptr<float>();
  const uint16_t* gb = bf16_grad ? reinterpret_cast<const uint16_t*>(grad.data_ptr<at::BFloat16>()) : nullptr;
  constexpr int64_t kGroup = 32;  // chunks per rebuilt buffer: 128 KiB of fp32, in L2
  std::mutex mu;
  std::vector<std::pair<int64_t, std::vector<int64_t>>> found;  // (first chunk, new odd positions) per range
  at::parallel_for(0, nchunks, 8, [&](int64_t c0, int64_t c1) {
    std::vector<float> buf(kGroup * kChunk);
    std::vector<int64_t> mine;
    const int64_t* k = std::lower_bound(op, op + nodd, c0 * kChunk);
    for (int64_t g0 = c0; g0 < c1; g0 += kGroup) {
      const int64_t g1 = std::min(c1, g0 + kGroup);
      const int64_t e0 = g0 * kChunk, e1 = std::min(g1 * kChunk, n);
      uint32_t* bb = reinterpret_cast<uint32_t*>(buf.data());
      fp4adam::master_rebuild((int)mode, hp, lp, k, op + nodd, e0, e1, bb);
      ChunkArgs ag = a;
      ag.param = buf.data() - e0;  // the chunk step indexes the parameter by its flat position
      if (bf16_grad)
        step_range(ag, gb, g0, g1, simd);
      else
        step_range(ag, gf, g0, g1, simd);
      fp4adam::master_store((int)mode, bb, e0, e1, a.seed, a.stream0, hp, lp, mine);
    }
    std::lock_guard<std::mutex> g(mu);
    found.emplace_back(c0, std::move(mine));
  });
  std::sort(found.begin(), found.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  int64_t total = 0;
  for (const auto& f : found) total += (int64_t)f.second.size();
  at::Tensor out = at::empty({total}, at::kLong);
  int64_t* w = out.data_ptr<int64_t>();
  for (const auto& f : found) w = std::copy(f.second.begin(), f.second.end(), w);
  return out;
}

// Checks split on every fp32 pattern in [start, stop): to_bf16 gives h, the residual and odd rebuild b exactly
// (NaN patterns: h is NaN and the rebuilt pattern is NaN). Returns the number of patterns that fail.
int64_t split_selfcheck(int64_t start, int64_t stop) {
  std::atomic<int64_t> bad{0};
  at::parallel_for(start, stop, 1 << 20, [&](int64_t i0, int64_t i1) {
    int64_t mine = 0;
    for (int64_t i = i0; i < i1; ++i) {
      const uint32_t b = (uint32_t)i;
      const uint16_t h = to_bf16(fp4::u2f(b));
      bool o;
      const int16_t r = split_residual(b, o);
      const uint32_t back = split_join(h, r, o);
      const bool nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
      mine += nan ? !((back & 0x7FFFFFFFu) > 0x7F800000u) : back != b;
    }
    bad += mine;
  });
  return bad.load();
}

// True when the magnitude pattern of every element of a fp32/bf16/fp16 CPU tensor is below the dtype's limit:
// the patterns of |x| order as the values, and every non-finite pattern lies at or above the infinity's. One
// integer compare per element, read once at memory speed. Other dtypes: None (the caller decides).
c10::optional<bool> magnitudes_below(const at::Tensor& t, uint32_t f32_limit, uint16_t bf16_limit,
                                     uint16_t f16_limit) {
  TORCH_CHECK(t.device().is_cpu(), "expects a CPU tensor");
  auto x = t.contiguous();
  const int64_t n = x.numel();
  std::atomic<bool> ok{true};
  auto scan = [&](auto* p, auto mag_mask, auto limit) {
    at::parallel_for(0, n, 1 << 16, [&](int64_t i0, int64_t i1) {
      if (!ok.load(std::memory_order_relaxed)) return;
      uint32_t bad = 0;
      for (int64_t i = i0; i < i1; ++i) bad |= (uint32_t)((p[i] & mag_mask) >= limit);
      if (bad) ok = false;
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat:
      scan(reinterpret_cast<const uint32_t*>(x.data_ptr<float>()), 0x7FFFFFFFu, f32_limit);
      break;
    case at::kBFloat16:
      scan(reinterpret_cast<const uint16_t*>(x.data_ptr()), (uint16_t)0x7FFF, bf16_limit);
      break;
    case at::kHalf:
      scan(reinterpret_cast<const uint16_t*>(x.data_ptr()), (uint16_t)0x7FFF, f16_limit);
      break;
    default:
      return c10::nullopt;
  }
  return ok.load();
}

// True when every element of a CPU tensor is finite (below the infinity's pattern).
bool all_finite(at::Tensor t) {
  TORCH_CHECK(t.device().is_cpu(), "all_finite: expects a CPU tensor");
  const auto r = magnitudes_below(t, 0x7F800000u, 0x7F80, 0x7C00);
  return r.has_value() ? *r : at::isfinite(t).all().item<bool>();
}

// True when every element of a fp32/bf16/fp16 CPU tensor is finite and of magnitude below 2^64 (FP4AdamW's
// GRAD_LIMIT: a larger gradient overflows g*g in fp32); fp16 holds nothing as large, so there only the
// non-finite patterns fail.
bool grads_ok(at::Tensor t) {
  TORCH_CHECK(t.device().is_cpu(), "grads_ok: expects a CPU tensor");
  const auto r = magnitudes_below(t, 0x5F800000u, 0x5F80, 0x7C00);  // 2^64 in fp32 and bf16
  TORCH_CHECK(r.has_value(), "grads_ok: expects a fp32, bf16 or fp16 tensor, got ", t.scalar_type());
  return *r;
}

bool have_simd() { return fp4cpu::have_simd(); }
bool set_simd(bool on) { return fp4cpu::set_simd(on); }
std::string isa() { return fp4cpu::kIsa; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_step", &fused_step, "fused FP4AdamW step on packed states (CPU)", py::arg("param"), py::arg("grad"),
        py::arg("m_codes"), py::arg("m_scales"), py::arg("m_tscale"), py::arg("v_codes"), py::arg("v_scales"),
        py::arg("v_tscale"), py::arg("b1"), py::arg("omb1"), py::arg("b2"), py::arg("omb2"), py::arg("eps"),
        py::arg("decay"), py::arg("step_size"), py::arg("rsbc2"), py::arg("weight_decay"), py::arg("maximize"),
        py::arg("v_kind"), py::arg("m_stochastic"), py::arg("seed"), py::arg("stream0"),
        py::arg("bf16_out") = py::none(), py::arg("w_data") = std::vector<at::Tensor>{},
        py::arg("w_scales") = std::vector<at::Tensor>{}, py::arg("w_offsets") = std::vector<int64_t>{},
        py::arg("w_rows") = std::vector<int64_t>{}, py::arg("w_cols") = std::vector<int64_t>{},
        py::arg("w_amax") = std::vector<double>{}, py::arg("v_stochastic") = false, py::arg("grad_scale") = 1.0);
  m.def("fused_step_master", &fused_step_master, "fused FP4AdamW step of a bf16 parameter with a compact master",
        py::arg("hi"), py::arg("lo"), py::arg("odd"), py::arg("grad"), py::arg("m_codes"), py::arg("m_scales"),
        py::arg("m_tscale"), py::arg("v_codes"), py::arg("v_scales"), py::arg("v_tscale"), py::arg("b1"),
        py::arg("omb1"), py::arg("b2"), py::arg("omb2"), py::arg("eps"), py::arg("decay"), py::arg("step_size"),
        py::arg("rsbc2"), py::arg("weight_decay"), py::arg("maximize"), py::arg("v_kind"), py::arg("m_stochastic"),
        py::arg("seed"), py::arg("stream0"), py::arg("mode"), py::arg("v_stochastic") = false);
  m.def("split_selfcheck", &split_selfcheck, "split master: patterns in [start, stop) that do not rebuild exactly");
  m.def("all_finite", &all_finite, "whether every element is finite");
  m.def("grads_ok", &grads_ok, "whether every element is finite and of magnitude below 2^64");
  m.def("have_simd", &have_simd, "whether the build's vector path is compiled in and enabled");
  m.def("set_simd", &set_simd, "enable/disable the build's vector path (tests compare it with the scalar path)");
  m.def("isa", &isa, "the instruction set this build targets (avx512, avx2, neon, sve or scalar)");
}
