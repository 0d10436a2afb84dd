"""Bit-level scalar rules of docs/design.md section 3, written with torch tensor ops.

These functions are the oracle every compiled backend must match byte for byte; csrc/fp4_codec.h
implements the same rules as scalar inline functions. Everything is fp32 or int32 arithmetic so
that each step rounds exactly as the C code does (no fused multiply-add, no fast math).
"""

from __future__ import annotations

import torch


F32_MAX = torch.finfo(torch.float32).max

#: magnitudes of E2M1 codes 0..7; code | 8 is the negative
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
INT2_MAX = 3.0  # the outer level of int2 (2-bit saved activations): codes are -3, -1, 1, 3
E4M3_NAN = 0x7F
E8M0_NAN = 0xFF
UFP4_MIN = 2.0 ** -7
UFP4_MAX = 1.5


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def _from_bits(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int32).contiguous().view(torch.float32)


def signbit(x: torch.Tensor) -> torch.Tensor:
    """True where the fp32 sign bit is set (so -0.0 counts as negative)."""
    return _bits(x) < 0


def _rne_mantissa(a: torch.Tensor, mbits: int) -> torch.Tensor:
    """Round the fp32 pattern of a >= 0 to `mbits` mantissa bits, ties to even, by integer arithmetic.

    Returns the rounded pattern shifted right by (23 - mbits): (biased fp32 exponent << mbits) | mantissa.
    """
    shift = 23 - mbits
    b = _bits(a)
    lsb = (b >> shift) & 1
    return (b + ((1 << (shift - 1)) - 1) + lsb) >> shift


def e2m1_encode_magnitude(a: torch.Tensor) -> torch.Tensor:
    """Magnitude code 0..7 of a in [0, 6] (fp32), round to nearest, ties to even code."""
    sub = torch.round(a * 2.0)  # a < 1: the grid is k * 0.5, torch.round is half-to-even
    nrm = _rne_mantissa(a, 1) - (126 << 1)
    return torch.where(a < 1.0, sub.to(torch.int32), nrm).clamp_(0, 7)


