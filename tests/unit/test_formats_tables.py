"""Every code of every element and scale format, and every rounding tie, against the published definitions.

Expected values are computed here from the format definitions (sign, exponent, mantissa fields and
bias), never from fp4offload's tables; expected codes come from a brute-force "nearest value, ties
to the even code" search over those values. Each rule is checked twice: on the torch reference
(`fp4offload.formats.bits`, the oracle) and through the public `quantize` / `dequantize` on each
backend (the CPU extension with and without its AVX-512 paths, and the torch reference), with
inputs built so that every scale is exactly 1 and the element codes are the format's own rounding.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers.extensions import CPU_PATHS, cpu_path
from helpers.formulas import e2m1_value, e4m3_value, e8m0_value, ufp4_value

import fp4offload
from fp4offload.formats import bits
from fp4offload.formats.packed import PackedTensor

# ---- the definitions ---------------------------------------------------------------------------------


def nearest_even(a: float, grid: list[tuple[int, float]]) -> int:
    """Code of the grid value nearest to a >= 0, ties to the even code; saturates at both ends.

    `grid` is (code, value) sorted by value; comparisons are against exact midpoints (dyadic, so
    exact in float64), which makes the search exact for any fp32 input.
    """
    if a <= grid[0][1]:
        return grid[0][0]
    for (c0, v0), (c1, v1) in zip(grid, grid[1:]):
        if a <= v1:
            mid = (v0 + v1) / 2
            if a < mid:
                return c0
            if a > mid:
                return c1
            return c0 if c0 % 2 == 0 else c1
    return grid[-1][0]


E2M1_GRID = [(c, e2m1_value(c)) for c in range(8)]
E4M3_GRID = [(c, e4m3_value(c)) for c in range(0x7F)]
UFP4_GRID = [(c, ufp4_value(c)) for c in range(16)]


def f32(v) -> float:
    return float(np.float32(v))


def next_up(v: float) -> float:
    return float(np.nextafter(np.float32(v), np.float32(np.inf)))


def next_down(v: float) -> float:
    return float(np.nextafter(np.float32(v), np.float32(-np.inf)))


def signed_code(x: float, grid, sign_bit: int) -> int:
    neg = math.copysign(1.0, x) < 0
    return nearest_even(abs(x), grid) | (sign_bit if neg else 0)


def unpack(data: torch.Tensor) -> list[int]:
    """Nibbles of packed bytes, element 2i from the low nibble (docs/design.md 3.2)."""
    out = []
    for b in data.tolist():
        out += [b & 0xF, b >> 4]
    return out


def same(a: float, b: float) -> bool:
    """Equal including the sign of zero, NaN equal to NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


# ---- backends ---------------------------------------------------------------------------------------


@pytest.fixture(params=[f"cpu-{p}" for p in CPU_PATHS] + ["reference"])
def backend(request, monkeypatch):
    """Run the public API on one backend: the CPU extension on each path this CPU has, or the torch reference."""
    if request.param == "reference":
        monkeypatch.setenv("FP4OFFLOAD_BACKEND", "reference")
        yield request.param
        return
    from fp4offload._ops import cpu

    request.getfixturevalue("cpu_ext")
    monkeypatch.setenv("FP4OFFLOAD_BACKEND", "cpu")
    yield from cpu_path(request.param[4:], monkeypatch, cpu.extension)


# ---- E2M1 --------------------------------------------------------------------------------------------


def test_e2m1_table_from_definition():
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for c in range(16):
        v = e2m1_value(c)
        assert abs(v) == expected[c & 7]
        assert (math.copysign(1.0, v) < 0) == bool(c & 8)
    got = bits.e2m1_decode_magnitude(torch.arange(16)).tolist()
    assert all(same(g, e2m1_value(c)) for c, g in enumerate(got)), got


def _e2m1_inputs() -> list[float]:
    """Every value, every midpoint (tie), the fp32 neighbours of each, zeros and tiny values."""
    vals = [v for _, v in E2M1_GRID]
    mids = [(a + b) / 2 for a, b in zip(vals, vals[1:])]
    xs = set(vals + mids)
    for m in mids + vals[1:]:
        xs |= {next_up(m), next_down(m)}
    xs |= {1e-30, 1e-45, 0.1, 0.26, 2.4, 2.6, 4.9, 5.1, 5.999}
    xs = sorted(x for x in xs if 0 <= x <= 6)
    return xs + [-x for x in xs]  # includes -0.0 and tiny negatives


