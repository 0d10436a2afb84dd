// Torch bindings of the fused CUDA FP4AdamW step (csrc/cuda/adam_kernels.cu); same signature as the CPU
// extension's fused_step, so fp4offload/optim/adamw.py calls either the same way.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

extern "C" int fp4adam_fused_step_cuda(float* param, const void* grad, int grad_is_bf16, int64_t n, uint8_t* m_codes,
                                       uint8_t* m_scales, float* m_ts, uint8_t* v_codes, uint8_t* v_scales,
                                       float* v_ts, const float* scalars8, int weight_decay, int maximize,
                                       int v_nvfp4, int m_stochastic, uint32_t seed, uint32_t stream0,
                                       uint16_t* bf16_out, void* stream);

namespace {

uint8_t* u8(torch::Tensor& t, const char* name, int64_t need, const torch::Device& dev) {
  TORCH_CHECK(t.device() == dev && t.is_contiguous() && t.scalar_type() == torch::kUInt8, "fused_step (cuda): ", name,
              " must be a contiguous uint8 tensor on ", dev);
  TORCH_CHECK(t.numel() == need, "fused_step (cuda): ", name, " has ", t.numel(), " bytes, expected ", need);
  return t.data_ptr<uint8_t>();
}

void fused_step(torch::Tensor param, torch::Tensor grad, torch::Tensor m_codes, torch::Tensor m_scales,
                torch::Tensor m_ts, torch::Tensor v_codes, torch::Tensor v_scales, torch::Tensor v_ts, double b1,
                double omb1, double b2, double omb2, double eps, double decay, double step_size, double rsbc2,
                bool weight_decay, bool maximize, bool v_nvfp4, bool m_stochastic, int64_t seed, int64_t stream0,
                c10::optional<torch::Tensor> bf16_out) {
  TORCH_CHECK(param.is_cuda() && param.is_contiguous() && param.scalar_type() == torch::kFloat32,
              "fused_step (cuda): param must be a contiguous fp32 CUDA tensor");
  const auto dev = param.device();
  TORCH_CHECK(grad.device() == dev && grad.is_contiguous() &&
                  (grad.scalar_type() == torch::kFloat32 || grad.scalar_type() == torch::kBFloat16),
              "fused_step (cuda): grad must be a contiguous fp32 or bf16 tensor on the param's device");
  const int64_t n = param.numel();
  TORCH_CHECK(grad.numel() == n, "fused_step (cuda): grad and param sizes differ");
  if (n == 0) return;
  const int64_t nb = (n + 15) / 16, nchunks = (n + 1023) / 1024;
  const float sc[8] = {(float)b1, (float)omb1, (float)b2, (float)omb2, (float)eps, (float)decay, (float)step_size,
                       (float)rsbc2};
  uint16_t* bf = nullptr;
  if (bf16_out.has_value() && bf16_out->defined()) {
    TORCH_CHECK(bf16_out->device() == dev && bf16_out->is_contiguous() && bf16_out->scalar_type() == torch::kBFloat16 &&
                    bf16_out->numel() == n,
                "fused_step (cuda): bf16_out must be a contiguous bf16 tensor of the param's size on its device");
    bf = reinterpret_cast<uint16_t*>(bf16_out->data_ptr<at::BFloat16>());
  }
  const bool gbf = grad.scalar_type() == torch::kBFloat16;
  const int err = fp4adam_fused_step_cuda(
      param.data_ptr<float>(), gbf ? (const void*)grad.data_ptr<at::BFloat16>() : (const void*)grad.data_ptr<float>(),
      gbf ? 1 : 0, n, u8(m_codes, "m_codes", nb * 8, dev), u8(m_scales, "m_scales", nb, dev),
      reinterpret_cast<float*>(u8(m_ts, "m_tscale", nchunks * 4, dev)), u8(v_codes, "v_codes", nb * 8, dev),
      u8(v_scales, "v_scales", nb, dev), reinterpret_cast<float*>(u8(v_ts, "v_tscale", nchunks * 4, dev)), sc,
      weight_decay, maximize, v_nvfp4, m_stochastic, (uint32_t)seed, (uint32_t)stream0, bf,
      c10::cuda::getCurrentCUDAStream(dev.index()).stream());
  TORCH_CHECK(err == 0, "fused_step (cuda): kernel launch failed with cudaError ", err);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_step", &fused_step, "fused FP4AdamW step on packed states (CUDA)");
}
