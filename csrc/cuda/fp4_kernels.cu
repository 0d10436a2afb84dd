// CUDA kernels for fp4offload: thin loops around csrc/fp4_codec.h (docs/design.md sections 3 and 4).
//
// Each kernel is the GPU counterpart of a loop in csrc/cpu/fp4_cpu.cpp and produces the bytes of
// fp4offload/formats/reference.py. Build with --fmad=false and without fast math (no --use_fast_math,
// keep --prec-div=true and --ftz=false): every multiply and divide of the header must round on its own.
//
// Work split (all loops grid-stride; loops that shuffle are warp-uniform so every lane takes part):
// - 1x16 NVFP4/ufp4 and 1x32 MX: a thread owns one 16-byte run of the source (4 fp32 or 8 bf16/fp16
//   elements), so G = block / run consecutive lanes own one block and reduce its amax by shuffles.
// - 16x16 tiles: 32 lanes per tile (a warp; half an AMD wave64), lane l owns 8 elements of tile row l/2.
// - NVFP4 is two passes: (1) finite amax + non-finite count, scope amax by atomicMax on the fp32 bits
//   (valid for non-negative floats), a tiny kernel turns it into (s_enc, s_dec); (2) block scale +
//   encode + pack, re-reading the source instead of storing per-block amax. MX is one pass.
// - Decoders: a thread writes 8 consecutive outputs; code values come from a 16-entry table in shared
//   memory filled from the header's e2m1_value / ufp4_value.
//
// sm_100a hardware path (docs/design.md 4): where the target is arch- or family-specific and >= sm_100, the
// nearest-rounding E2M1 pair encoder uses cvt.rn.satfinite.e2m1x2.f32. It rounds to nearest even and
// saturates at 6, which is the software rule on magnitudes. It is fed |y| and the sign bits are set in
// software, so the result never depends on how the hardware signs a zero (NVIDIA's host emulation in
// cuda_fp4.hpp keeps the sign, -0 -> 0x8, which is also the software rule) or a NaN (the emulation gives
// +6, code 0x7, dropping the sign; the software rule keeps it). NaN magnitudes give code 7 either way.
// Stochastic rounding and ufp4 (nearest or stochastic) always use the software rule.
#include <stdint.h>

#include "gpu_compat.h"
FP4_GPU_HD_BEGIN
#include "fp4_codec.h"
FP4_GPU_HD_END
#include "fp4_kernels.cuh"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 1000) && \
    (defined(__CUDA_ARCH_SPECIFIC__) || defined(__CUDA_ARCH_FAMILY_SPECIFIC__))
#define FP4_HW_E2M1 1
#else
#define FP4_HW_E2M1 0
#endif

