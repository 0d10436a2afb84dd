// CPU codec for fp4offload: the torch bindings of the loops in codec_impl.h (around csrc/fp4_codec.h), parallel over
// blocks with at::parallel_for (OpenMP in torch's CPU builds). NVFP4/ufp4 rows and MX blocks (amax, encode nearest
// and stochastic, decode) have AVX-512 versions in nvfp4_avx512.h in the AVX-512 build; the AVX2, NEON and SVE
// builds run the portable rows and MXFP4 blocks of nvfp4_rows.h.
#include "torch_ext.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "fp4_codec.h"
#include "cpu/nvfp4_avx512.h"
#include "cpu/nvfp4_rows.h"
#include "cpu/codec_impl.h"

// fp32, bf16 and fp16: the dtypes fp4offload quantizes from and decodes to.
#define FP4_DISPATCH(TYPE, NAME, ...)                                                   \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)              \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)       \
                                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace {

using fp4::kMxBlock;
using fp4::kNvBlock;
using fp4codec::ceil_div;
using fp4codec::NvGeom;
using fp4codec::mx_decode_impl;
using fp4codec::mx_encode_impl;
using fp4codec::nvfp4_decode_impl;
using fp4codec::nvfp4_encode_impl;

std::vector<at::Tensor> nvfp4_encode(at::Tensor x, int64_t rows, int64_t cols, int64_t tile, int64_t scope,
                                        bool ufp4, bool stochastic, int64_t seed, int64_t stream, bool propagate,
                                        c10::optional<at::Tensor> amax) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "nvfp4_encode: x must be a contiguous CPU tensor");
  TORCH_CHECK(x.numel() == rows * cols, "nvfp4_encode: rows * cols != numel");
  const NvGeom g(rows, cols, tile, scope);
  auto u8 = at::TensorOptions().dtype(at::kByte);
  auto data = at::empty({g.data_bytes()}, u8);
  auto scales = at::empty({g.nb}, u8);
  const float* amax_in = nullptr;
  if (amax.has_value()) {
    TORCH_CHECK(amax->scalar_type() == at::kFloat && amax->is_contiguous() && amax->numel() == g.nscopes,
                "nvfp4_encode: amax must be a contiguous fp32 tensor with one value per scope (", g.nscopes, ")");
    amax_in = amax->data_ptr<float>();
  }
  std::vector<float> s_dec;
  int64_t nonfinite = 0;
  const bool simd = fp4cpu::have_simd();  // AVX-512 kernels, or the portable vector rows (nvfp4_rows.h)
  FP4_DISPATCH(x.scalar_type(), "nvfp4_encode", [&] {
    nvfp4_encode_impl<scalar_t>(x.data_ptr<scalar_t>(), g, ufp4, stochastic, (uint32_t)seed, (uint32_t)stream,
                                propagate, amax_in, simd, data.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), s_dec,
                                nonfinite);
  });
  auto ts = at::from_blob(s_dec.data(), {(int64_t)s_dec.size()}, at::kFloat).clone();
  return {data, scales, ts, at::scalar_tensor(nonfinite, at::kLong)};
}

at::Tensor nvfp4_decode(at::Tensor data, at::Tensor scales, at::Tensor tensor_scale, int64_t rows,
                           int64_t cols, int64_t tile, int64_t scope, bool ufp4, at::ScalarType out_dtype) {
  const NvGeom g(rows, cols, tile, scope);
  auto out = at::empty({g.n}, at::TensorOptions().dtype(out_dtype));
  if (g.n == 0) return out;
  TORCH_CHECK(data.numel() >= g.data_bytes() && scales.numel() >= g.nb && tensor_scale.numel() >= g.nscopes,
              "nvfp4_decode: data/scales/tensor_scale are smaller than the shape needs");
  auto ts = tensor_scale.to(at::kFloat).contiguous();
  const bool simd = fp4cpu::have_simd();  // AVX-512 kernels, or the portable vector rows (nvfp4_rows.h)
  FP4_DISPATCH(out_dtype, "nvfp4_decode", [&] {
    nvfp4_decode_impl<scalar_t>(data.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), ts.data_ptr<float>(), g, ufp4,
                                simd, out.data_ptr<scalar_t>());
  });
  return out;
}

