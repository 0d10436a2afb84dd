// The fused FP4AdamW step on CUDA: one thread block per chunk of 1024 elements, one thread per NVFP4 block
// of 16 elements. Decodes m and sqrt(v), updates the master weight, re-encodes both, optionally writes a bf16
// copy of the new weight. Same operation order as fp4offload/_optim/reference_step.py (normative) and the
// CPU step; every scalar rule comes from csrc/fp4_codec.h. Build with --fmad=false (no contraction) and
// without fast math: sqrtf and '/' are then IEEE round-to-nearest, as the reference requires.
//
// m is rounded to nearest or stochastically (m_stochastic: bits sr_key(seed, stream0 + segment, 0)), sqrt(v)
// (v itself for nvfp4; the grid is v_kind, a kernel id of FP4_V_GRIDS in csrc/grids.h) likewise (v_stochastic: the
// same rule from seed ^ fp4::kVSeedXor, so an element's two states draw independent bits); the index of an element's
// bits is its position in its segment of 2^20.
//
// The master is a template parameter of the one kernel (the Adam math is written once):
//   kFp32  - an fp32 tensor, updated in place (optionally with a bf16 copy);
//   kSplit - master="split" (fp4offload/_optim/master.py, normative): the bf16 parameter `hi`, the int16
//            residual `lo` and the odd flags, here a dense mask of one uint16 per block of 16 (bit j: element
//            j of the block is odd), which the thread that owns the block reads before and writes after;
//   kBf16  - master="bf16": the bf16 parameter, rounded stochastically after the update.
// The bindings turn the sorted odd positions into the mask (fp4adam_fused_step_master_cuda does it, on the
// stream, with a validity flag that makes the step a no-op) and the mask back into positions.
//
// Pure CUDA (HIP on AMD, through gpu_compat.h; no torch headers): csrc/cuda/adam_cuda.cpp binds it.
#include <stdint.h>

#include "gpu_compat.h"
FP4_GPU_HD_BEGIN
#include "fp4_codec.h"
#include "master_bits.h"
FP4_GPU_HD_END

namespace fp4adam_cuda {

using fp4master::bf16_stochastic;
using fp4master::split_join;
using fp4master::split_residual;
using fp4master::to_bf16;

constexpr int kChunk = 1024;
constexpr int kBlocksPerChunk = kChunk / 16;  // threads per CUDA block
constexpr int kWarpsPerChunk = kBlocksPerChunk / fp4gpu::kWarp;  // 2 on NVIDIA, 1 wave64 on AMD
constexpr int64_t kSegment = 1 << 20;
constexpr int kFp32 = 0, kSplit = 1, kBf16 = 2;  // the master forms (fused_step_master's mode is 1 or 2)

struct Scalars {
  float b1, omb1, b2, omb2, eps, decay, step_size, rsbc2;
};

struct Args {
  int64_t n;
  float* param;       // kFp32
  uint16_t* hi;       // kSplit, kBf16: the bf16 parameter (bit patterns)
  int16_t* lo;        // kSplit: the residual
  uint16_t* odd;      // kSplit: the odd mask, one word per block of 16 (in and out)
  const int* bad;     // kSplit: nonzero when the odd positions were invalid; the step then changes nothing
  const float* grad_f32;
  const uint16_t* grad_bf16;
  uint8_t *m_codes, *m_scales, *v_codes, *v_scales;
  float *m_ts, *v_ts;
  uint16_t* bf16_out;
  Scalars s;
  int weight_decay, maximize, v_kind, m_stochastic, v_stochastic;
  uint32_t seed, stream0;
};

// Max over the CUDA block (kBlocksPerChunk threads = kWarpsPerChunk warps); every thread gets the result.
__device__ __forceinline__ float block_max(float v, float* shared) {
  for (int o = fp4gpu::kWarp / 2; o > 0; o >>= 1) v = fp4::fmax_(v, fp4gpu::shfl_xor(v, o));
  const int warp = threadIdx.x / fp4gpu::kWarp;
  __syncthreads();
  if ((threadIdx.x % fp4gpu::kWarp) == 0) shared[warp] = v;
  __syncthreads();
  float r = shared[0];
  for (int w = 1; w < kWarpsPerChunk; ++w) r = fp4::fmax_(r, shared[w]);
  return r;
}

// Encodes this thread's 16 values (x) into its block of a chunk, given the chunk's tensor scale. mbits 0 with
// 4-bit codes: E2M1; else the unsigned grid of cbits-bit codes with mbits mantissa bits. `codes`: the block's
// 8 bytes (4-bit codes) or 4 (2-bit).
__device__ __forceinline__ void encode_block(const float* x, float amax_b, bool bad, const fp4::TensorScale& ts,
                                             int mbits, bool stochastic, uint32_t key, uint32_t index0,
                                             uint8_t* codes, uint8_t* scale, int cbits = 4) {
  const bool ugrid = mbits || cbits != 4;
  const float elem_max = fp4::grid_max(mbits, cbits);
  float k;
  bool live;
  *scale = fp4::block_scale(amax_b, bad, elem_max, ts, k, live);
  uint32_t w[2] = {0u, 0u};
  if (live) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float y = x[j] * k;
      const uint32_t rnd = stochastic ? fp4::sr_bits(key, (uint64_t)(index0 + j)) : 0u;
      uint8_t c;
      if (ugrid) {
        c = stochastic ? fp4::ugrid_encode_sr(fp4::fabs_(y), rnd, mbits, cbits)
                       : fp4::ugrid_encode(fp4::fabs_(y), mbits, cbits);
      } else {
        c = fp4::e2m1_encode(y, stochastic, rnd);
      }
      if (cbits == 2)
        w[0] |= fp4::code2_slot(c, j);
      else
        w[j >> 3] |= fp4::word_slot(c, j & 7);
    }
  }
  if (cbits == 2)
    reinterpret_cast<uint32_t*>(codes)[0] = w[0];
  else
    reinterpret_cast<uint2*>(codes)[0] = make_uint2(w[0], w[1]);
}

