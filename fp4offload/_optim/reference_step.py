"""The reference AdamW step on packed states, in torch ops: the oracle of the fused CPU and CUDA steps.

Numerics (normative; the C++ step in csrc/cpu/adam_cpu.cpp and the CUDA step in csrc/cuda/adam_kernels.cu
follow them op for op, built with -ffp-contract=off / --fmad=false, so all three give the same bits):

Scalars, computed once per (parameter, step) in float64 from the group's hyperparameters and the step
count ``t`` (1-based, after the increment), then rounded once to fp32 (:class:`StepScalars`):
``b1 = beta1``, ``omb1 = 1 - beta1``, ``b2 = beta2``, ``omb2 = 1 - beta2``, ``eps``,
``decay = 1 - lr * weight_decay``, ``step_size = lr / (1 - beta1**t)``,
``rsbc2 = 1 / sqrt(1 - beta2**t)``.

Per element, fp32, each line one correctly rounded operation (no fused multiply-add):

1. ``g = float(grad)`` (``g = -g`` when ``maximize``)
2. ``m = decode(m_state)``; ``u = decode(v_state)`` and ``v = u * u`` for ``v_format="ue2m2"`` (the default) or
   ``"ufp4"`` (u = sqrt(v) is stored), or ``v = decode(v_state)`` for ``v_format="nvfp4"`` (the ablation); fp32
   states are read as is.
3. ``p = p * decay`` (skipped when ``weight_decay == 0``; decoupled weight decay as in torch.optim.AdamW)
4. ``m = (m * b1) + (g * omb1)``
5. ``v = (v * b2) + ((g * g) * omb2)``
6. ``u = sqrt(v)`` (correctly rounded; see :func:`sqrt_rn`)
7. ``d = (u * rsbc2) + eps``
8. ``p = p - ((m / d) * step_size)``
9. store: m -> NVFP4 1x16 with one fp32 scale per chunk of ``CHUNK`` elements (docs/design.md 3.3), nearest or
   stochastic rounding; u -> ue2m2 or ufp4 1x16 per chunk (3.7), nearest or stochastic (``v_rounding``); or
   v -> NVFP4 for the ablation.
   The update of step 8 uses the unquantized m and v of this step; only what is stored is rounded.
10. optional working copies of the new weight: bf16 (round to nearest even, as ``Tensor.to(torch.bfloat16)``)
    and/or NVFP4 16x16 with one tensor scale (a second pass: the tensor scale needs the new amax of the
    whole tensor, which is known only after its last chunk).

Layout: the flattened parameter is cut into chunks of ``CHUNK = 1024`` elements (64 blocks of 16, 4 KiB of
fp32: the fused step's working set of one chunk stays in L1); each chunk has its own fp32 tensor scale, so
a chunk is the unit of quantization and the fused step can finish a chunk before touching the next.
Chunks are grouped in segments of ``SEGMENT = 2**20`` elements: the unit of transfer for the host and NVMe
tiers and of the stochastic-rounding streams. Tensors with fewer than ``min_numel`` elements (default 4096)
keep fp32 m and v and take steps 1-8 on fp32 states.

Stochastic rounding of m (docs/design.md 3.9) draws the 32 random bits of element ``i`` of segment ``s`` of the
parameter with stream id ``pid`` (its position in the optimizer's parameter order; for a tensor FP4AdamW's
``tensor_key`` names, ``2**15`` + the number of names first stepped before its own) as
``random_bits(seed, stream, i - s * SEGMENT)`` with ``seed = (base_seed * 0x01000193 + t) mod 2**32`` and
``stream = (pid * 2**16 + s) mod 2**32``. Every input is saved in the state dict (``step``, the base seed,
the parameter order; named tensors are numbered in the order they are first stepped, which a resumed run
repeats), so a resumed run draws the same bits. The second moment, when rounded stochastically, draws its bits by
the same rule from ``seed ^ V_SEED_XOR``: the same stream and index, independent bits.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..formats import reference
from .._config.grids import V_GRIDS
from ..formats.layout import packed_sizes as layout_sizes

CHUNK = 1024
SEGMENT = 1 << 20
V_SEED_XOR = 0x2545F491  # v's stochastic rounding: m's rule with seed ^ V_SEED_XOR (fp4_codec.h's kVSeedXor)
#: v_format -> its row of grids.py (the grid, its mantissa and code bits; ``signed``: v itself in NVFP4)
V_GRID = {g.name: g for g in V_GRIDS}
#: v_format -> the fused steps' v_kind (csrc/grids.h's kernel id)
V_KIND = {g.name: g.kid for g in V_GRIDS}
BLOCK = 16


def f32(x: float) -> float:
    """Round a Python float to the nearest fp32 value."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