namespace fp4cuda {
namespace {

using fp4gpu::kWarp;  // lanes of a warp: 32 on NVIDIA, 64 on AMD (gpu_compat.h)
constexpr int kThreads = 256;
// A 16x16 tile is reduced by kTileLanes consecutive lanes of 8 elements each: a warp on NVIDIA, half a wave64.
constexpr int kTileLanes = 32;
static_assert(kWarp % kTileLanes == 0 && kThreads % kWarp == 0, "tiles and CTAs are whole lane groups");

// ---- element types ----------------------------------------------------------------------------------

template <int DT>
struct Elem;
template <>
struct Elem<kF32> {
  using raw = uint32_t;
  __device__ static float get(raw r) { return __uint_as_float(r); }
  __device__ static raw put(float f) { return __float_as_uint(f); }
};
template <>
struct Elem<kBF16> {
  using raw = uint16_t;
  __device__ static float get(raw r) { return __uint_as_float((uint32_t)r << 16); }  // exact
  __device__ static raw put(float f) { return fp4gpu::bf16_bits_rn(f); }
};
template <>
struct Elem<kF16> {
  using raw = uint16_t;
  __device__ static float get(raw r) { return __half2float(__ushort_as_half(r)); }  // exact
  __device__ static raw put(float f) { return __half_as_ushort(__float2half_rn(f)); }
};

__device__ __forceinline__ uint32_t word_of(const uint4& q, int w) {
  return w == 0 ? q.x : (w == 1 ? q.y : (w == 2 ? q.z : q.w));
}

__host__ __device__ __forceinline__ bool aligned(const void* p, unsigned a) {
  return ((uintptr_t)p & (uintptr_t)(a - 1)) == 0;
}

// Loads x[i0 .. i0+N) as fp32 (zeros past n): 16-byte loads when `vec` (x 16-byte aligned) and the run
// is whole, element loads otherwise.
template <int DT, int N>
__device__ __forceinline__ void load_run(const typename Elem<DT>::raw* __restrict__ x, int64_t i0, int64_t n,
                                         bool vec, float (&v)[N]) {
  using raw = typename Elem<DT>::raw;
  constexpr int kPer = 16 / (int)sizeof(raw);
  static_assert(N % kPer == 0, "runs are whole 16-byte vectors");
  if (vec && i0 + N <= n) {
    const uint4* p = reinterpret_cast<const uint4*>(x + i0);
#pragma unroll
    for (int k = 0; k < N / kPer; ++k) {
      const uint4 q = __ldg(p + k);
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const raw r = sizeof(raw) == 4 ? (raw)word_of(q, j) : (raw)(word_of(q, j >> 1) >> ((j & 1) * 16));
        v[k * kPer + j] = Elem<DT>::get(r);
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) v[j] = i0 + j < n ? Elem<DT>::get(x[i0 + j]) : 0.0f;
  }
}

// Stores o[0 .. N) to out[i0 ..) (only below n): 16-byte stores when `vec` and the run is whole.
template <int DT, int N>
__device__ __forceinline__ void store_run(typename Elem<DT>::raw* __restrict__ out, int64_t i0, int64_t n, bool vec,
                                          const float (&o)[N]) {
  using raw = typename Elem<DT>::raw;
  constexpr int kPer = 16 / (int)sizeof(raw);
  static_assert(N % kPer == 0, "runs are whole 16-byte vectors");
  if (vec && i0 + N <= n) {
    uint4* p = reinterpret_cast<uint4*>(out + i0);
#pragma unroll
    for (int k = 0; k < N / kPer; ++k) {
      uint32_t w[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (sizeof(raw) == 4) {
          w[q] = (uint32_t)Elem<DT>::put(o[k * kPer + q]);
        } else {
          w[q] = (uint32_t)Elem<DT>::put(o[k * kPer + 2 * q]) | ((uint32_t)Elem<DT>::put(o[k * kPer + 2 * q + 1]) << 16);
        }
      }
      p[k] = make_uint4(w[0], w[1], w[2], w[3]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (i0 + j < n) out[i0 + j] = Elem<DT>::put(o[j]);
  }
}

__device__ __forceinline__ uint32_t load_u32(const uint8_t* p, bool words) {
  if (words) return *reinterpret_cast<const uint32_t*>(p);
  return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

// Stores the low 8*B bits of `packed` at p (p is B-byte aligned by construction of the layouts).
template <int B>
__device__ __forceinline__ void store_bytes(uint8_t* p, uint32_t packed) {
  static_assert(B == 2 || B == 4, "2 or 4 code bytes per thread");
  if (B == 2)
    *reinterpret_cast<uint16_t*>(p) = (uint16_t)packed;
  else
    *reinterpret_cast<uint32_t*>(p) = packed;
}

// ---- reductions -------------------------------------------------------------------------------------

template <int G>
__device__ __forceinline__ float group_max(float m) {
#pragma unroll
  for (int off = G / 2; off > 0; off >>= 1) m = fp4::fmax_(m, fp4gpu::shfl_xor(m, off));
  return m;
}

template <int G>
__device__ __forceinline__ uint32_t group_or(uint32_t b) {
#pragma unroll
  for (int off = G / 2; off > 0; off >>= 1) b |= fp4gpu::shfl_xor(b, off);
  return b;
}

__device__ __forceinline__ uint32_t warp_sum(uint32_t s) {
#pragma unroll
  for (int off = kWarp / 2; off > 0; off >>= 1) s += fp4gpu::shfl_xor(s, off);
  return s;
}

// Finite amax and non-finite count of a run (as the reference's _finite_magnitudes).
template <int N>
__device__ __forceinline__ void finite_amax(const float (&v)[N], float& m, uint32_t& bad) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    const bool fin = fp4::is_finite(v[j]);
    bad += fin ? 0u : 1u;
    m = fp4::fmax_(m, fin ? fp4::fabs_(v[j]) : 0.0f);
  }
}

// A thread's run of a 1x16 or 1x32 block: when `active`, loads x[i0 .. i0+N) (as load_run) with its finite amax
// and non-finite count; m = 0 and bad = 0 otherwise (v is then left unset).
template <int DT, int N>
__device__ __forceinline__ void load_run_amax(const typename Elem<DT>::raw* __restrict__ x, int64_t i0, int64_t n,
                                              bool vec, bool active, float (&v)[N], float& m, uint32_t& bad) {
  m = 0.0f;
  bad = 0;
  if (active) {
    load_run<DT, N>(x, i0, n, vec, v);
    finite_amax(v, m, bad);
  }
}

// A lane's 8 elements of a 16x16 tile: row r, columns c0 .. c0+8 of the (rows, cols) source; zeros for a row
// past the last (load_run zero-fills past the last column).
template <int DT>
__device__ __forceinline__ void load_tile_run(const typename Elem<DT>::raw* __restrict__ x, int64_t r, int64_t c0,
                                              int64_t rows, int64_t cols, bool vec, float (&v)[8]) {
  if (r < rows) {
    load_run<DT, 8>(x + r * cols, c0, cols, vec, v);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = 0.0f;
  }
}

__device__ __forceinline__ void atomic_max_nonneg(float* addr, float v) {
  atomicMax(reinterpret_cast<unsigned int*>(addr), __float_as_uint(v));  // order of bits == order of values
}

// ---- element encoders -------------------------------------------------------------------------------

__device__ __forceinline__ uint32_t e2m1_pair_sw(float y0, float y1) {
  return fp4::pack2(fp4::e2m1_encode(y0, false, 0u), fp4::e2m1_encode(y1, false, 0u));
}

// Nearest-even E2M1 codes of (y0, y1), y0 in the low nibble.
__device__ __forceinline__ uint32_t e2m1_pair_rn(float y0, float y1) {
#if FP4_HW_E2M1
  unsigned short mag;
  // d = {a -> high nibble, b -> low nibble}; magnitudes only, signs below.
  asm("{\n\t.reg .b8 t;\n\tcvt.rn.satfinite.e2m1x2.f32 t, %1, %2;\n\tmov.b16 %0, {t, 0};\n\t}"
      : "=h"(mag)
      : "f"(fp4::fabs_(y1)), "f"(fp4::fabs_(y0)));
  const uint8_t s0 = (uint8_t)((fp4::f2u(y0) >> 28) & 0x8u), s1 = (uint8_t)((fp4::f2u(y1) >> 28) & 0x8u);
  return (uint32_t)mag | fp4::pack2(s0, s1);  // the codes' sign bits
#else
  return e2m1_pair_sw(y0, y1);
#endif
}

// Codes of v[j] * s for a run of N elements whose first element sits at `index0` of the padded code
// layout, packed two a byte (element 0 in the low nibble of byte 0).
template <int N>
__device__ __forceinline__ uint32_t encode_run(const float (&v)[N], float s, bool ufp4, bool stochastic,
                                               uint32_t key, uint64_t index0) {
  static_assert(N <= 8, "at most 4 code bytes");
  uint32_t packed = 0;
#pragma unroll
  for (int j = 0; j < N; j += 2) {
    const float y0 = v[j] * s, y1 = v[j + 1] * s;
    uint32_t pair;
    if (ufp4 && stochastic) {  // the bits E2M1 would draw for these elements
      pair = fp4::pack2(fp4::ufp4_encode_sr(fp4::fabs_(y0), fp4::sr_bits(key, index0 + j)),
                        fp4::ufp4_encode_sr(fp4::fabs_(y1), fp4::sr_bits(key, index0 + j + 1)));
    } else if (ufp4) {
      pair = fp4::pack2(fp4::ufp4_encode(fp4::fabs_(y0)), fp4::ufp4_encode(fp4::fabs_(y1)));
    } else if (stochastic) {
      pair = fp4::pack2(fp4::e2m1_encode(y0, true, fp4::sr_bits(key, index0 + j)),
                        fp4::e2m1_encode(y1, true, fp4::sr_bits(key, index0 + j + 1)));
    } else {
      pair = e2m1_pair_rn(y0, y1);
    }
    packed |= fp4::word_slot(pair, j);
  }
  return packed;
}

__device__ __forceinline__ uint32_t run_key(bool stochastic, uint32_t seed, uint32_t sid, int64_t index0) {
  // A run never crosses a multiple of 2^32 (its length divides 16), so one key serves it.
  return stochastic ? fp4::sr_key(seed, sid, (uint32_t)((uint64_t)index0 >> 32)) : 0u;
}

// ---- NVFP4 / ufp4 encode ----------------------------------------------------------------------------

// Scope reduction modes of pass 1.
enum ScopeMode : int { kWhole = 0, kPerWarp = 1, kPerBlock = 2, kNone = 3 };

template <int DT>
__global__ void __launch_bounds__(kThreads)
    nv_flat_amax(const void* xv, int64_t n, int64_t nb, int64_t per, int mode, bool vec, float* amax_s,
                 unsigned long long* bad_total) {
  using raw = typename Elem<DT>::raw;
  constexpr int N = 16 / (int)sizeof(raw);
  constexpr int G = fp4::kNvBlock / N;
  const raw* x = static_cast<const raw*>(xv);
  const int lane = threadIdx.x % kWarp;
  const int64_t total = nb * G, stride = (int64_t)gridDim.x * blockDim.x;
  float run = 0.0f;
  uint32_t bad_run = 0;
  for (int64_t base = (int64_t)blockIdx.x * blockDim.x + (threadIdx.x - lane); base < total; base += stride) {
    const int64_t u = base + lane;
    float v[N], m;
    uint32_t bad;
    load_run_amax<DT, N>(x, u * N, n, vec, u < total, v, m, bad);
    bad_run += bad;
    m = group_max<G>(m);
    if (mode == kWhole) {
      run = fp4::fmax_(run, m);
    } else if (mode == kPerWarp) {  // the warp's blocks share one scope
      m = group_max<kWarp>(m);
      if (lane == 0 && m > 0.0f) atomic_max_nonneg(&amax_s[(base / G) / per], m);
    } else if (mode == kPerBlock) {
      if (u < total && lane % G == 0 && m > 0.0f) atomic_max_nonneg(&amax_s[(u / G) / per], m);
    }
  }
  if (mode == kWhole) {
    run = group_max<kWarp>(run);
    if (lane == 0 && run > 0.0f) atomic_max_nonneg(&amax_s[0], run);
  }
  bad_run = warp_sum(bad_run);
  if (lane == 0 && bad_run) atomicAdd(bad_total, (unsigned long long)bad_run);
}

template <int DT>
__global__ void __launch_bounds__(kThreads)
    nv_tile_amax(const void* xv, int64_t rows, int64_t cols, int64_t ntiles, int64_t C, bool vec, float* amax_s,
                 unsigned long long* bad_total) {
  using raw = typename Elem<DT>::raw;
  const raw* x = static_cast<const raw*>(xv);
  const int lane = threadIdx.x % kTileLanes;  // lane of the tile's group
  const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / kTileLanes;
  const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) / kTileLanes;
  float run = 0.0f;
  uint32_t bad_run = 0;
  for (int64_t t = warp; t < ntiles; t += nwarps) {
    const int64_t r = (t / C) * 16 + (lane >> 1), c0 = (t % C) * 16 + (lane & 1) * 8;
    float v[8];
    load_tile_run<DT>(x, r, c0, rows, cols, vec, v);
    finite_amax(v, run, bad_run);
  }
  if (amax_s) {
    run = group_max<kTileLanes>(run);
    if (lane == 0 && run > 0.0f) atomic_max_nonneg(&amax_s[0], run);
  }
  bad_run = warp_sum(bad_run);  // the whole warp's count: one lane of the warp adds it
  if (threadIdx.x % kWarp == 0 && bad_run) atomicAdd(bad_total, (unsigned long long)bad_run);
}

// ws[s] holds the scope amax (or `amax` overrides it); leaves s_enc in ws[s] and writes s_dec.
__global__ void nv_tensor_scales(float* ws, const float* amax, int64_t nscopes, float elem_max, float* s_dec) {
  for (int64_t s = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; s < nscopes; s += (int64_t)gridDim.x * blockDim.x) {
    const fp4::TensorScale ts = fp4::tensor_scale(amax ? amax[s] : ws[s], elem_max);
    ws[s] = ts.enc;
    s_dec[s] = ts.dec;
  }
}

struct EncodeArgs {
  float elem_max;
  bool ufp4, stochastic, propagate, vec;
  uint32_t seed, sid;
  const float* s_enc;
  const float* s_dec;
  uint8_t* data;
  uint8_t* scales;
};

// One thread's run of a 1x16 block or 16x16 tile: the block's E4M3 scale (from the group's amax `m`) into
// `sc`, and the run's packed codes (0 for an all-zero or non-finite block). `pos` indexes the code layout.
template <int N>
__device__ __forceinline__ uint32_t encode_scaled_run(const float (&v)[N], float m, uint32_t bad, float s_enc,
                                                      float s_dec, const EncodeArgs& a, int64_t pos, uint8_t& sc) {
  sc = fp4::block_scale_code(m, a.elem_max, s_enc);
  if (sc == 0 || bad) return 0;
  return encode_run<N>(v, fp4::block_encode_scale(sc, s_dec), a.ufp4, a.stochastic,
                       run_key(a.stochastic, a.seed, a.sid, pos), (uint64_t)pos);
}

template <int DT>
__global__ void __launch_bounds__(kThreads)
    nv_flat_encode(const void* xv, int64_t n, int64_t nb, int64_t per, EncodeArgs a) {
  using raw = typename Elem<DT>::raw;
  constexpr int N = 16 / (int)sizeof(raw);
  constexpr int G = fp4::kNvBlock / N;
  const raw* x = static_cast<const raw*>(xv);
  const int lane = threadIdx.x % kWarp;
  const int64_t total = nb * G, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t base = (int64_t)blockIdx.x * blockDim.x + (threadIdx.x - lane); base < total; base += stride) {
    const int64_t u = base + lane, i0 = u * N;
    const bool active = u < total;
    float v[N], m;
    uint32_t bad;
    load_run_amax<DT, N>(x, i0, n, a.vec, active, v, m, bad);
    m = group_max<G>(m);
    bad = group_or<G>(bad);
    if (!active) continue;
    const int64_t b = u / G, s = b / per;
    uint8_t sc;
    const uint32_t packed = encode_scaled_run<N>(v, m, bad, a.s_enc[s], a.s_dec[s], a, i0, sc);
    if (lane % G == 0) a.scales[b] = (bad && a.propagate) ? fp4::kE4M3NaN : sc;
    store_bytes<N / 2>(a.data + i0 / 2, packed);
  }
}

template <int DT>
__global__ void __launch_bounds__(kThreads)
    nv_tile_encode(const void* xv, int64_t rows, int64_t cols, int64_t ntiles, int64_t C, int64_t cp, EncodeArgs a) {
  using raw = typename Elem<DT>::raw;
  const raw* x = static_cast<const raw*>(xv);
  const int lane = threadIdx.x % kTileLanes;  // lane of the tile's group
  const int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / kTileLanes;
  const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) / kTileLanes;
  for (int64_t t = warp; t < ntiles; t += nwarps) {
    const int64_t r = (t / C) * 16 + (lane >> 1), c0 = (t % C) * 16 + (lane & 1) * 8;
    float v[8];
    load_tile_run<DT>(x, r, c0, rows, cols, a.vec, v);
    float m = 0.0f;
    uint32_t bad = 0;
    finite_amax(v, m, bad);
    m = group_max<kTileLanes>(m);
    bad = group_or<kTileLanes>(bad);
    const int64_t pos = r * cp + c0;  // position in the padded row-major code layout
    uint8_t sc;
    const uint32_t packed = encode_scaled_run<8>(v, m, bad, a.s_enc[0], a.s_dec[0], a, pos, sc);
    if (lane == 0) a.scales[t] = (bad && a.propagate) ? fp4::kE4M3NaN : sc;
    store_bytes<4>(a.data + pos / 2, packed);
  }
}

