// Torch bindings of the fused CUDA FP4AdamW step (csrc/cuda/adam_kernels.cu); same signatures as the CPU
// extension's fused_step and fused_step_master (less fused_step's NVFP4 weight regions w_*, which only the CPU step
// writes; v_stochastic, a keyword in both, comes after them there), so fp4offload/_optim/adamw.py calls either the
// same way.
#include "torch_ext.h"
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "fp4_codec.h"

extern "C" int fp4adam_fused_step_cuda(float* param, const void* grad, int grad_is_bf16, int64_t n, uint8_t* m_codes,
                                       uint8_t* m_scales, float* m_ts, uint8_t* v_codes, uint8_t* v_scales,
                                       float* v_ts, const float* scalars8, int weight_decay, int maximize,
                                       int v_kind, int m_stochastic, uint32_t seed, uint32_t stream0,
                                       uint16_t* bf16_out, int v_stochastic, void* stream);
extern "C" int fp4adam_fused_step_master_cuda(uint16_t* hi, int16_t* lo, const int64_t* odd_pos, int64_t k,
                                              uint32_t* words, int mode, const void* grad, int grad_is_bf16,
                                              int64_t n, uint8_t* m_codes, uint8_t* m_scales, float* m_ts,
                                              uint8_t* v_codes, uint8_t* v_scales, float* v_ts,
                                              const float* scalars8, int weight_decay, int maximize, int v_kind,
                                              int m_stochastic, uint32_t seed, uint32_t stream0, int v_stochastic,
                                              void* stream);

