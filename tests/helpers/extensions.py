"""The compiled pieces the tests load: the fused FP4AdamW steps, the CPU paths (vector instruction sets) this
machine can run, each against the scalar path, and the optional system libraries (a test that needs a missing one
skips naming the fix, or fails under CI)."""

from __future__ import annotations

import os

import pytest

from fp4offload._ops import cpu_isa

#: the CPU paths the cross-backend tests run over on this architecture (skipped where the CPU lacks one)
CPU_PATHS = ("sve", "neon", "scalar") if cpu_isa.arch() == "aarch64" else ("avx512", "avx2", "scalar")


def fused_extension(cuda: bool):
    """The fused FP4AdamW step extension (CUDA or CPU); skips when it does not build."""
    from fp4offload._optim import fused

    e = fused.cuda_extension() if cuda else fused.cpu_extension()
    if e is None:
        what = "CUDA FP4AdamW step" if cuda else "fused CPU step"
        pytest.skip(f"{what} does not build: {fused.failures()}")
    return e


def cpu_path(path: str, monkeypatch, load):
    """A fixture's body: forces the CPU path `path` (FP4OFFLOAD_CPU_ISA; "scalar": the default build with its
    vector path switched off, so no extra build), yields load() (the extension), then restores it.
    Skips a path this CPU lacks."""
    if path != "scalar":
        if path not in cpu_isa.available():
            pytest.skip(f"this CPU has no {path} path (it has {', '.join(cpu_isa.available())})")
        monkeypatch.setenv(cpu_isa.ENV, path)
    ext = load()
    before = ext.have_simd()
    on = ext.set_simd(path != "scalar")
    assert on == (path != "scalar"), f"the {ext.isa()} build has no vector path"
    assert path == "scalar" or ext.isa() == path
    yield ext
    ext.set_simd(before)


LIBAIO_FIX = "apt-get install -y libaio-dev"


def skip_or_fail(why: str) -> None:
    """Skip a test that needs an optional system library, naming the fix; under CI (``CI`` set, as .ci/run
    does) fail instead, so CI always runs it."""
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"{why} (CI installs it: see .ci/run)")
    pytest.skip(why)


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