template <int kMode>
__global__ void __launch_bounds__(kBlocksPerChunk) fused_step_kernel(Args a) {
  __shared__ float red[kWarpsPerChunk];
  if (kMode == kSplit && *a.bad) return;  // the same for every thread: no barrier is left waiting
  const int64_t c = blockIdx.x;
  const int64_t i0 = c * kChunk + (int64_t)threadIdx.x * 16;
  const int cnt = i0 >= a.n ? 0 : (a.n - i0 < 16 ? (int)(a.n - i0) : 16);
  const int64_t nb = (a.n + 15) / 16;
  const int64_t b = c * kBlocksPerChunk + threadIdx.x;  // NVFP4 block index
  const bool has = b < nb;
  const int64_t seg = (c * kChunk) / kSegment;
  const uint32_t index0 = (uint32_t)(i0 - seg * kSegment);
  const uint32_t wkey = kMode == kBf16 ? fp4::sr_key(a.seed, a.stream0 + (uint32_t)seg, 1u) : 0u;
  const int vmb = fp4::v_mbits(a.v_kind), vcb = fp4::v_cbits(a.v_kind);
  const bool v_nv = vmb == 0 && vcb == 4;
  float m[16], u[16];
  float m_amax = 0.0f, u_amax = 0.0f;
  bool m_bad = false, u_bad = false;
  if (has) {
    const float msd = a.m_ts[c], vsd = a.v_ts[c];
    const float msv = fp4::e4m3_value(a.m_scales[b]), vsv = fp4::e4m3_value(a.v_scales[b]);
    const uint2 mc = reinterpret_cast<const uint2*>(a.m_codes)[b];
    const uint2 vc = vcb == 2 ? make_uint2(reinterpret_cast<const uint32_t*>(a.v_codes)[b], 0u)
                              : reinterpret_cast<const uint2*>(a.v_codes)[b];
    const uint32_t odd_in = kMode == kSplit ? (uint32_t)a.odd[b] : 0u;
    uint32_t odd_out = 0u;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t mw = j < 8 ? mc.x : mc.y, vw = j < 8 ? vc.x : vc.y;
      const uint8_t mcode = fp4::word_code(mw, j & 7);
      const uint8_t vcode = vcb == 2 ? fp4::code2_of(vc.x, j) : fp4::word_code(vw, j & 7);
      const float mo = (fp4::e2m1_value(mcode) * msv) * msd;
      const float vdec = ((v_nv ? fp4::e2m1_value(vcode) : fp4::ugrid_value(vcode, vmb, vcb)) * vsv) * vsd;
      if (j < cnt) {
        const int64_t i = i0 + j;
        float g = a.grad_f32 ? a.grad_f32[i] : __uint_as_float((uint32_t)a.grad_bf16[i] << 16);
        if (a.maximize) g = -g;
        float p;
        if (kMode == kFp32) p = a.param[i];
        else if (kMode == kSplit) p = __uint_as_float(split_join(a.hi[i], a.lo[i], (odd_in >> j) & 1u));
        else p = __uint_as_float((uint32_t)a.hi[i] << 16);
        if (a.weight_decay) p = __fmul_rn(p, a.s.decay);
        const float mn = __fadd_rn(__fmul_rn(mo, a.s.b1), __fmul_rn(g, a.s.omb1));
        const float vo = v_nv ? vdec : __fmul_rn(vdec, vdec);
        const float vn = __fadd_rn(__fmul_rn(vo, a.s.b2), __fmul_rn(__fmul_rn(g, g), a.s.omb2));
        const float un = __fsqrt_rn(vn);
        const float d = __fadd_rn(__fmul_rn(un, a.s.rsbc2), a.s.eps);
        p = __fsub_rn(p, __fmul_rn(__fdiv_rn(mn, d), a.s.step_size));
        if (kMode == kFp32) {
          a.param[i] = p;
          if (a.bf16_out) a.bf16_out[i] = to_bf16(p);
        } else if (kMode == kSplit) {
          bool o;
          a.hi[i] = to_bf16(p);
          a.lo[i] = split_residual(__float_as_uint(p), o);
          odd_out |= (o ? 1u : 0u) << j;
        } else {
          a.hi[i] = bf16_stochastic(__float_as_uint(p), fp4::sr_bits(wkey, (uint64_t)(index0 + j)) >> 16);
        }
        m[j] = mn;
        u[j] = v_nv ? vn : un;
      } else {
        m[j] = 0.0f;
        u[j] = 0.0f;
      }
      const bool mf = fp4::is_finite(m[j]), uf = fp4::is_finite(u[j]);
      m_bad |= !mf;
      u_bad |= !uf;
      m_amax = fp4::fmax_(m_amax, mf ? fp4::fabs_(m[j]) : 0.0f);
      u_amax = fp4::fmax_(u_amax, uf ? fp4::fabs_(u[j]) : 0.0f);
    }
    if (kMode == kSplit) a.odd[b] = (uint16_t)odd_out;
  }
  const float m_chunk = block_max(m_amax, red);
  const float u_chunk = block_max(u_amax, red);
  if (!has) return;
  const fp4::TensorScale mts = fp4::tensor_scale(m_chunk, fp4::kE2M1Max);
  const fp4::TensorScale uts = fp4::tensor_scale(u_chunk, fp4::grid_max(vmb, vcb));
  const uint32_t key = a.m_stochastic ? fp4::sr_key(a.seed, a.stream0 + (uint32_t)seg, 0u) : 0u;
  const uint32_t vkey = a.v_stochastic ? fp4::sr_key(a.seed ^ fp4::kVSeedXor, a.stream0 + (uint32_t)seg, 0u) : 0u;
  encode_block(m, m_amax, m_bad, mts, 0, a.m_stochastic != 0, key, index0, a.m_codes + b * 8, a.m_scales + b);
  encode_block(u, u_amax, u_bad, uts, vmb, a.v_stochastic != 0, vkey, index0, a.v_codes + b * 2 * vcb,
               a.v_scales + b, vcb);
  if (threadIdx.x == 0) {
    a.m_ts[c] = mts.dec;
    a.v_ts[c] = uts.dec;
  }
}