// ---- MX encode (one pass) ---------------------------------------------------------------------------

struct MxArgs {
  bool fp8, floor_mode, stochastic, propagate, vec;
  uint32_t seed, sid;
  uint8_t* data;
  uint8_t* scales;
  unsigned long long* bad_total;
};

template <int DT>
__global__ void __launch_bounds__(kThreads) mx_encode_k(const void* xv, int64_t n, int64_t nb, MxArgs a) {
  using raw = typename Elem<DT>::raw;
  constexpr int N = 16 / (int)sizeof(raw);
  constexpr int G = fp4::kMxBlock / N;
  const raw* x = static_cast<const raw*>(xv);
  const int lane = threadIdx.x % kWarp;
  const int64_t total = nb * G, stride = (int64_t)gridDim.x * blockDim.x;
  uint32_t bad_run = 0;
  for (int64_t base = (int64_t)blockIdx.x * blockDim.x + (threadIdx.x - lane); base < total; base += stride) {
    const int64_t u = base + lane, i0 = u * N;
    const bool active = u < total;
    float v[N], m;
    uint32_t bad;
    load_run_amax<DT, N>(x, i0, n, a.vec, active, v, m, bad);
    bad_run += bad;
    m = group_max<G>(m);
    bad = group_or<G>(bad);
    if (!active) continue;
    const int64_t b = u / G;
    const int32_t e = a.fp8 ? fp4::mx_exponent(m, 0x600000u, 8, a.floor_mode) : fp4::mx_exponent(m, 0x400000u, 2, a.floor_mode);
    if (lane % G == 0) a.scales[b] = (bad && a.propagate) ? fp4::kE8M0NaN : (uint8_t)(e + 127);
    const float inv = fp4::pow2(-e);
    if (a.fp8) {
      uint32_t w[N / 4];
#pragma unroll
      for (int k = 0; k < N / 4; ++k) {
        w[k] = 0;
        if (!bad) {
#pragma unroll
          for (int j = 0; j < 4; ++j) w[k] |= (uint32_t)fp4::e4m3_encode(v[4 * k + j] * inv) << (8 * j);
        }
      }
      if constexpr (N == 4)
        *reinterpret_cast<uint32_t*>(a.data + i0) = w[0];
      else
        *reinterpret_cast<uint2*>(a.data + i0) = make_uint2(w[0], w[1]);
    } else {
      uint32_t packed = 0;
      if (!bad) packed = encode_run<N>(v, inv, false, a.stochastic, run_key(a.stochastic, a.seed, a.sid, i0), (uint64_t)i0);
      store_bytes<N / 2>(a.data + i0 / 2, packed);
    }
  }
  bad_run = warp_sum(bad_run);
  if (lane == 0 && bad_run) atomicAdd(a.bad_total, (unsigned long long)bad_run);
}

