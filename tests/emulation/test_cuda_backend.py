"""The CUDA extension produces exactly the bytes of the torch reference (docs/design.md section 3), on a GPU.

Every case encodes on the device and compares with the reference run on the CPU (the oracle the CPU
backend is verified against too); decoders get the reference's bytes and must return the reference's
values. Non-finite values compare by position (a GPU's NaN payload differs from a CPU's).
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers.codec_data import codec_data, rows_cols

from fp4offload.formats import reference

pytestmark = pytest.mark.gpu

SHAPES = [(0,), (1,), (7,), (16,), (17,), (33,), (1000,), (4097,), (3, 5), (16, 16), (17, 31), (2, 3, 50),
          (64, 48), (130, 257), (3, 1000003 // 3), (257, 1031)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NV_VARIANTS = ["nv-1x16", "nv-16x16", "nv-scope64", "nv-scope48", "nv-scope4096", "nv-sr", "nv-16x16-sr", "ufp4",
               "ufp4-scope64", "ufp4-sr", "ufp4-scope1024-sr", "ufp4-16x16-sr"]
MX_VARIANTS = ["mxfp4", "mxfp4-floor", "mxfp4-sr", "mxfp8", "mxfp8-floor"]


@pytest.fixture(scope="module")
def cu():
    """The CUDA backend module with its extension built (a build failure fails, it does not skip)."""
    from fp4offload._ops import cuda

    cuda.extension()
    return cuda


_data, _rows_cols = codec_data, rows_cols


def _eq(ref, got, what=""):
    """Bitwise equality of a reference result (CPU) and a CUDA result; NaNs compare by position."""
    if not isinstance(ref, torch.Tensor):
        assert ref == got, (what, ref, got)
        return
    got = got.cpu()
    assert ref.dtype == got.dtype and ref.shape == got.shape, (what, ref.dtype, got.dtype, ref.shape, got.shape)
    if ref.is_floating_point():
        nan_r, nan_g = torch.isnan(ref), torch.isnan(got)
        assert torch.equal(nan_r, nan_g), (what, "NaN positions differ")
        ib = torch.int32 if ref.dtype == torch.float32 else torch.int16
        bad = (ref.view(ib) != got.view(ib)) & ~nan_r
        assert not bool(bad.any()), (what, bad.nonzero()[:8].flatten().tolist())
    else:
        bad = ref != got
        assert not bool(bad.any()), (what, bad.nonzero()[:8].flatten().tolist(), ref[bad][:8].tolist(),
                                     got[bad][:8].tolist())


def _nv_args(variant, shape, dtype):
    x = _data(shape, dtype, (shape, variant))
    if variant.startswith("ufp4"):
        x = x.abs()
    rows, cols = _rows_cols(shape)
    tile = 16 if "16x16" in variant else 1
    scope = int(re.search(r"scope(\d+)", variant).group(1)) if "scope" in variant else 0
    return x, rows, cols, tile, scope, variant.startswith("ufp4"), variant.endswith("sr")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", NV_VARIANTS)
def test_nvfp4_bytes_equal(shape, dtype, variant, cu):
    x, rows, cols, tile, scope, ufp4, sr = _nv_args(variant, shape, dtype)
    ref = reference.nvfp4_encode(x, rows, cols, tile, scope, ufp4, sr, 1234, 7, False)
    got = cu.nvfp4_encode(x.cuda(), rows, cols, tile, scope, ufp4, sr, 1234, 7, False)
    for i, (a, b) in enumerate(zip(ref, got)):
        _eq(a, b, ("encode", i))
    for out_dtype in DTYPES:
        dec = (ref[0], ref[1], ref[2], rows, cols, tile, scope, ufp4, out_dtype)
        got_dec = cu.nvfp4_decode(ref[0].cuda(), ref[1].cuda(), ref[2].cuda(), *dec[3:])
        assert got_dec.is_cuda
        _eq(reference.nvfp4_decode(*dec), got_dec, ("decode", out_dtype))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("variant", MX_VARIANTS)
def test_mx_bytes_equal(shape, dtype, variant, cu):
    x = _data(shape, dtype, (shape, variant))
    fp8, floor, sr = variant.startswith("mxfp8"), "floor" in variant, variant.endswith("sr")
    ref = reference.mx_encode(x, fp8, floor, sr, 99, 3, False)
    got = cu.mx_encode(x.cuda(), fp8, floor, sr, 99, 3, False)
    for i, (a, b) in enumerate(zip(ref, got)):
        _eq(a, b, ("encode", i))
    for out_dtype in DTYPES:
        _eq(reference.mx_decode(ref[0], ref[1], x.numel(), fp8, out_dtype),
            cu.mx_decode(ref[0].cuda(), ref[1].cuda(), x.numel(), fp8, out_dtype), ("decode", out_dtype))


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4-16x16", "ufp4", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("propagate", [True, False])
def test_nonfinite_bytes_and_count(fmt, propagate, cu):
    x = _data((20, 30), torch.float32, 5).abs()
    x[0, 20] = float("nan")
    x[3, 10] = float("inf")
    x[3, 11] = -float("inf")
    if fmt.startswith("mx"):
        args = (x, fmt == "mxfp8", False, False, 0, 0, propagate)
        ref, got = reference.mx_encode(*args), cu.mx_encode(x.cuda(), *args[1:])
    else:
        tile = 16 if fmt.endswith("16x16") else 1
        args = (x, 20, 30, tile, 0, fmt == "ufp4", False, 0, 0, propagate)
        ref, got = reference.nvfp4_encode(*args), cu.nvfp4_encode(x.cuda(), *args[1:])
    for i, (a, b) in enumerate(zip(ref, got)):
        _eq(a, b, ("encode", i))
    assert got[-1] == 3
    if propagate:  # the blocks holding them decode to NaN, nothing else does
        if fmt.startswith("mx"):
            dec = cu.mx_decode(got[0], got[1], x.numel(), fmt == "mxfp8", torch.float32).cpu()
        else:
            dec = cu.nvfp4_decode(got[0], got[1], got[2], 20, 30, tile, 0, fmt == "ufp4", torch.float32).cpu()
        assert bool(torch.isnan(dec.view(20, 30)[0, 20])) and bool(torch.isnan(dec.view(20, 30)[3, 10]))
        assert 0 < int(torch.isnan(dec).sum()) < x.numel()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_int2_bytes_equal_reference(dtype, stochastic, cu):
    """int2 (2-bit saved activations): the CUDA kernels' bytes, count and decode are the reference's, with a dead
    block and a non-finite one."""
    x = codec_data((37, 130), torch.float32, 9)
    x.view(-1)[16:32] = 0.0
    x.view(-1)[100] = float("nan")
    x = x.to(dtype)
    args = (stochastic, 11, 3, True)
    ref, got = reference.int2_encode(x, *args), cu.int2_encode(x.cuda(), *args)
    for i, (a, b) in enumerate(zip(ref, got)):
        _eq(a, b, ("encode", i))
    assert got[-1] == 1
    for out_dtype in DTYPES:
        _eq(reference.int2_decode(ref[0], ref[1], ref[2], x.numel(), out_dtype),
            cu.int2_decode(ref[0].cuda(), ref[1].cuda(), ref[2].cuda(), x.numel(), out_dtype), ("decode", out_dtype))


@pytest.mark.parametrize("shape", [(0,), (0, 16), (3, 0)], ids=str)
def test_empty_tensors(shape, cu):
    x = torch.zeros(shape, device="cuda")
    rows, cols = _rows_cols(shape)
    for tile, scope in [(1, 0), (1, 64), (16, 0)]:
        data, scales, ts, count = cu.nvfp4_encode(x, rows, cols, tile, scope, False, False, 0, 0, False)
        assert data.numel() == 0 and scales.numel() == 0 and count == 0
        assert ts.cpu().tolist() == [0.0]
        assert cu.nvfp4_decode(data, scales, ts, rows, cols, tile, scope, False, torch.bfloat16).numel() == 0
    data, scales, count = cu.mx_encode(x, False, False, False, 0, 0, False)
    assert data.numel() == 0 and scales.numel() == 0 and count == 0
    assert cu.mx_decode(data, scales, 0, False, torch.float32).numel() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_misaligned_inputs_take_the_scalar_path_with_the_same_bytes(dtype, cu):
    big = _data((5000,), dtype, 3)
    x = big.cuda()[1:4001]  # contiguous, but 2 or 4 bytes past a 16-byte boundary
    assert x.data_ptr() % 16 != 0
    xc = big[1:4001]
    for tile, rows, cols in [(1, 1, 4000), (16, 40, 100)]:
        ref = reference.nvfp4_encode(xc, rows, cols, tile, 0, False, False, 5, 6, False)
        got = cu.nvfp4_encode(x, rows, cols, tile, 0, False, False, 5, 6, False)
        for i, (a, b) in enumerate(zip(ref, got)):
            _eq(a, b, ("encode", tile, i))
        buf = torch.empty(ref[0].numel() + 1, dtype=torch.uint8, device="cuda")
        buf[1:] = ref[0].cuda()  # codes at an odd address
        _eq(reference.nvfp4_decode(ref[0], ref[1], ref[2], rows, cols, tile, 0, False, dtype),
            cu.nvfp4_decode(buf[1:], ref[1].cuda(), ref[2].cuda(), rows, cols, tile, 0, False, dtype))
    for fp8 in (False, True):
        ref = reference.mx_encode(xc, fp8, False, False, 1, 2, False)
        got = cu.mx_encode(x, fp8, False, False, 1, 2, False)
        for i, (a, b) in enumerate(zip(ref, got)):
            _eq(a, b, ("mx encode", fp8, i))


@pytest.mark.parametrize("tile,scope", [(1, 0), (1, 32), (16, 0)])
def test_amax_override(tile, scope, cu):
    x = _data((40, 48), torch.float32, 11)
    nscopes = 1 if not scope else -(-x.numel() // scope)
    amax = torch.full((nscopes,), float(x.abs().max()) * 3.0)
    args = (x, 40, 48, tile, scope, False, False, 0, 0, False)
    ref = reference.nvfp4_encode(*args, amax=amax)
    got = cu.nvfp4_encode(x.cuda(), *args[1:], amax=amax.cuda())
    for i, (a, b) in enumerate(zip(ref, got)):
        _eq(a, b, ("encode", i))
    assert not torch.equal(ref[2], reference.nvfp4_encode(*args)[2])


@pytest.mark.parametrize("ufp4", [False, True], ids=["e2m1", "ufp4"])
def test_stochastic_rounding_depends_on_seed_and_stream(cu, ufp4):
    x = _data((4096,), torch.float32, 1).cuda()
    if ufp4:
        x = x.abs()
    a = cu.nvfp4_encode(x, 1, 4096, 1, 0, ufp4, True, 1, 0, False)[0]
    assert torch.equal(a, cu.nvfp4_encode(x, 1, 4096, 1, 0, ufp4, True, 1, 0, False)[0])
    assert not torch.equal(a, cu.nvfp4_encode(x, 1, 4096, 1, 0, ufp4, True, 2, 0, False)[0])
    assert not torch.equal(a, cu.nvfp4_encode(x, 1, 4096, 1, 0, ufp4, True, 1, 1, False)[0])
    assert not torch.equal(a, cu.nvfp4_encode(x, 1, 4096, 1, 0, ufp4, False, 1, 0, False)[0])


def test_extremes_bytes_equal(cu):
    vals = [3.4e38, -3.4e38, 1e-40, -1e-45, 1.17e-38, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30, 1e-30]
    x = torch.tensor(vals * 3, dtype=torch.float32)
    for scope in (0, 16):
        args = (x, 1, x.numel(), 1, scope, False, False, 0, 0, False)
        for i, (a, b) in enumerate(zip(reference.nvfp4_encode(*args), cu.nvfp4_encode(x.cuda(), *args[1:]))):
            _eq(a, b, ("nv", scope, i))
    for fp8 in (False, True):
        for floor in (False, True):
            args = (x, fp8, floor, False, 0, 0, False)
            for i, (a, b) in enumerate(zip(reference.mx_encode(*args), cu.mx_encode(x.cuda(), *args[1:]))):
                _eq(a, b, ("mx", fp8, floor, i))


def test_pair_encoder_matches_the_software_rule(cu):
    """On sm_100a+ the kernels' nearest pair encoder is the cvt.e2m1x2 instruction: it must give the codes
    of fp4_codec.h for every input (ties, -0, subnormals, saturation, Inf, NaN); elsewhere both are software."""
    ext = cu.extension()
    bits = torch.arange(0, 1 << 32, 4099, dtype=torch.int64)  # a sweep over every exponent, both signs
    y = (bits - (1 << 31)).to(torch.int32).view(torch.float32)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 0.0, -0.0, 1e-45, -1e-45, float("inf"),
                         -float("inf"), float("nan"), -float("nan")], dtype=torch.float32)
    y = torch.cat([y, ties, -ties, ties * (1 + 2 ** -23), ties * (1 - 2 ** -24)])
    if y.numel() % 2:
        y = torch.cat([y, torch.zeros(1)])
    hw, sw = ext.e2m1_pack_check(y.cuda())
    assert torch.equal(hw, sw)
    major = torch.cuda.get_device_capability()[0]
    assert cu.hardware_e2m1() == (major >= 10)


def test_runs_on_the_current_stream(cu):
    x = _data((1 << 20,), torch.bfloat16, 2)
    ref = reference.nvfp4_encode(x, 1, x.numel(), 1, 0, False, False, 0, 0, False)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        xd = x.cuda(non_blocking=False)
        got = cu.nvfp4_encode(xd, 1, x.numel(), 1, 0, False, False, 0, 0, False)
    side.synchronize()
    for i, (a, b) in enumerate(zip(ref, got)):
        _eq(a, b, ("encode", i))


def test_cuda_tensors_dispatch_to_the_cuda_backend(monkeypatch):
    import fp4offload
    from fp4offload._ops import backend_for, backend_name

    monkeypatch.delenv("FP4OFFLOAD_BACKEND", raising=False)
    assert backend_name("cuda") == "cuda"
    assert backend_for(torch.device("cuda")).NAME == "cuda"
    x = _data((33, 64), torch.bfloat16, 4)
    p = fp4offload.quantize(x.cuda(), "nvfp4", block="16x16")
    assert p.device.type == "cuda" and p.data.is_cuda and p.tensor_scale.is_cuda
    q = fp4offload.quantize(x, "nvfp4", block="16x16")
    assert torch.equal(p.data.cpu(), q.data) and torch.equal(p.scales.cpu(), q.scales)
    back = fp4offload.dequantize(p)
    assert back.is_cuda and back.dtype == torch.bfloat16 and back.shape == x.shape
    assert torch.equal(back.cpu().view(torch.int16), fp4offload.dequantize(q).view(torch.int16))
    monkeypatch.setenv("FP4OFFLOAD_BACKEND", "reference")
    assert backend_name("cuda") == "reference"
