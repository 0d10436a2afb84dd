"""Helpers for the tests' extension fixtures: the fused FP4AdamW steps, and the CPU paths (vector instruction
sets) this machine can run, each against the scalar path."""

from __future__ import annotations

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