@dataclass(frozen=True)
class StepScalars:
    """The fp32 scalars of one AdamW step of one parameter (see the module docstring)."""

    b1: float
    omb1: float
    b2: float
    omb2: float
    eps: float
    decay: float
    step_size: float
    rsbc2: float
    weight_decay: bool

    @classmethod
    def make(cls, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
             step: int) -> "StepScalars":
        bc1 = 1.0 - beta1 ** step
        bc2 = 1.0 - beta2 ** step
        return cls(f32(beta1), f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2), f32(eps), f32(1.0 - lr * weight_decay),
                   f32(lr / bc1), f32(1.0 / math.sqrt(bc2)), weight_decay != 0)


def sr_seed(base_seed: int, step: int) -> int:
    """The stochastic-rounding seed of step `step` (see the module docstring)."""
    return (base_seed * 0x01000193 + step) & 0xFFFFFFFF


def sr_stream(pid: int, segment: int) -> int:
    """The stochastic-rounding stream of segment `segment` of parameter number `pid`."""
    return (pid * 65536 + segment) & 0xFFFFFFFF


class Packed(NamedTuple):
    """A packed 1x16 state (or a segment of one): codes (u8, 8 bytes per block; 4 for a 2-bit grid), block scales
    (u8, E4M3), chunk scales (u8 holding the little-endian bytes of one fp32 decode scale per chunk)."""

    codes: torch.Tensor
    scales: torch.Tensor
    tscale: torch.Tensor

    def tscale_f32(self) -> torch.Tensor:
        return self.tscale.view(torch.float32)

    @property
    def bits(self) -> int:
        """Bits per code, from the sizes: 4 or 2."""
        return self.codes.numel() // (2 * self.scales.numel()) if self.scales.numel() else 4


def v_bits(v_format: str) -> int:
    """Bits per code of the v state in `v_format`."""
    return V_GRID[v_format].bits


def packed_sizes(n: int, bits: int = 4) -> tuple[int, int, int]:
    """(code bytes, block scales, chunk-scale bytes) of a packed state of n elements with codes of `bits` bits
    (formats.layout's sizes of nvfp4 1x16 with one fp32 scale per CHUNK; ufp4 and ue2m2 have the same; a 2-bit
    grid half the code bytes)."""
    sz = layout_sizes("nvfp4", "1x16", (n,), scope=CHUNK)
    return sz.data * bits // 4, sz.scales, 4 * -(-n // CHUNK)


def empty_packed(n: int, device, bits: int = 4) -> Packed:
    """An all-zero packed state: decodes to 0 (its chunk scales are 0)."""
    c, s, t = packed_sizes(n, bits)
    z = lambda k: torch.zeros(k, dtype=torch.uint8, device=device)  # noqa: E731
    return Packed(z(c), z(s), z(t))


def segment_ranges(n: int) -> list[tuple[int, int]]:
    """[start, stop) of each segment of a flat tensor of n elements."""
    return [(s0, min(n, s0 + SEGMENT)) for s0 in range(0, n, SEGMENT)]


def segment_view(p: Packed, start: int, stop: int) -> Packed:
    """The part of a packed state covering elements [start, stop); start is a multiple of CHUNK."""
    assert start % CHUNK == 0
    bits = p.bits
    c0, s0, t0 = start * bits // 8, start // BLOCK, 4 * (start // CHUNK)
    nc, ns, nt = packed_sizes(stop - start, bits)
    c1, s1, t1 = c0 + nc, s0 + ns, t0 + nt
    return Packed(p.codes[c0:c1], p.scales[s0:s1], p.tscale[t0:t1])


def _grid_kern(kern, unsigned):
    """(backend, its `ufp4` argument) for a grid: the compiled codecs encode E2M1 and ufp4; the other grids
    (FP4AdamW's v states, which the fused steps encode themselves) go through the reference, which runs on any
    device."""
    ug, mb, cb = reference.grid_of(unsigned)
    if not ug:
        return kern, False
    if (mb, cb) == (1, 4):
        return kern, 1
    return reference, unsigned


def decode(kern, p: Packed, n: int, unsigned) -> torch.Tensor:
    """fp32 values of a packed state of n elements, through the kernel API (`kern`: a backend module).
    `unsigned`: False for E2M1 codes, else the unsigned grid, as its mantissa bits (True = 1: ufp4; 2: ue2m2) or
    its grids.py row."""
    if n == 0:
        return torch.zeros(0, dtype=torch.float32, device=p.codes.device)
    kern, unsigned = _grid_kern(kern, unsigned)
    return kern.nvfp4_decode(p.codes, p.scales, p.tscale_f32(), 1, n, 1, CHUNK, unsigned, torch.float32)