TIES = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}


def test_e2m1_ties_by_definition():
    """The brute-force oracle agrees with docs/design.md 3.1's list of ties (so it is the rule we mean)."""
    for x, v in TIES.items():
        assert e2m1_value(nearest_even(x, E2M1_GRID)) == v
        assert e2m1_value(signed_code(-x, E2M1_GRID, 8)) == -v
    assert signed_code(-0.0, E2M1_GRID, 8) == 8
    assert signed_code(-0.2, E2M1_GRID, 8) == 8


def test_e2m1_reference_encode_magnitude():
    xs = [x for x in _e2m1_inputs() if math.copysign(1.0, x) > 0] + [6.0]
    got = bits.e2m1_encode_magnitude(torch.tensor(xs, dtype=torch.float32)).tolist()
    want = [nearest_even(x, E2M1_GRID) for x in xs]
    assert got == want, [(x, g, w) for x, g, w in zip(xs, got, want) if g != w]


def _blocks_with_max(values: list[float], block: int, top: float) -> tuple[torch.Tensor, list[int]]:
    """Lay `values` into blocks of `block` elements whose element 0 is `top` (so the block amax is top).

    Returns the flat fp32 tensor and the flat positions of the values.
    """
    per = block - 1
    out, pos = [], []
    for i in range(0, len(values), per):
        chunk = values[i:i + per]
        base = len(out)
        out += [top] + chunk + [0.0] * (per - len(chunk))
        pos += [base + 1 + j for j in range(len(chunk))]
    return torch.tensor(out, dtype=torch.float32), pos


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "nvfp4-16x16"])
def test_e2m1_public_encode_every_tie(fmt, backend):
    """quantize() rounds each value to the nearest E2M1 code, ties to even, sign kept (-0 -> code 8).

    MXFP4: a block amax of 6 gives the E8M0 scale 2^0. NVFP4: a leading block holding 2688 = 6 * 448
    makes the tensor scale exactly 1, and each block amax of 6 makes the E4M3 block scale exactly 1.
    """
    xs = _e2m1_inputs()
    if fmt == "mxfp4":
        x, pos = _blocks_with_max(xs, 32, 6.0)
        p = fp4offload.quantize(x, "mxfp4")
        assert p.scales.tolist() == [127] * p.scales.numel()
    elif fmt == "nvfp4":
        x, pos = _blocks_with_max(xs, 16, 6.0)
        x = torch.cat([torch.tensor([2688.0] + [0.0] * 15), x])
        pos = [p_ + 16 for p_ in pos]
        p = fp4offload.quantize(x, "nvfp4")
        assert p.tensor_scale.tolist() == [1.0]
        assert p.scales[1:].tolist() == [0x38] * (p.scales.numel() - 1)  # E4M3 1.0
    else:  # 16 columns: each 16x16 tile is 256 consecutive elements; a leading tile holds 2688
        x, pos = _blocks_with_max(xs, 256, 6.0)
        x = torch.cat([torch.tensor([2688.0] + [0.0] * 255), x])
        pos = [q + 256 for q in pos]
        p = fp4offload.quantize(x.view(-1, 16), "nvfp4", block="16x16")
        assert p.tensor_scale.tolist() == [1.0]
        assert p.scales[1:].tolist() == [0x38] * (p.scales.numel() - 1)
    codes = unpack(p.data)
    flat = x.tolist()
    bad = []
    for q in pos:
        want = signed_code(flat[q], E2M1_GRID, 8)
        if codes[q] != want:
            bad.append((flat[q], codes[q], want))
    assert not bad, f"(input, got code, expected code): {bad[:10]}"
    # decode: value(code) * 1 * 1, the sign of zero kept
    dec = fp4offload.dequantize(p).reshape(-1).tolist()
    for q in pos:
        assert same(dec[q], e2m1_value(codes[q])), (flat[q], dec[q])