// ---- decoders ---------------------------------------------------------------------------------------

__device__ __forceinline__ void fill_table(float* tab, bool ufp4) {
  if (threadIdx.x < 16) tab[threadIdx.x] = ufp4 ? fp4::ufp4_value((uint8_t)threadIdx.x) : fp4::e2m1_value((uint8_t)threadIdx.x);
  __syncthreads();
}

template <int DT>
__global__ void __launch_bounds__(kThreads)
    nv_flat_decode(const uint8_t* data, const uint8_t* scales, const float* s_dec, int64_t n, int64_t per, bool ufp4,
                   bool words, bool vec, void* outv) {
  __shared__ float tab[16];
  fill_table(tab, ufp4);
  auto* out = static_cast<typename Elem<DT>::raw*>(outv);
  const int64_t units = (n + 7) / 8, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < units; u += stride) {
    const int64_t i0 = u * 8, b = i0 / fp4::kNvBlock;
    const float sv = fp4::e4m3_value(scales[b]), sd = s_dec[b / per];
    const uint32_t codes = load_u32(data + i0 / 2, words);
    float o[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = (tab[fp4::word_code(codes, j)] * sv) * sd;
    store_run<DT, 8>(out, i0, n, vec, o);
  }
}

template <int DT>
__global__ void __launch_bounds__(kThreads)
    nv_tile_decode(const uint8_t* data, const uint8_t* scales, const float* s_dec, int64_t rows, int64_t cols,
                   int64_t C, int64_t cp, bool ufp4, bool words, bool vec, void* outv) {
  __shared__ float tab[16];
  fill_table(tab, ufp4);
  auto* out = static_cast<typename Elem<DT>::raw*>(outv);
  const int64_t cw = (cols + 7) / 8, units = rows * cw, stride = (int64_t)gridDim.x * blockDim.x;
  const float sd = s_dec[0];
  for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < units; u += stride) {
    const int64_t r = u / cw, c0 = (u % cw) * 8, pos = r * cp + c0;
    const float sv = fp4::e4m3_value(scales[(r / 16) * C + c0 / 16]);
    const uint32_t codes = load_u32(data + pos / 2, words);  // pos / 2 is a multiple of 4
    float o[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = (tab[fp4::word_code(codes, j)] * sv) * sd;
    store_run<DT, 8>(out + r * cols, c0, cols, vec, o);
  }
}

