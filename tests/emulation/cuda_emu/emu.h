// emu.h: a host emulation of the CUDA features csrc/cuda/fp4_kernels.cu and adam_kernels.cu use, so that
// the kernels' index arithmetic, work split, warp reductions and launch sequence run (slowly) on a CPU in CI.
// tests/emulation/test_cuda_emulated.py rewrites each `kernel<<<grid, block, shm, stream>>>(args)` into
// `emu::Launch(grid, block, shm, stream)(kernel, args)` and compiles the file with g++ and this header.
//
// Model: the CTAs of a launch run one after another; the threads of a CTA are ucontext fibers resumed
// round-robin. A warp has FP4_WARP_SIZE lanes: 32 (NVIDIA) unless the build passes -DFP4_WARP_SIZE=64 (an AMD
// wave64), which csrc/cuda/gpu_compat.h then uses as the kernels' kWarp and lane mask width. A warp shuffle is a
// two-phase exchange (post, yield, read, yield), so it is exact as long as every lane of a warp takes the same
// sequence of shuffles, which the kernels guarantee (their loops that shuffle are warp-uniform); a shuffle whose
// partner lane was elsewhere, whose offset leaves the warp, or whose mask leaves a lane of the warp out is counted
// in `divergent` (each is a bug on a GPU too). __syncthreads is one yield: a barrier as long as every thread of the CTA
// yields equally often between two of them (the codecs call it once, at entry; the fused Adam step's
// block_max shuffles warp-uniformly between its two). `__shared__` becomes `static` (one CTA at a time). Atomics are plain read-modify-writes (one OS thread).
// The fp4_codec.h rules compile as host code here (the CPU backend's versions); the device-only
// intrinsics are replaced by exact host equivalents. This checks the kernels' logic, not the GPU.
#pragma once
#define FP4_GPU_EMULATION 1
#ifndef FP4_WARP_SIZE
#define FP4_WARP_SIZE 32
#endif
#include <ucontext.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#include <vector>
#include <functional>
#include <algorithm>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static

typedef int cudaError_t;
enum : int { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
typedef void* cudaStream_t;
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
inline cudaError_t cudaGetDevice(int* d) { *d = 0; return 0; }
// One emulated multiprocessor: grids stay small, so the kernels' grid-stride loops run several rounds.
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr, int) { *v = 1; return 0; }
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) { memset(p, v, n); return 0; }
inline cudaError_t cudaGetLastError() { return 0; }
inline const char* cudaGetErrorString(cudaError_t) { return "emu"; }

struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return uint2{a, b}; }
struct dim3v { unsigned x, y, z; };