namespace {

uint8_t* u8(at::Tensor& t, const char* name, int64_t need, const at::Device& dev) {
  TORCH_CHECK(t.device() == dev && t.is_contiguous() && t.scalar_type() == at::kByte, "fused_step (cuda): ", name,
              " must be a contiguous uint8 tensor on ", dev);
  TORCH_CHECK(t.numel() == need, "fused_step (cuda): ", name, " has ", t.numel(), " bytes, expected ", need);
  return t.data_ptr<uint8_t>();
}

void fused_step(at::Tensor param, at::Tensor grad, at::Tensor m_codes, at::Tensor m_scales,
                at::Tensor m_ts, at::Tensor v_codes, at::Tensor v_scales, at::Tensor v_ts, double b1,
                double omb1, double b2, double omb2, double eps, double decay, double step_size, double rsbc2,
                bool weight_decay, bool maximize, int64_t v_kind, bool m_stochastic, int64_t seed, int64_t stream0,
                c10::optional<at::Tensor> bf16_out, bool v_stochastic) {
  TORCH_CHECK(param.is_cuda() && param.is_contiguous() && param.scalar_type() == at::kFloat,
              "fused_step (cuda): param must be a contiguous fp32 CUDA tensor");
  TORCH_CHECK(fp4::v_mbits(v_kind) >= 0, "fused_step (cuda): v_kind must be one of" FP4_V_KINDS_TEXT ", got ", v_kind);
  const auto dev = param.device();
  TORCH_CHECK(grad.device() == dev && grad.is_contiguous() &&
                  (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16),
              "fused_step (cuda): grad must be a contiguous fp32 or bf16 tensor on the param's device");
  const int64_t n = param.numel();
  TORCH_CHECK(grad.numel() == n, "fused_step (cuda): grad and param sizes differ");
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(dev);
  const int64_t nb = (n + 15) / 16, nchunks = (n + 1023) / 1024;
  const float sc[8] = {(float)b1, (float)omb1, (float)b2, (float)omb2, (float)eps, (float)decay, (float)step_size,
                       (float)rsbc2};
  uint16_t* bf = nullptr;
  if (bf16_out.has_value() && bf16_out->defined()) {
    TORCH_CHECK(bf16_out->device() == dev && bf16_out->is_contiguous() && bf16_out->scalar_type() == at::kBFloat16 &&
                    bf16_out->numel() == n,
                "fused_step (cuda): bf16_out must be a contiguous bf16 tensor of the param's size on its device");
    bf = reinterpret_cast<uint16_t*>(bf16_out->data_ptr<at::BFloat16>());
  }
  const bool gbf = grad.scalar_type() == at::kBFloat16;
  const int err = fp4adam_fused_step_cuda(
      param.data_ptr<float>(), gbf ? (const void*)grad.data_ptr<at::BFloat16>() : (const void*)grad.data_ptr<float>(),
      gbf ? 1 : 0, n, u8(m_codes, "m_codes", nb * 8, dev), u8(m_scales, "m_scales", nb, dev),
      reinterpret_cast<float*>(u8(m_ts, "m_tscale", nchunks * 4, dev)), u8(v_codes, "v_codes", nb * 2 * fp4::v_cbits(v_kind), dev),
      u8(v_scales, "v_scales", nb, dev), reinterpret_cast<float*>(u8(v_ts, "v_tscale", nchunks * 4, dev)), sc,
      weight_decay, maximize, (int)v_kind, m_stochastic, (uint32_t)seed, (uint32_t)stream0, bf, v_stochastic,
      c10::cuda::getCurrentCUDAStream(dev.index()).stream());
  TORCH_CHECK(err == 0, "fused_step (cuda): kernel launch failed with cudaError ", err);
}

// The positions of the set bits of the odd mask (one int16 word per block of 16, nb words), sorted: the blocks
// with a bit set (rare), then their bits. Transients: the nonzero list and 16 ints per such block.
at::Tensor mask_positions(const at::Tensor& mask) {
  const at::Tensor blocks = at::nonzero(mask).reshape({-1});
  if (blocks.numel() == 0) return blocks;
  const at::Tensor words = mask.index_select(0, blocks).to(at::kInt).bitwise_and(0xFFFF);
  const at::Tensor bits = words.unsqueeze(1).bitwise_right_shift(at::arange(16, words.options())).bitwise_and(1);
  const at::Tensor rc = at::nonzero(bits);  // (row, bit), rows ascending, bits ascending within a row
  return blocks.index_select(0, rc.select(1, 0)) * 16 + rc.select(1, 1);
}

// The CPU extension's fused_step_master on CUDA tensors: one AdamW step of the flat bf16 parameter `hi` whose
// master is compact (mode 1: split, with the int16 residual `lo` and the sorted int64 positions `odd`, on any
// device; mode 2: bf16 with stochastic rounding), packed states updated in place; returns the new odd positions
// (mode 1, on the parameter's device) or an empty tensor. The positions travel to the kernel as a dense mask of
// one uint16 per block of 16 (n / 8 bytes, in and out); invalid positions raise with nothing changed.
at::Tensor fused_step_master(at::Tensor hi, c10::optional<at::Tensor> lo, at::Tensor odd,
                                at::Tensor grad, at::Tensor m_codes, at::Tensor m_scales, at::Tensor m_ts,
                                at::Tensor v_codes, at::Tensor v_scales, at::Tensor v_ts, double b1,
                                double omb1, double b2, double omb2, double eps, double decay, double step_size,
                                double rsbc2, bool weight_decay, bool maximize, int64_t v_kind, bool m_stochastic,
                                int64_t seed, int64_t stream0, int64_t mode, bool v_stochastic) {
  TORCH_CHECK(mode == 1 || mode == 2, "fused_step_master (cuda): mode must be 1 (split) or 2 (bf16)");
  TORCH_CHECK(fp4::v_mbits(v_kind) >= 0, "fused_step_master (cuda): v_kind must be one of" FP4_V_KINDS_TEXT ", got ",
              v_kind);
  TORCH_CHECK(hi.is_cuda() && hi.is_contiguous() && hi.scalar_type() == at::kBFloat16,
              "fused_step_master (cuda): the parameter must be a contiguous bf16 CUDA tensor");
  const auto dev = hi.device();
  const int64_t n = hi.numel();
  TORCH_CHECK(grad.device() == dev && grad.is_contiguous() && grad.numel() == n &&
                  (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16),
              "fused_step_master (cuda): grad must be a contiguous fp32 or bf16 tensor of the parameter's size on "
              "its device");
  int16_t* lp = nullptr;
  if (mode == 1) {
    TORCH_CHECK(lo.has_value() && lo->defined() && lo->device() == dev && lo->is_contiguous() &&
                    lo->scalar_type() == at::kShort && lo->numel() == n,
                "fused_step_master (cuda): split needs a contiguous int16 residual of the parameter's size on its "
                "device");
    lp = lo->data_ptr<int16_t>();
  }
  TORCH_CHECK(odd.scalar_type() == at::kLong && odd.dim() == 1,
              "fused_step_master (cuda): odd must be a 1-d int64 tensor");
  const auto longs = hi.options().dtype(at::kLong);
  if (n == 0) return at::empty({0}, longs);
  const c10::cuda::CUDAGuard guard(dev);
  const int64_t nb = (n + 15) / 16, nchunks = (n + 1023) / 1024, nwords = (n + 31) / 32;
  const float sc[8] = {(float)b1, (float)omb1, (float)b2, (float)omb2, (float)eps, (float)decay, (float)step_size,
                       (float)rsbc2};
  at::Tensor pos, words;
  if (mode == 1) {
    pos = odd.to(dev).contiguous();
    words = at::empty({nwords + 1}, hi.options().dtype(at::kInt));  // the mask, then the invalid flag
  }
  const bool gbf = grad.scalar_type() == at::kBFloat16;
  const int err = fp4adam_fused_step_master_cuda(
      reinterpret_cast<uint16_t*>(hi.data_ptr<at::BFloat16>()), lp, mode == 1 ? pos.data_ptr<int64_t>() : nullptr,
      mode == 1 ? pos.numel() : 0, mode == 1 ? reinterpret_cast<uint32_t*>(words.data_ptr<int32_t>()) : nullptr,
      (int)mode, gbf ? (const void*)grad.data_ptr<at::BFloat16>() : (const void*)grad.data_ptr<float>(), gbf ? 1 : 0,
      n, u8(m_codes, "m_codes", nb * 8, dev), u8(m_scales, "m_scales", nb, dev),
      reinterpret_cast<float*>(u8(m_ts, "m_tscale", nchunks * 4, dev)), u8(v_codes, "v_codes", nb * 2 * fp4::v_cbits(v_kind), dev),
      u8(v_scales, "v_scales", nb, dev), reinterpret_cast<float*>(u8(v_ts, "v_tscale", nchunks * 4, dev)), sc,
      weight_decay, maximize, (int)v_kind, m_stochastic, (uint32_t)seed, (uint32_t)stream0, v_stochastic,
      c10::cuda::getCurrentCUDAStream(dev.index()).stream());
  TORCH_CHECK(err == 0, "fused_step_master (cuda): kernel launch failed with cudaError ", err);
  if (mode == 2) return at::empty({0}, longs);
  TORCH_CHECK(words[nwords].item<int32_t>() == 0,
              "fused_step_master (cuda): odd must hold increasing positions inside the parameter");
  return mask_positions(words.narrow(0, 0, nwords).view(at::kShort).narrow(0, 0, nb));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // v_stochastic last, with a default, so positional callers of the earlier signature keep working
  m.def("fused_step", &fused_step, "fused FP4AdamW step on packed states (CUDA)", py::arg("param"), py::arg("grad"),
        py::arg("m_codes"), py::arg("m_scales"), py::arg("m_tscale"), py::arg("v_codes"), py::arg("v_scales"),
        py::arg("v_tscale"), py::arg("b1"), py::arg("omb1"), py::arg("b2"), py::arg("omb2"), py::arg("eps"),
        py::arg("decay"), py::arg("step_size"), py::arg("rsbc2"), py::arg("weight_decay"), py::arg("maximize"),
        py::arg("v_kind"), py::arg("m_stochastic"), py::arg("seed"), py::arg("stream0"),
        py::arg("bf16_out") = py::none(), py::arg("v_stochastic") = false);
  m.def("fused_step_master", &fused_step_master, "fused FP4AdamW step of a bf16 parameter with a compact master (CUDA)",
        py::arg("hi"), py::arg("lo"), py::arg("odd"), py::arg("grad"), py::arg("m_codes"), py::arg("m_scales"),
        py::arg("m_tscale"), py::arg("v_codes"), py::arg("v_scales"), py::arg("v_tscale"), py::arg("b1"),
        py::arg("omb1"), py::arg("b2"), py::arg("omb2"), py::arg("eps"), py::arg("decay"), py::arg("step_size"),
        py::arg("rsbc2"), py::arg("weight_decay"), py::arg("maximize"), py::arg("v_kind"), py::arg("m_stochastic"),
        py::arg("seed"), py::arg("stream0"), py::arg("mode"), py::arg("v_stochastic") = false);
}
