// fp4cpu::parallel_for(begin, end, grain, f): at::parallel_for in the torch extensions (OpenMP in torch's builds);
// one serial call f(begin, end) in the standalone builds (FP4_STANDALONE: tests/emulation/isa_driver).
#pragma once

#include <stdint.h>

#if defined(FP4_STANDALONE)
namespace fp4cpu {
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t, const F& f) {
  if (begin < end) f(begin, end);
}
}  // namespace fp4cpu
#else
#include <ATen/Parallel.h>
namespace fp4cpu {
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, f);
}
}  // namespace fp4cpu
#endif
