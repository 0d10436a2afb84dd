"""The CUDA kernels' logic, run on the CPU under a host emulation, produces the reference's bytes.

No GPU is needed: csrc/cuda/fp4_kernels.cu is compiled with g++ against tests/emulation/cuda_emu/emu.h (CTAs run
in turn, threads as fibers, warp shuffles as lock-step exchanges), and its launchers are called through
ctypes on CPU tensors. This proves the work split, the index arithmetic of every layout, the warp
reductions (including that every shuffle is warp-uniform), the scope reduction modes, the vector and
scalar load/store paths and the launch sequence; the GPU itself is tested by tests/emulation/test_cuda_backend.py.
Every codec test runs twice: with 32-lane warps (NVIDIA) and with 64-lane ones (an AMD wave64, -DFP4_WARP_SIZE=64,
which csrc/cuda/gpu_compat.h turns into the kernels' kWarp and 64-bit lane masks); both must give the reference's
bytes. The fused step runs with 64 lanes on a subset of its cases.
The fused CUDA FP4AdamW step (csrc/cuda/adam_kernels.cu) runs the same way against the reference step,
through tests/unit/test_optim_fused.py's checks, and against the reference and the CPU step together for the
compact masters and for sqrt(v)'s stochastic rounding (the GPU run is tests/emulation/test_optim_cuda.py).
"""

from __future__ import annotations

import ctypes
import itertools
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from helpers.codec_data import codec_data
from helpers.optim_cases import (check_v_rounded_stochastically, clone_packed, run_fused, run_master,
                                 special_grads)
from fp4offload.formats import reference
from fp4offload._optim import reference_step as R

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
EMU = Path(__file__).resolve().parent / "cuda_emu"
DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

_API = r"""
#include "emu.h"
#include "cuda/fp4_kernels.cuh"
extern "C" {
int e_nv_enc(const void* x, int dt, long rows, long cols, long tile, long scope, int ufp4, int sr, unsigned seed,
             unsigned sid, int prop, const float* amax, uint8_t* data, uint8_t* scales, float* ts, float* ws,
             unsigned long long* cnt) {
  return fp4cuda::nvfp4_encode(x, (fp4cuda::DType)dt, rows, cols, tile, scope, ufp4, sr, seed, sid, prop, amax, data,
                               scales, ts, ws, cnt, nullptr);
}
int e_nv_dec(const uint8_t* d, const uint8_t* s, const float* ts, long rows, long cols, long tile, long scope, int ufp4,
             void* out, int dt) {
  return fp4cuda::nvfp4_decode(d, s, ts, rows, cols, tile, scope, ufp4, out, (fp4cuda::DType)dt, nullptr);
}
int e_mx_enc(const void* x, int dt, long n, int fp8, int fl, int sr, unsigned seed, unsigned sid, int prop, uint8_t* d,
             uint8_t* s, unsigned long long* cnt) {
  return fp4cuda::mx_encode(x, (fp4cuda::DType)dt, n, fp8, fl, sr, seed, sid, prop, d, s, cnt, nullptr);
}
int e_mx_dec(const uint8_t* d, const uint8_t* s, long n, int fp8, void* out, int dt) {
  return fp4cuda::mx_decode(d, s, n, fp8, out, (fp4cuda::DType)dt, nullptr);
}
int e_i2_enc(const void* x, int dt, long n, int sr, unsigned seed, unsigned sid, int prop, uint8_t* d, uint8_t* s,
             float* ts, float* ws, unsigned long long* cnt) {
  return fp4cuda::int2_encode(x, (fp4cuda::DType)dt, n, sr, seed, sid, prop, d, s, ts, ws, cnt, nullptr);
}
int e_i2_dec(const uint8_t* d, const uint8_t* s, const float* ts, long n, void* out, int dt) {
  return fp4cuda::int2_decode(d, s, ts, n, out, (fp4cuda::DType)dt, nullptr);
}
long e_divergent() { return emu::S().divergent; }
int e_lanes() { return fp4gpu::kWarp == emu::kLanes ? fp4gpu::kWarp : -1; }
}
"""


def _rewrite_launches(source: str, at_least: int = 8) -> str:
    """`k<<<g, b, s, st>>>(args)` -> `emu::Launch(g, b, s, st)(k, args)`; the codecs have at least 8 launches."""
    out, n = re.subn(r"([\w:]+(?:<\w+>)?)<<<(.*?)>>>\(", r"emu::Launch(\2)(\1, ", source, flags=re.S)
    assert n >= at_least, "fewer kernel launches found than the source has"
    return out


