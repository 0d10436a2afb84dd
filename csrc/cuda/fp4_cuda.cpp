// Torch bindings of the CUDA codecs: the kernel API of fp4offload/ops (same arguments and results as
// csrc/cpu/fp4_cpu.cpp and fp4offload/formats/reference.py), on CUDA tensors, enqueued on the current
// stream. Outputs stay on the device; nothing here synchronizes (the non-finite count is returned as a
// 0-dim int64 CUDA tensor, which the Python wrapper turns into an int).
#include "torch_ext.h"
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <vector>

#include "fp4_kernels.cuh"

namespace {

fp4cuda::DType dtype_of(at::ScalarType t, const char* fn, const char* name) {
  switch (t) {
    case at::kFloat:
      return fp4cuda::kF32;
    case at::kBFloat16:
      return fp4cuda::kBF16;
    case at::kHalf:
      return fp4cuda::kF16;
    default:
      TORCH_CHECK(false, fn, ": ", name, " has dtype ", t, "; allowed: float32, bfloat16, float16 (cast it first)");
  }
  return fp4cuda::kF32;
}

void check_cuda(const at::Tensor& t, const char* fn, const char* name) {
  TORCH_CHECK(t.is_cuda(), fn, ": ", name, " is on ", t.device(), "; it must be a CUDA tensor (move it with .cuda(), "
              "or use the cpu backend for CPU tensors)");
  TORCH_CHECK(t.is_contiguous(), fn, ": ", name, " must be contiguous; call .contiguous() first");
}

void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* fn, const char* name) {
  TORCH_CHECK(a.device() == b.device(), fn, ": ", name, " is on ", b.device(), " but the data is on ", a.device(),
              "; move both to one device");
}

void check_u8(const at::Tensor& t, int64_t need, const char* fn, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kByte, fn, ": ", name, " has dtype ", t.scalar_type(), "; allowed: uint8");
  TORCH_CHECK(t.numel() >= need, fn, ": ", name, " holds ", t.numel(), " bytes; the layout needs ", need,
              " (was it encoded with other rows/cols/tile/scope?)");
}

// A decoder's inputs: codes and block scales on one CUDA device, an output dtype the kernels write.
fp4cuda::DType check_decode(const at::Tensor& data, const at::Tensor& scales, at::ScalarType out_dtype,
                            const char* fn) {
  check_cuda(data, fn, "data");
  check_cuda(scales, fn, "scales");
  check_same_device(data, scales, fn, "scales");
  return dtype_of(out_dtype, fn, "out_dtype");
}

void cuda_ok(cudaError_t e, const char* fn) {
  TORCH_CHECK(e == cudaSuccess, fn, ": CUDA launch failed: ", cudaGetErrorString(e));
}

std::vector<at::Tensor> nvfp4_encode(at::Tensor x, int64_t rows, int64_t cols, int64_t tile, int64_t scope,
                                        bool ufp4, bool stochastic, int64_t seed, int64_t sr_stream, bool propagate,
                                        c10::optional<at::Tensor> amax) {
  const char* fn = "nvfp4_encode";
  check_cuda(x, fn, "x");
  const fp4cuda::DType dt = dtype_of(x.scalar_type(), fn, "x");
  TORCH_CHECK(rows >= 0 && cols >= 0 && x.numel() == rows * cols, fn, ": rows * cols = ", rows * cols,
              " but x has ", x.numel(), " elements");
  TORCH_CHECK(tile == 1 || tile == 16, fn, ": tile = ", tile, "; allowed: 1 (1x16 blocks) or 16 (16x16 tiles)");
  TORCH_CHECK(tile == 16 || (scope >= 0 && scope % 16 == 0), fn, ": scope = ", scope,
              "; allowed: 0 or a positive multiple of 16 (16x16 tiles ignore it)");
  c10::cuda::CUDAGuard guard(x.device());
  const fp4cuda::NvLayout L = fp4cuda::nv_layout(rows, cols, tile, scope);
  const float* amax_ptr = nullptr;
  if (amax.has_value()) {
    check_cuda(*amax, fn, "amax");
    check_same_device(x, *amax, fn, "amax");
    TORCH_CHECK(amax->scalar_type() == at::kFloat && amax->numel() == L.nscopes, fn,
                ": amax must be fp32 with one value per scope (", L.nscopes, "), got ", amax->scalar_type(), " with ",
                amax->numel());
    amax_ptr = amax->data_ptr<float>();
  }
  auto u8 = x.options().dtype(at::kByte);
  auto f32 = x.options().dtype(at::kFloat);
  auto data = at::empty({L.data_bytes}, u8);
  auto scales = at::empty({L.nb}, u8);
  auto ts = at::empty({L.nscopes}, f32);
  auto ws = at::empty({L.nscopes}, f32);
  auto count = at::empty({}, x.options().dtype(at::kLong));
  cuda_ok(fp4cuda::nvfp4_encode(x.data_ptr(), dt, rows, cols, tile, scope, ufp4, stochastic, (uint32_t)seed,
                                (uint32_t)sr_stream, propagate, amax_ptr, data.data_ptr<uint8_t>(),
                                scales.data_ptr<uint8_t>(), ts.data_ptr<float>(), ws.data_ptr<float>(),
                                reinterpret_cast<unsigned long long*>(count.data_ptr<int64_t>()),
                                c10::cuda::getCurrentCUDAStream().stream()),
          fn);
  return {data, scales, ts, count};
}