template <int DT>
__global__ void __launch_bounds__(kThreads)
    mx_decode_k(const uint8_t* data, const uint8_t* scales, int64_t n, bool fp8, bool words, bool vec, void* outv) {
  __shared__ float tab[16];
  fill_table(tab, false);
  auto* out = static_cast<typename Elem<DT>::raw*>(outv);
  const int64_t units = (n + 7) / 8, stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t u = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; u < units; u += stride) {
    const int64_t i0 = u * 8;
    const float sv = fp4::e8m0_value(scales[i0 / fp4::kMxBlock]);
    float o[8];
    if (fp8) {
      const uint32_t lo = load_u32(data + i0, words), hi = load_u32(data + i0 + 4, words);
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = fp4::e4m3_value((uint8_t)(((j < 4 ? lo : hi) >> (8 * (j & 3))) & 0xFF)) * sv;
    } else {
      const uint32_t codes = load_u32(data + i0 / 2, words);
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = tab[fp4::word_code(codes, j)] * sv;
    }
    store_run<DT, 8>(out, i0, n, vec, o);
  }
}

// ---- int2 (2-bit saved activations; fp4_codec.h) -------------------------------------------------------
// A thread owns one 16-element block: pass 1 writes its finite amax to ws[1 + b], raises the tensor amax in ws[0]
// and counts non-finite values; pass 2 turns ws[0] into the tensor scale (every thread alike; block 0's first thread
// stores s_dec), then scales, rounds and packs the block into one 32-bit word.

