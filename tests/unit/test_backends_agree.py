"""The CPU extension produces exactly the bytes of the torch reference (docs/design.md section 3)."""

import pytest
import torch
from helpers.codec_data import codec_data, rows_cols
from helpers.extensions import CPU_PATHS, cpu_path

from fp4offload.formats import reference
from fp4offload._ops import cpu

SHAPES = [(0,), (1,), (7,), (16,), (17,), (33,), (1000,), (4097,), (3, 5), (16, 16), (17, 31), (2, 3, 50),
          (64, 48), (130, 257)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


_data, _rows_cols = codec_data, rows_cols


@pytest.fixture(params=CPU_PATHS)
def simd(request, monkeypatch, cpu_ext):
    """The codec on each path this CPU has (the vector builds, and the scalar path)."""
    yield from cpu_path(request.param, monkeypatch, cpu.extension)


def _eq(a, b):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        if a.is_floating_point():
            assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                               b.view(torch.int32) if b.dtype == torch.float32 else b)
        else:
            assert torch.equal(a, b)
    else:
        assert a == b


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["nv-1x16", "nv-16x16", "nv-scope", "nv-sr", "nv-16x16-sr", "ufp4", "ufp4-scope",
                                     "ufp4-sr", "ufp4-scope-sr", "ufp4-16x16-sr"])
def test_nvfp4_bytes_equal(shape, dtype, variant, simd):
    x = _data(shape, dtype, (shape, variant))
    if variant.startswith("ufp4"):
        x = x.abs()
    rows, cols = _rows_cols(shape)
    tile = 16 if "16x16" in variant else 1
    scope = 64 if "scope" in variant else 0
    args = (x, rows, cols, tile, scope, variant.startswith("ufp4"), variant.endswith("sr"), 1234, 7, False)
    ref = reference.nvfp4_encode(*args)
    got = cpu.nvfp4_encode(*args)
    for a, b in zip(ref, got):
        _eq(a, b)
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        dec_args = (ref[0], ref[1], ref[2], rows, cols, tile, scope, variant.startswith("ufp4"), out_dtype)
        _eq(reference.nvfp4_decode(*dec_args), cpu.nvfp4_decode(*dec_args))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["mxfp4", "mxfp4-floor", "mxfp4-sr", "mxfp8", "mxfp8-floor"])
def test_mx_bytes_equal(shape, dtype, variant, simd):
    x = _data(shape, dtype, (shape, variant))
    args = (x, variant.startswith("mxfp8"), "floor" in variant, variant.endswith("sr"), 99, 3, False)
    ref = reference.mx_encode(*args)
    got = cpu.mx_encode(*args)
    for a, b in zip(ref, got):
        _eq(a, b)
    dec = (ref[0], ref[1], x.numel(), variant.startswith("mxfp8"), torch.float32)
    _eq(reference.mx_decode(*dec), cpu.mx_decode(*dec))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8", "ufp4"])
def test_nonfinite_propagate_bytes_equal(fmt, simd):
    x = _data((300,), torch.float32, 5).abs()
    x[20] = float("nan")
    x[100] = float("inf")
    x[101] = -float("inf")
    if fmt in ("nvfp4", "ufp4"):
        args = (x, 1, 300, 1, 0, fmt == "ufp4", False, 0, 0, True)
        ref, got = reference.nvfp4_encode(*args), cpu.nvfp4_encode(*args)
    else:
        args = (x, fmt == "mxfp8", False, False, 0, 0, True)
        ref, got = reference.mx_encode(*args), cpu.mx_encode(*args)
    for a, b in zip(ref, got):
        _eq(a, b)
    assert ref[-1] == 3


def test_extremes_bytes_equal(simd):
    """Huge, tiny and subnormal values, and ties on every grid, take the same path in both backends."""
    vals = [3.4e38, -3.4e38, 1e-40, -1e-45, 1.17e-38, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30, 1e-30]
    x = torch.tensor(vals * 3, dtype=torch.float32)
    for scope in (0, 16):
        args = (x, 1, x.numel(), 1, scope, False, False, 0, 0, False)
        for a, b in zip(reference.nvfp4_encode(*args), cpu.nvfp4_encode(*args)):
            _eq(a, b)
    for fp8 in (False, True):
        for floor in (False, True):
            args = (x, fp8, floor, False, 0, 0, False)
            for a, b in zip(reference.mx_encode(*args), cpu.mx_encode(*args)):
                _eq(a, b)