template <class To, class From> inline To bitcast_(From f) { To t; memcpy(&t, &f, sizeof(To)); return t; }
inline float __uint_as_float(unsigned u) { return bitcast_<float>(u); }
inline unsigned __float_as_uint(float f) { return bitcast_<unsigned>(f); }
inline int __float2int_rn(float a) { return (int)nearbyintf(a); }
// the fused Adam step's explicitly rounded operations: plain fp32 ones (built with -ffp-contract=off)
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
struct __half { uint16_t b; };
struct __nv_bfloat16 { uint16_t b; };
inline __half __ushort_as_half(uint16_t u) { return __half{u}; }
inline float __half2float(__half h) { return (float)bitcast_<_Float16>(h.b); }
inline __half __float2half_rn(float f) { return __half{bitcast_<uint16_t>((_Float16)f)}; }
inline uint16_t __half_as_ushort(__half h) { return h.b; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u = bitcast_<uint32_t>(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return __nv_bfloat16{(uint16_t)0x7FC0};
  return __nv_bfloat16{(uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}
inline uint16_t __bfloat16_as_ushort(__nv_bfloat16 b) { return b.b; }
template <class T> inline T __ldg(const T* p) { return *p; }
inline unsigned atomicMax(unsigned* a, unsigned v) { unsigned o = *a; *a = std::max(o, v); return o; }
inline unsigned atomicOr(unsigned* a, unsigned v) { unsigned o = *a; *a = o | v; return o; }
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) { auto o = *a; *a += v; return o; }

namespace emu {
constexpr int kLanes = FP4_WARP_SIZE;
constexpr int kMaxThreads = 2048;  // per CTA
struct Thread { ucontext_t ctx; dim3v tid; bool done; uint64_t shuffles; };
struct State {
  std::vector<Thread> th;
  std::vector<std::vector<char>> stacks;
  ucontext_t sched;
  int cur = 0;
  uint64_t slots[kMaxThreads / kLanes][kLanes], gens[kMaxThreads / kLanes][kLanes];
  long divergent = 0;  // shuffles that are not a whole warp's exchange (see above)
  dim3v block{0, 0, 0}, bdim{1, 1, 1}, gdim{1, 1, 1};
  std::function<void()> body;
  long switches = 0;
};
inline State& S() { static State s; return s; }
inline const dim3v& thread_idx() { return S().th[S().cur].tid; }
inline void yield() { State& s = S(); ++s.switches; swapcontext(&s.th[s.cur].ctx, &s.sched); }
inline void entry() { S().body(); S().th[S().cur].done = true; }
template <class T> inline T shfl_xor(T v, int off) {
  State& s = S();
  const int w = s.cur / kLanes, l = s.cur % kLanes;
  if (off <= 0 || off >= kLanes) {
    ++s.divergent;
    off = 0;
  }
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  const uint64_t gen = ++s.th[s.cur].shuffles;
  s.slots[w][l] = bits;
  s.gens[w][l] = gen;
  yield();
  if (s.gens[w][l ^ off] != gen) ++s.divergent;
  const uint64_t o = s.slots[w][l ^ off];
  T r;
  memcpy(&r, &o, sizeof(T));
  yield();
  return r;
}
struct Launch {
  unsigned g, t;
  Launch(unsigned g_, unsigned t_, int = 0, cudaStream_t = nullptr) : g(g_), t(t_) {}
  template <class F, class... A> void operator()(F kernel, A... args) {
    State& s = S();
    s.gdim = dim3v{g, 1, 1};
    s.bdim = dim3v{t, 1, 1};
    if (t == 0 || t > (unsigned)kMaxThreads) abort();
    s.th.assign(t, Thread{});
    s.stacks.resize(t);
    for (unsigned b = 0; b < g; ++b) {
      s.block = dim3v{b, 0, 0};
      memset(s.gens, 0, sizeof(s.gens));
      s.body = [&] { kernel(args...); };
      for (unsigned i = 0; i < t; ++i) {
        s.stacks[i].resize(1 << 16);
        Thread& th = s.th[i];
        th.tid = dim3v{i, 0, 0};
        th.done = false;
        th.shuffles = 0;
        getcontext(&th.ctx);
        th.ctx.uc_stack.ss_sp = s.stacks[i].data();
        th.ctx.uc_stack.ss_size = s.stacks[i].size();
        th.ctx.uc_link = &s.sched;
        makecontext(&th.ctx, (void (*)())entry, 0);
      }
      bool any = true;
      while (any) {
        any = false;
        for (unsigned i = 0; i < t; ++i) {
          if (s.th[i].done) continue;
          any = true;
          s.cur = (int)i;
          swapcontext(&s.sched, &s.th[i].ctx);
        }
      }
    }
  }
};
}  // namespace emu

#define threadIdx (emu::thread_idx())
#define blockIdx (emu::S().block)
#define blockDim (emu::S().bdim)
#define gridDim (emu::S().gdim)
// The mask must name every lane of the warp: all 32 bits, or all 64 with FP4_WARP_SIZE=64 (a 32-bit mask
// there leaves half the wave out).
template <class M, class T> inline T __shfl_xor_sync(M mask, T v, int off) {
  const unsigned long long all = emu::kLanes == 64 ? ~0ull : 0xFFFFFFFFull;
  if ((unsigned long long)mask != all || sizeof(M) * 8 < (size_t)emu::kLanes) ++emu::S().divergent;
  return emu::shfl_xor(v, off);
}
inline void __syncthreads() { emu::yield(); }