def test_e2m1_public_saturation(backend):
    """MXFP4 floor mode (OCP): a block amax in [4, 8) keeps the scale 2^0, so values in (6, 8) clip to +-6."""
    vals = [6.5, 7.0, 7.99, -6.01, -7.5, 6.0, 5.5, 5.0]
    x, pos = _blocks_with_max(vals, 32, 7.999)
    p = fp4offload.quantize(x, "mxfp4", scale_mode="floor")
    assert p.scales.tolist() == [127]
    codes = unpack(p.data)
    assert [codes[q] for q in pos] == [7, 7, 7, 15, 15, 7, 7, 6]
    # rceil on the same block moves the scale up instead of clipping: 2^1
    assert fp4offload.quantize(x, "mxfp4").scales.tolist() == [128]


def test_e2m1_packing_nibble_order(backend):
    """Element 2i is the low nibble of byte i, element 2i+1 the high nibble; odd tails pad with 0."""
    x = torch.tensor([6.0, 1.0, -0.5, 3.0, 0.0] + [0.0] * 27)
    p = fp4offload.quantize(x, "mxfp4")
    assert p.data[:3].tolist() == [0x7 | (0x2 << 4), 0x9 | (0x5 << 4), 0x0]
    p = fp4offload.quantize(torch.tensor([6.0, 1.0, 3.0]), "mxfp4")
    assert p.data.tolist()[:2] == [0x27, 0x05]


# ---- E4M3 --------------------------------------------------------------------------------------------


def test_e4m3_all_256_codes():
    """bits.e4m3_table and torch's own float8_e4m3fn both decode every pattern as the definition says."""
    ref = bits.e4m3_table().tolist()
    torch_f8 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    for c in range(256):
        want = e4m3_value(c)
        assert same(ref[c], want), (hex(c), ref[c], want)
        assert same(torch_f8[c], want), (hex(c), torch_f8[c], want)
    assert e4m3_value(0x7E) == 448.0 and e4m3_value(0x01) == 2.0 ** -9 and e4m3_value(0x08) == 2.0 ** -6
    # re-encode every finite code to itself (-0 -> 0x80: the sign is kept)
    codes = [c for c in range(256) if (c & 0x7F) != 0x7F]
    vals = torch.tensor([e4m3_value(c) for c in codes], dtype=torch.float32)
    assert bits.e4m3_encode(vals).tolist() == codes


def _e4m3_inputs() -> list[float]:
    vals = [v for _, v in E4M3_GRID]
    mids = [(a + b) / 2 for a, b in zip(vals, vals[1:])]
    xs = set(vals + mids)
    for m in mids:
        xs |= {next_up(m), next_down(m)}
    xs |= {2.0 ** -11, 2.0 ** -10, next_up(2.0 ** -10), 1e-30, 1e-42}
    xs = sorted(x for x in xs if x <= 448)
    return xs + [-x for x in xs]


def test_e4m3_reference_ties_and_saturation():
    xs = _e4m3_inputs() + [464.0, 480.0, 1e6, 3.4e38, -500.0, -3.4e38]
    got = bits.e4m3_encode(torch.tensor(xs, dtype=torch.float32)).tolist()
    want = [signed_code(x, E4M3_GRID, 0x80) for x in xs]
    assert got == want, [(x, hex(g), hex(w)) for x, g, w in zip(xs, got, want) if g != w][:10]
    assert got[-6:] == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE]
    # spot checks of the rule itself: ties to even, below half the smallest subnormal -> 0
    enc = lambda v: int(bits.e4m3_encode(torch.tensor([v], dtype=torch.float32)))  # noqa: E731
    assert enc(2.0 ** -10) == 0x00 and enc(3 * 2.0 ** -10) == 0x02 and enc(-(2.0 ** -10)) == 0x80
    assert enc(1.0625) == 0x38 and enc(1.1875) == 0x3A and enc(1.0626) == 0x39