template <int DT>
__global__ void __launch_bounds__(kThreads)
    int2_amax_k(const void* xv, int64_t n, int64_t nb, float* ws, unsigned long long* bad_total) {
  const auto* x = static_cast<const typename Elem<DT>::raw*>(xv);
  for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < nb; b += (int64_t)gridDim.x * blockDim.x) {
    float m = 0.0f;
    uint32_t bad = 0;
    for (int j = 0; j < fp4::kNvBlock; ++j) {
      const int64_t i = b * fp4::kNvBlock + j;
      const float v = i < n ? Elem<DT>::get(x[i]) : 0.0f;
      const bool fin = fp4::is_finite(v);
      bad += fin ? 0u : 1u;
      m = fp4::fmax_(m, fin ? fp4::fabs_(v) : 0.0f);
    }
    ws[1 + b] = bad ? -1.0f : m;  // -1 marks a block with non-finite values
    if (m > 0.0f) atomic_max_nonneg(ws, m);
    if (bad) atomicAdd(bad_total, (unsigned long long)bad);
  }
}

template <int DT>
__global__ void __launch_bounds__(kThreads)
    int2_encode_k(const void* xv, int64_t n, int64_t nb, const float* ws, bool stochastic, bool propagate,
                  uint32_t seed, uint32_t sid, uint8_t* data, uint8_t* scales, float* s_dec_out) {
  const auto* x = static_cast<const typename Elem<DT>::raw*>(xv);
  const fp4::TensorScale ts = fp4::tensor_scale(ws[0], fp4::kInt2Max);
  if (blockIdx.x == 0 && threadIdx.x == 0) *s_dec_out = ts.dec;
  for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < nb; b += (int64_t)gridDim.x * blockDim.x) {
    const float m = ws[1 + b];
    const int64_t i0 = b * fp4::kNvBlock;
    uint32_t* out = reinterpret_cast<uint32_t*>(data + b * (fp4::kNvBlock / 4));
    const uint8_t sc = m > 0.0f ? fp4::int2_scale_code(m, ts.enc) : 0;
    if (sc == 0) {  // all zero, non-finite (m is -1), or far below the tensor's amax: a dead block
      scales[b] = m < 0.0f && propagate ? fp4::kE4M3NaN : 0;
      *out = 0x01010101u * fp4::kInt2DeadByte;
      continue;
    }
    scales[b] = sc;
    const float k = fp4::block_encode_scale(sc, ts.dec);
    const uint32_t key = stochastic ? fp4::sr_key(seed, sid, (uint32_t)((uint64_t)i0 >> 32)) : 0u;
    uint32_t w = 0;
    for (int j = 0; j < fp4::kNvBlock; ++j) {
      const int64_t i = i0 + j;
      const float y = i < n ? __fmul_rn(Elem<DT>::get(x[i]), k) : 0.0f;
      w |= fp4::code2_slot(fp4::int2_encode(y, stochastic, stochastic ? fp4::sr_bits(key, (uint64_t)i) : 0u), j);
    }
    *out = w;
  }
}

template <int DT>
__global__ void __launch_bounds__(kThreads)
    int2_decode_k(const uint8_t* data, const uint8_t* scales, const float* tensor_scale, int64_t n, int64_t nb,
                  void* outv) {
  auto* out = static_cast<typename Elem<DT>::raw*>(outv);
  const float s_dec = tensor_scale[0];
  for (int64_t b = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; b < nb; b += (int64_t)gridDim.x * blockDim.x) {
    const float d = __fmul_rn(fp4::e4m3_value(scales[b]), s_dec);
    const int64_t i0 = b * fp4::kNvBlock;
    for (int j = 0; j < fp4::kNvBlock && i0 + j < n; ++j)
      out[i0 + j] = Elem<DT>::put(__fmul_rn(fp4::int2_level(fp4::code2_at(data, i0 + j)), d));
  }
}

// ---- diagnostics ------------------------------------------------------------------------------------

__global__ void e2m1_check_k(const float* y, int64_t npairs, uint8_t* hw, uint8_t* sw) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < npairs; i += (int64_t)gridDim.x * blockDim.x) {
    const float y0 = y[2 * i], y1 = y[2 * i + 1];
    hw[i] = (uint8_t)e2m1_pair_rn(y0, y1);
    sw[i] = (uint8_t)e2m1_pair_sw(y0, y1);
  }
}

