"""benchmarks/quant_sim.py, the plain-torch model of FP4AdamW's stored states that the grid and rounding
ablations run on: its nearest rounding lands where the codec's does, and its scatter ordering of the two
sqrt(v) grids is the one docs/numerics.md reports."""

import pytest
import torch

from benchmarks import quant_sim as Q
from fp4offload.formats import reference
from fp4offload._optim import reference_step as R


@pytest.mark.parametrize("grid,mbits", [("e3m1", 1), ("e2m2", 2)])
def test_nearest_matches_the_codec(grid, mbits):
    g = torch.Generator().manual_seed(0)
    n = 5 * R.CHUNK + 77
    x = torch.rand(n, generator=g) ** 3 * torch.exp(torch.randn(n, generator=g))
    sim = Q.roundtrip(x, "rn", True, g, grid)
    packed = R.empty_packed(n, "cpu")
    R.encode_into(reference, x, packed, mbits, False, 0, 0)
    codec = R.decode(reference, packed, n, mbits)
    same = torch.isclose(sim, codec, rtol=1e-6, atol=0).float().mean().item()
    assert same > 0.999, same  # the model divides where the codec multiplies by a reciprocal: rare tie flips


def test_finer_grid_scatters_less():
    coarse = Q.ema_scatter("e3m1", 0.0, steps=1500, n=4096)
    fine = Q.ema_scatter("e2m2", 0.0, steps=1500, n=4096)
    assert fine["log_std"] < 0.8 * coarse["log_std"], (fine, coarse)


def test_srv_is_for_unsigned_grids_only():
    with pytest.raises(ValueError, match="srv"):
        Q.roundtrip(torch.rand(2048), "srv", False, torch.Generator().manual_seed(0))