def test_e4m3_public_mxfp8(backend):
    """MXFP8 elements are E4M3: with a block amax of 448 the E8M0 scale is 2^0 and codes are the rounding."""
    xs = _e4m3_inputs()
    x, pos = _blocks_with_max(xs, 32, 448.0)
    p = fp4offload.quantize(x, "mxfp8")
    assert p.scales.tolist() == [127] * p.scales.numel()
    codes = p.data.tolist()
    flat = x.tolist()
    bad = [(flat[q], hex(codes[q]), hex(signed_code(flat[q], E4M3_GRID, 0x80)))
           for q in pos if codes[q] != signed_code(flat[q], E4M3_GRID, 0x80)]
    assert not bad, bad[:10]
    dec = fp4offload.dequantize(p).tolist()
    assert all(same(dec[q], e4m3_value(codes[q])) for q in pos)
    # saturation: floor mode keeps 2^0 for a block amax in [256, 512), and 448 < |x| < 512 clips to 448
    x, pos = _blocks_with_max([464.0, 500.0, -511.0, 449.0], 32, 511.0)
    p = fp4offload.quantize(x, "mxfp8", scale_mode="floor")
    assert p.scales.tolist() == [127]
    assert [p.data.tolist()[q] for q in pos] == [0x7E, 0x7E, 0xFE, 0x7E]


# ---- E8M0 --------------------------------------------------------------------------------------------


def test_e8m0_all_256_codes():
    ref = bits.e8m0_table().tolist()
    torch_e8 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu).float().tolist()
    for c in range(256):
        assert same(ref[c], e8m0_value(c)), (c, ref[c])
        assert same(torch_e8[c], e8m0_value(c)), (c, torch_e8[c])


def test_e8m0_public_decode_every_scale(backend):
    """An MXFP4 block of 1.0 codes under each of the 256 scales decodes to 2^(c-127); 0xFF to NaN."""
    scales = torch.arange(256, dtype=torch.uint8)
    data = torch.full((256 * 16,), 0x22, dtype=torch.uint8)  # code 2 = 1.0 in both nibbles
    header = {"format": "mxfp4", "block": "1x32", "shape": [256, 32], "dtype": "float32", "scale_scope": 0}
    p = PackedTensor.from_parts(header, {"data": data, "scales": scales})
    dec = fp4offload.dequantize(p)
    for c in range(256):
        row = dec[c].tolist()
        assert all(same(v, e8m0_value(c)) for v in row), (c, row[0], e8m0_value(c))


def test_e8m0_public_encode_every_exponent(backend):
    """A block amax of exactly 6 * 2^e gets the scale code e + 127 (rceil: the smallest 2^e with amax <= 6 * 2^e)."""
    es = list(range(-127, 126))
    x = torch.zeros(len(es), 32)
    for i, e in enumerate(es):
        x[i, 0] = 6.0 * 2.0 ** e
        x[i, 1] = -(2.0 ** e)  # code 10 (-1.0) after scaling
    p = fp4offload.quantize(x, "mxfp4")
    assert p.scales.tolist() == [e + 127 for e in es]
    codes = unpack(p.data)
    assert all(codes[32 * i] == 7 and codes[32 * i + 1] == 10 for i in range(len(es)))
    # just above 6 * 2^e moves to 2^(e+1); all-zero and fp32-subnormal blocks take the smallest scale
    y = torch.tensor([next_up(6.0), 0.0, 1e-45, 3.4e38]).repeat_interleave(32).view(4, 32)
    assert fp4offload.quantize(y, "mxfp4", nonfinite="propagate").scales.tolist() == [128, 0, 0, 126 + 127]


# ---- ufp4 --------------------------------------------------------------------------------------------


def test_ufp4_all_16_codes(backend):
    want = [ufp4_value(c) for c in range(16)]
    assert want[0] == 0.0078125 and want[15] == 1.5 and want == sorted(want)
    assert bits.ufp4_values().tolist() == want
    # public decode with an E4M3 block scale of 1.0 (0x38) and a tensor scale of 1
    data = torch.tensor([c | ((15 - c) << 4) for c in range(16)], dtype=torch.uint8)  # 32 elements
    header = {"format": "ufp4", "block": "1x16", "shape": [32], "dtype": "float32", "scale_scope": 0}
    p = PackedTensor.from_parts(header, {"data": data, "scales": torch.tensor([0x38, 0x38], dtype=torch.uint8),
                                         "tensor_scale": torch.tensor([1.0])})
    dec = fp4offload.dequantize(p).tolist()
    assert dec == [ufp4_value(c) for c in unpack(data)]