def _emu_library(d: Path, sources: dict[str, str], warp: int = 32) -> ctypes.CDLL:
    """Compiles `sources` (file name -> text) with g++ against emu.h (standing in for the CUDA headers), with
    `warp` lanes to a warp (32: NVIDIA; 64: an AMD wave64)."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ is not on PATH")
    stub = d / "stub"
    stub.mkdir()
    for h in ("cuda_runtime.h", "cuda_runtime_api.h", "cuda_bf16.h", "cuda_fp16.h"):
        (stub / h).write_text('#include "emu.h"\n')
    shutil.copy(EMU / "emu.h", stub / "emu.h")
    for name, text in sources.items():
        (d / name).write_text(text)
    lib = d / "libemu.so"
    cmd = [cxx, "-std=c++17", "-O1", "-fPIC", "-shared", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas",
           "-Wno-unused-function", f"-DFP4_WARP_SIZE={warp}", "-I", str(stub), "-I", str(CSRC),
           "-I", str(CSRC / "cuda"), "-include", "emu.h", *(str(d / name) for name in sources), "-o", str(lib)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ctypes.CDLL(str(lib))


WARPS = [32, 64]
WARP_IDS = ["warp32", "wave64"]


def _codec_library(d: Path, warp: int, source: str | None = None) -> ctypes.CDLL:
    """csrc/cuda/fp4_kernels.cu (or `source`, a changed copy of it) with `warp` lanes, its launchers typed."""
    src = (CSRC / "cuda" / "fp4_kernels.cu").read_text() if source is None else source
    src = src.replace('#include "fp4_kernels.cuh"', '#include "cuda/fp4_kernels.cuh"')
    so = _emu_library(d, {"kernels.cpp": _rewrite_launches(src), "api.cpp": _API}, warp)
    P, Int, L, U = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_uint
    so.e_nv_enc.argtypes = [P, Int, L, L, L, L, Int, Int, U, U, Int, P, P, P, P, P, P]
    so.e_nv_dec.argtypes = [P, P, P, L, L, L, L, Int, P, Int]
    so.e_mx_enc.argtypes = [P, Int, L, Int, Int, Int, U, U, Int, P, P, P]
    so.e_mx_dec.argtypes = [P, P, L, Int, P, Int]
    so.e_i2_enc.argtypes = [P, Int, L, Int, U, U, Int, P, P, P, P, P]
    so.e_i2_dec.argtypes = [P, P, P, L, P, Int]
    so.e_divergent.restype = ctypes.c_long
    assert so.e_lanes() == warp, "the kernels' kWarp is not the emulated warp's width"
    return so


@pytest.fixture(scope="module", params=WARPS, ids=WARP_IDS)
def emu(request, tmp_path_factory):
    return _codec_library(tmp_path_factory.mktemp(f"cuda_emu{request.param}"), request.param)


def _p(t):
    return None if t is None else ctypes.c_void_p(t.data_ptr())


def _cdiv(a, b):
    return -(-a // b)


def nv_encode(so, x, rows, cols, tile, scope, ufp4, sr, seed, sid, prop, amax=None):
    n = rows * cols
    if tile == 16:
        rp, cp = _cdiv(rows, 16) * 16, _cdiv(cols, 16) * 16
        nb, nbytes, nsc = rp * cp // 256, rp * cp // 2, 1
    else:
        nb = _cdiv(n, 16)
        per = scope // 16 if scope else max(nb, 1)
        nbytes, nsc = nb * 8, max(_cdiv(nb, per), 1)
    data = torch.full((nbytes,), 0xAB, dtype=torch.uint8)  # poison: every byte must be written
    scales = torch.full((nb,), 0xCD, dtype=torch.uint8)
    ts, ws, cnt = torch.full((nsc,), 7.0), torch.empty(nsc), torch.full((), 99, dtype=torch.int64)
    rc = so.e_nv_enc(_p(x), DT[x.dtype], rows, cols, tile, scope, ufp4, sr, seed, sid, prop, _p(amax), _p(data),
                     _p(scales), _p(ts), _p(ws), _p(cnt))
    assert rc == 0
    return data, scales, ts, int(cnt)


def nv_decode(so, data, scales, ts, rows, cols, tile, scope, ufp4, dtype):
    out = torch.empty(rows * cols, dtype=dtype)
    assert so.e_nv_dec(_p(data), _p(scales), _p(ts), rows, cols, tile, scope, ufp4, _p(out), DT[dtype]) == 0
    return out


def mx_encode(so, x, fp8, floor, sr, seed, sid, prop):
    nb = _cdiv(x.numel(), 32)
    data = torch.full((nb * (32 if fp8 else 16),), 0xAB, dtype=torch.uint8)
    scales, cnt = torch.full((nb,), 0xCD, dtype=torch.uint8), torch.full((), 99, dtype=torch.int64)
    assert so.e_mx_enc(_p(x), DT[x.dtype], x.numel(), fp8, floor, sr, seed, sid, prop, _p(data), _p(scales),
                       _p(cnt)) == 0
    return data, scales, int(cnt)


def mx_decode(so, data, scales, n, fp8, dtype):
    out = torch.empty(n, dtype=dtype)
    assert so.e_mx_dec(_p(data), _p(scales), n, fp8, _p(out), DT[dtype]) == 0
    return out


def int2_encode(so, x, sr, seed, sid, prop):
    nb = _cdiv(x.numel(), 16)
    data, scales = torch.full((nb * 4,), 0xAB, dtype=torch.uint8), torch.full((nb,), 0xCD, dtype=torch.uint8)
    ts, ws, cnt = torch.full((1,), 7.0), torch.empty(1 + nb), torch.full((), 99, dtype=torch.int64)
    assert so.e_i2_enc(_p(x), DT[x.dtype], x.numel(), sr, seed, sid, prop, _p(data), _p(scales), _p(ts), _p(ws),
                       _p(cnt)) == 0
    return data, scales, ts, int(cnt)


def int2_decode(so, data, scales, ts, n, dtype):
    out = torch.empty(n, dtype=dtype)
    assert so.e_i2_dec(_p(data), _p(scales), _p(ts), n, _p(out), DT[dtype]) == 0
    return out


def _eq(ref, got, what=""):
    if not isinstance(ref, torch.Tensor):
        assert ref == got, (what, ref, got)
        return
    assert ref.dtype == got.dtype and ref.shape == got.shape, (what, ref.dtype, got.dtype, ref.shape, got.shape)
    if ref.is_floating_point():
        nan_r = torch.isnan(ref)
        assert torch.equal(nan_r, torch.isnan(got)), (what, "NaN positions differ")
        ib = torch.int32 if ref.dtype == torch.float32 else torch.int16
        bad = (ref.view(ib) != got.view(ib)) & ~nan_r
    else:
        bad = ref != got
    assert not bool(bad.any()), (what, bad.nonzero()[:8].flatten().tolist())


def _eq_each(ref, got, *what):
    """_eq on each output of an encoder (ref's i-th against got's i-th), named (*what, i)."""
    for i, (a, b) in enumerate(zip(ref, got)):
        _eq(a, b, (*what, i))


_data = codec_data


def _nonfinite(x, variant, nan_at, inf_at, inf):
    """Whether the case is a "...nonfinite" one; if so, x (flat) gets a NaN at nan_at and `inf` at inf_at."""
    prop = variant.endswith("nonfinite")
    if prop:
        x.view(-1)[nan_at] = float("nan")
        x.view(-1)[inf_at] = inf
    return prop


# (shape, variant): 1x16 with whole/per-warp/per-block scopes, tiles with ragged edges, SR, ufp4 (nearest and SR),
# non-finite
NV_CASES = [((0,), "nv"), ((17,), "nv"), ((33, 7), "nv-16x16"), ((130, 257), "nv"), ((130, 257), "nv-16x16"),
            ((5000,), "nv-scope48"), ((5000,), "nv-scope256"), ((40, 100), "nv-scope4096"), ((2, 3, 50), "nv-sr"),
            ((37, 41), "nv-16x16-sr"), ((1000,), "ufp4-scope64"), ((2, 3, 50), "ufp4-sr"),
            ((5000,), "ufp4-scope256-sr"), ((37, 41), "ufp4-16x16-sr"), ((600,), "nv-nonfinite"),
            ((20, 30), "nv-16x16-nonfinite")]
MX_CASES = [((0,), "mxfp4"), ((33,), "mxfp4"), ((130, 257), "mxfp4-floor"), ((4097,), "mxfp4-sr"),
            ((1000,), "mxfp8"), ((2, 3, 50), "mxfp8-floor"), ((600,), "mxfp4-nonfinite"), ((600,), "mxfp8-nonfinite")]


@pytest.mark.parametrize("dtype", list(DT), ids=str)
@pytest.mark.parametrize("shape,variant", NV_CASES, ids=[f"{v}-{s}" for s, v in NV_CASES])
def test_nvfp4_kernels_match_reference(shape, variant, dtype, emu):
    x = _data(shape, dtype, (shape, variant))
    ufp4 = variant.startswith("ufp4")
    if ufp4:
        x = x.abs()
    prop = _nonfinite(x, variant, 5, -1, float("inf"))
    rows, cols = (x.numel() // shape[-1] if shape[-1] else 0), shape[-1]
    tile = 16 if "16x16" in variant else 1
    scope = int(re.search(r"scope(\d+)", variant).group(1)) if "scope" in variant else 0
    sr = variant.endswith("sr")
    args = (x, rows, cols, tile, scope, ufp4, sr, 1234, 7, prop)
    ref = reference.nvfp4_encode(*args)
    got = nv_encode(emu, *args)
    _eq_each(ref, got, "encode")
    for out_dtype in DT:
        dec = (ref[0], ref[1], ref[2], rows, cols, tile, scope, ufp4, out_dtype)
        _eq(reference.nvfp4_decode(*dec), nv_decode(emu, *dec), ("decode", out_dtype))
    assert emu.e_divergent() == 0


@pytest.mark.parametrize("dtype", list(DT), ids=str)
@pytest.mark.parametrize("shape,variant", MX_CASES, ids=[f"{v}-{s}" for s, v in MX_CASES])
def test_mx_kernels_match_reference(shape, variant, dtype, emu):
    x = _data(shape, dtype, (shape, variant))
    prop = _nonfinite(x, variant, 3, 39, -float("inf"))
    fp8 = variant.startswith("mxfp8")
    args = (x, fp8, "floor" in variant, variant.endswith("sr"), 99, 3, prop)
    ref = reference.mx_encode(*args)
    got = mx_encode(emu, *args)
    _eq_each(ref, got, "encode")
    for out_dtype in DT:
        _eq(reference.mx_decode(ref[0], ref[1], x.numel(), fp8, out_dtype),
            mx_decode(emu, ref[0], ref[1], x.numel(), fp8, out_dtype), ("decode", out_dtype))
    assert emu.e_divergent() == 0


INT2_CASES = [((0,), "int2"), ((17,), "int2"), ((130, 257), "int2"), ((4097,), "int2-sr"), ((2, 3, 50), "int2-sr"),
              ((600,), "int2-nonfinite"), ((600,), "int2-sr-nonfinite")]


@pytest.mark.parametrize("dtype", list(DT), ids=str)
@pytest.mark.parametrize("shape,variant", INT2_CASES, ids=[f"{v}-{s}" for s, v in INT2_CASES])
def test_int2_kernels_match_reference(shape, variant, dtype, emu):
    x = _data(shape, dtype, (shape, variant))
    if x.numel() > 40:
        x.view(-1)[16:32] = 0.0  # a dead block
    prop = _nonfinite(x, variant, 7, 300, float("inf"))
    args = (x, "-sr" in variant, 4321, 5, prop)
    ref = reference.int2_encode(*args)
    _eq_each(ref, int2_encode(emu, *args), "encode")
    for out_dtype in DT:
        _eq(reference.int2_decode(ref[0], ref[1], ref[2], x.numel(), out_dtype),
            int2_decode(emu, ref[0], ref[1], ref[2], x.numel(), out_dtype), ("decode", out_dtype))
    assert emu.e_divergent() == 0


@pytest.mark.parametrize("dtype", list(DT), ids=str)
def test_misaligned_buffers_match_reference(dtype, emu):
    big = _data((2100,), dtype, 3)
    x = big[1:2001]  # contiguous, 2 or 4 bytes past a 16-byte boundary: the element-wise load path
    assert x.data_ptr() % 16 != 0
    for tile, rows, cols in [(1, 1, 2000), (16, 20, 100)]:
        ref = reference.nvfp4_encode(x, rows, cols, tile, 0, False, False, 5, 6, False)
        _eq_each(ref, nv_encode(emu, x, rows, cols, tile, 0, False, False, 5, 6, False), "encode", tile)
        buf = torch.empty(ref[0].numel() + 1, dtype=torch.uint8)
        buf[1:] = ref[0]  # codes at an odd address: the byte-wise code path of the decoders
        _eq(reference.nvfp4_decode(ref[0], ref[1], ref[2], rows, cols, tile, 0, False, dtype),
            nv_decode(emu, buf[1:], ref[1], ref[2], rows, cols, tile, 0, False, dtype), ("decode", tile))
    for fp8 in (False, True):
        ref = reference.mx_encode(x, fp8, False, False, 1, 2, False)
        _eq_each(ref, mx_encode(emu, x, fp8, False, False, 1, 2, False), "mx encode", fp8)


@pytest.mark.parametrize("tile,scope", [(1, 0), (1, 32), (16, 0)])
def test_amax_override_matches_reference(tile, scope, emu):
    x = _data((40, 48), torch.float32, 11)
    nscopes = 1 if not scope else _cdiv(x.numel(), scope)
    amax = torch.full((nscopes,), float(x.abs().max()) * 3.0)
    args = (x, 40, 48, tile, scope, False, False, 0, 0, False)
    ref = reference.nvfp4_encode(*args, amax=amax)
    _eq_each(ref, nv_encode(emu, *args, amax=amax), "encode")
    assert not torch.equal(ref[2], reference.nvfp4_encode(*args)[2])


@pytest.mark.parametrize("n", [1000, 4096 + 17])
def test_ufp4_stochastic_encode_matches_reference(n, emu):
    """ufp4 with stochastic rounding (the second moment's codec): the reference's bytes for several seeds and
    streams (its bits are E2M1's: sr_key(seed, stream, index >> 32), sr_bits at the element's index), different
    from the nearest codes, with the same scales; another seed or stream draws other bits."""
    x = _data((n,), torch.float32, n).abs()
    near = reference.nvfp4_encode(x, 1, n, 1, 1024, True, False, 0, 0, False)
    codes = {}
    for seed, stream in ((1, 0), (0x2545F491, 7), (12345, 65536 * 3 + 1)):
        ref = reference.nvfp4_encode(x, 1, n, 1, 1024, True, True, seed, stream, False)
        got = nv_encode(emu, x, 1, n, 1, 1024, True, True, seed, stream, False)
        _eq_each(ref, got, "ufp4 sr", seed, stream)
        _eq_each(near[1:], got[1:], "ufp4 sr scales", seed, stream)
        assert not torch.equal(got[0], near[0])
        codes[(seed, stream)] = got[0]
    a, b, c = codes.values()
    assert not torch.equal(a, b) and not torch.equal(a, c)
    assert emu.e_divergent() == 0


_PACK_API = r"""
#include "fp4_codec.h"
extern "C" {
void e_pack_codes(const uint8_t* codes, int n, uint8_t* out) { fp4::pack_codes(codes, n, out); }
int e_code_at(const uint8_t* packed, long i) { return fp4::code_at(packed, i); }
unsigned e_word(const uint8_t* codes8) {  // 8 codes into a word through word_slot, then back through word_code
  uint32_t w = 0;
  for (int j = 0; j < 8; ++j) w |= fp4::word_slot(codes8[j], j);
  for (int j = 0; j < 8; ++j)
    if (fp4::word_code(w, j) != codes8[j]) return 0xFFFFFFFFu;
  return w;
}
void e_pack_codes2(const uint8_t* codes, int n, uint8_t* out) { fp4::pack_codes2(codes, n, out); }
int e_code2_at(const uint8_t* packed, long i) { return fp4::code2_at(packed, i); }
unsigned e_word2(const uint8_t* codes16) {  // 16 codes into a word through code2_slot, then back through code2_of
  uint32_t w = 0;
  for (int j = 0; j < 16; ++j) w |= fp4::code2_slot(codes16[j], j);
  for (int j = 0; j < 16; ++j)
    if (fp4::code2_of(w, j) != codes16[j]) return 0xFFFFFFFFu;
  return w;
}
unsigned e_nibbles(unsigned b) { return fp4::crumbs_to_nibbles(b); }
unsigned e_crumbs(unsigned lo, unsigned hi) { return fp4::nibbles_to_crumbs(lo, hi); }
}
"""


def test_codec_header_pack_helpers_match_reference(tmp_path):
    """csrc/fp4_codec.h's packed-layout helpers (which every kernel packs through) give reference.pack_nibbles'
    bytes, an odd tail included, and read them back; a packed word is the 4 bytes read little-endian."""
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ is not on PATH")
    (tmp_path / "pack.cpp").write_text(_PACK_API)
    lib = tmp_path / "libpack.so"
    proc = subprocess.run([cxx, "-std=c++17", "-O1", "-fPIC", "-shared", "-I", str(CSRC), str(tmp_path / "pack.cpp"),
                           "-o", str(lib)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    so = ctypes.CDLL(str(lib))
    so.e_pack_codes.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    so.e_code_at.argtypes = [ctypes.c_void_p, ctypes.c_long]
    so.e_word.argtypes = [ctypes.c_void_p]
    so.e_word.restype = ctypes.c_uint
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 15, 16, 17, 33, 256):
        codes = torch.randint(0, 16, (n,), dtype=torch.uint8, generator=g)
        out = torch.full(((n + 1) // 2,), 0xAB, dtype=torch.uint8)
        so.e_pack_codes(_p(codes), n, _p(out))
        _eq(reference.pack_nibbles(codes), out, ("pack", n))
        assert [so.e_code_at(_p(out), i) for i in range(n)] == codes.tolist()
    codes = torch.randint(0, 16, (8,), dtype=torch.uint8, generator=g)
    assert so.e_word(_p(codes)) == int.from_bytes(bytes(reference.pack_nibbles(codes).tolist()), "little")
    # 2-bit codes: four a byte (pack_codes2, code2_slot/code2_of, code2_at), and a byte of them as the two bytes of the
    # 4-bit layout holding the same four codes (crumbs_to_nibbles) and back (nibbles_to_crumbs)
    so.e_pack_codes2.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    so.e_code2_at.argtypes = [ctypes.c_void_p, ctypes.c_long]
    so.e_word2.argtypes = [ctypes.c_void_p]
    so.e_word2.restype = ctypes.c_uint
    so.e_nibbles.argtypes = [ctypes.c_uint]
    so.e_crumbs.argtypes = [ctypes.c_uint, ctypes.c_uint]
    for n in (4, 16, 64):
        codes = torch.randint(0, 4, (n,), dtype=torch.uint8, generator=g)
        out = torch.full((n // 4,), 0xAB, dtype=torch.uint8)
        so.e_pack_codes2(_p(codes), n, _p(out))
        _eq(reference.pack_codes(codes, 2), out, ("pack2", n))
        assert [so.e_code2_at(_p(out), i) for i in range(n)] == codes.tolist()
    codes = torch.randint(0, 4, (16,), dtype=torch.uint8, generator=g)
    assert so.e_word2(_p(codes)) == int.from_bytes(bytes(reference.pack_codes(codes, 2).tolist()), "little")
    for b in range(256):
        four = reference.unpack_codes(torch.tensor([b], dtype=torch.uint8), 2)
        two = so.e_nibbles(b)
        assert [two & 0xFF, two >> 8] == reference.pack_nibbles(four).tolist(), b
        assert so.e_crumbs(two & 0xFF, two >> 8) == b


def mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """adam_cuda.cpp's mask_positions, op for op: the sorted positions of the set bits of the odd mask."""
    blocks = torch.nonzero(mask).reshape(-1)
    if blocks.numel() == 0:
        return blocks
    words = mask.index_select(0, blocks).to(torch.int32).bitwise_and(0xFFFF)
    bits = words.unsqueeze(1).bitwise_right_shift(torch.arange(16, dtype=torch.int32)).bitwise_and(1)
    rc = torch.nonzero(bits)
    return blocks.index_select(0, rc.select(1, 0)) * 16 + rc.select(1, 1)


@pytest.fixture(scope="module")
def emu_adam(tmp_path_factory):
    """csrc/cuda/adam_kernels.cu (the fused CUDA FP4AdamW step) compiled with g++ against emu.h, with the
    extensions' fused_step and fused_step_master signatures (the latter wrapped as adam_cuda.cpp wraps it), so
    tests/unit/test_optim_fused.py's checks and the compact-master checks below run on it."""
    return _adam_library(tmp_path_factory.mktemp("cuda_emu_adam"), 32)


@pytest.fixture(scope="module")
def emu_adam64(tmp_path_factory):
    """emu_adam with 64-lane warps (an AMD wave64: one warp per CTA of 64 threads)."""
    return _adam_library(tmp_path_factory.mktemp("cuda_emu_adam64"), 64)


def _adam_library(d: Path, warp: int):
    src = _rewrite_launches((CSRC / "cuda" / "adam_kernels.cu").read_text(), at_least=2)
    so = _emu_library(d, {"adam.cpp": src + '\nextern "C" long e_divergent() { return emu::S().divergent; }\n'
                          'extern "C" int e_lanes() { return fp4gpu::kWarp == emu::kLanes ? fp4gpu::kWarp : -1; }\n'},
                      warp)
    assert so.e_lanes() == warp, "the kernels' kWarp is not the emulated warp's width"
    P, Int, U, I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_int64
    so.fp4adam_fused_step_cuda.argtypes = [P, P, Int, I64, P, P, P, P, P, P, P, Int, Int, Int, Int, U, U, P, Int,
                                           P]
    so.fp4adam_fused_step_master_cuda.argtypes = [P, P, P, I64, P, Int, P, Int, I64, P, P, P, P, P, P, P, Int, Int,
                                                  Int, Int, U, U, Int, P]
    so.e_divergent.restype = ctypes.c_long

    def scalars(*xs):
        return torch.tensor(xs, dtype=torch.float32)

    class Ext:
        @staticmethod
        def fused_step(param, grad, mc, ms, mt, vc, vs, vt, b1, omb1, b2, omb2, eps, decay, step_size, rsbc2,
                       weight_decay, maximize, v_kind, m_stochastic, seed, stream0, bf16_out=None,
                       v_stochastic=False):
            sc = scalars(b1, omb1, b2, omb2, eps, decay, step_size, rsbc2)
            rc = so.fp4adam_fused_step_cuda(_p(param), _p(grad), int(grad.dtype == torch.bfloat16), param.numel(),
                                            _p(mc), _p(ms), _p(mt), _p(vc), _p(vs), _p(vt), _p(sc),
                                            int(weight_decay), int(maximize), int(v_kind), int(m_stochastic),
                                            seed & 0xFFFFFFFF, stream0 & 0xFFFFFFFF, _p(bf16_out),
                                            int(v_stochastic), None)
            assert rc == 0 and so.e_divergent() == 0

        @staticmethod
        def fused_step_master(hi, lo, odd, grad, mc, ms, mt, vc, vs, vt, b1, omb1, b2, omb2, eps, decay, step_size,
                              rsbc2, weight_decay, maximize, v_kind, m_stochastic, seed, stream0, mode,
                              v_stochastic=False):
            n = hi.numel()
            nwords, nb = _cdiv(n, 32), _cdiv(n, 16)
            words = torch.full((nwords + 1,), -1, dtype=torch.int32)  # poison: the entry point clears it
            pos = odd.contiguous()
            sc = scalars(b1, omb1, b2, omb2, eps, decay, step_size, rsbc2)
            rc = so.fp4adam_fused_step_master_cuda(
                _p(hi), _p(lo), _p(pos), pos.numel(), _p(words) if mode == 1 else None, mode, _p(grad),
                int(grad.dtype == torch.bfloat16), n, _p(mc), _p(ms), _p(mt), _p(vc), _p(vs), _p(vt), _p(sc),
                int(weight_decay), int(maximize), int(v_kind), int(m_stochastic), seed & 0xFFFFFFFF,
                stream0 & 0xFFFFFFFF, int(v_stochastic), None)
            assert rc == 0 and so.e_divergent() == 0
            if mode == 2 or n == 0:
                return torch.zeros(0, dtype=torch.int64)
            if int(words[nwords]) != 0:
                raise RuntimeError("fused_step_master (cuda): odd must hold increasing positions inside the "
                                   "parameter")
            return mask_positions(words[:nwords].view(torch.int16)[:nb])

    return Ext()


@pytest.mark.parametrize("n", [1, 17, 1024, 5003])
@pytest.mark.parametrize("v_format", ["ue2m2", "ufp4", "nvfp4", "ue2m0"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "sr"])
def test_fused_adam_kernel_matches_reference_step(n, v_format, stochastic, emu_adam):
    run_fused(emu_adam, n, v_format, stochastic, torch.float32)


@pytest.mark.parametrize("n,v_format,stochastic", [(17, "ue2m2", True), (5003, "ufp4", False),
                                                    (3 * 1024 + 7, "nvfp4", True), (1025, "ue2m0", True)])
def test_fused_adam_kernel_with_wave64_matches_reference_step(n, v_format, stochastic, emu_adam64):
    """The fused step with 64-lane warps (one wave64 per CTA: block_max's second warp is gone) stores the
    reference's bytes, with fp32 and bf16 gradients."""
    run_fused(emu_adam64, n, v_format, stochastic, torch.float32)
    run_fused(emu_adam64, n, v_format, stochastic, torch.bfloat16, wd=0.1)


@pytest.mark.parametrize("mode", ["split", "bf16"])
def test_fused_adam_kernel_with_wave64_compact_master_matches_cpu_and_reference(mode, emu_adam64, cpu_ext):
    run_master(_oracles(emu_adam64, cpu_ext), 5003, mode, True, "ufp4", torch.bfloat16, 0.1, steps=2,
               v_stochastic=mode == "bf16")


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "sr"])
def test_fused_adam_kernel_bf16_grads_ragged_size(stochastic, emu_adam):
    """bf16 gradients on a size that is neither a multiple of a block nor of a chunk (the last CTA's last
    thread has 7 elements, the threads after it none)."""
    run_fused(emu_adam, 3 * 1024 + 7, "nvfp4" if stochastic else "ufp4", stochastic, torch.bfloat16, wd=0.1)


