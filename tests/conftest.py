"""Fixtures shared by every folder. tests/ goes on sys.path first, so a test anywhere below imports the shared
modules as ``from helpers.dist import run_ranks`` (tests/helpers is a package)."""

import os
import sys
from pathlib import Path

# Before torch loads its OpenMP runtime: threads that wait sleep instead of spinning. Two test processes, each with
# ranks and intra-op threads, share this machine's cores; spinning threads then take the CPU from the ones with work
# (a one-rank DeepSpeed run beside two busy processes: more than 120 s spinning, 16.5 s passive, 12 s alone).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers.extensions import CPU_PATHS, LIBAIO_FIX, cpu_path, fused_extension, skip_or_fail  # noqa: E402

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fp4offload/torch_extensions"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def cpu_ext():
    """The CPU extension module (built on first use); skips when no compiler is available."""
    from fp4offload._ops import cpu

    try:
        return cpu.extension()
    except Exception as e:  # pragma: no cover - depends on the machine's toolchain
        pytest.skip(f"CPU extension does not build here: {e}")


@pytest.fixture(params=CPU_PATHS)
def step_ext(request, monkeypatch):
    """The fused CPU FP4AdamW step on each path this CPU has (its vector builds, and the scalar path); a test
    taking it runs once per path."""
    yield from cpu_path(request.param, monkeypatch, lambda: fused_extension(cuda=False))


@pytest.fixture
def simd(step_ext):
    """The path `step_ext` runs, for tests that name it."""
    return step_ext.isa() if step_ext.have_simd() else "scalar"


@pytest.fixture(params=["cpu", "reference"])
def backend(request, monkeypatch):
    """Run the public API on the CPU extension, then on the torch reference (FP4OFFLOAD_BACKEND forces it).
    tests/unit/test_formats_tables.py has its own (AVX-512 on and off)."""
    if request.param == "cpu":
        request.getfixturevalue("cpu_ext")
    monkeypatch.setenv("FP4OFFLOAD_BACKEND", request.param)
    return request.param


@pytest.fixture(params=("threads", "aio"))
def engine(request):
    """FP4AdamW's NVMe I/O engines, each test run with both (aio needs DeepSpeed's async_io op)."""
    if request.param == "aio":
        from fp4offload._optim import nvme as nvme_mod

        op, why = nvme_mod.aio_op()
        if op is None:
            skip_or_fail(f"DeepSpeed's async_io op does not load here ({why}); install it: {LIBAIO_FIX}")
    return request.param