@pytest.mark.parametrize("tile,scope", [(1, 0), (1, 32), (16, 0)])
@pytest.mark.parametrize("factor", [3.0, 0.5], ids=["above", "below"])
@pytest.mark.parametrize("variant", ["nearest", "stochastic", "ufp4", "bf16", "nan-propagate"])
def test_amax_override_bytes_equal(tile, scope, factor, variant, simd):
    """An amax given from outside (e.g. max-reduced across ranks) sets the tensor scale in both backends (the
    CPU encodes in one pass then); below the data's amax the largest values saturate alike."""
    x = _data((40, 48), torch.float32, 11)
    if variant == "bf16":
        x = x.bfloat16()
    if variant == "nan-propagate":
        x[3, 5] = float("nan")
    ufp4 = variant == "ufp4"
    if ufp4:
        x = x.abs()
    nscopes = 1 if not scope else -(-x.numel() // scope)
    amax = torch.full((nscopes,), float(x.float().nan_to_num().abs().max()) * factor)
    args = (x, 40, 48, tile, scope, ufp4, variant == "stochastic", 7, 2, variant == "nan-propagate")
    ref = reference.nvfp4_encode(*args, amax=amax)
    got = cpu.nvfp4_encode(*args, amax=amax)
    for a, b in zip(ref, got):
        _eq(a, b)
    own = reference.nvfp4_encode(*args)
    assert not torch.equal(ref[2], own[2])  # the override really changed the tensor scale
    elem_max = 1.5 if ufp4 else 6.0
    assert torch.allclose(ref[2], (amax / (elem_max * 448.0)), rtol=1e-6)
    assert int(got[3]) == (1 if variant == "nan-propagate" else 0)


def test_overflowing_block_multiplier_bytes_equal(cpu_ext):
    """A clamped tensor scale (subnormal amax) or an amax override of 0 must not turn zeros into NaN."""
    x = torch.tensor([0.0, -0.0, 1e-41, -3e-42] * 8 + [0.0] * 16, dtype=torch.float32)
    for amax in (None, torch.zeros(1)):
        args = (x, 1, x.numel(), 1, 0, False, False, 0, 0, False)
        ref = reference.nvfp4_encode(*args, amax=amax)
        got = cpu.nvfp4_encode(*args, amax=amax)
        for a, b in zip(ref, got):
            _eq(a, b)
        dec = reference.nvfp4_decode(ref[0], ref[1], ref[2], 1, x.numel(), 1, 0, False, torch.float32)
        assert not torch.isnan(dec).any()
    zero = reference.nvfp4_encode(x, 1, x.numel(), 1, 0, False, False, 0, 0, False, amax=torch.zeros(1))
    assert int(zero[1].sum()) == 0 and int(zero[0].sum()) == 0  # amax 0: every scale and code is 0


@pytest.mark.parametrize("scope", [0, 32, 512])
@pytest.mark.parametrize("variant", ["nearest", "stochastic", "ufp4", "ufp4-stochastic"])
def test_grouped_block_paths_bytes_equal(scope, variant, simd):
    """The CPU encodes whole 1x16 blocks 16 and 4 at a time: groups holding dead (all-zero) blocks, a block
    with NaN (propagated), a tiny block, scopes that cut a group, and the ragged end all match the reference."""
    x = _data((4096 + 37,), torch.float32, ("grouped", scope, variant))
    x[16 * 5:16 * 6] = 0.0  # a dead block inside the first group of 16 and the second group of 4
    x[16 * 37:16 * 40] = 0.0  # three dead blocks in one group of 4
    x[16 * 70:16 * 71] *= 1e-30  # a block far below the others: its scale underflows
    x[16 * 200 + 3] = float("nan")  # propagated: that block decodes to NaN, its group goes block by block
    if variant.startswith("ufp4"):
        x = x.abs()
    for propagate, amax in ((True, None), (True, torch.full((1 if not scope else -(-x.numel() // scope),), 3.0))):
        args = (x, 1, x.numel(), 1, scope, variant.startswith("ufp4"), variant.endswith("stochastic"), 99, 5, propagate)
        ref = reference.nvfp4_encode(*args, amax=amax)
        got = cpu.nvfp4_encode(*args, amax=amax)
        for a, b in zip(ref, got):
            _eq(a, b)
        assert int(got[3]) == 1



# (rows, cols): lengths that end inside a row of 16, an MX block of 32, a group of 4 or 16 blocks; 16x16 tiles cut
# by both edges
SR_SHAPES = [(1, 1), (1, 15), (1, 17), (1, 31), (1, 33), (1, 63), (1, 65), (1, 257), (1, 1000), (1, 4096 + 48 + 5),
             (3, 31), (17, 33), (40, 25), (33, 127)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4-16x16", "nvfp4-scope", "ufp4", "mxfp4", "mxfp4-floor"])
def test_stochastic_bytes_equal_for_every_seed_and_tail(fmt, dtype, simd):
    """Stochastic rounding draws fp4::sr_bits(key, element index) lane by lane on the vector paths: for several seeds
    and streams (the key's inputs), tails, and non-finite values (counted; their blocks zero, or NaN-scaled when
    propagated), every path gives the reference's bytes. The bits matter: rounded to nearest, or with another seed,
    the same tensor gives other bytes."""
    mx = fmt.startswith("mxfp4")

    def encode(backend, x, rows, cols, seed, stream, propagate, stochastic=True):
        if mx:
            return backend.mx_encode(x, False, fmt.endswith("floor"), stochastic, seed, stream, propagate)
        tile, scope = (16 if fmt.endswith("16x16") else 1), (64 if fmt.endswith("scope") else 0)
        return backend.nvfp4_encode(x, rows, cols, tile, scope, fmt == "ufp4", stochastic, seed, stream, propagate)

    for rows, cols in SR_SHAPES:
        n = rows * cols
        x = _data((n,), dtype, (fmt, rows, cols))
        if fmt == "ufp4":
            x = x.abs()
        bad = 2 if n > 300 else 0
        if bad:
            x[37] = float("nan")
            x[n - 2] = float("inf")
        for seed, stream in ((0, 0), (1, 2), (0xFFFFFFFF, 77), (123456789, 0xFFFFFFFF)):
            for propagate in ((False, True) if mx else (True,)):  # NVFP4 without propagate raises in the API
                ref = encode(reference, x, rows, cols, seed, stream, propagate)
                got = encode(cpu, x, rows, cols, seed, stream, propagate)
                for a, b in zip(ref, got):
                    _eq(a, b)
                assert int(got[-1]) == bad
        if n >= 1000:
            sr = [encode(cpu, x, rows, cols, seed, 2, True)[0] for seed in (1, 3)]
            assert not torch.equal(sr[0], encode(cpu, x, rows, cols, 1, 2, True, stochastic=False)[0])
            assert not torch.equal(sr[0], sr[1])
