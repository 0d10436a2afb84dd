"""The host kernels give the same bytes on every instruction set, ARM included, proven here without ARM hardware.

tests/isa_driver/driver.cpp runs the fused step (every v format and rounding, fp32 and bf16 gradients, decay,
maximize, the bf16 copy, special values, tails shorter than a vector or a block), the split and bf16 masters and
the codec rules, on the scalar path and on its build's vector path, and prints a digest of every output byte
per case. The x86 scalar build is the reference (its path is the one the torch reference step is tested against);
the AVX2 build runs natively, the aarch64 builds (NEON; SVE, vector-length agnostic) under qemu-aarch64-static
at 128, 256 and 512 bits and on a NEON-only CPU model."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import skip_or_fail

from fp4offload.ops import cpu_isa
from fp4offload.ops.build import csrc_dir

DRIVER = Path(__file__).parent / "isa_driver" / "driver.cpp"
INSTALL = "apt-get install -y qemu-user-static g++-aarch64-linux-gnu"
# the flags of the extension builds (fp4offload/ops/build.py): no fast math, no FMA contraction
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
    assert len(rows) > 100 and all(p == "scalar" for _, p in rows)
    return {case: d for (case, _), d in rows.items()}


def _check(rows, reference, vector_name="vector"):
    assert rows, "the driver printed nothing"
    vec = [case for case, p in rows if p == vector_name]
    assert len(vec) >= 100, f"only {len(vec)} vector cases ran"
    bad = [f"{case} ({p})" for (case, p), d in rows.items() if reference.get(case) != d]
    assert not bad, f"{len(bad)} case(s) differ from the x86 scalar reference: {bad[:8]}"


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
def test_avx2_build_equals_the_scalar_reference(tmp_path, reference):
    exe = _build("g++", tmp_path / "avx2", [*cpu_isa.FLAGS["avx2"]])
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
            "neon": _build(cxx, d / "neon", ["-static", *cpu_isa.FLAGS["neon"]]),
            "sve": _build(cxx, d / "sve", ["-static", *cpu_isa.FLAGS["sve"]])}


def test_neon_build_under_qemu_equals_x86(aarch64, reference):
    # cortex-a72: ARMv8.0 with NEON and no SVE, so an SVE instruction would fault
    _check(_digests([aarch64["qemu"], "-cpu", "cortex-a72", str(aarch64["neon"])]), reference)


@pytest.mark.parametrize("bits", [128, 256, 512])
def test_sve_build_under_qemu_equals_x86(aarch64, reference, bits):
    cpu = f"max,sve-default-vector-length={bits // 8}"
    _check(_digests([aarch64["qemu"], "-cpu", cpu, str(aarch64["sve"])]), reference)


def test_sve_build_faults_without_sve(aarch64):
    """The SVE build really runs SVE code: on a CPU model without SVE it dies with an illegal instruction."""
    p = subprocess.run([aarch64["qemu"], "-cpu", "cortex-a72", str(aarch64["sve"]), "--vector"], capture_output=True,
                       timeout=600)
    assert p.returncode != 0
