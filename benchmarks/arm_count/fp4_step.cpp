// One FP4AdamW step (the defaults: m stochastic, sqrt(v) on ue2m2 to nearest, weight decay, fp32 gradient) over n
// elements on the build's vector step (step_range_fast: the SIMD-layer step of csrc/cpu/adam_simd.h on NEON, the
// NEON layer in the SVE build too), for benchmarks/arm_instructions.py to count under qemu.
// n from argv[1].
#include <stdint.h>
#include <stdlib.h>

#include <vector>

#include "cpu/adam_simd.h"

int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? atoll(argv[1]) : 65536;
  std::vector<float> p(n), g(n);
  for (int64_t i = 0; i < n; ++i) {
    p[i] = fp4::u2f(0x3C000000u + (fp4::fmix32((uint32_t)i) >> 9));
    g[i] = fp4::u2f(0x38000000u + (fp4::fmix32((uint32_t)i ^ 0x55u) >> 9));
  }
  const int64_t nb = (n + 15) / 16, nc = (n + 1023) / 1024;
  std::vector<uint8_t> mc(nb * 8), ms(nb), vc(nb * 8), vs(nb);
  std::vector<float> mt(nc), vt(nc);
  fp4adam::ChunkArgs a{};
  a.n = n;
  a.param = p.data();
  a.m_codes = mc.data();
  a.m_scales = ms.data();
  a.v_codes = vc.data();
  a.v_scales = vs.data();
  a.m_ts = mt.data();
  a.v_ts = vt.data();
  a.s = fp4adam::Scalars{0.9f, 0.1f, 0.999f, 0.001f, 1e-8f, 0.9999f, 0.01f, 31.6f, true};
  a.m_stochastic = true;
  a.v_kind = fp4::kV_ue2m2;
  a.seed = 1;
  fp4adam::step_range_fast(a, g.data(), 0, nc);
  return mt[0] >= 0.0f ? 0 : 1;
}