std::vector<at::Tensor> mx_encode(at::Tensor x, bool fp8, bool floor_mode, bool stochastic, int64_t seed,
                                     int64_t stream, bool propagate) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "mx_encode: x must be a contiguous CPU tensor");
  const int64_t n = x.numel();
  const int64_t nb = ceil_div(n, kMxBlock);
  auto u8 = at::TensorOptions().dtype(at::kByte);
  auto data = at::empty({fp8 ? nb * kMxBlock : nb * kMxBlock / 2}, u8);
  auto scales = at::empty({nb}, u8);
  int64_t nonfinite = 0;
  const bool simd = fp4cpu::have_simd();  // AVX-512 blocks, or the portable MXFP4 blocks (nvfp4_rows.h)
  FP4_DISPATCH(x.scalar_type(), "mx_encode", [&] {
    mx_encode_impl<scalar_t>(x.data_ptr<scalar_t>(), n, fp8, floor_mode, stochastic, (uint32_t)seed, (uint32_t)stream,
                             propagate, simd, data.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), nonfinite);
  });
  return {data, scales, at::scalar_tensor(nonfinite, at::kLong)};
}

at::Tensor mx_decode(at::Tensor data, at::Tensor scales, int64_t numel, bool fp8, at::ScalarType out_dtype) {
  auto out = at::empty({numel}, at::TensorOptions().dtype(out_dtype));
  if (numel == 0) return out;
  FP4_DISPATCH(out_dtype, "mx_decode", [&] {
    mx_decode_impl<scalar_t>(data.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), numel, fp8,
                             out.data_ptr<scalar_t>());
  });
  return out;
}

std::vector<at::Tensor> int2_encode(at::Tensor x, bool stochastic, int64_t seed, int64_t stream, bool propagate) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "int2_encode: x must be a contiguous CPU tensor");
  const int64_t n = x.numel();
  const int64_t nb = ceil_div(n, kNvBlock);
  auto u8 = at::TensorOptions().dtype(at::kByte);
  auto data = at::empty({nb * (kNvBlock / 4)}, u8);
  auto scales = at::empty({nb}, u8);
  float s_dec = 0.0f;
  int64_t nonfinite = 0;
  const bool simd = fp4cpu::have_simd();
  FP4_DISPATCH(x.scalar_type(), "int2_encode", [&] {
    fp4codec::int2_encode_impl<scalar_t>(x.data_ptr<scalar_t>(), n, stochastic, (uint32_t)seed, (uint32_t)stream,
                                         propagate, simd, data.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), s_dec,
                                         nonfinite);
  });
  return {data, scales, at::full({1}, s_dec, at::kFloat), at::scalar_tensor(nonfinite, at::kLong)};
}

at::Tensor int2_decode(at::Tensor data, at::Tensor scales, at::Tensor tensor_scale, int64_t numel,
                          at::ScalarType out_dtype) {
  auto out = at::empty({numel}, at::TensorOptions().dtype(out_dtype));
  if (numel == 0) return out;
  TORCH_CHECK(data.numel() >= ceil_div(numel, kNvBlock) * (kNvBlock / 4) && scales.numel() >= ceil_div(numel, kNvBlock)
                  && tensor_scale.numel() >= 1, "int2_decode: data/scales/tensor_scale are smaller than the shape needs");
  const float s_dec = tensor_scale.to(at::kFloat).reshape({-1})[0].item<float>();
  FP4_DISPATCH(out_dtype, "int2_decode", [&] {
    fp4codec::int2_decode_impl<scalar_t>(data.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), s_dec, numel,
                                         out.data_ptr<scalar_t>());
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("nvfp4_encode", &nvfp4_encode, "NVFP4/ufp4 encode (CPU)");
  m.def("nvfp4_decode", &nvfp4_decode, "NVFP4/ufp4 decode (CPU)");
  m.def("mx_encode", &mx_encode, "MXFP4/MXFP8 encode (CPU)");
  m.def("mx_decode", &mx_decode, "MXFP4/MXFP8 decode (CPU)");
  m.def("int2_encode", &int2_encode, "int2 encode (CPU): 2-bit codes, E4M3 scales per 16 rounded up, fp32 tensor scale");
  m.def("int2_decode", &int2_decode, "int2 decode (CPU)");
  m.def("have_simd", &fp4cpu::have_simd, "whether the build's vector paths are compiled in and enabled");
  m.def("set_simd", &fp4cpu::set_simd, "enable/disable the vector paths (tests compare them with the scalar ones)");
  m.def("isa", [] { return std::string(fp4cpu::kIsa); }, "the instruction set this build targets");
}
