// A standalone driver (no torch) of the host kernels' shared code: the fused FP4AdamW chunk step on the scalar
// path and on the build's vector step (csrc/cpu/adam_chunk.h; on NEON csrc/cpu/adam_simd.h), the compact masters, the codec's loops
// (csrc/cpu/codec_impl.h: NVFP4 1x16 and 16x16, per-scope scales, ufp4, MXFP4 rceil and floor, MXFP8, int2; nearest and
// stochastic; encode and decode) and the codec rules of csrc/fp4_codec.h. It prints one line per case, "<case> <path> <FNV-1a 64 of every output byte>", from inputs
// it makes itself from integer hashes (no libm, so every architecture sees the same inputs).
//
// tests/emulation/test_isa_driver.py builds it natively (the x86 reference) and cross-built for aarch64 (NEON; SVE), runs
// the aarch64 builds under qemu-aarch64-static at several SVE vector lengths, and compares every line.
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <string>
#include <vector>

#define FP4_STANDALONE 1  // the codec without torch: serial parallel_for, no AVX-512 code (csrc/cpu/parallel.h)

#include "cpu/adam_chunk.h"
#include "cpu/adam_simd.h"
#include "cpu/codec_impl.h"

#ifndef FP4_CPU_VEC
#define FP4_CPU_VEC 0  // the build has only the scalar path
#endif

namespace {

using fp4adam::ChunkArgs;
using fp4adam::kChunk;

uint64_t fnv(uint64_t h, const void* p, size_t n) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001B3ull;
  return h;
}
constexpr uint64_t kFnv0 = 0xCBF29CE484222325ull;

// A float with a random sign, mantissa and an exponent spread over `span` binades below 2^top; special values
// (0, -0, subnormals, inf, NaN) at the rate 1/`special` when special > 0.
float rnd_float(uint32_t seed, uint32_t i, int top, int span, int special) {
  const uint32_t h = fp4::fmix32(seed * 0x9E3779B9u ^ fp4::fmix32(i + 0x1234567u));
  const uint32_t h2 = fp4::fmix32(h ^ 0xA5A5A5A5u);
  if (special > 0 && h2 % (uint32_t)special == 0) {
    const uint32_t kinds[7] = {0x00000000u, 0x80000000u, 0x00000001u, 0x807FFFFFu, 0x7F800000u, 0xFF800000u,
                               0x7FC00000u};
    return fp4::u2f(kinds[(h2 >> 8) % 7]);
  }
  const int e = 127 + top - (int)(h2 % (uint32_t)span);
  return fp4::u2f((h & 0x80000000u) | ((uint32_t)e << 23) | (h & 0x7FFFFFu));
}

struct State {
  std::vector<float> p;
  std::vector<uint16_t> bf, hi;
  std::vector<int16_t> lo;
  std::vector<int64_t> odd;
  std::vector<uint8_t> mc, ms, vc, vs;
  std::vector<float> mt, vt;
};

State make_state(int64_t n, uint32_t seed) {
  State s;
  const int64_t nb = (n + 15) / 16, nc = (n + kChunk - 1) / kChunk;
  s.p.resize(n);
  for (int64_t i = 0; i < n; ++i) s.p[i] = rnd_float(seed, (uint32_t)i, 1, 12, 0);
  s.bf.assign(n, 0);
  s.mc.assign(nb * 8, 0);
  s.ms.assign(nb, 0);
  s.vc.assign(nb * 8, 0);
  s.vs.assign(nb, 0);
  s.mt.assign(nc, 0.0f);
  s.vt.assign(nc, 0.0f);
  // compact masters: bf16 halves of p, the split residual and odd positions
  s.hi.resize(n);
  s.lo.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = fp4::f2u(s.p[i]);
    s.hi[i] = fp4master::to_bf16(s.p[i]);
    bool o;
    s.lo[i] = fp4master::split_residual(b, o);
    if (o) s.odd.push_back(i);
  }
  return s;
}

