"""Helpers for the tests' extension fixtures: the fused FP4AdamW steps and the AVX-512 switch."""

from __future__ import annotations

import pytest


def fused_extension(cuda: bool):
    """The fused FP4AdamW step extension (CUDA or CPU); skips when it does not build."""
    from fp4offload.optim import fused

    e = fused.cuda_extension() if cuda else fused.cpu_extension()
    if e is None:
        what = "CUDA FP4AdamW step" if cuda else "fused CPU step"
        pytest.skip(f"{what} does not build: {fused.failures()}")
    return e


def avx512_switched(ext, want: bool, reason: str):
    """A fixture's body: yields ext.set_avx512(want) (skips with `reason` when AVX-512 is wanted and not
    compiled for this CPU), then switches back to what it was."""
    before = ext.have_avx512()
    on = ext.set_avx512(want)
    if want and not on:
        pytest.skip(reason)
    yield on
    ext.set_avx512(before)
