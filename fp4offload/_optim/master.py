"""The compact master weights of FP4AdamW (``master="split"`` and ``"bf16"``), in torch ops.

Normative definitions (docs/numerics.md, "Master weights"); the fused CPU step (csrc/cpu/adam_cpu.cpp,
``fused_step_master``) follows them bit for bit. All bit patterns below are unsigned: ``b`` is the 32-bit
pattern of an fp32 value ``x``, ``h`` the 16-bit pattern of a bf16 value.

**split.** The fp32 master ``x`` is held as the bf16 parameter ``h = rne(x)`` (round to nearest even, what
``x.to(torch.bfloat16)`` gives, so forward and backward see the same weight as with an fp32 master), a signed
16-bit residual ``r`` and a sparse list of positions, ``odd``:

- ``a = (b + 0x8000) >> 16`` is ``x`` rounded to bf16 with ties away from zero (the addition works on the
  magnitude bits, the sign bit rides along, and a carry out of the mantissa moves into the exponent as it
  should); ``r = b - (a << 16)`` lies in ``[-0x8000, 0x7FFF]`` for every non-NaN ``x``, so ``b = (a << 16) + r``
  is a bijection between those patterns and the pairs ``(a, r)``.
- ``rne(x)`` and ``a`` differ only when ``x`` is a tie whose lower neighbour is even, ``(b & 0x1FFFF) ==
  0x8000``; then ``a = h + 1``. Those positions are ``odd``: they are rare (a tie needs the 16 low bits of an
  fp32 result to be exactly ``0x8000``), and no 16-bit residual could do without them: an even ``h`` is the
  rounding of 65537 fp32 patterns.
- Rebuilding: ``a = h + [i in odd]``, ``b = (a << 16) + r``, except that ``r > 0`` counts as 0 when ``h`` is
  infinite (no encoded value has it; a parameter set to Inf from outside stays Inf). NaN: ``h`` is the NaN
  the step wrote (``0x7FC0``), ``r = 0``.

**bf16.** The master is the bf16 parameter itself, rounded stochastically after each update:
``h = (b + (bits >> 16)) >> 16`` with ``bits = random_bits(seed, stream, 2**32 + i)`` (formats.bits; index
``i`` inside the segment, the high word 1 keeps these draws apart from m's), the seed and stream of m's
stochastic rounding of the same step and segment (reference_step); NaN gives ``0x7FC0``. Deterministic for a
seed, and the same after a resume.
"""

from __future__ import annotations

import torch

from ..formats import bits as B

SR_INDEX_HI = 1  # the high word of the stochastic-rounding index of the bf16 master (m's draws use 0)
_NAN_BF16 = 0x7FC0


def _u32(x: torch.Tensor) -> torch.Tensor:
    """The fp32 bit patterns of x as int64 in [0, 2**32)."""
    return x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _f32(b: torch.Tensor) -> torch.Tensor:
    """fp32 values of int64 patterns in [0, 2**32)."""
    return torch.where(b >= 1 << 31, b - (1 << 32), b).to(torch.int32).view(torch.float32)


def _u16(h: torch.Tensor) -> torch.Tensor:
    """The bf16 bit patterns of h (bf16 or int16) as int64 in [0, 2**16)."""
    return h.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def _as_i16(v: torch.Tensor) -> torch.Tensor:
    """int64 values in [-2**15, 2**16) (a signed residual or an unsigned pattern) as int16 bits."""
    return torch.where(v >= 1 << 15, v - (1 << 16), v).to(torch.int16)


def _isnan_bits(b: torch.Tensor) -> torch.Tensor:
    return (b & 0x7FFFFFFF) > 0x7F800000


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, r, odd) of a flat fp32 tensor: the bf16 rounding (nearest even), the int16 residual and the sorted
    int64 positions where the rebuilt upper half is h + 1 (see the module docstring)."""
    b = _u32(x)
    nan = _isnan_bits(b)
    a = (b + 0x8000) >> 16
    r = torch.where(nan, torch.zeros_like(b), b - (a << 16))
    odd = ((b & 0x1FFFF) == 0x8000) & ~nan
    h = torch.where(nan, torch.full_like(b, _NAN_BF16), a - odd.to(torch.int64))
    return _as_i16(h).view(torch.bfloat16), r.to(torch.int16), odd.nonzero().reshape(-1)


def residual(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(r, odd) of x, for a step that has written h = rne(x) already."""
    _, r, odd = split(x)
    return r, odd


def join(h: torch.Tensor, r: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """The fp32 master rebuilt from its bf16 upper half h, residual r and positions odd (flat tensors)."""
    a = _u16(h)
    if odd.numel():
        a = a.index_add(0, odd.to(a.device), torch.ones(odd.numel(), dtype=torch.int64, device=a.device))
    rr = r.to(torch.int64)
    inf = (a & 0x7FFF) == 0x7F80
    rr = torch.where(inf & (rr > 0), torch.zeros_like(rr), rr)
    return _f32(((a << 16) + rr) & 0xFFFFFFFF)


def stochastic_bf16(x: torch.Tensor, seed: int, stream: int) -> torch.Tensor:
    """x (flat fp32, one segment) rounded stochastically to bf16 with the draws of (seed, stream)."""
    b = _u32(x)
    idx = torch.arange(x.numel(), dtype=torch.int64, device=x.device) + (SR_INDEX_HI << 32)
    rnd = B.random_bits(seed, stream, idx) >> 16
    h = torch.where(_isnan_bits(b), torch.full_like(b, _NAN_BF16), (b + rnd) >> 16)
    return _as_i16(h).view(torch.bfloat16)


def odd_in(odd: torch.Tensor, s0: int, s1: int) -> torch.Tensor:
    """The positions of sorted `odd` in [s0, s1), relative to s0."""
    lo, hi = (int(i) for i in torch.searchsorted(odd, torch.tensor([s0, s1], dtype=odd.dtype, device=odd.device)))
    return odd[lo:hi] - s0


__all__ = ["split", "residual", "join", "stochastic_bf16", "odd_in", "SR_INDEX_HI"]