ChunkArgs args(State& s, int64_t n, int v_kind, bool msr, bool vsr, bool wd, bool maximize, bool bf16_out, int t) {
  ChunkArgs a{};
  a.n = n;
  a.param = s.p.data();
  a.m_codes = s.mc.data();
  a.m_scales = s.ms.data();
  a.v_codes = s.vc.data();
  a.v_scales = s.vs.data();
  a.m_ts = s.mt.data();
  a.v_ts = s.vt.data();
  // AdamW's scalars at step t (lr 1e-2, betas 0.9 / 0.999, eps 1e-8, weight decay 0.01), as float constants
  const float bc1 = t == 1 ? 0.1f : t == 2 ? 0.19f : 0.271f;
  const float bc2 = t == 1 ? 0.001f : t == 2 ? 0.001999f : 0.002997001f;
  a.s = fp4adam::Scalars{0.9f, 0.1f, 0.999f, 0.001f, 1e-8f, wd ? 0.9999f : 1.0f, 0.01f / bc1, 1.0f / bc2, wd};
  // rsbc2 stands for 1 / sqrt(bc2) in the real step; any fixed float exercises the same arithmetic
  a.maximize = maximize;
  a.m_stochastic = msr;
  a.v_stochastic = vsr;
  a.v_kind = v_kind;
  a.seed = 0x5EED0000u + (uint32_t)t;
  a.stream0 = 7;
  a.bf16_out = bf16_out ? s.bf.data() : nullptr;
  return a;
}