def _ufp4_inputs() -> list[float]:
    vals = [v for _, v in UFP4_GRID]
    xs = set(vals)
    for k in range(-7, 0):
        xs |= {1.25 * 2.0 ** k, 1.75 * 2.0 ** k}
    for a, b in zip(vals, vals[1:]):
        m = (a + b) / 2
        xs |= {m, next_up(m), next_down(m)}
    xs |= {0.0, 1e-30, 2.0 ** -8, 0.007, 0.0078}
    return sorted(x for x in xs if x <= 1.5)


def test_ufp4_ties_by_definition():
    for k in range(-7, 0):
        assert ufp4_value(nearest_even(1.25 * 2.0 ** k, UFP4_GRID)) == 2.0 ** k
        assert ufp4_value(nearest_even(1.75 * 2.0 ** k, UFP4_GRID)) == 2.0 ** (k + 1)
    assert ufp4_value(nearest_even(1.25, UFP4_GRID)) == 1.0
    assert nearest_even(0.0, UFP4_GRID) == 0 and nearest_even(1e-30, UFP4_GRID) == 0


def test_ufp4_reference_encode():
    xs = _ufp4_inputs() + [1.75, 2.0, 1e30]
    got = bits.ufp4_encode(torch.tensor(xs, dtype=torch.float32)).tolist()
    want = [nearest_even(x, UFP4_GRID) for x in xs]
    assert got == want, [(x, g, w) for x, g, w in zip(xs, got, want) if g != w]
    assert got[-3:] == [15, 15, 15]


def test_ufp4_public_encode(backend):
    """A leading block holding 672 = 1.5 * 448 makes the tensor scale 1; a block amax of 1.5 the block scale 1."""
    xs = _ufp4_inputs()
    x, pos = _blocks_with_max(xs, 16, 1.5)
    x = torch.cat([torch.tensor([672.0] + [0.0] * 15), x])
    pos = [q + 16 for q in pos]
    p = fp4offload.quantize(x, "ufp4")
    assert p.tensor_scale.tolist() == [1.0]
    assert p.scales[1:].tolist() == [0x38] * (p.scales.numel() - 1)
    codes = unpack(p.data)
    flat = x.tolist()
    bad = [(flat[q], codes[q], nearest_even(flat[q], UFP4_GRID)) for q in pos
           if codes[q] != nearest_even(flat[q], UFP4_GRID)]
    assert not bad, bad[:10]
    dec = fp4offload.dequantize(p).tolist()
    assert all(dec[q] == ufp4_value(codes[q]) for q in pos)
    assert min(dec) == 2.0 ** -7  # no zero: zeros and tiny values round up to the smallest code


# ---- NVFP4 block scale is E4M3 of (amax_b / 6) * s_enc ------------------------------------------------


def test_nvfp4_block_scale_rounds_as_e4m3(backend):
    """Block scales are the E4M3 rounding (ties to even, subnormals, flush to 0) of (amax_b / 6) * s_enc."""
    targets = [e4m3_value(c) for c in range(1, 0x7F)]
    mids = [(a + b) / 2 for a, b in zip([0.0] + targets, targets)]
    ts = sorted(set(targets + mids + [2.0 ** -11, 2.0 ** -10, next_up(2.0 ** -10)]))
    x = torch.zeros(len(ts) + 1, 16)
    x[0, 0] = 2688.0  # s_enc = 1
    for i, t in enumerate(ts):
        x[i + 1, 0] = 6.0 * t  # exact: a power-of-two-ish multiple within fp32
    p = fp4offload.quantize(x, "nvfp4")
    assert p.tensor_scale.tolist() == [1.0]
    got = p.scales[1:].tolist()
    want = [nearest_even(f32(f32(6.0 * t) / 6.0), E4M3_GRID) for t in ts]
    assert got == want, [(t, hex(g), hex(w)) for t, g, w in zip(ts, got, want) if g != w][:10]
    # a block whose scale flushes to 0 decodes to zeros
    dec = fp4offload.dequantize(p)
    for i, c in enumerate(got):
        if c == 0:
            assert torch.all(dec[i + 1] == 0)