@pytest.mark.parametrize("kind", ["overflow", "nonfinite", "zeros"])
def test_fused_adam_kernel_special_values(kind, emu_adam):
    run_fused(emu_adam, 3001, "ue2m2", True, torch.bfloat16, special=special_grads(kind), maximize=True)


# ---- sqrt(v) (or v) with stochastic rounding (v_stochastic) -------------------------------------------------

def _ref_fp32_step(p, g, m, v, sc, *, v_format, m_sr, v_sr, seed, pid, maximize, bf):
    for k, (s0, s1) in enumerate(R.segment_ranges(p.numel())):
        R.packed_step(p[s0:s1], g[s0:s1], R.segment_view(m, s0, s1), R.segment_view(v, s0, s1), sc,
                      v_format=v_format, m_stochastic=m_sr, seed=seed, stream=R.sr_stream(pid, k), maximize=maximize,
                      bf16_out=bf[s0:s1], v_stochastic=v_sr)


def _run_fp32(exts, n, v_format, m_sr, v_sr, gdt, *, wd=0.01, maximize=False, special=None, steps=3, pid=3):
    """`steps` steps of each fused_step in `exts` (name -> extension) and of the reference (packed_step, segment
    by segment) on the same fp32 master; asserts every byte of the weights, their bf16 copy and packed m and v
    agrees after each step. With v_sr, also that v's codes are not those of nearest rounding."""
    g0 = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=g0)
    runs = {name: [p0.clone(), R.empty_packed(n, "cpu"), R.empty_packed(n, "cpu", R.v_bits(v_format))]
            for name in ("ref", *exts)}
    moved = 0
    for t in range(1, steps + 1):
        g = torch.randn(n, generator=g0) * torch.exp(torch.randn(n, generator=g0) * 2)
        if special is not None:
            g = special(g, t)
        g = g.to(gdt)
        sc = R.StepScalars.make(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd, step=t)
        seed = R.sr_seed(7, t)
        kw = dict(v_format=v_format, m_sr=m_sr, seed=seed, pid=pid, maximize=maximize)
        if v_sr:  # the step with v rounded to nearest, from the same start
            p, m, v = runs["ref"]
            near = [p.clone(), clone_packed(m), clone_packed(v)]
            _ref_fp32_step(near[0], g, *near[1:], sc, v_sr=False, bf=torch.empty(n, dtype=torch.bfloat16), **kw)
        bfs = {}
        for name, (p, m, v) in runs.items():
            bfs[name] = bf = torch.empty(n, dtype=torch.bfloat16)
            if name == "ref":
                _ref_fp32_step(p, g, m, v, sc, v_sr=v_sr, bf=bf, **kw)
            else:
                exts[name].fused_step(p, g, *m, *v, sc.b1, sc.omb1, sc.b2, sc.omb2, sc.eps, sc.decay, sc.step_size,
                                      sc.rsbc2, sc.weight_decay, maximize, R.V_KIND[v_format], m_sr, seed,
                                      R.sr_stream(pid, 0), bf, v_stochastic=v_sr)
        ref = runs["ref"]
        nan = ref[0].isnan()  # NaN weights: torch's bf16 cast keeps the payload, the kernels write 0x7FC0
        for name in exts:
            got = runs[name]
            assert torch.equal(ref[0].view(torch.int32), got[0].view(torch.int32)), f"{name}: weights, step {t}"
            assert torch.equal(bfs["ref"][~nan].view(torch.int16), bfs[name][~nan].view(torch.int16)), name
            assert bool(bfs[name][nan].isnan().all()), name
            for what, a, b in zip(("m codes", "m scales", "m chunk scales", "v codes", "v scales",
                                   "v chunk scales"), (*ref[1], *ref[2]), (*got[1], *got[2])):
                assert torch.equal(a, b), f"{name}: {what} differ at step {t} (n={n}, v_stochastic={v_sr})"
        if v_sr:
            moved += check_v_rounded_stochastically(
                ref[2], near[2], [(ref[0].view(torch.int32), near[0].view(torch.int32)), *zip(ref[1], near[1])])
    assert ref[0].nan_to_num().abs().sum() > 0 and ref[1].codes.any()
    assert moved > 0 or not v_sr


