// fp4_kernels.cuh: host launchers of the CUDA codecs (docs/design.md sections 3 and 4).
//
// Pure CUDA runtime API (HIP's on AMD, through gpu_compat.h), no torch headers: fp4_kernels.cu compiles standalone with nvcc, and the torch
// bindings (fp4_cuda.cpp) only allocate tensors and call these. Every launcher takes raw device
// pointers and the cudaStream_t to enqueue on, never synchronizes, and returns the launch status
// (cudaErrorInvalidValue for a tile other than 1/16 or a scope that is not a multiple of 16).
// Sources and decoder inputs may sit at any address (16-byte vector paths are taken where aligned);
// encoder outputs (data) must be 8-byte aligned, as every fresh allocation is.
//
// Layouts and bytes are those of fp4offload/formats/reference.py (the oracle) and csrc/cpu/fp4_cpu.cpp:
// - tile == 1: blocks of 16 (NVFP4/ufp4) or 32 (MX) consecutive elements of the flat tensor, zero-padded;
//   `scope` elements share one fp32 tensor scale (0: the whole tensor).
// - tile == 16: 16x16 tiles of the (rows, cols) view padded to multiples of 16, codes row-major over the
//   padded view, block scales row-major over the tile grid, one tensor scale.
#pragma once

#include "gpu_compat.h"
#include <stdint.h>

namespace fp4cuda {

/// Element type of a source or destination tensor.
enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

/// Sizes of an NVFP4/ufp4 encoding, computed on the host exactly as the reference does.
struct NvLayout {
  int64_t n = 0;          // elements
  bool tiled = false;     // 16x16 tiles (else 1x16 blocks)
  int64_t cp = 0;         // padded columns (tiled)
  int64_t R = 0, C = 0;   // tile grid (tiled)
  int64_t nb = 0;         // blocks (or tiles): one scale byte each
  int64_t per = 1;        // blocks per tensor scale
  int64_t nscopes = 1;    // tensor scales
  int64_t data_bytes = 0; // packed code bytes
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline NvLayout nv_layout(int64_t rows, int64_t cols, int64_t tile, int64_t scope) {
  NvLayout L;
  L.n = rows * cols;
  L.tiled = tile == 16;
  const int64_t rp = ceil_div(rows, 16) * 16;
  L.cp = ceil_div(cols, 16) * 16;
  L.R = rp / 16;
  L.C = L.cp / 16;
  L.nb = L.tiled ? L.R * L.C : ceil_div(L.n, 16);
  const int64_t one = L.nb > 1 ? L.nb : 1;
  L.per = L.tiled ? one : (scope ? scope / 16 : one);
  L.nscopes = ceil_div(L.nb, L.per) > 1 ? ceil_div(L.nb, L.per) : 1;
  L.data_bytes = L.tiled ? rp * L.cp / 2 : L.nb * 8;
  return L;
}

/// NVFP4 (or ufp4) encode of `x` (rows*cols elements of type `dt`).
///
/// Writes data[nv_layout().data_bytes], scales[nb], tensor_scale[nscopes] (s_dec per scope) and
/// *nonfinite (the Inf/NaN count, as unsigned long long). `workspace` holds nscopes floats.
/// `amax` (nscopes floats, device) replaces the measured scope amax when not null. Non-finite blocks
/// get zero codes; their scale byte is the E4M3 NaN code when `propagate` (else the regular code: the
/// caller raises). Stochastic rounding (E2M1, or ufp4 with fp4::ufp4_encode_sr) keys on (seed, stream_id,
/// position in the padded code layout).
cudaError_t nvfp4_encode(const void* x, DType dt, int64_t rows, int64_t cols, int64_t tile, int64_t scope,
                         bool ufp4, bool stochastic, uint32_t seed, uint32_t stream_id, bool propagate,
                         const float* amax, uint8_t* data, uint8_t* scales, float* tensor_scale, float* workspace,
                         unsigned long long* nonfinite, cudaStream_t stream);

/// Inverse of nvfp4_encode: out[rows*cols] of type `out_dt` = (value(code) * fp32(scale_b)) * s_dec.
cudaError_t nvfp4_decode(const uint8_t* data, const uint8_t* scales, const float* tensor_scale, int64_t rows,
                         int64_t cols, int64_t tile, int64_t scope, bool ufp4, void* out, DType out_dt,
                         cudaStream_t stream);

/// MXFP4 (E2M1) or MXFP8 (E4M3) encode with an E8M0 scale per 32 elements. data holds
/// ceil(n/32)*16 bytes (fp4) or ceil(n/32)*32 (fp8); scales ceil(n/32).
cudaError_t mx_encode(const void* x, DType dt, int64_t n, bool fp8, bool floor_mode, bool stochastic,
                      uint32_t seed, uint32_t stream_id, bool propagate, uint8_t* data, uint8_t* scales,
                      unsigned long long* nonfinite, cudaStream_t stream);

/// Inverse of mx_encode: out[n] = value(code) * 2^(scale - 127).
cudaError_t mx_decode(const uint8_t* data, const uint8_t* scales, int64_t n, bool fp8, void* out, DType out_dt,
                      cudaStream_t stream);

/// int2 encode (csrc/fp4_codec.h): 2-bit codes of n elements, four a byte (data holds ceil(n/16)*4 bytes), an E4M3
/// scale per 16 rounded up (scales[ceil(n/16)]), one fp32 tensor scale (tensor_scale[1], s_dec). `workspace` holds
/// 1 + ceil(n/16) floats. Blocks with non-finite values get the E4M3 NaN scale when `propagate`.
cudaError_t int2_encode(const void* x, DType dt, int64_t n, bool stochastic, uint32_t seed, uint32_t stream_id,
                        bool propagate, uint8_t* data, uint8_t* scales, float* tensor_scale, float* workspace,
                        unsigned long long* nonfinite, cudaStream_t stream);

/// Inverse of int2_encode: out[n] = (2c - 3) * (fp32(scale_b) * s_dec).
cudaError_t int2_decode(const uint8_t* data, const uint8_t* scales, const float* tensor_scale, int64_t n, void* out,
                        DType out_dt, cudaStream_t stream);

/// Diagnostics for the sm_100a hardware path. For i < npairs, hw[i] packs (y[2i], y[2i+1]) with the
/// nearest-rounding pair encoder the kernels use on this device (cvt.rn.satfinite.e2m1x2.f32 where it
/// was compiled in) and sw[i] with the software rule of fp4_codec.h; the two must always agree.
cudaError_t e2m1_pack_check(const float* y, int64_t npairs, uint8_t* hw, uint8_t* sw, cudaStream_t stream);

/// Writes 1 to *flag when the code running on this device uses the hardware E2M1 conversion, else 0.
cudaError_t hw_e2m1_flag(int* flag, cudaStream_t stream);

}  // namespace fp4cuda