def encode_into(kern, x: torch.Tensor, out: Packed, unsigned: bool | int, stochastic: bool, seed: int,
                stream: int) -> None:
    """Encode fp32 x into `out` (in place), one fp32 scale per CHUNK, through the kernel API (`unsigned` as in
    decode)."""
    n = x.numel()
    if n == 0:
        return
    kern, unsigned = _grid_kern(kern, unsigned)
    data, scales, ts, _ = kern.nvfp4_encode(x.contiguous(), 1, n, 1, CHUNK, unsigned, stochastic, seed, stream, False)
    out.codes.copy_(data)
    out.scales.copy_(scales)
    out.tscale.copy_(ts.to(torch.float32).view(torch.uint8))


def _t(x: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, x)  # a full-size operand: the op rounds exactly as the kernels do


def sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root.

    torch.sqrt on fp32 CPU tensors is not correctly rounded (torch 2.13's vectorized CPU kernel misses the
    nearest fp32 value for about 17% of inputs), while sqrtf, _mm512_sqrt_ps and CUDA's __fsqrt_rn are.
    The square root of an fp32 value taken in fp64 and rounded once to fp32 is the correctly rounded
    result (fp64 has more than 2 * 24 + 2 significant bits), so the reference computes it that way.
    """
    return torch.sqrt(v.to(torch.float64)).to(torch.float32)


def adamw_math(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, sc: StepScalars,
               maximize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1 and 3-8 of the module docstring on fp32 tensors; returns (p, m, v, u), new tensors."""
    g = g.to(torch.float32)
    if maximize:
        g = torch.neg(g)
    if sc.weight_decay:
        p = torch.mul(p, _t(sc.decay, p))
    m = torch.add(torch.mul(m, _t(sc.b1, m)), torch.mul(g, _t(sc.omb1, g)))
    v = torch.add(torch.mul(v, _t(sc.b2, v)), torch.mul(torch.mul(g, g), _t(sc.omb2, g)))
    u = sqrt_rn(v)
    d = torch.add(torch.mul(u, _t(sc.rsbc2, u)), _t(sc.eps, u))
    p = torch.sub(p, torch.mul(torch.div(m, d), _t(sc.step_size, m)))
    return p, m, v, u


def packed_step(param: torch.Tensor, grad: torch.Tensor, m: Packed, v: Packed, sc: StepScalars, *, v_format: str,
                m_stochastic: bool, seed: int, stream: int, maximize: bool = False, kern=reference,
                bf16_out: torch.Tensor | None = None, v_stochastic: bool = False) -> None:
    """One AdamW step of a flat fp32 segment `param` (updated in place) with packed states m, v (updated in place).
    `v_stochastic`: the second moment is stored with stochastic rounding (bits from ``seed ^ V_SEED_XOR``).

    `kern` is a codec backend (default: the torch reference); every backend gives the same bytes.
    `bf16_out`, when given, receives the new weight rounded to bf16.
    """
    n = param.numel()
    m_old = decode(kern, m, n, False)
    grid = V_GRID[v_format]
    if not grid.signed:
        u_old = decode(kern, v, n, grid)
        v_old = torch.mul(u_old, u_old)
    else:
        v_old = decode(kern, v, n, False)
    p_new, m_new, v_new, u_new = adamw_math(param, grad.reshape(-1), m_old, v_old, sc, maximize)
    param.copy_(p_new)
    if bf16_out is not None:
        bf16_out.copy_(p_new.to(torch.bfloat16))
    encode_into(kern, m_new, m, False, m_stochastic, seed, stream)
    v_seed = (seed ^ V_SEED_XOR) if v_stochastic else 0
    if not grid.signed:
        encode_into(kern, u_new, v, grid, v_stochastic, v_seed, stream if v_stochastic else 0)
    else:
        encode_into(kern, v_new, v, False, v_stochastic, v_seed, stream if v_stochastic else 0)


def fp32_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
              sc: StepScalars, *, maximize: bool = False, bf16_out: torch.Tensor | None = None) -> None:
    """The same step with fp32 states (tensors under min_numel), all updated in place."""
    p_new, m_new, v_new, _ = adamw_math(param, grad.reshape(-1), exp_avg.reshape(-1), exp_avg_sq.reshape(-1), sc,
                                        maximize)
    param.copy_(p_new)
    exp_avg.view(-1).copy_(m_new)
    exp_avg_sq.view(-1).copy_(v_new)
    if bf16_out is not None:
        bf16_out.copy_(p_new.to(torch.bfloat16))