# (n, v format, m stochastic, grad dtype, weight decay, maximize): both v formats with m nearest and stochastic,
# ragged sizes (5003 % 16 = 11; 3 * 1024 + 7), bf16 gradients, and two segments once (one step; both keys change
# at the boundary)
V_SR_CASES = [(n, vf, sr, torch.float32, 0.01, False) for n, (vf, sr) in
              zip([17, 1024 + 1, 5003, 5003], itertools.product(["ufp4", "nvfp4"], [False, True]))]
V_SR_CASES += [(3 * 1024 + 7, "ufp4", True, torch.bfloat16, 0.1, True),
               (3 * 1024 + 7, "nvfp4", False, torch.bfloat16, 0.0, False),
               (5003, "ue2m2", False, torch.float32, 0.01, False),
               (3 * 1024 + 7, "ue2m2", True, torch.bfloat16, 0.1, True),
               (R.SEGMENT + 1043, "ue2m2", True, torch.float32, 0.01, False),
               (5003, "ue2m0", True, torch.bfloat16, 0.1, False)]


@pytest.mark.parametrize("n,v_format,m_sr,gdt,wd,maximize", V_SR_CASES,
                         ids=[f"{c[0]}-{c[1]}-m_{'sr' if c[2] else 'nearest'}-{str(c[3])[6:]}" for c in V_SR_CASES])