at::Tensor nvfp4_decode(at::Tensor data, at::Tensor scales, at::Tensor tensor_scale, int64_t rows,
                           int64_t cols, int64_t tile, int64_t scope, bool ufp4, at::ScalarType out_dtype) {
  const char* fn = "nvfp4_decode";
  const fp4cuda::DType dt = check_decode(data, scales, out_dtype, fn);
  TORCH_CHECK(tile == 1 || tile == 16, fn, ": tile = ", tile, "; allowed: 1 or 16");
  TORCH_CHECK(tile == 16 || (scope >= 0 && scope % 16 == 0), fn, ": scope = ", scope,
              "; allowed: 0 or a positive multiple of 16 (16x16 tiles ignore it)");
  c10::cuda::CUDAGuard guard(data.device());
  const fp4cuda::NvLayout L = fp4cuda::nv_layout(rows, cols, tile, scope);
  auto out = at::empty({L.n}, data.options().dtype(out_dtype));
  if (L.n == 0) return out;
  check_u8(data, L.data_bytes, fn, "data");
  check_u8(scales, L.nb, fn, "scales");
  auto ts = tensor_scale.to(data.device(), at::kFloat).contiguous();
  TORCH_CHECK(ts.numel() >= L.nscopes, fn, ": tensor_scale has ", ts.numel(), " values; the layout needs ", L.nscopes);
  cuda_ok(fp4cuda::nvfp4_decode(data.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), ts.data_ptr<float>(), rows, cols,
                                tile, scope, ufp4, out.data_ptr(), dt, c10::cuda::getCurrentCUDAStream().stream()),
          fn);
  return out;
}

std::vector<at::Tensor> mx_encode(at::Tensor x, bool fp8, bool floor_mode, bool stochastic, int64_t seed,
                                     int64_t sr_stream, bool propagate) {
  const char* fn = "mx_encode";
  check_cuda(x, fn, "x");
  const fp4cuda::DType dt = dtype_of(x.scalar_type(), fn, "x");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel(), nb = fp4cuda::ceil_div(n, 32);
  auto u8 = x.options().dtype(at::kByte);
  auto data = at::empty({fp8 ? nb * 32 : nb * 16}, u8);
  auto scales = at::empty({nb}, u8);
  auto count = at::empty({}, x.options().dtype(at::kLong));
  cuda_ok(fp4cuda::mx_encode(x.data_ptr(), dt, n, fp8, floor_mode, stochastic, (uint32_t)seed, (uint32_t)sr_stream,
                             propagate, data.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(),
                             reinterpret_cast<unsigned long long*>(count.data_ptr<int64_t>()),
                             c10::cuda::getCurrentCUDAStream().stream()),
          fn);
  return {data, scales, count};
}

at::Tensor mx_decode(at::Tensor data, at::Tensor scales, int64_t numel, bool fp8, at::ScalarType out_dtype) {
  const char* fn = "mx_decode";
  const fp4cuda::DType dt = check_decode(data, scales, out_dtype, fn);
  c10::cuda::CUDAGuard guard(data.device());
  auto out = at::empty({numel}, data.options().dtype(out_dtype));
  if (numel == 0) return out;
  const int64_t nb = fp4cuda::ceil_div(numel, 32);
  check_u8(data, fp8 ? nb * 32 : nb * 16, fn, "data");
  check_u8(scales, nb, fn, "scales");
  cuda_ok(fp4cuda::mx_decode(data.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), numel, fp8, out.data_ptr(), dt,
                             c10::cuda::getCurrentCUDAStream().stream()),
          fn);
  return out;
}

