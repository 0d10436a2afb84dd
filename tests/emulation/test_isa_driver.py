"""The host kernels give the same bytes on every instruction set, ARM included, proven here without ARM hardware.

tests/emulation/isa_driver/driver.cpp runs the fused step (every v format and rounding, fp32 and bf16 gradients, decay,
maximize, the bf16 copy, special values, tails shorter than a vector or a block), the split and bf16 masters and
the codec rules, on the scalar path and on its build's vector path, and prints a digest of every output byte
per case. The x86 scalar build is the reference (its step is the path the torch reference step is tested against,
and its codec digests are checked here against the torch reference codec);
the AVX2 build and the AVX-512 build of the SIMD layer run natively, the aarch64 builds (NEON; SVE, vector-length
agnostic) under qemu-aarch64-static at 128, 256 and 512 bits and on a NEON-only CPU model."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from helpers.extensions import skip_or_fail

from fp4offload._ops import cpu_isa
from fp4offload._ops.build import csrc_dir

DRIVER = Path(__file__).parent / "isa_driver" / "driver.cpp"
INSTALL = "apt-get install -y qemu-user-static g++-aarch64-linux-gnu"
# the flags of the extension builds (fp4offload/_ops/build.py): no fast math, no FMA contraction
CFLAGS = ["-std=c++17", "-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]


def _build(cxx: str, out: Path, flags: list[str]) -> Path:
    subprocess.run([cxx, *CFLAGS, *flags, f"-I{csrc_dir()}", str(DRIVER), "-o", str(out)], check=True,
                   capture_output=True, text=True, timeout=300)
    return out


def _digests(cmd: list[str]) -> dict[tuple[str, str], str]:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    rows = {}
    for line in out.splitlines():
        case, path, digest = line.split()
        rows[(case, path)] = digest
    return rows


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The x86 (or this host's) scalar build's digests, by case."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++ (apt-get install -y g++)")
    exe = _build("g++", tmp_path_factory.mktemp("drv") / "scalar", [])
    rows = _digests([str(exe)])
    assert len(rows) > 100 and all(p in ("scalar", "codec") for _, p in rows)
    return {case: d for (case, _), d in rows.items()}


def _check(rows, reference, vector_name="vector"):
    assert rows, "the driver printed nothing"
    vec = [case for case, p in rows if p == vector_name]
    assert len(vec) >= 100, f"only {len(vec)} vector cases ran"
    bad = [f"{case} ({p})" for (case, p), d in rows.items() if reference.get(case) != d]
    assert not bad, f"{len(bad)} case(s) differ from the x86 scalar reference: {bad[:8]}"


def _fmix32(h):
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _fnv(h: int, data: bytes) -> int:
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


@pytest.mark.parametrize("variant", [0, 1, 2, 3, 12, 13, 15, 16, 18, 19],
                         ids=["nv", "nv-sr", "nv16x16", "nv16x16-sr", "mxfp4", "mxfp4-sr", "mxfp4-floor-sr", "mxfp8",
                              "int2", "int2-sr"])
def test_the_driver_codec_is_the_reference_codec(reference, variant):
    """The driver's codec digests (x86 build) equal the torch reference codec's bytes on the same inputs, so the
    aarch64 builds that match the driver match the reference."""
    import torch

    from fp4offload.formats import reference as ref

    rows, cols = 17, 31
    n = rows * cols
    with np.errstate(over="ignore"):
        i = np.arange(n, dtype=np.uint32)
        seed = np.uint32(rows * 7919 + cols)
        h = _fmix32((seed * np.uint32(0x9E3779B9)) ^ _fmix32(i + np.uint32(0x1234567)))
        h2 = _fmix32(h ^ np.uint32(0xA5A5A5A5))
        e = (np.uint32(127 + 3) - h2 % np.uint32(24)).astype(np.uint32)
        bits = (h & np.uint32(0x80000000)) | (e << np.uint32(23)) | (h & np.uint32(0x7FFFFF))
    x = torch.from_numpy(bits.view(np.float32).copy())
    stochastic, kind = bool(variant & 1), variant >> 1
    d = 0xCBF29CE484222325
    if kind <= 1:
        tile = 16 if kind == 1 else 1
        data, scales, ts, bad = ref.nvfp4_encode(x, rows, cols, tile, 0, False, stochastic, 0xC0DE, 5, False)
        for t in (data, scales, ts.to(torch.float32)):
            d = _fnv(d, t.contiguous().numpy().tobytes())
        d = _fnv(d, int(bad).to_bytes(8, "little"))
        back = ref.nvfp4_decode(data, scales, ts, rows, cols, tile, 0, False, torch.float32)
    elif kind == 9:
        data, scales, ts, bad = ref.int2_encode(x, stochastic, 0xC0DE, 5, True)
        for t in (data, scales, ts.to(torch.float32)):
            d = _fnv(d, t.contiguous().numpy().tobytes())
        d = _fnv(d, int(bad).to_bytes(8, "little"))
        back = ref.int2_decode(data, scales, ts, n, torch.float32)
    else:
        fp8 = kind == 8
        data, scales, bad = ref.mx_encode(x, fp8, kind == 7, stochastic and not fp8, 0xC0DE, 5, False)
        for t in (data, scales):
            d = _fnv(d, t.contiguous().numpy().tobytes())
        d = _fnv(d, int(bad).to_bytes(8, "little"))
        back = ref.mx_decode(data, scales, n, fp8, torch.float32)
    d = _fnv(d, back.contiguous().numpy().tobytes())
    assert reference[f"codec-{rows}x{cols}-v{variant}-s0"] == f"{d:016x}"


def test_the_driver_sees_wrong_bits(tmp_path, reference):
    """The comparison has teeth: with another stochastic-rounding stream, every case that rounds m
    stochastically differs from the reference."""
    src = DRIVER.read_text().replace("a.stream0 = 7;", "a.stream0 = 8;")
    bent = tmp_path / "bent.cpp"
    bent.write_text(src)
    exe = tmp_path / "bent"
    subprocess.run(["g++", *CFLAGS, f"-I{csrc_dir()}", f"-I{DRIVER.parent}", str(bent), "-o", str(exe)], check=True,
                   capture_output=True, timeout=300)
    rows = _digests([str(exe)])
    sr = [case for case, _ in rows if "-m1-" in case and not case.startswith("step-n1-")]  # 1 element: exact
    same = [case for case in sr if rows[(case, "scalar")] == reference[case]]
    assert sr and not same, same


@pytest.mark.skipif(cpu_isa.arch() != "x86" or "avx2" not in cpu_isa.available(), reason="needs an x86 CPU with AVX2")
@pytest.mark.slow  # ~14 s
def test_avx2_build_equals_the_scalar_reference(tmp_path, reference):
    exe = _build("g++", tmp_path / "avx2", [*cpu_isa.row("avx2").flags])
    _check(_digests([str(exe)]), reference)


@pytest.mark.skipif(cpu_isa.arch() != "x86" or "avx512" not in cpu_isa.available(),
                    reason="needs an x86 CPU with AVX-512 F/BW/VL/DQ/VBMI and BMI2")
@pytest.mark.slow  # ~14 s
def test_avx512_layer_build_equals_the_scalar_reference(tmp_path, reference):
    # the driver has no torch, hence none of the hand-scheduled kernels: its vector step is the SIMD-layer step
    # on simd_avx512.h, which FP4_CPU_VEC selects
    exe = _build("g++", tmp_path / "avx512", [*cpu_isa.row("avx512").flags, "-DFP4_CPU_VEC=1"])
    _check(_digests([str(exe)]), reference)


@pytest.fixture(scope="module")
def aarch64(tmp_path_factory):
    """The NEON and SVE builds of the driver (static, for qemu-user)."""
    cxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64-static")
    if cpu_isa.arch() != "x86":
        pytest.skip("cross-builds from x86")
    if cxx is None or qemu is None:
        skip_or_fail(f"needs the aarch64 cross compiler and qemu: {INSTALL}")
    d = tmp_path_factory.mktemp("aarch64")
    return {"qemu": qemu,
            "neon": _build(cxx, d / "neon", ["-static", *cpu_isa.row("neon").flags]),
            "sve": _build(cxx, d / "sve", ["-static", *cpu_isa.row("sve").flags])}


@pytest.mark.slow  # the aarch64 cross builds (~20 s) and qemu
def test_neon_build_under_qemu_equals_x86(aarch64, reference):
    # cortex-a72: ARMv8.0 with NEON and no SVE, so an SVE instruction would fault
    _check(_digests([aarch64["qemu"], "-cpu", "cortex-a72", str(aarch64["neon"])]), reference)


@pytest.mark.parametrize("bits", [128, 256, 512])
@pytest.mark.slow  # the aarch64 cross builds (~20 s) and qemu
def test_sve_build_under_qemu_equals_x86(aarch64, reference, bits):
    cpu = f"max,sve-default-vector-length={bits // 8}"
    _check(_digests([aarch64["qemu"], "-cpu", cpu, str(aarch64["sve"])]), reference)


@pytest.mark.slow  # the aarch64 cross builds (~20 s) and qemu
def test_sve_build_faults_without_sve(aarch64):
    """The SVE build really runs SVE code: on a CPU model without SVE it dies with an illegal instruction."""
    p = subprocess.run([aarch64["qemu"], "-cpu", "cortex-a72", str(aarch64["sve"]), "--vector"], capture_output=True,
                       timeout=600)
    assert p.returncode != 0