def test_fused_adam_kernel_v_stochastic_matches_cpu_and_reference(n, v_format, m_sr, gdt, wd, maximize, emu_adam,
                                                                  cpu_ext):
    """v_stochastic: the emulated kernel, the CPU step and the reference store the same bytes (v's bits from
    seed ^ kVSeedXor, m's index), and v's codes are not the nearest ones."""
    _run_fp32(_oracles(emu_adam, cpu_ext), n, v_format, m_sr, True, gdt, wd=wd, maximize=maximize,
              steps=1 if n > R.SEGMENT else 3)


@pytest.mark.parametrize("kind", ["overflow", "zeros"])
def test_fused_adam_kernel_v_stochastic_special_values(kind, emu_adam, cpu_ext):
    """v = Inf in some blocks (their codes are 0, the others still round stochastically) and all-zero blocks."""
    _run_fp32(_oracles(emu_adam, cpu_ext), 3001, "ufp4", True, True, torch.float32, special=special_grads(kind))


# ---- the compact masters (master="split" | "bf16") in the fused CUDA step ------------------------------

@pytest.fixture(scope="module")
def cpu_ext():
    """The CPU extension's fused_step_master as a second oracle, where it builds (else the reference alone)."""
    from fp4offload._optim import fused

    return fused.cpu_extension()