// Every byte, with one exception: a NaN in the fp32 parameter counts as one value. Its sign and payload come
// from the hardware (an invalid operation gives 0xFFC00000 on x86 and 0x7FC00000 on ARM, and IEEE 754 leaves
// both open); the packed states and the bf16 copies carry no payload (their rules write 0x7FC0 or drop the block).
uint64_t digest(const State& s, bool with_master) {
  uint64_t h = kFnv0;
  for (float x : s.p) {
    const uint32_t b = (fp4::f2u(x) & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : fp4::f2u(x);
    h = fnv(h, &b, 4);
  }
  h = fnv(h, s.bf.data(), s.bf.size() * 2);
  h = fnv(h, s.mc.data(), s.mc.size());
  h = fnv(h, s.ms.data(), s.ms.size());
  h = fnv(h, s.vc.data(), s.vc.size());
  h = fnv(h, s.vs.data(), s.vs.size());
  h = fnv(h, s.mt.data(), s.mt.size() * 4);
  h = fnv(h, s.vt.data(), s.vt.size() * 4);
  if (with_master) {
    h = fnv(h, s.hi.data(), s.hi.size() * 2);
    h = fnv(h, s.lo.data(), s.lo.size() * 2);
    h = fnv(h, s.odd.data(), s.odd.size() * 8);
  }
  return h;
}

template <typename G>
void step(const ChunkArgs& a, const G* g, bool vec) {
  const int64_t nc = (a.n + kChunk - 1) / kChunk;
#if FP4_CPU_VEC
  if (vec) return fp4adam::step_range_fast(a, g, 0, nc);
#endif
  (void)vec;
  fp4adam::step_range_scalar(a, g, 0, nc);
}

std::vector<float> gradient(int64_t n, uint32_t seed, int special) {
  std::vector<float> g(n);
  for (int64_t i = 0; i < n; ++i) g[i] = rnd_float(seed, (uint32_t)i, 2, 30, special);
  if (n > 3) {
    g[0] = 0.0f;
    g[1] = -0.0f;
  }
  return g;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& g) {
  std::vector<uint16_t> out(g.size());
  for (size_t i = 0; i < g.size(); ++i) out[i] = fp4master::to_bf16(g[i]);
  return out;
}

// The fused step: 3 steps of one configuration.
uint64_t run_step(int64_t n, int v_kind, bool msr, bool vsr, bool bf16_grad, bool wd, bool maximize, bool bf16_out,
                  int special, bool vec, float gscale = 1.0f) {
  State s = make_state(n, (uint32_t)n);
  for (int t = 1; t <= 3; ++t) {
    const std::vector<float> g = gradient(n, (uint32_t)(n * 31 + t), special);
    ChunkArgs a = args(s, n, v_kind, msr, vsr, wd, maximize, bf16_out, t);
    a.gscaled = gscale != 1.0f;
    a.gscale = gscale;
    if (bf16_grad) {
      const std::vector<uint16_t> gb = to_bf16(g);
      step(a, gb.data(), vec);
    } else {
      step(a, g.data(), vec);
    }
  }
  return digest(s, false);
}

// A compact master (mode 1 split, 2 bf16): rebuild, step, write back, in groups of 32 chunks (adam_cpu.cpp).
uint64_t run_master(int64_t n, int mode, int v_kind, bool msr, bool vec) {
  State s = make_state(n, (uint32_t)n + 99);
  const int64_t nc = (n + kChunk - 1) / kChunk;
  constexpr int64_t kGroup = 32;
  for (int t = 1; t <= 3; ++t) {
    const std::vector<float> g = gradient(n, (uint32_t)(n * 17 + t), 0);
    ChunkArgs a = args(s, n, v_kind, msr, false, true, false, false, t);
    a.bf16_out = mode == 1 ? s.hi.data() : nullptr;
    std::vector<int64_t> odd_new;
    const int64_t* k = s.odd.data();
    std::vector<float> buf(kGroup * kChunk);
    for (int64_t g0 = 0; g0 < nc; g0 += kGroup) {
      const int64_t g1 = std::min(nc, g0 + kGroup);
      const int64_t e0 = g0 * kChunk, e1 = std::min(g1 * kChunk, n);
      uint32_t* bb = reinterpret_cast<uint32_t*>(buf.data());
      fp4adam::master_rebuild(mode, s.hi.data(), s.lo.data(), k, s.odd.data() + s.odd.size(), e0, e1, bb);
      ChunkArgs ag = a;
      ag.param = buf.data() - e0;
#if FP4_CPU_VEC
      if (vec)
        fp4adam::step_range_fast(ag, g.data(), g0, g1);
      else
#endif
        fp4adam::step_range_scalar(ag, g.data(), g0, g1);
      fp4adam::master_store(mode, bb, e0, e1, a.seed, a.stream0, s.hi.data(), s.lo.data(), odd_new);
    }
    if (mode == 1) s.odd = odd_new;
  }
  return digest(s, true);
}

// The codec rules on a spread of inputs: E2M1 nearest and stochastic, E4M3, the unsigned grids, MX exponents,
// block scales, bf16 rounding.
uint64_t run_rules() {
  uint64_t h = kFnv0;
  for (uint32_t i = 0; i < 200000; ++i) {
    const float x = rnd_float(3, i, 4, 40, 50);
    const uint32_t r = fp4::fmix32(i * 0x85EBCA6Bu + 1);
    uint8_t out[16];
    const bool fin = fp4::is_finite(x);
    out[0] = fin ? fp4::e2m1_encode(x * 0.37f, false, 0) : 0;
    out[1] = fin ? fp4::e2m1_encode(x * 0.37f, true, r) : 0;
    out[2] = fin ? fp4::e4m3_encode(x) : 0;
    out[3] = fin ? fp4::ugrid_encode(fp4::fabs_(x) * 0.01f, 1) : 0;
    out[4] = fin ? fp4::ugrid_encode(fp4::fabs_(x) * 0.01f, 2) : 0;
    out[5] = fin ? fp4::ugrid_encode_sr(fp4::fabs_(x) * 0.01f, r, 1) : 0;
    out[6] = fin ? fp4::ugrid_encode_sr(fp4::fabs_(x) * 0.01f, r, 2) : 0;
    out[7] = fin ? (uint8_t)(fp4::mx_exponent(fp4::fabs_(x), 0x400000u, 2, false) + 127) : 0;
    out[8] = fin ? (uint8_t)(fp4::mx_exponent(fp4::fabs_(x), 0x600000u, 8, true) + 127) : 0;
    const fp4::TensorScale ts = fp4::tensor_scale(fin ? fp4::fabs_(x) * 3.0f : 1.0f, 6.0f);
    float k;
    bool live;
    out[9] = fp4::block_scale(fin ? fp4::fabs_(x) : 0.0f, !fin, 6.0f, ts, k, live);
    const uint16_t b = fp4master::to_bf16(x);
    memcpy(out + 10, &b, 2);
    const float v = fp4::e4m3_value((uint8_t)i) + fp4::e2m1_value((uint8_t)(i & 15)) + fp4::ugrid_value((uint8_t)(i & 15), 2);
    memcpy(out + 12, &v, 4);
    h = fnv(h, out, 16);
    h = fnv(h, &k, 4);
  }
  return h;
}

// The digest of decoded values; NaN blocks decode to NaN: one value, whatever the payload.
uint64_t fnv_decoded(uint64_t h, const std::vector<float>& back) {
  for (float v : back) {
    const uint32_t b = (fp4::f2u(v) & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : fp4::f2u(v);
    h = fnv(h, &b, 4);
  }
  return h;
}

// The codec on a (rows, cols) fp32 tensor: every NVFP4/ufp4 and MX variant, encode then decode, one digest.
uint64_t run_codec(int64_t rows, int64_t cols, int variant, bool specials, bool vec) {
  const int64_t n = rows * cols;
  std::vector<float> x(n);
  for (int64_t i = 0; i < n; ++i) x[i] = rnd_float((uint32_t)(rows * 7919 + cols), (uint32_t)i, 3, 24, specials ? 61 : 0);
  uint64_t h = kFnv0;
  const bool stochastic = variant & 1;
  const int kind = variant >> 1;  // 0 nv 1x16, 1 nv 16x16, 2 nv scope 1024, 3 ufp4, 4 ufp4 16x16, 5 nv amax given,
                                  // 6 mxfp4 rceil, 7 mxfp4 floor, 8 mxfp8, 9 int2
  if (kind == 9) {
    const int64_t nb = (n + fp4::kNvBlock - 1) / fp4::kNvBlock;
    std::vector<uint8_t> data(nb * (fp4::kNvBlock / 4)), scales(nb);
    float s_dec = 0.0f;
    int64_t bad = 0;
    fp4codec::int2_encode_impl<float>(x.data(), n, stochastic, 0xC0DEu, 5u, true, vec, data.data(), scales.data(),
                                      s_dec, bad);
    h = fnv(h, data.data(), data.size());
    h = fnv(h, scales.data(), scales.size());
    h = fnv(h, &s_dec, 4);
    h = fnv(h, &bad, 8);
    std::vector<float> back(n);
    fp4codec::int2_decode_impl<float>(data.data(), scales.data(), s_dec, n, back.data());
    h = fnv_decoded(h, back);
    return h;
  }
  if (kind <= 5) {
    const bool ufp4 = kind == 3 || kind == 4;
    const int64_t tile = (kind == 1 || kind == 4) ? 16 : 1;
    const int64_t scope = kind == 2 ? 1024 : 0;
    const fp4codec::NvGeom g(rows, cols, tile, scope);
    std::vector<uint8_t> data(g.data_bytes()), scales(g.nb);
    std::vector<float> s_dec, amax;
    int64_t bad = 0;
    const float* amax_in = nullptr;
    if (kind == 5) {
      amax.assign(g.nscopes, 0.0f);
      for (int64_t i = 0; i < n; ++i)
        if (fp4::is_finite(x[i])) amax[0] = fp4::fmax_(amax[0], fp4::fabs_(x[i]) * 0.75f);  // some saturate
      amax_in = amax.data();
    }
    fp4codec::nvfp4_encode_impl<float>(x.data(), g, ufp4, stochastic, 0xC0DEu, 5u, specials, amax_in, vec,
                                       data.data(), scales.data(), s_dec, bad);
    h = fnv(h, data.data(), data.size());
    h = fnv(h, scales.data(), scales.size());
    h = fnv(h, s_dec.data(), s_dec.size() * 4);
    h = fnv(h, &bad, 8);
    if (!bad || specials) {
      std::vector<float> back(n);
      fp4codec::nvfp4_decode_impl<float>(data.data(), scales.data(), s_dec.data(), g, ufp4, vec, back.data());
      h = fnv_decoded(h, back);
    }
    return h;
  }
  const bool fp8 = kind == 8, floor_mode = kind == 7;
  const int64_t nb = (n + fp4::kMxBlock - 1) / fp4::kMxBlock;
  std::vector<uint8_t> data(fp8 ? nb * fp4::kMxBlock : nb * fp4::kMxBlock / 2), scales(nb);
  int64_t bad = 0;
  fp4codec::mx_encode_impl<float>(x.data(), n, fp8, floor_mode, stochastic && !fp8, 0xC0DEu, 5u, specials, vec,
                                  data.data(), scales.data(), bad);
  h = fnv(h, data.data(), data.size());
  h = fnv(h, scales.data(), scales.size());
  h = fnv(h, &bad, 8);
  std::vector<float> back(n);
  fp4codec::mx_decode_impl<float>(data.data(), scales.data(), n, fp8, back.data());
  h = fnv_decoded(h, back);
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  const bool vec_only = argc > 1 && std::string(argv[1]) == "--vector";
  const char* vec_name = FP4_CPU_VEC ? "vector" : "scalar";
  auto emit = [&](const std::string& name, auto fn) {
    if (!vec_only) printf("%s scalar %016llx\n", name.c_str(), (unsigned long long)fn(false));
    if (FP4_CPU_VEC) printf("%s %s %016llx\n", name.c_str(), vec_name, (unsigned long long)fn(true));
  };
  const int64_t sizes[] = {1, 15, 16, 17, 1000, 1024, 1025, 5003, 70001};
#define FP4_V_ID(name, id, mbits, block, cbits) id,
  const int vkinds[] = {FP4_V_GRIDS(FP4_V_ID)};  // every v grid (csrc/grids.h)
#undef FP4_V_ID
  for (int64_t n : sizes)
    for (int vk : vkinds)
      for (int r = 0; r < 4; ++r) {
        const bool msr = r & 2, vsr = r & 1;
        char name[96];
        snprintf(name, sizeof name, "step-n%lld-vk%d-m%d-v%d", (long long)n, vk, (int)msr, (int)vsr);
        emit(name, [&](bool v) { return run_step(n, vk, msr, vsr, false, true, false, n % 2 == 1, 0, v); });
      }
  for (int64_t n : {17, 1025, 5003})
    for (int f = 0; f < 4; ++f) {
      char name[96];
      snprintf(name, sizeof name, "step-bf16grad-n%lld-f%d", (long long)n, f);
      emit(name, [&](bool v) { return run_step(n, 2, true, false, true, f & 1, f & 2, true, 0, v); });
    }
  for (int64_t n : {17, 5003})
    for (int bf = 0; bf < 2; ++bf) {  // an engine's clipping factor, applied as each gradient is read
      char name[96];
      snprintf(name, sizeof name, "step-gscale-n%lld-bf%d", (long long)n, bf);
      emit(name, [&](bool v) { return run_step(n, 2, true, true, bf, true, n == 17, false, 0, v, 0.3183f); });
    }
  for (int vk : vkinds) {
    char name[96];
    snprintf(name, sizeof name, "step-special-vk%d", vk);
    emit(name, [&](bool v) { return run_step(3000, vk, true, vk == 2, false, true, false, true, 97, v); });
  }
  for (int mode = 1; mode <= 2; ++mode)
    for (int64_t n : {1000, 70001}) {
      char name[96];
      snprintf(name, sizeof name, "master%d-n%lld", mode, (long long)n);
      emit(name, [&](bool v) { return run_master(n, mode, 2, true, v); });
    }
  if (!vec_only) {
    printf("rules scalar %016llx\n", (unsigned long long)run_rules());
    const int64_t shapes[][2] = {{1, 1}, {1, 7}, {1, 16}, {1, 33}, {3, 5}, {16, 16}, {17, 31}, {64, 48}, {130, 257},
                                 {1, 4097}};
    for (const auto& sh : shapes)
      for (int variant = 0; variant < 20; ++variant)
        for (int sp = 0; sp < 2; ++sp) {
          char name[96];
          snprintf(name, sizeof name, "codec-%lldx%lld-v%d-s%d", (long long)sh[0], (long long)sh[1], variant, sp);
          printf("%s codec %016llx\n", name, (unsigned long long)run_codec(sh[0], sh[1], variant, sp, false));
          if (FP4_CPU_VEC)  // the build's vector rows and MXFP4 blocks (nvfp4_rows.h)
            printf("%s codec-vector %016llx\n", name, (unsigned long long)run_codec(sh[0], sh[1], variant, sp, true));
        }
  }
  return 0;
}
