// The fused FP4AdamW step on CUDA: one thread block per chunk of 1024 elements, one thread per NVFP4 block
// of 16 elements. Decodes m and sqrt(v), updates the fp32 master, re-encodes both, optionally writes a bf16
// copy of the new weight. Same operation order as fp4offload/optim/reference_step.py (normative) and the
// CPU step; every scalar rule comes from csrc/fp4_codec.h. Build with --fmad=false (no contraction) and
// without fast math: sqrtf and '/' are then IEEE round-to-nearest, as the reference requires.
//
// Pure CUDA (no torch headers): csrc/cuda/adam_cuda.cpp binds it.
#include <cuda_runtime.h>
#include <stdint.h>

#include "fp4_codec.h"

namespace fp4adam_cuda {

constexpr int kChunk = 1024;
constexpr int kBlocksPerChunk = kChunk / 16;  // threads per CUDA block
constexpr int64_t kSegment = 1 << 20;

struct Scalars {
  float b1, omb1, b2, omb2, eps, decay, step_size, rsbc2;
};

struct Args {
  int64_t n;
  float* param;
  const float* grad_f32;
  const uint16_t* grad_bf16;
  uint8_t *m_codes, *m_scales, *v_codes, *v_scales;
  float *m_ts, *v_ts;
  uint16_t* bf16_out;
  Scalars s;
  int weight_decay, maximize, v_nvfp4, m_stochastic;
  uint32_t seed, stream0;
};

__device__ __forceinline__ uint16_t to_bf16(float x) {
  const uint32_t b = __float_as_uint(x);
  if ((b & 0x7F800000u) == 0x7F800000u && (b & 0x7FFFFFu)) return (uint16_t)0x7FC0;
  return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// Max over the CUDA block (kBlocksPerChunk threads = 2 warps); every thread gets the result.
__device__ __forceinline__ float block_max(float v, float* shared2) {
  for (int o = 16; o > 0; o >>= 1) v = fp4::fmax_(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  const int warp = threadIdx.x >> 5;
  __syncthreads();
  if ((threadIdx.x & 31) == 0) shared2[warp] = v;
  __syncthreads();
  return fp4::fmax_(shared2[0], shared2[1]);
}

// Encodes this thread's 16 values (x) into its block of a chunk, given the chunk's tensor scale.
__device__ __forceinline__ void encode_block(const float* x, float amax_b, bool bad, const fp4::TensorScale& ts,
                                             bool unsigned_, bool stochastic, uint32_t key, uint32_t index0,
                                             uint8_t* codes8, uint8_t* scale) {
  const float elem_max = unsigned_ ? fp4::kUfp4Max : fp4::kE2M1Max;
  float k;
  bool live;
  *scale = fp4::block_scale(amax_b, bad, elem_max, ts, k, live);
  uint32_t w[2] = {0u, 0u};
  if (live) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float y = x[j] * k;
      uint8_t c;
      if (unsigned_) {
        c = fp4::ufp4_encode(fp4::fabs_(y));
      } else {
        const uint32_t rnd = stochastic ? fp4::sr_bits(key, (uint64_t)(index0 + j)) : 0u;
        c = fp4::e2m1_encode(y, stochastic, rnd);
      }
      w[j >> 3] |= fp4::word_slot(c, j & 7);
    }
  }
  reinterpret_cast<uint2*>(codes8)[0] = make_uint2(w[0], w[1]);
}

__global__ void __launch_bounds__(kBlocksPerChunk) fused_step_kernel(Args a) {
  __shared__ float red[2];
  const int64_t c = blockIdx.x;
  const int64_t i0 = c * kChunk + (int64_t)threadIdx.x * 16;
  const int cnt = i0 >= a.n ? 0 : (a.n - i0 < 16 ? (int)(a.n - i0) : 16);
  const int64_t nb = (a.n + 15) / 16;
  const int64_t b = c * kBlocksPerChunk + threadIdx.x;  // NVFP4 block index
  const bool has = b < nb;
  float m[16], u[16];
  float m_amax = 0.0f, u_amax = 0.0f;
  bool m_bad = false, u_bad = false;
  if (has) {
    const float msd = a.m_ts[c], vsd = a.v_ts[c];
    const float msv = fp4::e4m3_value(a.m_scales[b]), vsv = fp4::e4m3_value(a.v_scales[b]);
    const uint2 mc = reinterpret_cast<const uint2*>(a.m_codes)[b];
    const uint2 vc = reinterpret_cast<const uint2*>(a.v_codes)[b];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t mw = j < 8 ? mc.x : mc.y, vw = j < 8 ? vc.x : vc.y;
      const uint8_t mcode = fp4::word_code(mw, j & 7), vcode = fp4::word_code(vw, j & 7);
      const float mo = (fp4::e2m1_value(mcode) * msv) * msd;
      const float vdec = ((a.v_nvfp4 ? fp4::e2m1_value(vcode) : fp4::ufp4_value(vcode)) * vsv) * vsd;
      if (j < cnt) {
        const int64_t i = i0 + j;
        float g = a.grad_f32 ? a.grad_f32[i] : __uint_as_float((uint32_t)a.grad_bf16[i] << 16);
        if (a.maximize) g = -g;
        float p = a.param[i];
        if (a.weight_decay) p = __fmul_rn(p, a.s.decay);
        const float mn = __fadd_rn(__fmul_rn(mo, a.s.b1), __fmul_rn(g, a.s.omb1));
        const float vo = a.v_nvfp4 ? vdec : __fmul_rn(vdec, vdec);
        const float vn = __fadd_rn(__fmul_rn(vo, a.s.b2), __fmul_rn(__fmul_rn(g, g), a.s.omb2));
        const float un = __fsqrt_rn(vn);
        const float d = __fadd_rn(__fmul_rn(un, a.s.rsbc2), a.s.eps);
        p = __fsub_rn(p, __fmul_rn(__fdiv_rn(mn, d), a.s.step_size));
        a.param[i] = p;
        if (a.bf16_out) a.bf16_out[i] = to_bf16(p);
        m[j] = mn;
        u[j] = a.v_nvfp4 ? vn : un;
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
  }
  const float m_chunk = block_max(m_amax, red);
  const float u_chunk = block_max(u_amax, red);
  if (!has) return;
  const fp4::TensorScale mts = fp4::tensor_scale(m_chunk, fp4::kE2M1Max);
  const fp4::TensorScale uts = fp4::tensor_scale(u_chunk, a.v_nvfp4 ? fp4::kE2M1Max : fp4::kUfp4Max);
  const int64_t seg = (c * kChunk) / kSegment;
  const uint32_t key = a.m_stochastic ? fp4::sr_key(a.seed, a.stream0 + (uint32_t)seg, 0u) : 0u;
  const uint32_t index0 = (uint32_t)(i0 - seg * kSegment);
  encode_block(m, m_amax, m_bad, mts, false, a.m_stochastic != 0, key, index0, a.m_codes + b * 8, a.m_scales + b);
  encode_block(u, u_amax, u_bad, uts, a.v_nvfp4 == 0, false, 0u, 0u, a.v_codes + b * 8, a.v_scales + b);
  if (threadIdx.x == 0) {
    a.m_ts[c] = mts.dec;
    a.v_ts[c] = uts.dec;
  }
}

}  // namespace fp4adam_cuda

// C entry point for the bindings: returns the cudaError_t of the launch.
extern "C" int fp4adam_fused_step_cuda(float* param, const void* grad, int grad_is_bf16, int64_t n, uint8_t* m_codes,
                                       uint8_t* m_scales, float* m_ts, uint8_t* v_codes, uint8_t* v_scales,
                                       float* v_ts, const float* scalars8, int weight_decay, int maximize,
                                       int v_nvfp4, int m_stochastic, uint32_t seed, uint32_t stream0,
                                       uint16_t* bf16_out, void* stream) {
  using namespace fp4adam_cuda;
  if (n <= 0) return 0;
  Args a;
  a.n = n;
  a.param = param;
  a.grad_f32 = grad_is_bf16 ? nullptr : static_cast<const float*>(grad);
  a.grad_bf16 = grad_is_bf16 ? static_cast<const uint16_t*>(grad) : nullptr;
  a.m_codes = m_codes;
  a.m_scales = m_scales;
  a.m_ts = m_ts;
  a.v_codes = v_codes;
  a.v_scales = v_scales;
  a.v_ts = v_ts;
  a.bf16_out = bf16_out;
  a.s = Scalars{scalars8[0], scalars8[1], scalars8[2], scalars8[3], scalars8[4], scalars8[5], scalars8[6], scalars8[7]};
  a.weight_decay = weight_decay;
  a.maximize = maximize;
  a.v_nvfp4 = v_nvfp4;
  a.m_stochastic = m_stochastic;
  a.seed = seed;
  a.stream0 = stream0;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  fused_step_kernel<<<(unsigned)chunks, kBlocksPerChunk, 0, static_cast<cudaStream_t>(stream)>>>(a);
  return (int)cudaGetLastError();
}