def _oracles(emu_adam, cpu_ext):
    return {"emu": emu_adam, **({"cpu": cpu_ext} if cpu_ext is not None else {})}


_COMBOS = list(itertools.product([False, True], ["ufp4", "nvfp4"], [torch.float32, torch.bfloat16]))
# (n, mode, m stochastic, v format, grad dtype, weight decay): the small sizes take the roundings, v formats and
# grad dtypes in turn (decay off on every other size, so the planted ties in the still blocks survive); 5003
# (five chunks, 5003 % 16 = 11) every combination; two segments (1043 % 16 = 3) once, bf16 with m's stochastic
# rounding, so that both keys change at the segment boundary (one step: the emulation alone takes ~1.5 s; split
# has nothing per segment in the kernel, its mask spans the tensor; tests/emulation/test_optim_cuda.py runs it on a GPU)
MASTER_CASES = [(n, mode, *_COMBOS[(2 * a + b) % 8], 0.1 * (a % 2))
                for a, n in enumerate([1, 17, 1024 + 1]) for b, mode in enumerate(["split", "bf16"])]
MASTER_CASES += [(5003, mode, sr, vf, gdt, 0.0 if gdt == torch.bfloat16 else 0.1)
                 for mode in ("split", "bf16") for sr, vf, gdt in _COMBOS]
