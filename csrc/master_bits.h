// The bit rules of the bf16 rounding and of FP4AdamW's compact master weights (fp4offload/_optim/master.py,
// normative; docs/numerics.md "Master weights"), shared by the CPU step (csrc/cpu/adam_cpu.cpp) and the CUDA
// step (csrc/cuda/adam_kernels.cu). `b` is the 32-bit pattern of an fp32 value, `h` a bf16 pattern.
#pragma once

#include "fp4_codec.h"

namespace fp4master {

// Round to nearest even; NaN -> 0x7FC0 (as c10::BFloat16).
FP4_HD uint16_t to_bf16(float x) {
  const uint32_t b = fp4::f2u(x);
  if ((b & 0x7F800000u) == 0x7F800000u && (b & 0x7FFFFFu)) return (uint16_t)0x7FC0;
  return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// split: the fp32 pattern from the bf16 half h, the residual r and whether the position is odd.
FP4_HD uint32_t split_join(uint16_t h, int16_t r, bool odd) {
  const uint32_t a = (uint32_t)h + (odd ? 1u : 0u);
  int32_t rr = r;
  if ((a & 0x7FFFu) == 0x7F80u && rr > 0) rr = 0;  // an infinite h stays infinite
  return (a << 16) + (uint32_t)rr;
}

// split: the residual of b, whose upper half is written as to_bf16(b); odd when b is a tie that rounded down.
FP4_HD int16_t split_residual(uint32_t b, bool& odd) {
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) {
    odd = false;
    return 0;
  }
  const uint32_t a = (b + 0x8000u) >> 16;
  odd = (b & 0x1FFFFu) == 0x8000u;
  return (int16_t)(int32_t)(b - (a << 16));
}

// bf16 master: b rounded stochastically with 16 random bits; NaN -> 0x7FC0.
FP4_HD uint16_t bf16_stochastic(uint32_t b, uint32_t rnd16) {
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)0x7FC0;
  return (uint16_t)((b + rnd16) >> 16);
}

}  // namespace fp4master