def e2m1_encode_magnitude_sr(a: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of a in [0, 6] (fp32): up with probability (a - lo) / step (docs/design.md 3.9).

    The position of a on the grid in fixed point, 22 fraction bits per grid step (the fp32 pattern less
    126 << 23 for a >= 1, trunc(a * 2^23) for a < 1), plus the top 22 of the 32 random bits; the carry out of
    the fraction rounds up. Same integer steps as fp4_codec.h's e2m1_encode_mag_sr.
    """
    x = torch.where(a < 1.0, (a * 8388608.0).to(torch.int64), _bits(a).to(torch.int64) - (126 << 23))
    return ((x + (rand.to(torch.int64) >> 10)) >> 22).to(torch.int32)


def e2m1_decode_magnitude(code: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=code.device)
    return table[code.long()]


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """E4M3 'fn' code of fp32 x: round to nearest even, saturate to +-448, sign kept. Not for NaN."""
    a = x.abs().clamp(max=E4M3_MAX)
    sub = torch.round(a * 512.0).to(torch.int32)  # a < 2^-6: subnormal grid k * 2^-9
    nrm = _rne_mantissa(a, 3) - (120 << 3)
    code = torch.where(a < 2.0 ** -6, sub, nrm).clamp_(0, 0x7E)
    return code | (signbit(x).to(torch.int32) << 7)


def e4m3_table(device=None) -> torch.Tensor:
    """fp32 value of every E4M3 'fn' code (0x7F and 0xFF are NaN)."""
    c = torch.arange(256, dtype=torch.int32)
    e = (c >> 3) & 0xF
    m = (c & 7).to(torch.float64)
    mag = torch.where(e == 0, m * 2.0 ** -9, (1 + m / 8) * torch.pow(2.0, (e - 7).to(torch.float64)))
    mag = torch.where((c & 0x7F) == 0x7F, torch.full_like(mag, float("nan")), mag)
    val = torch.where(c >= 128, -mag, mag).to(torch.float32)
    return val.to(device) if device is not None else val


def e8m0_table(device=None) -> torch.Tensor:
    """fp32 value 2^(c-127) of every E8M0 code (0xFF is NaN); code 0 is 2^-127, an fp32 subnormal."""
    c = torch.arange(256, dtype=torch.float64)
    val = torch.pow(2.0, c - 127).to(torch.float32)
    val[255] = float("nan")
    return val.to(device) if device is not None else val


def pow2_f32(k: torch.Tensor) -> torch.Tensor:
    """Exact 2^k in fp32 for integer k in [-127, 127], built from the bit pattern."""
    k = k.to(torch.int32)
    normal = (k + 127).clamp(min=1) << 23
    return _from_bits(torch.where(k >= -126, normal, torch.full_like(k, 0x00400000)))


def e8m0_exponent(amax: torch.Tensor, elem_max_mant: int, elem_emax: int, mode: str) -> torch.Tensor:
    """Unbiased shared exponent e for an MX block, from the fp32 bits of amax (finite, >= 0).

    `rceil`: the smallest e with amax <= elem_max * 2^e, where elem_max = (1 + elem_max_mant / 2^23) * 2^elem_emax
    (E2M1: 1.5 * 2^2; E4M3: 1.75 * 2^8), so nothing clips. `floor`: e = floor(log2 amax) - elem_emax (OCP v1.0).
    Zero and subnormal amax give the smallest scale; e is clamped to [-127, 127].
    """
    b = _bits(amax)
    exp = (b >> 23) & 0xFF
    mant = b & 0x7FFFFF
    e = exp - 127 - elem_emax
    if mode == "rceil":
        e = e + (mant > elem_max_mant).to(torch.int32)
    e = torch.where(exp == 0, torch.full_like(e, -127), e)
    return e.clamp_(-127, 127)


# Unsigned zero-free grids for u = sqrt(v) (docs/design.md 3.7): `cbits`-bit codes (4, or 2 for ue2m0), `mbits`
# mantissa bits and nb = 2^cbits >> mbits binades, the top one [1, 2): code c is
# (1 + (c mod 2^mbits) / 2^mbits) * 2^(c >> mbits - nb + 1). ufp4 (E3M1) has mbits 1 (2^-7 .. 1.5); ue2m2 has
# mbits 2 (2^-3 .. 1.75); the 2-bit ue2m0 has mbits 0 (1/8, 1/4, 1/2, 1). Values below the grid take code 0.
# The grids by name: the unsigned rows of grids.py.


def ugrid_spec(grid) -> tuple[int, int]:
    """(mantissa bits, code bits) of an unsigned grid given as its mantissa bits (an int or True: 4-bit codes) or
    as a grids.VGrid row."""
    if hasattr(grid, "bits"):
        return grid.mbits, grid.bits
    return int(grid), 4


def _nb(mbits: int, cbits: int) -> int:
    return (1 << cbits) >> mbits


def ugrid_min(mbits: int, cbits: int = 4) -> float:
    return 2.0 ** (1 - _nb(mbits, cbits))


def ugrid_max(mbits: int) -> float:
    return 2.0 - 2.0 ** -mbits


def _ugrid_bias(mbits: int, cbits: int = 4) -> int:
    return 128 - _nb(mbits, cbits)  # the fp32 exponent field of the grid's smallest binade


def ugrid_encode(y: torch.Tensor, mbits: int = 1, cbits: int = 4) -> torch.Tensor:
    """Code of y >= 0 (already scaled) on the grid: nearest code value, ties to even code; below the grid's
    smallest value -> code 0."""
    a = y.clamp(max=ugrid_max(mbits))
    code = _rne_mantissa(a, mbits) - (_ugrid_bias(mbits, cbits) << mbits)
    return torch.where(a < ugrid_min(mbits, cbits), torch.zeros_like(code), code).clamp_(0, (1 << cbits) - 1)


def ugrid_encode_sr(y: torch.Tensor, rand: torch.Tensor, mbits: int = 1, cbits: int = 4) -> torch.Tensor:
    """Stochastic rounding of y >= 0 (already scaled) to the grid (fp4_codec.h's ugrid_encode_sr): the
    fp32 pattern less bias << 23 is the code above 23 - mbits fraction bits, plus the top 23 - mbits random bits;
    below the grid's smallest value -> code 0. The largest value has a zero fraction, so the code stays below
    2^cbits."""
    a = y.clamp(max=ugrid_max(mbits))
    shift = 23 - mbits
    code = ((_bits(a).to(torch.int64) - (_ugrid_bias(mbits, cbits) << 23) + (rand.to(torch.int64) >> (32 - shift)))
            >> shift).to(torch.int32)
    return torch.where(a < ugrid_min(mbits, cbits), torch.zeros_like(code), code)


def ugrid_values(mbits: int = 1, device=None, cbits: int = 4) -> torch.Tensor:
    """The values of the grid's codes, 0 .. 2^cbits - 1."""
    c = torch.arange(1 << cbits, dtype=torch.float64)
    per = 2 ** mbits
    val = torch.pow(2.0, torch.div(c, per, rounding_mode="floor") - (_nb(mbits, cbits) - 1)) * (1 + (c % per) / per)
    return val.to(torch.float32).to(device) if device is not None else val.to(torch.float32)


def ufp4_encode(y: torch.Tensor) -> torch.Tensor:
    """ufp4 code of y >= 0 (already scaled): nearest code value, ties to even code; below 2^-7 -> code 0."""
    return ugrid_encode(y, 1)


def ufp4_encode_sr(y: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of y >= 0 (already scaled) to a ufp4 code (one kept mantissa bit, 22 fraction bits)."""
    return ugrid_encode_sr(y, rand, 1)


def ufp4_values(device=None) -> torch.Tensor:
    return ugrid_values(1, device)


# --- counter-based random bits (docs/design.md 3.9) -------------------------------------------------------

_M32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, b: int) -> torch.Tensor:
    """(a * b) mod 2^32 for int64 lanes holding uint32 values, without int64 overflow."""
    lo = a * (b & 0xFFFF)
    hi = ((a * (b >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 lanes holding uint32 values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _fmix32_int(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def sr_key(seed: int, stream: int, index_hi: int = 0) -> int:
    """Per-(seed, stream, index >> 32) key: fmix32(seed * 0x9E3779B9 ^ fmix32(stream ^ hi * 0x7FEB352D))."""
    inner = _fmix32_int((stream ^ ((index_hi * 0x7FEB352D) & _M32)) & _M32)
    return _fmix32_int(((seed * 0x9E3779B9) & _M32) ^ inner)


def random_bits(seed: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """32 random bits per element index: fmix32(lo32(index) * 0x9E3779B1 + key(seed, stream, index >> 32)).

    Returned as int64 holding the uint32 value. `index` is an int64 tensor of element positions.
    """
    index = index.to(torch.int64)
    hi = index >> 32
    if hi.numel() and int(hi.max()) != int(hi.min()):
        his = torch.unique(hi)
        out = torch.empty_like(index)
        for h in his.tolist():
            sel = hi == h
            out[sel] = random_bits(seed, stream, index[sel])
        return out
    key = sr_key(seed & _M32, stream & _M32, int(hi.flatten()[0]) if hi.numel() else 0)
    return _fmix32((_mul32(index & _M32, 0x9E3779B1) + key) & _M32)
