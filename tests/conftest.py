import os

import pytest
import torch
from _extensions import CPU_PATHS, cpu_path, fused_extension

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
    tests/test_formats_tables.py has its own (AVX-512 on and off)."""
    if request.param == "cpu":
        request.getfixturevalue("cpu_ext")
    monkeypatch.setenv("FP4OFFLOAD_BACKEND", request.param)
    return request.param


LIBAIO_FIX = "apt-get install -y libaio-dev"


def skip_or_fail(why: str) -> None:
    """Skip a test that needs an optional system library, naming the fix; under CI (``CI`` set, as .ci/run
    does) fail instead, so CI always runs it."""
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{why} (CI installs it: see .ci/run)")
    pytest.skip(why)


@pytest.fixture(params=("threads", "aio"))
def engine(request):
    """FP4AdamW's NVMe I/O engines, each test run with both (aio needs DeepSpeed's async_io op)."""
    if request.param == "aio":
        from fp4offload._optim import nvme as nvme_mod

        op, why = nvme_mod.aio_op()
        if op is None:
            skip_or_fail(f"DeepSpeed's async_io op does not load here ({why}); install it: {LIBAIO_FIX}")
    return request.param


def require_libaio() -> None:
    """DeepSpeed's async_io op needs libaio (its NVMe swapper, and FP4AdamW's aio engine)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        ok = bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception as e:  # DeepSpeed missing or its builder broken
        ok, why = False, f"{type(e).__name__}: {e}"
    else:
        why = "libaio is not installed"
    if not ok:
        skip_or_fail(f"DeepSpeed's async_io op is unavailable ({why}); install it: {LIBAIO_FIX}")