__global__ void hw_flag_k(int* flag) { *flag = FP4_HW_E2M1; }

// ---- host helpers -----------------------------------------------------------------------------------

// Blocks for a grid-stride loop over `threads` threads: enough to fill the device, never more than needed.
int grid_for(int64_t threads) {
  static int sm_count[64] = {0};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) dev = 0;
  int& sms = sm_count[dev & 63];
  if (sms <= 0) {
    int v = 0;
    sms = (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess && v > 0) ? v : 132;
  }
  const int64_t want = (threads + kThreads - 1) / kThreads, cap = (int64_t)sms * 8;
  return (int)(want < 1 ? 1 : (want < cap ? want : cap));
}

size_t esize(DType dt) { return dt == kF32 ? 4 : 2; }

#define FP4_CHECK(expr)                       \
  do {                                        \
    const cudaError_t e_ = (expr);            \
    if (e_ != cudaSuccess) return e_;         \
  } while (0)

#define FP4_LAUNCHED() FP4_CHECK(cudaGetLastError())

// Calls body with the compile-time DType tag matching `dt`.
#define FP4_DISPATCH(dt, DTC, ...)           \
  switch (dt) {                              \
    case kF32: {                             \
      constexpr int DTC = kF32;              \
      __VA_ARGS__;                           \
      break;                                 \
    }                                        \
    case kBF16: {                            \
      constexpr int DTC = kBF16;             \
      __VA_ARGS__;                           \
      break;                                 \
    }                                        \
    case kF16: {                             \
      constexpr int DTC = kF16;              \
      __VA_ARGS__;                           \
      break;                                 \
    }                                        \
    default:                                 \
      return cudaErrorInvalidValue;          \
  }

}  // namespace

// ---- launchers --------------------------------------------------------------------------------------

cudaError_t nvfp4_encode(const void* x, DType dt, int64_t rows, int64_t cols, int64_t tile, int64_t scope,
                         bool ufp4, bool stochastic, uint32_t seed, uint32_t stream_id, bool propagate,
                         const float* amax, uint8_t* data, uint8_t* scales, float* tensor_scale, float* workspace,
                         unsigned long long* nonfinite, cudaStream_t stream) {
  if (tile != 1 && tile != 16) return cudaErrorInvalidValue;
  if (tile == 1 && (scope < 0 || scope % 16 != 0)) return cudaErrorInvalidValue;
  const NvLayout L = nv_layout(rows, cols, tile, scope);
  const float elem_max = ufp4 ? fp4::kUfp4Max : fp4::kE2M1Max;
  FP4_CHECK(cudaMemsetAsync(workspace, 0, sizeof(float) * (size_t)L.nscopes, stream));
  FP4_CHECK(cudaMemsetAsync(nonfinite, 0, sizeof(unsigned long long), stream));
  float* amax_s = amax ? nullptr : workspace;  // an override needs no measured scope amax
  const bool vec = aligned(x, 16) && (!L.tiled || (cols * (int64_t)esize(dt)) % 16 == 0);
  if (L.nb > 0) {
    if (L.tiled) {
      FP4_DISPATCH(dt, DTC, (nv_tile_amax<DTC><<<grid_for(L.nb * kTileLanes), kThreads, 0, stream>>>(
                                x, rows, cols, L.nb, L.C, vec, amax_s, nonfinite)));
    } else {
      const int G = dt == kF32 ? 4 : 2, blocks_per_warp = kWarp / G;
      const int mode = !amax_s ? kNone : (L.nscopes == 1 ? kWhole : (L.per % blocks_per_warp == 0 ? kPerWarp : kPerBlock));
      FP4_DISPATCH(dt, DTC, (nv_flat_amax<DTC><<<grid_for(L.nb * G), kThreads, 0, stream>>>(
                                x, L.n, L.nb, L.per, mode, vec, amax_s, nonfinite)));
    }
    FP4_LAUNCHED();
  }
  nv_tensor_scales<<<grid_for(L.nscopes), kThreads, 0, stream>>>(workspace, amax, L.nscopes, elem_max, tensor_scale);
  FP4_LAUNCHED();
  if (L.nb == 0) return cudaSuccess;
  EncodeArgs a;
  a.elem_max = elem_max;
  a.ufp4 = ufp4;
  a.stochastic = stochastic;
  a.propagate = propagate;
  a.vec = vec;
  a.seed = seed;
  a.sid = stream_id;
  a.s_enc = workspace;
  a.s_dec = tensor_scale;
  a.data = data;
  a.scales = scales;
  if (L.tiled) {
    FP4_DISPATCH(dt, DTC, (nv_tile_encode<DTC><<<grid_for(L.nb * kTileLanes), kThreads, 0, stream>>>(
                              x, rows, cols, L.nb, L.C, L.cp, a)));
  } else {
    const int G = dt == kF32 ? 4 : 2;
    FP4_DISPATCH(dt, DTC, (nv_flat_encode<DTC><<<grid_for(L.nb * G), kThreads, 0, stream>>>(x, L.n, L.nb, L.per, a)));
  }
  FP4_LAUNCHED();
  return cudaSuccess;
}