MASTER_CASES += [(5003, mode, sr, "ue2m2", torch.float32, 0.1) for mode, sr in (("split", True), ("bf16", False))]
MASTER_CASES += [(R.SEGMENT + 1043, "bf16", True, "ue2m2", torch.bfloat16, 0.0)]
MASTER_CASES += [(5003, "split", True, "ue2m0", torch.float32, 0.1)]


@pytest.mark.parametrize("n,mode,stochastic,v_format,gdt,wd", MASTER_CASES,
                         ids=[f"{c[1]}-{c[0]}-{'sr' if c[2] else 'nearest'}-{c[3]}-{str(c[4])[6:]}-wd{c[5]:g}"
                              for c in MASTER_CASES])
def test_fused_adam_kernel_compact_master_matches_cpu_and_reference(n, mode, stochastic, v_format, gdt, wd,
                                                                     emu_adam, cpu_ext):
    steps = 1 if n > R.SEGMENT else 3
    before, after = run_master(_oracles(emu_adam, cpu_ext), n, mode, stochastic, v_format, gdt, wd, steps=steps)
    if mode == "split":
        assert before >= len(range(0, n, 14))  # every planted tie that rounds down is odd
        if wd == 0:  # the still blocks keep their ties: odd comes out of the kernel too
            assert after >= sum(1 for i in range(0, n, 14) if (i // 16) % 5 == 2) > 0 or n < 48


@pytest.mark.parametrize("mode", ["split", "bf16"])
@pytest.mark.parametrize("kind", ["overflow", "nonfinite"])
def test_fused_adam_kernel_compact_master_special_values(kind, mode, emu_adam, cpu_ext):
    """g^2 overflow (v = Inf in some blocks), non-finite gradients (NaN masters), and infinite and NaN masters
    at the start (an infinite half with a positive residual stays infinite, with a negative one it is finite)."""
    run_master(_oracles(emu_adam, cpu_ext), 5003, mode, mode == "bf16", "ufp4", torch.float32, 0.1,
               special=special_grads(kind))


# (n, mode, m stochastic, v format, grad dtype) with v_stochastic: both masters and v formats, and two segments
# once (bf16 mode: its weight key and both state keys change at the boundary)
V_SR_MASTER_CASES = [(5003, mode, sr, vf, gdt) for mode in ("split", "bf16")
                     for sr, vf, gdt in ((True, "ufp4", torch.float32), (False, "nvfp4", torch.bfloat16),
                                         (True, "ue2m2", torch.bfloat16))]
V_SR_MASTER_CASES += [(R.SEGMENT + 1043, "bf16", True, "ue2m2", torch.bfloat16)]
V_SR_MASTER_CASES += [(5003, "bf16", True, "ue2m0", torch.bfloat16)]


@pytest.mark.parametrize("n,mode,stochastic,v_format,gdt", V_SR_MASTER_CASES,
                         ids=[f"{c[1]}-{c[0]}-m_{'sr' if c[2] else 'nearest'}-{c[3]}-{str(c[4])[6:]}"
                              for c in V_SR_MASTER_CASES])
def test_fused_adam_kernel_compact_master_v_stochastic_matches_cpu_and_reference(n, mode, stochastic, v_format, gdt,
                                                                                 emu_adam, cpu_ext):
    run_master(_oracles(emu_adam, cpu_ext), n, mode, stochastic, v_format, gdt, 0.1,
               steps=1 if n > R.SEGMENT else 3, v_stochastic=True)


def test_fused_adam_kernel_compact_master_v_stochastic_special_values(emu_adam, cpu_ext):
    run_master(_oracles(emu_adam, cpu_ext), 5003, "split", True, "ufp4", torch.float32, 0.1,
               special=special_grads("overflow"), v_stochastic=True)


def test_fused_adam_kernel_compact_master_refuses_bad_odd_positions(emu_adam):
    """Unsorted, repeated or out-of-range odd positions raise, and the step changed nothing."""
    n = 3000
    h = (torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    lo = torch.arange(n, dtype=torch.int16)
    g = torch.randn(n)
    sc = R.StepScalars.make(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1)
    cases = ([5, 3], [7, 7], [n], [-1], [0, 1, 2, n + 100], [10, 2000, 1999])
    for bad in cases:
        m, v = R.empty_packed(n, "cpu"), R.empty_packed(n, "cpu")
        hh, ll = h.clone(), lo.clone()
        with pytest.raises(RuntimeError, match="odd must hold increasing positions"):
            emu_adam.fused_step_master(hh, ll, torch.tensor(bad, dtype=torch.int64), g, *m, *v, sc.b1, sc.omb1,
                                       sc.b2, sc.omb2, sc.eps, sc.decay, sc.step_size, sc.rsbc2, True, False, False,
                                       True, 1, 2, 1)
        assert torch.equal(hh.view(torch.int16), h.view(torch.int16)) and torch.equal(ll, lo)
        assert not any(t.any() for t in (*m, *v))
    print(f"fuzz: {len(cases)} cases of bad odd positions, each refused with nothing changed")


# ---- the warp-size switch itself ----------------------------------------------------------------------

_SHFL_PROBE = r"""
#include "gpu_compat.h"
__global__ void probe(unsigned* out, int narrow) {
  const unsigned v = threadIdx.x;
  out[threadIdx.x] = narrow ? __shfl_xor_sync(0xFFFFFFFFu, v, 1) : fp4gpu::shfl_xor(v, fp4gpu::kWarp / 2);
}
extern "C" long e_probe(unsigned* out, int narrow) {
  emu::S().divergent = 0;
  emu::Launch(1, 128)(probe, out, narrow);
  return emu::S().divergent;
}
"""


@pytest.mark.parametrize("warp", WARPS, ids=WARP_IDS)
def test_emulated_warp_width_and_lane_mask(warp, tmp_path):
    """The switch changes the warp: with 64 lanes, fp4gpu::shfl_xor(v, kWarp / 2) exchanges lanes 32 apart inside
    each 64-lane warp, and a 32-bit lane mask (which leaves half a wave64 out) is counted as divergent; with 32 lanes
    that mask is whole and the exchange is 16 apart."""
    so = _emu_library(tmp_path, {"probe.cpp": _SHFL_PROBE}, warp)
    so.e_probe.restype = ctypes.c_long
    out = torch.zeros(128, dtype=torch.int32)
    assert so.e_probe(_p(out), 0) == 0
    lane = torch.arange(128, dtype=torch.int32)
    assert torch.equal(out, lane ^ (warp // 2))
    assert so.e_probe(_p(out), 1) == (128 if warp == 64 else 0)


def test_wave64_emulation_catches_a_32_lane_leftover(tmp_path):
    """A kernel that still adds its warp's count on every 32nd lane (the tile kernels' lane) after a whole-warp
    sum counts each non-finite element twice with 64 lanes: the wave64 build's count is wrong, the 32-lane one's
    is right, so the 64-lane run is what keeps such a line out of the kernels."""
    src = (CSRC / "cuda" / "fp4_kernels.cu").read_text()
    fixed = "if (threadIdx.x % kWarp == 0 && bad_run) atomicAdd"
    assert src.count(fixed) == 1
    x = _data((20, 30), torch.float32, 7)
    x.view(-1)[[5, 77, 301]] = float("nan")
    want = reference.nvfp4_encode(x, 20, 30, 16, 0, False, False, 0, 0, True)[3]
    assert want == 3
    for warp, ok in ((32, True), (64, False)):
        (tmp_path / f"w{warp}").mkdir()
        so = _codec_library(tmp_path / f"w{warp}", warp, src.replace(fixed, "if (lane == 0 && bad_run) atomicAdd"))
        got = nv_encode(so, x, 20, 30, 16, 0, False, False, 0, 0, True)[3]
        assert (got == want) is ok, (warp, got, want)
