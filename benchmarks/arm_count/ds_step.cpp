// One step of DeepSpeed's cpu_adam vector loop (Adam_Optimizer::Step_AVX from the installed DeepSpeed's
// csrc/includes/cpu_adam.h, its NEON form, or Step_SVE with __SVE__; fp32 parameters and states, AdamW, weight decay) over n elements, for
// benchmarks/arm_instructions.py to count under qemu. Built against a stub torch/extension.h (the header's
// torch types appear only in declarations). n from argv[1].
#include <stdint.h>
#include <stdlib.h>

#include <vector>

#include "cpu_adam.h"

int main(int argc, char** argv) {
  const size_t n = argc > 1 ? (size_t)atoll(argv[1]) : 65536;
  std::vector<float> p(n, 0.01f), g(n, 0.001f), m(n, 0.0f), v(n, 0.0f);
  Adam_Optimizer opt(1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, true);
  opt.IncrementStep(1, 0.9f, 0.999f);
  opt.update_state(1e-3f, 1e-8f, 0.01f, true);
  size_t done = 0;
#if defined(__SVE__)
  opt.Step_SVE<1, float, float>(&done, p.data(), g.data(), m.data(), v.data(), n, false);
#else
  opt.Step_AVX<1, float, float>(&done, p.data(), g.data(), m.data(), v.data(), n, false);
#endif
  return done == n ? 0 : 1;
}