cudaError_t nvfp4_decode(const uint8_t* data, const uint8_t* scales, const float* tensor_scale, int64_t rows,
                         int64_t cols, int64_t tile, int64_t scope, bool ufp4, void* out, DType out_dt,
                         cudaStream_t stream) {
  if (tile != 1 && tile != 16) return cudaErrorInvalidValue;
  if (tile == 1 && (scope < 0 || scope % 16 != 0)) return cudaErrorInvalidValue;
  const NvLayout L = nv_layout(rows, cols, tile, scope);
  if (L.n == 0) return cudaSuccess;
  if (L.tiled) {
    const bool vec = aligned(out, 16) && (cols * (int64_t)esize(out_dt)) % 16 == 0, words = aligned(data, 4);
    const int64_t units = rows * ((cols + 7) / 8);
    FP4_DISPATCH(out_dt, DTC, (nv_tile_decode<DTC><<<grid_for(units), kThreads, 0, stream>>>(
                                  data, scales, tensor_scale, rows, cols, L.C, L.cp, ufp4, words, vec, out)));
  } else {
    const bool vec = aligned(out, 16), words = aligned(data, 4);
    FP4_DISPATCH(out_dt, DTC, (nv_flat_decode<DTC><<<grid_for((L.n + 7) / 8), kThreads, 0, stream>>>(
                                  data, scales, tensor_scale, L.n, L.per, ufp4, words, vec, out)));
  }
  FP4_LAUNCHED();
  return cudaSuccess;
}

cudaError_t mx_encode(const void* x, DType dt, int64_t n, bool fp8, bool floor_mode, bool stochastic,
                      uint32_t seed, uint32_t stream_id, bool propagate, uint8_t* data, uint8_t* scales,
                      unsigned long long* nonfinite, cudaStream_t stream) {
  FP4_CHECK(cudaMemsetAsync(nonfinite, 0, sizeof(unsigned long long), stream));
  const int64_t nb = ceil_div(n, fp4::kMxBlock);
  if (nb == 0) return cudaSuccess;
  MxArgs a;
  a.fp8 = fp8;
  a.floor_mode = floor_mode;
  a.stochastic = stochastic && !fp8;
  a.propagate = propagate;
  a.vec = aligned(x, 16);
  a.seed = seed;
  a.sid = stream_id;
  a.data = data;
  a.scales = scales;
  a.bad_total = nonfinite;
  const int G = dt == kF32 ? 8 : 4;
  FP4_DISPATCH(dt, DTC, (mx_encode_k<DTC><<<grid_for(nb * G), kThreads, 0, stream>>>(x, n, nb, a)));
  FP4_LAUNCHED();
  return cudaSuccess;
}

cudaError_t mx_decode(const uint8_t* data, const uint8_t* scales, int64_t n, bool fp8, void* out, DType out_dt,
                      cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const bool vec = aligned(out, 16), words = aligned(data, 4);
  FP4_DISPATCH(out_dt, DTC, (mx_decode_k<DTC><<<grid_for((n + 7) / 8), kThreads, 0, stream>>>(
                                data, scales, n, fp8, words, vec, out)));
  FP4_LAUNCHED();
  return cudaSuccess;
}

cudaError_t int2_encode(const void* x, DType dt, int64_t n, bool stochastic, uint32_t seed, uint32_t stream_id,
                        bool propagate, uint8_t* data, uint8_t* scales, float* tensor_scale, float* workspace,
                        unsigned long long* nonfinite, cudaStream_t stream) {
  const int64_t nb = ceil_div(n, fp4::kNvBlock);
  FP4_CHECK(cudaMemsetAsync(workspace, 0, sizeof(float), stream));
  FP4_CHECK(cudaMemsetAsync(nonfinite, 0, sizeof(unsigned long long), stream));
  if (nb > 0) {
    FP4_DISPATCH(dt, DTC, (int2_amax_k<DTC><<<grid_for(nb), kThreads, 0, stream>>>(x, n, nb, workspace, nonfinite)));
    FP4_LAUNCHED();
  }
  FP4_DISPATCH(dt, DTC, (int2_encode_k<DTC><<<grid_for(nb > 0 ? nb : 1), kThreads, 0, stream>>>(
                            x, n, nb, workspace, stochastic, propagate, seed, stream_id, data, scales, tensor_scale)));
  FP4_LAUNCHED();
  return cudaSuccess;
}

cudaError_t int2_decode(const uint8_t* data, const uint8_t* scales, const float* tensor_scale, int64_t n, void* out,
                        DType out_dt, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t nb = ceil_div(n, fp4::kNvBlock);
  FP4_DISPATCH(out_dt, DTC, (int2_decode_k<DTC><<<grid_for(nb), kThreads, 0, stream>>>(data, scales, tensor_scale, n,
                                                                                       nb, out)));
  FP4_LAUNCHED();
  return cudaSuccess;
}

cudaError_t e2m1_pack_check(const float* y, int64_t npairs, uint8_t* hw, uint8_t* sw, cudaStream_t stream) {
  if (npairs == 0) return cudaSuccess;
  e2m1_check_k<<<grid_for(npairs), kThreads, 0, stream>>>(y, npairs, hw, sw);
  FP4_LAUNCHED();
  return cudaSuccess;
}

cudaError_t hw_e2m1_flag(int* flag, cudaStream_t stream) {
  hw_flag_k<<<1, 1, 0, stream>>>(flag);
  FP4_LAUNCHED();
  return cudaSuccess;
}

}  // namespace fp4cuda
