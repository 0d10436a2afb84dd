"""The public `quantize` / `dequantize`: stochastic rounding, error bounds, non-finite input, shapes, dtypes, errors.

Each test runs on the active CPU extension and, where cheap, on the torch reference too
(FP4OFFLOAD_BACKEND forces it). Byte equality of the two backends on random data is proved in
test_backends_agree.py; here each backend must satisfy the properties on its own.
"""

from __future__ import annotations

import ast
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.formulas import e2m1_value, e4m3_value, ufp4_value

import fp4offload.formats
from fp4offload import ConfigError, NonFiniteError, PackedTensor, dequantize, quantize
from fp4offload.formats import layout, reference

E4M3_NAN, E8M0_NAN = 0x7F, 0xFF


E4M3 = torch.tensor([e4m3_value(c) for c in range(256)], dtype=torch.float64)


def codes_of(p: PackedTensor) -> torch.Tensor:
    """Element codes in storage order (low nibble first for 4-bit formats)."""
    if p.format == "mxfp8":
        return p.data.long()
    return torch.stack((p.data & 15, p.data >> 4), dim=1).reshape(-1).long()


def gauss(shape, seed=0, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


# ==== 3. stochastic rounding =================================================================================

# (value, lower neighbour, upper neighbour) on the E2M1 grid with a scale of exactly 1
SR_VALUES = [(0.3, 0.0, 0.5), (1.1, 1.0, 1.5), (2.7, 2.0, 3.0), (4.5, 4.0, 6.0), (5.9, 4.0, 6.0),
             (0.01, 0.0, 0.5), (-0.3, -0.5, -0.0), (-4.5, -6.0, -4.0)]


def _exact_scale_blocks(value: float, nblocks: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [6, value, value, ...] whose scales are exactly 1 (see test_formats_tables); mask of value slots."""
    width = 32 if fmt == "mxfp4" else 16
    x = torch.full((nblocks, width), value)
    x[:, 0] = 6.0
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[:, 0] = False
    if fmt == "nvfp4":  # a leading block holding 2688 = 6 * 448 makes the tensor scale 1
        head = torch.zeros(1, width)
        head[0, 0] = 2688.0
        x = torch.cat([head, x])
        mask = torch.cat([torch.zeros(1, width, dtype=torch.bool), mask])
    return x.reshape(-1), mask.reshape(-1)


def _binomial_ok(ups: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    return abs(ups - n * p) <= sigmas * math.sqrt(n * p * (1 - p)) + 1


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_sr_unbiased_over_elements(fmt, backend):
    """Many copies of one value in one tensor: the count rounded up is Binomial(n, p) with
    p = (x - lo) / (hi - lo), within 5 sigma; hence the mean of the decoded values is x."""
    for value, lo, hi in SR_VALUES:
        x, mask = _exact_scale_blocks(value, 1000, fmt)
        dec = dequantize(quantize(x, fmt, rounding="stochastic", seed=11, stream=3))[mask].double()
        xv = float(torch.tensor(value, dtype=torch.float32))
        assert bool(((dec == lo) | (dec == hi)).all()), f"{value}: decodes outside its two neighbours"
        n = dec.numel()
        p = (xv - lo) / (hi - lo)
        ups = int((dec == hi).sum())
        assert _binomial_ok(ups, n, p), (value, ups, n * p, math.sqrt(n * p * (1 - p)))
        # nearest rounding of the same values is biased unless x is a tie; stochastic is not
        mean_err = abs(float(dec.mean()) - xv)
        assert mean_err <= 5 * (hi - lo) * math.sqrt(p * (1 - p) / n) + 1e-12


def test_sr_unbiased_over_seeds(backend):
    """The same 15 elements over 400 seeds: each element's up-count is Binomial(400, p) within 5 sigma."""
    vals = torch.linspace(0.05, 5.95, 15)
    x = torch.cat([torch.tensor([2688.0] + [0.0] * 15), torch.tensor([6.0]), vals])
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    xv = vals.double()
    lo_i = torch.searchsorted(grid, xv, right=True) - 1
    lo, hi = grid[lo_i], grid[lo_i + 1]
    p = (xv - lo) / (hi - lo)
    ups = torch.zeros(15)
    K = 400
    for seed in range(K):
        dec = dequantize(quantize(x, "nvfp4", rounding="stochastic", seed=seed))[17:].double()
        assert bool(((dec == lo) | (dec == hi)).all())
        ups += (dec == hi).double()
    for i in range(15):
        assert _binomial_ok(int(ups[i]), K, float(p[i])), (float(xv[i]), int(ups[i]), K * float(p[i]))


@pytest.mark.parametrize("fmt,block", [("nvfp4", "1x16"), ("nvfp4", "16x16"), ("mxfp4", None)])
def test_sr_deterministic_and_seeded(fmt, block, backend):
    x = gauss((64, 64), 1)
    a = quantize(x, fmt, block=block, rounding="stochastic", seed=5, stream=2)
    b = quantize(x, fmt, block=block, rounding="stochastic", seed=5, stream=2)
    assert torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales)
    frac = lambda p: float((codes_of(p) != codes_of(a)).double().mean())  # noqa: E731
    # another seed or another stream: a different draw (about half the codes that can move do)
    assert frac(quantize(x, fmt, block=block, rounding="stochastic", seed=6, stream=2)) > 0.2
    assert frac(quantize(x, fmt, block=block, rounding="stochastic", seed=5, stream=3)) > 0.2
    # the scales do not depend on the rounding
    assert torch.equal(quantize(x, fmt, block=block).scales, a.scales)


def test_sr_same_bytes_reference_and_cpu(cpu_ext, monkeypatch):
    """Through the public API, the CPU extension and the reference draw the same random bits."""
    x = gauss((33, 47), 2, dtype=torch.bfloat16)
    out = {}
    for name in ("cpu", "reference"):
        monkeypatch.setenv("FP4OFFLOAD_BACKEND", name)
        out[name] = [quantize(x, f, block=b, rounding="stochastic", seed=77, stream=9).data
                     for f, b in (("nvfp4", "1x16"), ("nvfp4", "16x16"), ("mxfp4", None))]
    for a, b in zip(out["cpu"], out["reference"]):
        assert torch.equal(a, b)


def test_sr_keeps_exact_values(backend):
    """A value already on the grid never moves, whatever the random bits."""
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    x = torch.cat([torch.tensor([2688.0] + [0.0] * 15), torch.tensor([6.0]), vals]).repeat(1)
    for seed in range(20):
        assert torch.equal(dequantize(quantize(x, "nvfp4", rounding="stochastic", seed=seed))[16:], x[16:])


# ==== 4. error bounds =======================================================================================


def _element_unit(p: PackedTensor, x: torch.Tensor) -> torch.Tensor:
    """Per element: the decoded size of one E2M1 unit, scale_b * s_dec (NVFP4) or 2^e (MX), float64."""
    n = x.numel()
    if p.format in ("mxfp4", "mxfp8"):
        s = torch.exp2(p.scales.double() - 127)
        return s.repeat_interleave(32)[:n].view(x.shape)
    S = E4M3[p.scales.long()] * p.tensor_scale.double()[0]
    if p.block == "1x16":
        return S.repeat_interleave(16)[:n].view(x.shape)
    rows, cols = x.shape
    R, C = -(-rows // 16), -(-cols // 16)
    return S.view(R, C).repeat_interleave(16, 0).repeat_interleave(16, 1)[:rows, :cols]


def _half_step(y: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid step around |y|: 0.25 up to 2, 0.5 up to 4, 1 above (clipping up to 6.4 included)."""
    return torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0)).double()


@pytest.mark.parametrize("block", ["1x16", "16x16"])
def test_nvfp4_error_bound_every_element(block, backend):
    """Round-trip error of NVFP4 on Gaussian data, element by element.

    Derivation. Let s = s_dec (fp32 tensor scale), S = the E4M3 block scale and u = S * s the decoded
    size of one E2M1 unit. The encoder maps x to y = x / u (up to one fp32 rounding) and rounds y to
    the nearest E2M1 value after clamping to +-6; decoding returns value * u. For a normal E4M3 scale,
    S >= (amax_b / 6 * s_enc) * (1 - 2^-4) (3 mantissa bits: relative rounding <= 2^-4), so
    |y| <= 6 / (1 - 2^-4) = 6.4 and the clip error (|y| - 6 <= 0.4) never exceeds the half-step 1
    of the top binade. Hence per element
        |x - dec| <= h(|y|) * u * (1 + 2^-20),  h = 0.25 for |y| <= 2, 0.5 for |y| <= 4, else 1,
    where the 2^-20 covers the fp32 roundings of the multiplier, the product and the decode.
    Relative to the block's amax the error is at most 1/6 (about 17%); the RMS relative error on
    Gaussian data is about 0.1 (asserted within [0.07, 0.13], printed).
    """
    x = gauss((256, 384), 3, scale=2.0)
    p = quantize(x, "nvfp4", block=block)
    dec = dequantize(p).double()
    xd = x.double()
    # the scales are what the recipe says: s_dec ~ amax / 2688, S within E4M3 rounding of its target
    amax = float(x.abs().max())
    assert abs(float(p.tensor_scale[0]) - amax / 2688) <= 1e-6 * amax / 2688
    S = E4M3[p.scales.long()]
    assert bool((S >= 2.0 ** -6).all()), "precondition: every block scale is a normal E4M3 value"
    u = _element_unit(p, x)
    y = xd.abs() / u
    assert float(y.max()) <= 6.4
    bound = _half_step(y) * u * (1 + 2.0 ** -20)
    err = (dec - xd).abs()
    assert bool((err <= bound).all()), f"{int((err > bound).sum())} elements above the bound"
    assert float((err / bound).max()) > 0.95  # the bound is attained, not loose
    rms = float((dec - xd).norm() / xd.norm())
    print(f"nvfp4 {block} RMS relative error on Gaussian data: {rms:.4f}")
    assert 0.07 <= rms <= 0.13


def test_mx_error_bounds_and_mxfp8_tighter(backend):
    """MXFP4 (rceil: |y| <= 6, nothing clips): |err| <= h(|y|) * 2^e. MXFP8 (E4M3 elements):
    |err| <= 2^-4 * |x| for normal E4M3 y, <= 2^-10 * 2^e below; its RMS error is < 1/4 of MXFP4's."""
    x = gauss((128, 256), 4)
    xd = x.double()
    p4 = quantize(x, "mxfp4")
    u = _element_unit(p4, x)
    y = xd.abs() / u
    assert float(y.max()) <= 6.0
    d4 = dequantize(p4).double()
    assert bool(((d4 - xd).abs() <= _half_step(y) * u).all())
    p8 = quantize(x, "mxfp8")
    u8 = _element_unit(p8, x)
    d8 = dequantize(p8).double()
    y8 = xd.abs() / u8
    bound8 = torch.where(y8 >= 2.0 ** -6, 2.0 ** -4 * xd.abs(), 2.0 ** -10 * u8)
    assert bool(((d8 - xd).abs() <= bound8).all())
    r4 = float((d4 - xd).norm() / xd.norm())
    r8 = float((d8 - xd).norm() / xd.norm())
    print(f"RMS relative error on Gaussian data: mxfp4 {r4:.4f}, mxfp8 {r8:.4f}")
    assert r8 < r4 / 4


def _representable(kind: str, seed: int):
    """A tensor whose every element is value(code) * block scale * tensor scale with exact scales.

    Returns (x, codes, scale codes, tensor scales or None)."""
    g = torch.Generator().manual_seed(seed)
    ri = lambda lo, hi, n: torch.randint(lo, hi, (n,), generator=g)  # noqa: E731
    if kind in ("mxfp4", "mxfp8"):
        nb = 40
        e = ri(-100, 100, nb)
        if kind == "mxfp4":
            codes = ri(0, 16, nb * 32).view(nb, 32)
            codes[:, 0] = torch.where(ri(0, 2, nb) > 0, 7, 15)
            vals = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)[codes]
        else:
            codes = ri(0, 256, nb * 32).view(nb, 32)
            codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # no NaN
            codes[:, 0] = torch.where(ri(0, 2, nb) > 0, 0x7E, 0xFE)
            vals = E4M3[codes]
        x = (vals * torch.exp2(e.double())[:, None]).float().reshape(-1)
        return x, codes.reshape(-1), (e + 127), None
    ufp4 = kind == "ufp4"
    tile = kind == "nvfp4-16x16"
    nb = 48
    scodes = ri(1, 0x7F, nb)
    ks = [-5]
    if kind == "nvfp4-scope":  # scope of 4 blocks, each with its own power-of-two tensor scale
        ks = ri(-20, 20, nb // 4).tolist()
        scodes[::4] = 0x7E
    else:
        scodes[0] = 0x7E  # the block holding the tensor amax has scale 448
    top = 15 if ufp4 else 7
    width = 256 if tile else 16
    codes = ri(0, 16, nb * width).view(nb, width)
    codes[:, 0] = top if ufp4 else torch.where(ri(0, 2, nb) > 0, 7, 15)
    table = [ufp4_value(c) if ufp4 else e2m1_value(c) for c in range(16)]
    vals = torch.tensor(table, dtype=torch.float64)[codes]
    kk = torch.tensor(ks, dtype=torch.float64).repeat_interleave(nb // len(ks))
    blocks = vals * E4M3[scodes][:, None] * torch.exp2(kk)[:, None]
    if tile:  # 48 tiles as a (64, 192) matrix: tile (R, C) row-major over a 4 x 12 grid
        x = blocks.view(4, 12, 16, 16).permute(0, 2, 1, 3).reshape(64, 192).float()
        codes_rm = codes.view(4, 12, 16, 16).permute(0, 2, 1, 3).reshape(-1)
        return x, codes_rm, scodes, [2.0 ** ks[0]]
    return blocks.float().reshape(-1), codes.reshape(-1), scodes, [2.0 ** k for k in ks]


@pytest.mark.parametrize("kind", ["nvfp4", "nvfp4-16x16", "nvfp4-scope", "ufp4", "mxfp4", "mxfp8"])
def test_representable_values_round_trip_exactly(kind, backend):
    x, codes, scodes, ts = _representable(kind, 7)
    fmt = kind.split("-")[0]
    kw = {"block": "16x16"} if kind == "nvfp4-16x16" else {"scale_scope": 64} if kind == "nvfp4-scope" else {}
    p = quantize(x, fmt, **kw)
    assert p.scales.tolist() == scodes.tolist()
    if ts is not None:
        assert p.tensor_scale.tolist() == ts
    assert torch.equal(codes_of(p)[: codes.numel()], codes)
    d = dequantize(p)
    assert torch.equal(d.view(torch.int32), x.view(torch.int32))  # bit for bit, -0 included


# ==== 5. non-finite input ===================================================================================

NF_CASES = [("nvfp4", {}), ("nvfp4", {"block": "16x16"}), ("nvfp4", {"scale_scope": 128}), ("ufp4", {}),
            ("mxfp4", {}), ("mxfp8", {}), ("mxfp4", {"scale_mode": "floor"})]


def _with_nonfinite(fmt: str, dtype=torch.float32):
    x = gauss((48, 40), 8).to(dtype)
    if fmt == "ufp4":
        x = x.abs()
    bad = {(3, 5): float("nan"), (20, 33): float("inf"), (47, 0): float("nan" if fmt == "ufp4" else "-inf")}
    for (r, c), v in bad.items():
        x[r, c] = v
    return x


def _block_of(fmt, kw, shape):
    rows, cols = shape
    idx = torch.arange(rows * cols).view(rows, cols)
    if kw.get("block") == "16x16":
        C = -(-cols // 16)
        return (idx // cols // 16) * C + (idx % cols) // 16
    return idx // (32 if fmt.startswith("mx") else 16)


@pytest.mark.parametrize("fmt,kw", NF_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_raise(fmt, kw, dtype, backend):
    x = _with_nonfinite(fmt, dtype)
    with pytest.raises(NonFiniteError) as ei:
        quantize(x, fmt, name="layers.3.mlp.weight", **kw)
    e = ei.value
    assert e.name == "layers.3.mlp.weight" and e.count == 3
    assert "layers.3.mlp.weight" in str(e) and " 3 " in str(e)
    with pytest.raises(NonFiniteError, match="'x'"):
        quantize(x, fmt, **kw)  # default name


@pytest.mark.parametrize("fmt,kw", NF_CASES)
def test_nonfinite_propagate(fmt, kw, backend):
    """The blocks holding Inf/NaN decode to NaN in full; every other block is byte-identical to a clean
    encode of the same values (non-finite replaced by 0, which leaves the tensor scale unchanged)."""
    x = _with_nonfinite(fmt)
    clean = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    p = quantize(x, fmt, nonfinite="propagate", **kw)
    pc = quantize(clean, fmt, **kw)
    if p.tensor_scale is not None:
        assert torch.equal(p.tensor_scale, pc.tensor_scale)
    blk = _block_of(fmt, kw, x.shape)
    bad_blocks = torch.unique(blk[~torch.isfinite(x)])
    assert bad_blocks.numel() == 3
    nan_code = E8M0_NAN if fmt.startswith("mx") else E4M3_NAN
    is_bad = torch.zeros(p.scales.numel(), dtype=torch.bool)
    is_bad[bad_blocks] = True
    assert bool((p.scales[is_bad] == nan_code).all())
    assert torch.equal(p.scales[~is_bad], pc.scales[~is_bad])
    d, dc = dequantize(p), dequantize(pc)
    in_bad = is_bad[blk]
    assert bool(torch.isnan(d[in_bad]).all())
    assert torch.equal(d[~in_bad], dc[~in_bad]) and bool(torch.isfinite(d[~in_bad]).all())
    # the codes of the clean blocks match too (storage order: flat for 1x16/MX, padded row-major for 16x16)
    if kw.get("block") != "16x16":
        per = 32 if fmt.startswith("mx") else 16
        keep = (~is_bad).repeat_interleave(per)
        assert torch.equal(codes_of(p)[keep], codes_of(pc)[keep])


# ==== 6. API ================================================================================================

FORMATS = [("nvfp4", "1x16"), ("nvfp4", "16x16"), ("mxfp4", None), ("mxfp8", None), ("ufp4", None)]
SHAPES = [(), (0,), (1,), (7,), (33,), (0, 5), (5, 0), (3, 5, 7), (2, 3, 4, 17)]


def _src(shape, fmt, dtype=torch.float32, seed=0):
    x = gauss(shape, seed, scale=3.0, dtype=torch.float32)
    return (x.abs() if fmt == "ufp4" else x).to(dtype)


@pytest.mark.parametrize("fmt,block", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_any_shape(fmt, block, shape, backend):
    x = _src(shape, fmt)
    p = quantize(x, fmt, block=block)
    assert p.shape == x.shape and p.format == fmt and p.block == (block or p.block)
    d = dequantize(p)
    assert d.shape == x.shape and d.dtype == x.dtype
    if x.numel():
        # coarse: within a quarter of the tensor amax (the exact bounds are tested above)
        assert float((d.float() - x.float()).abs().max()) <= float(x.abs().max()) / 4 + 1e-6
        # the same bytes as the flattened tensor where the layout is flat
        if block != "16x16":
            q = quantize(x.reshape(-1), fmt, block=block)
            assert torch.equal(q.data, p.data) and torch.equal(q.scales, p.scales)


@pytest.mark.parametrize("fmt,block", FORMATS)
def test_non_contiguous(fmt, block, backend):
    base = _src((40, 34), fmt, seed=1)
    views = [base.t(), base[::2], base[:, 1:], base[3:, ::3], base[:1].expand(8, 34), base.t()[5]]
    for v in views:
        assert not v.is_contiguous() or v.dim() == 1
        p, q = quantize(v, fmt, block=block), quantize(v.contiguous(), fmt, block=block)
        assert torch.equal(p.data, q.data) and torch.equal(p.scales, q.scales)
        d = dequantize(p)
        assert d.shape == v.shape and torch.equal(d, dequantize(q))


@pytest.mark.parametrize("fmt,block", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(fmt, block, dtype, backend):
    """bf16/fp16 sources encode exactly like their (exact) fp32 widening, and decode back to their dtype."""
    x = _src((17, 40), fmt, dtype=dtype, seed=2)
    p = quantize(x, fmt, block=block)
    q = quantize(x.float(), fmt, block=block)
    assert torch.equal(p.data, q.data) and torch.equal(p.scales, q.scales)
    assert p.dtype == dtype
    d = dequantize(p)
    assert d.dtype == dtype and torch.equal(d, dequantize(q).to(dtype))


@pytest.mark.parametrize("fmt,block", FORMATS)
def test_dequantize_dtype(fmt, block, backend):
    x = _src((9, 50), fmt, seed=3)
    p = quantize(x, fmt, block=block)
    d32 = dequantize(p, torch.float32)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        d = dequantize(p, dt)
        assert d.dtype == dt and d.shape == x.shape
        assert torch.equal(d, d32.to(dt))
    assert torch.equal(p.dequantize(torch.bfloat16), d32.to(torch.bfloat16))
    assert torch.equal(p.to("cpu").dequantize(), d32)


def _config_error(fn, key: str, *mentions: str):
    with pytest.raises(ConfigError) as ei:
        fn()
    assert ei.value.key == key, (ei.value.key, str(ei.value))
    for m in mentions:
        assert m in str(ei.value), (m, str(ei.value))
    return ei.value


def test_bad_arguments():
    x = torch.randn(64)
    _config_error(lambda: quantize(x, "fp4"), "fmt", "'fp4'", "'nvfp4'", "'mxfp4'", "'mxfp8'", "'ufp4'")
    _config_error(lambda: quantize(x, "nvfp4", block="1x32"), "block", "'1x16'", "'16x16'")
    _config_error(lambda: quantize(x, "mxfp4", block="16x16"), "block", "'1x32'")
    _config_error(lambda: quantize(x, "ufp4", block="16x16"), "block", "'1x16'")
    _config_error(lambda: quantize(x, "nvfp4", rounding="up"), "rounding", "'nearest'", "'stochastic'")
    _config_error(lambda: quantize(x.abs(), "mxfp8", rounding="stochastic"), "rounding", "'nearest'")
    assert quantize(x.abs(), "ufp4", rounding="stochastic").format == "ufp4"  # sqrt(v)'s rounding: allowed
    for dt in (torch.int32, torch.int8, torch.uint8, torch.complex64, torch.bool, torch.float64):
        _config_error(lambda: quantize(torch.zeros(4, dtype=dt)), "x.dtype", "torch.float32", "torch.bfloat16")
    for scope in (24, 0, -16, 8, True, 16.0):
        _config_error(lambda: quantize(x, "nvfp4", scale_scope=scope), "scale_scope", "multiple of 16")
    _config_error(lambda: quantize(x, "nvfp4", block="16x16", scale_scope=256), "scale_scope", "1x16")
    _config_error(lambda: quantize(x, "mxfp4", scale_scope=64), "scale_scope")
    _config_error(lambda: quantize(x, nonfinite="ignore"), "nonfinite", "'raise'", "'propagate'")
    _config_error(lambda: quantize(x, "mxfp4", scale_mode="ceil"), "scale_mode", "'rceil'", "'floor'")
    _config_error(lambda: quantize(torch.empty(16, device="meta")), "x.device", "cpu", "cuda")
    _config_error(lambda: quantize([1.0, 2.0]), "x", "torch.Tensor")
    e = _config_error(lambda: quantize(torch.tensor([0.5, -1e-9]), "ufp4", name="exp_avg_sq"), "exp_avg_sq",
                      "non-negative")
    assert "ufp4" in str(e)
    _config_error(lambda: quantize(torch.tensor([0.5, -1e-9]), "ufp4"), "x")
    p = quantize(x)
    _config_error(lambda: dequantize(p, torch.int32), "dtype", "torch.float32")
    _config_error(lambda: dequantize(x), "packed", "PackedTensor")


@pytest.mark.parametrize("fmt,block,per_elem", [("nvfp4", "1x16", 0.5625), ("nvfp4", "16x16", 0.5 + 1 / 256),
                                                ("mxfp4", None, 0.53125), ("mxfp8", None, 1.03125),
                                                ("ufp4", None, 0.5625)])
def test_nbytes(fmt, block, per_elem):
    for shape in ((3, 7), (1024, 1024)):
        p = quantize(_src(shape, fmt), fmt, block=block)
        assert p.nbytes == sum(t.numel() * t.element_size() for t in p.tensors().values())
        assert set(p.tensors()) == ({"data", "scales"} if fmt.startswith("mx") else {"data", "scales", "tensor_scale"})
    assert abs(p.nbytes / (1024 * 1024) - per_elem) < 1e-5
    assert layout.bytes_per_element(fmt, block) == per_elem  # the planner's sizes are these
    # against bf16: 3.56x smaller for nvfp4 1x16
    if (fmt, block) == ("nvfp4", "1x16"):
        assert abs(2 / (p.nbytes / 2 ** 20) - 3.5556) < 1e-3


@pytest.mark.parametrize("fmt,block,scope", [("nvfp4", "1x16", 0), ("nvfp4", "1x16", 1024), ("ufp4", "1x16", 48),
                                             ("nvfp4", "16x16", 0), ("mxfp4", "1x32", 0), ("mxfp8", "1x32", 0)])
@pytest.mark.parametrize("shape", [(0,), (1,), (17,), (5, 33), (40, 100), (3, 1024)])
def test_layout_sizes_are_what_quantize_allocates(fmt, block, scope, shape):
    p = quantize(_src(shape, fmt), fmt, block=block, scale_scope=scope or None)
    sizes = layout.packed_sizes(fmt, block, shape, scope)
    assert (p.data.numel(), p.scales.numel()) == (sizes.data, sizes.scales)
    assert (0 if p.tensor_scale is None else p.tensor_scale.numel()) == sizes.tensor_scales
    assert p.nbytes == sizes.nbytes
    assert p.rows_cols == layout.rows_cols(shape) == ((math.prod(shape[:-1]) if shape[-1] else 0), shape[-1])


def test_bytes_per_element_with_a_scope():
    # m and sqrt(v) of FP4AdamW: 4-bit codes, an E4M3 scale per 16, an fp32 scale per 1024 elements
    assert layout.bytes_per_element("nvfp4", "1x16", 1024) == 0.5 + 1 / 16 + 4 / 1024 == 0.56640625
    p = quantize(_src((8 * 1024,), "ufp4"), "ufp4", scale_scope=1024)
    assert p.nbytes / p.numel == layout.bytes_per_element("ufp4", "1x16", 1024)
    for bad in [("nvfp4", "16x16", 1024), ("mxfp4", "1x32", 64), ("nvfp4", "1x16", 24), ("nvfp4", "1x32", 0),
                ("fp8", None, 0)]:
        with pytest.raises(ValueError):
            layout.bytes_per_element(*bad)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 16, 33])
def test_reference_nibble_packing(n):
    codes = torch.arange(n) * 7 % 16
    data = reference.pack_nibbles(codes)
    expect = [int(codes[i]) | ((int(codes[i + 1]) if i + 1 < n else 0) << 4) for i in range(0, n, 2)]
    assert data.dtype == torch.uint8 and data.tolist() == expect  # odd tail: high nibble 0
    back = reference.unpack_nibbles(data)
    assert back[:n].tolist() == codes.tolist() and back[n:].tolist() == [0] * (len(back) - n)


_CODEC_SIDE = ["fp4offload.formats.layout", "fp4offload.formats.packed", "fp4offload.formats", "fp4offload._codec"]


@pytest.mark.parametrize("first", _CODEC_SIDE)
def test_each_module_imports_first_in_a_fresh_interpreter(first):
    code = (f"import {first}\n"
            "import torch\n"
            "from fp4offload.formats.packed import PackedTensor\n"
            "from fp4offload._codec import quantize\n"
            "x = torch.linspace(-3, 3, 64)\n"
            "p = quantize(x)\n"
            "assert isinstance(p, PackedTensor) and torch.equal(p.dequantize(), p.dequantize(torch.float32))\n"
            "assert (p.dequantize() - x).abs().max() < 0.5\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_formats_import_nothing_from_the_codec():
    """formats/ sits below fp4offload._codec: no module of it imports codec, at the top or inside a function."""
    root = Path(fp4offload.formats.__file__).parent
    for f in root.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
                assert not any(n == "codec" or n.endswith(".codec") for n in names), (f.name, names)
            elif isinstance(node, ast.Import):
                assert not any(a.name.endswith("codec") for a in node.names), f.name


def test_sr_rule_edges():
    """The stochastic rule at its edges (fixed-point grid position + the top 22 random bits, docs/design.md 3.9 as
    docs/numerics.md states it): grid values never move whatever the bits; a point p of the way to the
    next value rounds up for exactly the bit patterns whose top 22 bits reach (1 - p) * 2^22; 6 stays 6."""
    from fp4offload.formats import bits as B

    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    ones = torch.full((8,), 0xFFFFFFFF, dtype=torch.int64)
    assert B.e2m1_encode_magnitude_sr(grid, ones).tolist() == list(range(8))
    assert B.e2m1_encode_magnitude_sr(grid, torch.zeros(8, dtype=torch.int64)).tolist() == list(range(8))
    # a quarter of the way from each value to the next (exact in fp32): up iff rnd >> 10 >= 3/4 * 2^22
    a = grid[:7] + (grid[1:] - grid[:7]) / 4
    edge = 3 << 20
    below = torch.full((7,), ((edge - 1) << 10) | 0x3FF, dtype=torch.int64)
    at = torch.full((7,), edge << 10, dtype=torch.int64)
    assert B.e2m1_encode_magnitude_sr(a, below).tolist() == list(range(7))
    assert B.e2m1_encode_magnitude_sr(a, at).tolist() == list(range(1, 8))
    # below 2^-23 of a step the fraction truncates to 0: never up (the rule's only bias, < 2^-22 of a step)
    tiny = torch.tensor([2.0 ** -24, 0.5 + 2.0 ** -24])  # both exact in fp32
    assert tiny[1].item() != 0.5
    assert B.e2m1_encode_magnitude_sr(tiny, ones[:2]).tolist() == [0, 1]
