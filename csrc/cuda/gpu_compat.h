// gpu_compat.h: the few CUDA names csrc/cuda/ uses, for NVIDIA (nvcc) and AMD (hipcc) from one source
// (docs/design.md section 4, "ROCm").
//
// nvcc, and host compilers building the CUDA bindings, see the CUDA headers unchanged. hipcc (__HIPCC__) and host
// compilers building torch's ROCm bindings (__HIP_PLATFORM_AMD__) get HIP's headers, and the CUDA runtime names
// the kernels and launchers use become HIP's by the macros below. What differs in device code goes through:
//   FP4_WARP_SIZE, fp4gpu::kWarp  lanes of a warp: 32 on NVIDIA, 64 on AMD (wave64: CDNA always; RDNA under
//                                 -mwavefrontsize64, which fp4offload's ROCm build passes); a -D may set it, which
//                                 only the host emulation (tests/emulation/cuda_emu/emu.h) does, with 32 or 64
//   fp4gpu::LaneMask, kFullMask   every lane of a warp (64 bits when the warp has 64 lanes)
//   fp4gpu::shfl_xor(v, off)      the butterfly exchange of a whole warp (__shfl_xor_sync on CUDA, __shfl_xor on HIP)
//   fp4gpu::bf16_bits_rn(f)       f rounded to bf16, nearest even, as its bit pattern
//   FP4_GPU_HD_BEGIN / _END       around csrc/fp4_codec.h and master_bits.h: under hipcc they make the header's
//                                 functions host and device (FP4_HD is plain `static inline` outside nvcc)
// Under HIP, __fsqrt_rn is HIP's native (approximate) square root; it is mapped to sqrtf here, which is correctly
// rounded under -fhip-fp32-correctly-rounded-divide-sqrt (the ROCm build's flags), as '/' and __fdiv_rn are.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__)
#define FP4_GPU_HIP 1
#else
#define FP4_GPU_HIP 0
#endif

// ---- runtime API (host code: launchers and bindings) ------------------------------------------------

#if FP4_GPU_HIP
#include <hip/hip_runtime_api.h>
#ifndef cudaError_t
#define cudaError_t hipError_t
#endif
#ifndef cudaSuccess
#define cudaSuccess hipSuccess
#endif
#ifndef cudaErrorInvalidValue
#define cudaErrorInvalidValue hipErrorInvalidValue
#endif
#ifndef cudaStream_t
#define cudaStream_t hipStream_t
#endif
#ifndef cudaMemsetAsync
#define cudaMemsetAsync hipMemsetAsync
#endif
#ifndef cudaGetLastError
#define cudaGetLastError hipGetLastError
#endif
#ifndef cudaGetDevice
#define cudaGetDevice hipGetDevice
#endif
#ifndef cudaDeviceGetAttribute
#define cudaDeviceGetAttribute hipDeviceGetAttribute
#endif
#ifndef cudaDevAttrMultiProcessorCount
#define cudaDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#endif
#else
#include <cuda_runtime_api.h>
#endif

// ---- device code (the .cu files under nvcc or hipcc, and the host emulation) ------------------------

#if defined(__CUDACC__) || defined(__HIPCC__) || defined(FP4_GPU_EMULATION)

#if FP4_GPU_HIP
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
// HIP's __fsqrt_rn is the native square root (not correctly rounded); sqrtf is, with the ROCm build's flags.
#define __fsqrt_rn(x) sqrtf(x)
#define FP4_GPU_HD_BEGIN _Pragma("clang force_cuda_host_device begin")
#define FP4_GPU_HD_END _Pragma("clang force_cuda_host_device end")
#else
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define FP4_GPU_HD_BEGIN
#define FP4_GPU_HD_END
#endif

#ifndef FP4_WARP_SIZE
#if FP4_GPU_HIP
#define FP4_WARP_SIZE 64
#else
#define FP4_WARP_SIZE 32
#endif
#endif
#if FP4_WARP_SIZE != 32 && FP4_WARP_SIZE != 64
#error "FP4_WARP_SIZE must be 32 or 64"
#endif
#if defined(__CUDACC__) && FP4_WARP_SIZE != 32
#error "NVIDIA warps have 32 lanes: FP4_WARP_SIZE=64 is for AMD (and the host emulation)"
#endif
#if defined(__AMDGCN_WAVEFRONT_SIZE) && __AMDGCN_WAVEFRONT_SIZE != FP4_WARP_SIZE
#error "this AMD target runs wave32: build it with -mwavefrontsize64 (fp4offload's ROCm build passes it)"
#endif

namespace fp4gpu {

constexpr int kWarp = FP4_WARP_SIZE;
#if FP4_WARP_SIZE == 64
typedef unsigned long long LaneMask;
#else
typedef unsigned LaneMask;
#endif
constexpr LaneMask kFullMask = ~(LaneMask)0;

// v from lane (lane ^ off) of the warp; every lane of the warp must call it (the kernels' shuffling loops are
// warp-uniform).
template <class T>
__device__ __forceinline__ T shfl_xor(T v, int off) {
#if FP4_GPU_HIP
  return __shfl_xor(v, off, kWarp);
#else
  return __shfl_xor_sync(kFullMask, v, off);
#endif
}

// f rounded to bf16 (nearest even) as its bits; NaN -> 0x7FFF, as CUDA's __float2bfloat16_rn.
__device__ __forceinline__ uint16_t bf16_bits_rn(float f) {
#if FP4_GPU_HIP
  const uint32_t u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)0x7FFF;
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
#else
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#endif
}

}  // namespace fp4gpu

#endif  // device code