// The odd mask from k sorted positions: bit (pos & 31) of 32-bit word pos >> 5 (little-endian, so the uint16
// word of block pos >> 4 holds bit pos & 15). A position outside [0, n) or not above the one before it sets
// words[nwords] (the flag) and is left out.
__global__ void odd_mask_kernel(const int64_t* pos, int64_t k, int64_t n, uint32_t* words, int64_t nwords) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; t < k; t += stride) {
    const int64_t q = pos[t];
    if (q < 0 || q >= n || (t > 0 && pos[t - 1] >= q)) {
      words[nwords] = 1u;
      continue;
    }
    atomicOr(&words[q >> 5], 1u << (q & 31));
  }
}

template <int kMode>
int launch_step(const Args& a, cudaStream_t stream) {
  const int64_t chunks = (a.n + kChunk - 1) / kChunk;
  fused_step_kernel<kMode><<<(unsigned)chunks, kBlocksPerChunk, 0, stream>>>(a);
  return (int)cudaGetLastError();
}

Args make_args(const void* grad, int grad_is_bf16, int64_t n, uint8_t* m_codes, uint8_t* m_scales, float* m_ts,
               uint8_t* v_codes, uint8_t* v_scales, float* v_ts, const float* scalars8, int weight_decay,
               int maximize, int v_kind, int m_stochastic, int v_stochastic, uint32_t seed, uint32_t stream0) {
  Args a;
  a.n = n;
  a.param = nullptr;
  a.hi = nullptr;
  a.lo = nullptr;
  a.odd = nullptr;
  a.bad = nullptr;
  a.grad_f32 = grad_is_bf16 ? nullptr : static_cast<const float*>(grad);
  a.grad_bf16 = grad_is_bf16 ? static_cast<const uint16_t*>(grad) : nullptr;
  a.m_codes = m_codes;
  a.m_scales = m_scales;
  a.m_ts = m_ts;
  a.v_codes = v_codes;
  a.v_scales = v_scales;
  a.v_ts = v_ts;
  a.bf16_out = nullptr;
  a.s = Scalars{scalars8[0], scalars8[1], scalars8[2], scalars8[3], scalars8[4], scalars8[5], scalars8[6], scalars8[7]};
  a.weight_decay = weight_decay;
  a.maximize = maximize;
  a.v_kind = v_kind;
  a.m_stochastic = m_stochastic;
  a.v_stochastic = v_stochastic;
  a.seed = seed;
  a.stream0 = stream0;
  return a;
}

}  // namespace fp4adam_cuda