std::vector<at::Tensor> int2_encode(at::Tensor x, bool stochastic, int64_t seed, int64_t sr_stream,
                                       bool propagate) {
  const char* fn = "int2_encode";
  check_cuda(x, fn, "x");
  const fp4cuda::DType dt = dtype_of(x.scalar_type(), fn, "x");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel(), nb = fp4cuda::ceil_div(n, 16);
  auto u8 = x.options().dtype(at::kByte);
  auto f32 = x.options().dtype(at::kFloat);
  auto data = at::empty({nb * 4}, u8);
  auto scales = at::empty({nb}, u8);
  auto ts = at::empty({1}, f32);
  auto ws = at::empty({1 + nb}, f32);
  auto count = at::empty({}, x.options().dtype(at::kLong));
  cuda_ok(fp4cuda::int2_encode(x.data_ptr(), dt, n, stochastic, (uint32_t)seed, (uint32_t)sr_stream, propagate,
                               data.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), ts.data_ptr<float>(),
                               ws.data_ptr<float>(), reinterpret_cast<unsigned long long*>(count.data_ptr<int64_t>()),
                               c10::cuda::getCurrentCUDAStream().stream()),
          fn);
  return {data, scales, ts, count};
}

at::Tensor int2_decode(at::Tensor data, at::Tensor scales, at::Tensor tensor_scale, int64_t numel,
                          at::ScalarType out_dtype) {
  const char* fn = "int2_decode";
  const fp4cuda::DType dt = check_decode(data, scales, out_dtype, fn);
  c10::cuda::CUDAGuard guard(data.device());
  auto out = at::empty({numel}, data.options().dtype(out_dtype));
  if (numel == 0) return out;
  const int64_t nb = fp4cuda::ceil_div(numel, 16);
  check_u8(data, nb * 4, fn, "data");
  check_u8(scales, nb, fn, "scales");
  auto ts = tensor_scale.to(data.device(), at::kFloat).contiguous();
  TORCH_CHECK(ts.numel() >= 1, fn, ": tensor_scale is empty; the layout needs 1 value");
  cuda_ok(fp4cuda::int2_decode(data.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), ts.data_ptr<float>(), numel,
                               out.data_ptr(), dt, c10::cuda::getCurrentCUDAStream().stream()),
          fn);
  return out;
}

// Diagnostics of the sm_100a path (not part of the kernel API).
std::vector<at::Tensor> e2m1_pack_check(at::Tensor y) {
  const char* fn = "e2m1_pack_check";
  check_cuda(y, fn, "y");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.numel() % 2 == 0, fn, ": y must be fp32 with an even element count");
  c10::cuda::CUDAGuard guard(y.device());
  const int64_t npairs = y.numel() / 2;
  auto hw = at::empty({npairs}, y.options().dtype(at::kByte));
  auto sw = at::empty({npairs}, y.options().dtype(at::kByte));
  cuda_ok(fp4cuda::e2m1_pack_check(y.data_ptr<float>(), npairs, hw.data_ptr<uint8_t>(), sw.data_ptr<uint8_t>(),
                                   c10::cuda::getCurrentCUDAStream().stream()),
          fn);
  return {hw, sw};
}

bool hw_e2m1(int64_t device) {
  c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
  auto flag = at::zeros({}, at::TensorOptions().dtype(at::kInt).device(at::kCUDA, device));
  cuda_ok(fp4cuda::hw_e2m1_flag(flag.data_ptr<int>(), c10::cuda::getCurrentCUDAStream().stream()), "hw_e2m1");
  return flag.item<int>() != 0;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("nvfp4_encode", &nvfp4_encode, "NVFP4/ufp4 encode (CUDA)");
  m.def("nvfp4_decode", &nvfp4_decode, "NVFP4/ufp4 decode (CUDA)");
  m.def("mx_encode", &mx_encode, "MXFP4/MXFP8 encode (CUDA)");
  m.def("mx_decode", &mx_decode, "MXFP4/MXFP8 decode (CUDA)");
  m.def("int2_encode", &int2_encode, "int2 encode (CUDA): 2-bit codes, E4M3 scales per 16 rounded up, fp32 tensor scale");
  m.def("int2_decode", &int2_decode, "int2 decode (CUDA)");
  m.def("e2m1_pack_check", &e2m1_pack_check, "pack fp32 pairs with the kernels' nearest E2M1 pair encoder and the software rule");
  m.def("hw_e2m1", &hw_e2m1, "whether the code running on `device` uses cvt.rn.satfinite.e2m1x2.f32");
}
