"""What the activation tests share: a tiny Llama, its tokens, and a policy under which its tensors qualify."""

from __future__ import annotations

import pytest
import torch

from benchmarks import harness
from fp4offload import ActivationPolicy

MIN_NUMEL = 1024
TOKENS = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(1))


def P(**kw) -> ActivationPolicy:
    """A policy for the tiny model: small tensors qualify, and stochastic rounding bits are fixed (seed 0)."""
    kw.setdefault("min_numel", MIN_NUMEL)
    kw.setdefault("seed", 0)
    return ActivationPolicy(**kw)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One torch thread: on a small shared host two threads spin and run many times slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_model(seed: int = 0):
    return harness.small_llama(hidden=64, layers=2, heads=4, intermediate=172, seed=seed)