// C entry points for the bindings: each returns the cudaError_t of its launches.
extern "C" int fp4adam_fused_step_cuda(float* param, const void* grad, int grad_is_bf16, int64_t n, uint8_t* m_codes,
                                       uint8_t* m_scales, float* m_ts, uint8_t* v_codes, uint8_t* v_scales,
                                       float* v_ts, const float* scalars8, int weight_decay, int maximize,
                                       int v_kind, int m_stochastic, uint32_t seed, uint32_t stream0,
                                       uint16_t* bf16_out, int v_stochastic, void* stream) {
  using namespace fp4adam_cuda;
  if (n <= 0) return 0;
  Args a = make_args(grad, grad_is_bf16, n, m_codes, m_scales, m_ts, v_codes, v_scales, v_ts, scalars8, weight_decay,
                     maximize, v_kind, m_stochastic, v_stochastic, seed, stream0);
  a.param = param;
  a.bf16_out = bf16_out;
  return launch_step<kFp32>(a, static_cast<cudaStream_t>(stream));
}

// The step of a bf16 parameter `hi` with a compact master: mode 1 (split: residual `lo`, the k sorted odd
// positions `odd_pos`) or 2 (bf16, stochastic rounding with key sr_key(seed, stream0 + segment, 1)).
// `words` (mode 1): scratch of (n + 31) / 32 + 1 uint32; on return words[0 .. (n + 31) / 32) hold the new odd
// mask (read it as one uint16 per block of 16) and words[(n + 31) / 32] is nonzero when odd_pos was not
// increasing inside [0, n), in which case nothing else was changed.
extern "C" int fp4adam_fused_step_master_cuda(uint16_t* hi, int16_t* lo, const int64_t* odd_pos, int64_t k,
                                              uint32_t* words, int mode, const void* grad, int grad_is_bf16,
                                              int64_t n, uint8_t* m_codes, uint8_t* m_scales, float* m_ts,
                                              uint8_t* v_codes, uint8_t* v_scales, float* v_ts,
                                              const float* scalars8, int weight_decay, int maximize, int v_kind,
                                              int m_stochastic, uint32_t seed, uint32_t stream0, int v_stochastic,
                                              void* stream) {
  using namespace fp4adam_cuda;
  if (mode != kSplit && mode != kBf16) return (int)cudaErrorInvalidValue;
  const cudaStream_t st = static_cast<cudaStream_t>(stream);
  const int64_t nwords = (n + 31) / 32;
  if (mode == kSplit) {
    int err = (int)cudaMemsetAsync(words, 0, (size_t)(nwords + 1) * sizeof(uint32_t), st);
    if (err) return err;
    if (k > 0) {
      const int64_t blocks = (k + 255) / 256;
      odd_mask_kernel<<<(unsigned)(blocks < 1024 ? blocks : 1024), 256, 0, st>>>(odd_pos, k, n, words, nwords);
      err = (int)cudaGetLastError();
      if (err) return err;
    }
  }
  if (n <= 0) return 0;
  Args a = make_args(grad, grad_is_bf16, n, m_codes, m_scales, m_ts, v_codes, v_scales, v_ts, scalars8, weight_decay,
                     maximize, v_kind, m_stochastic, v_stochastic, seed, stream0);
  a.hi = hi;
  if (mode == kSplit) {
    a.lo = lo;
    a.odd = reinterpret_cast<uint16_t*>(words);
    a.bad = reinterpret_cast<const int*>(words + nwords);
    return launch_step<kSplit>(a, st);
  }
  return launch_step<kBf16>(a, st);
}
