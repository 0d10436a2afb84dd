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


@pytest.mark.parametrize("grid, values", [("l2b2", [0.125, 0.25, 0.5, 1.0]), ("l2b4", [1 / 64, 1 / 16, 0.25, 1.0]),
                                          ("e2m2", None)])
def test_grid_points_and_positions_are_inverse(grid, values):
    pts = Q._value(torch.arange(Q.codes(grid), dtype=torch.float32), True, grid)
    if values is not None:  # the 2-bit grids: four codes, one per binade
        assert pts.tolist() == values
    assert Q._position(pts, True, grid).tolist() == list(range(Q.codes(grid)))
    assert float(pts.max()) == Q.grid_max(grid)


@pytest.mark.parametrize("grid", ["l2b2", "l2b4"])
def test_two_bit_stochastic_rounding_is_unbiased_in_u(grid):
    g = torch.Generator().manual_seed(1)
    x = torch.full((64 * 1024,), 0.3)
    x[::16] = 1.0  # each block's maximum sits on the top code, so its scale is exact
    got = Q.roundtrip(x, "sr", True, g, grid)
    inner = torch.ones_like(x, dtype=torch.bool)
    inner[::16] = False
    assert len(set(got[inner].unique().tolist())) == 2  # the two codes around 0.3, nothing else
    assert abs(float(got[inner].mean()) - 0.3) < 0.003
