"""The second moment's rounding (FP4AdamW ``v_rounding``): a 4-bit sqrt(v) rounded to nearest stops moving once
Adam's slow average changes by less than half a code step per step; rounded stochastically it follows the
average, with the same bits on every backend and after a resume."""

import pytest
import torch

import fp4offload
from fp4offload import FP4AdamW
from fp4offload._optim import StateFormat, StepOptions
from fp4offload.errors import ConfigError
from fp4offload._optim import reference_step as R


def _train(backend, master, v_rounding, n=2 * R.CHUNK * 5 + 77, steps=3, dtype=torch.float32):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(n).to(dtype))
    opt = FP4AdamW([p], lr=1e-2, master=master, state_format=StateFormat(v_rounding=v_rounding, seed=11),
                   step_options=StepOptions(backend=backend))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        p.grad = (torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4).to(dtype)
        opt.step()
    entry = opt.state_dict()["state"][0]
    return p.detach().clone(), {k: v.clone() for k, v in entry.items() if torch.is_tensor(v)}


@pytest.mark.parametrize("master,dtype", [("fp32", torch.float32), ("split", torch.bfloat16),
                                          ("bf16", torch.bfloat16)])
def test_v_stochastic_fused_equals_reference(step_ext, simd, master, dtype):
    """Every master form: the fused CPU step (AVX-512 and scalar) writes the torch reference's bytes."""
    ref_p, ref = _train("reference", master, "stochastic", dtype=dtype)
    got_p, got = _train("auto", master, "stochastic", dtype=dtype)
    assert torch.equal(ref_p.view(torch.uint8), got_p.view(torch.uint8))
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    near_p, near = _train("auto", master, "nearest", dtype=dtype)
    assert not torch.equal(near["v_codes"], got["v_codes"])  # the option reaches the kernel
    assert torch.equal(near["m_codes"], got["m_codes"])  # m does not depend on v


def test_v_bits_differ_from_m_bits():
    """v's random bits are not m's: the same values rounded as m and as v round differently somewhere."""
    x = torch.rand(1 << 14) * 1.4 + 0.01
    seed, stream = R.sr_seed(3, 5), R.sr_stream(2, 0)
    as_m = fp4offload.quantize(x, "ufp4", rounding="stochastic", seed=seed, stream=stream, scale_scope=R.CHUNK)
    as_v = fp4offload.quantize(x, "ufp4", rounding="stochastic", seed=seed ^ R.V_SEED_XOR, stream=stream,
                               scale_scope=R.CHUNK)
    assert not torch.equal(as_m.data, as_v.data)


def test_ufp4_stochastic_unbiased_and_on_grid():
    """Stochastic ufp4 rounds to one of the two neighbouring codes, up with probability equal to the position
    between them: the mean over seeds is the value (the nearest rule is off by up to a quarter of a step)."""
    x = torch.linspace(0.02, 1.5, 16 * 64)
    x[::16] = 1.5  # every block's largest value is the format's: its scale is 1, its grid is ufp4's own
    grid = fp4offload.formats.bits.ufp4_values().double()
    near = fp4offload.quantize(x, "ufp4").dequantize().double()
    outs = torch.stack([fp4offload.quantize(x, "ufp4", rounding="stochastic", seed=s).dequantize()
                        for s in range(400)]).double()
    xd = x.double()
    lo = torch.stack([grid[grid <= v * (1 + 1e-6)].max() for v in xd])
    hi = torch.stack([grid[grid >= v * (1 - 1e-6)].min() for v in xd])
    tol = 1e-6
    assert bool(((outs >= lo * (1 - tol)) & (outs <= hi * (1 + tol))).all())  # a neighbour, always
    step = hi - lo
    inside = step > 0
    mean_err = (outs.mean(0) - xd).abs()
    assert float((mean_err[inside] / step[inside]).max()) < 0.12  # 400 draws: within ~4.5 standard errors
    assert float(((near - xd).abs()[inside] / step[inside]).max()) > 0.4  # nearest is off by up to half a step


def _ema_tracking(v_rounding, steps=3000, v_format="ufp4"):
    """One parameter whose elements all see gradients of size 1 for 200 steps, then half of each block of 16 sees
    gradients 30x smaller: fp32 Adam's v of those falls 900x relative to the rest. Returns the median |log| of
    the ratio of the stored v to the fp32 average of the same gradients, of the quieted and of the other
    elements."""
    n = 8 * R.CHUNK
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(n))
    opt = FP4AdamW([p], lr=0.0, weight_decay=0.0,
                   state_format=StateFormat(v_rounding=v_rounding, v_format=v_format, seed=5))
    quiet = (torch.arange(n) % 16) >= 8
    v = torch.zeros(n, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    for t in range(steps):
        grad = torch.randn(n, generator=g)
        if t >= 200:
            grad = torch.where(quiet, grad / 30, grad)
        p.grad = grad
        opt.step()
        v = 0.999 * v + 0.001 * grad.double() ** 2
    from fp4offload._optim.state import decode_state

    m_p, v_p = opt.placement.states(opt.state[p], p)
    _, stored = decode_state(m_p, v_p, n, v_format)
    err = (stored.double() / v).log().abs()  # |log| of the ratio: 0.69 is a factor of 2
    return float(err[quiet].median()), float(err[~quiet].median())


@pytest.mark.parametrize("v_format", ["ue2m2", "ufp4"])
def test_stochastic_v_follows_a_falling_average(v_format):
    """The staleness itself: rounded to nearest, the quieted half's sqrt(v) codes stay where they were (each
    step's decay is 0.05% of a 14-50% code step), so their v stays near the loud level; rounded stochastically
    it comes down with the fp32 average, in jumps of a code step (so it scatters around it)."""
    stale_quiet, _ = _ema_tracking("nearest", v_format=v_format)
    sr_quiet, sr_loud = _ema_tracking("stochastic", v_format=v_format)
    # measured (2026-12-03): nearest 4.0 (v 56x too large) on either grid; stochastic 1.1 (quieted) and 0.39
    # (the rest) on ufp4, 0.75 and 0.33 on ue2m2
    assert stale_quiet > 3.0  # v stuck far above the average it should hold
    assert sr_quiet < 1.6 and sr_loud < 0.6
    assert sr_quiet * 2.5 < stale_quiet


def test_ue2m2_scatters_less_than_ufp4():
    """The reason for ue2m2: a code step of 14-25% instead of 33-50%, so the stochastically rounded sqrt(v)
    scatters less around the average, the loud elements and the quieted ones (whose sqrt(v), 30x below the
    block's largest, sits beyond ue2m2's range of 14 and is held at its smallest value) alike."""
    q1, l1 = _ema_tracking("stochastic", v_format="ufp4")
    q2, l2 = _ema_tracking("stochastic", v_format="ue2m2")
    assert l2 < 0.9 * l1 and q2 < 0.8 * q1


def test_v_stochastic_resume_repeats_the_bits():
    """Six steps straight equal three, a state dict, a fresh optimizer, and three more."""
    def grads(n, k):
        g = torch.Generator().manual_seed(7)
        return [torch.randn(n, generator=g) for _ in range(k)]

    n = 5 * R.CHUNK + 5  # packed states (over min_numel)
    gs = grads(n, 6)
    p = torch.nn.Parameter(torch.ones(n))
    opt = FP4AdamW([p], lr=1e-2, state_format=StateFormat(v_rounding="stochastic", seed=9))
    for g in gs:
        p.grad = g.clone()
        opt.step()
    q = torch.nn.Parameter(torch.ones(n))
    first = FP4AdamW([q], lr=1e-2, state_format=StateFormat(v_rounding="stochastic", seed=9))
    for g in gs[:3]:
        q.grad = g.clone()
        first.step()
    second = FP4AdamW([q], lr=1e-2,
                      state_format=StateFormat(v_rounding="nearest", seed=0))  # the saved group options win
    second.load_state_dict(first.state_dict())
    assert second.param_groups[0]["v_rounding"] == "stochastic"
    for g in gs[3:]:
        q.grad = g.clone()
        second.step()
    assert torch.equal(p.detach(), q.detach())
    a, b = opt.state_dict()["state"][0], second.state_dict()["state"][0]
    assert torch.equal(a["v_codes"], b["v_codes"]) and torch.equal(a["m_codes"], b["m_codes"])


def test_old_state_dict_without_v_rounding_loads():
    """A state dict saved before v_rounding existed (no such group key) loads, with this optimizer's choice."""
    p = torch.nn.Parameter(torch.randn(5000))
    opt = FP4AdamW([p], lr=1e-3)
    p.grad = torch.randn(5000)
    opt.step()
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        del g["v_rounding"]
    q = torch.nn.Parameter(p.detach().clone())
    other = FP4AdamW([q], lr=1e-3, state_format=StateFormat(v_rounding="stochastic"))
    other.load_state_dict(sd)
    assert other.param_groups[0]["v_rounding"] == "stochastic"
    q.grad = torch.randn(5000)
    other.step()
    assert torch.isfinite(q).all()


@pytest.mark.parametrize("bad", ["up", None, 1, "Stochastic"])
def test_v_rounding_checked(bad):
    p = torch.nn.Parameter(torch.randn(10))
    with pytest.raises(ConfigError, match="v_rounding"):
        FP4AdamW([p], state_format=StateFormat(v_rounding=bad))
    opt = FP4AdamW([p])
    with pytest.raises(ConfigError, match=r"param_groups\[1\]\.v_rounding"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], "v_rounding": bad})


def test_ue2m2_grid_nearest_and_stochastic():
    """The ue2m2 grid (bits.ugrid_*, mbits 2): 16 values 1/8 .. 1.75, four per binade; nearest is the closest
    value (ties to the even code); stochastic lands on a neighbour and is unbiased over seeds."""
    from fp4offload.formats import bits as B

    vals = B.ugrid_values(2).double()
    assert vals[0] == 0.125 and vals[15] == 1.75 and vals[12] == 1.0 and vals[13] == 1.25
    assert bool((vals[1:] > vals[:-1]).all())
    y = torch.linspace(0.0, 2.0, 4001)
    near = vals[B.ugrid_encode(y, 2).long()]
    a = y.double().clamp(0.125, 1.75)
    best = (vals[None, :] - a[:, None]).abs().min(1).values
    assert bool(((near - a).abs() <= best + 1e-12).all())  # a closest value (below 1/8: the smallest)
    assert B.ugrid_encode(torch.tensor([1.125]), 2).item() == 12  # the tie between 1 and 1.25 goes to code 12
    x = torch.linspace(0.13, 1.74, 997)
    draws = torch.stack([vals[B.ugrid_encode_sr(x, B.random_bits(R.sr_seed(1, s), 0, torch.arange(997)), 2).long()]
                         for s in range(300)])
    lo = torch.stack([vals[vals <= v].max() for v in x.double()])
    hi = torch.stack([vals[vals >= v].min() for v in x.double()])
    assert bool(((draws == lo) | (draws == hi)).all())
    step = hi - lo
    inside = step > 0
    assert float(((draws.mean(0) - x.double()).abs()[inside] / step[inside]).max()) < 0.12


def test_ufp4_state_dict_resumes_in_ufp4_under_the_new_default():
    """A state dict written in ufp4 (the format before ue2m2) loads into an optimizer built with today's defaults
    and goes on in ufp4, bit for bit as the run that never stopped; moving its group to ue2m2 re-encodes once."""
    n = 5 * R.CHUNK + 9  # packed (over min_numel)
    g = torch.Generator().manual_seed(4)
    gs = [torch.randn(n, generator=g) for _ in range(6)]
    p = torch.nn.Parameter(torch.ones(n))
    straight = FP4AdamW([p], lr=1e-2, state_format=StateFormat(v_format="ufp4", seed=3))
    q = torch.nn.Parameter(torch.ones(n))
    first = FP4AdamW([q], lr=1e-2, state_format=StateFormat(v_format="ufp4", seed=3))
    for k, gk in enumerate(gs):
        p.grad = gk.clone()
        straight.step()
        if k < 3:
            q.grad = gk.clone()
            first.step()
    resumed = FP4AdamW([q], lr=1e-2)
    assert resumed.param_groups[0]["v_format"] == "ue2m2"
    resumed.load_state_dict(first.state_dict())
    assert resumed.param_groups[0]["v_format"] == "ufp4"
    for gk in gs[3:]:
        q.grad = gk.clone()
        resumed.step()
    assert torch.equal(p.detach(), q.detach())
    a, b = straight.state_dict()["state"][0], resumed.state_dict()["state"][0]
    assert b["v_format"] == "ufp4" and torch.equal(a["v_codes"], b["v_codes"])
    resumed.param_groups[0]["v_format"] = "ue2m2"
    q.grad = gs[0].clone()
    resumed.step()
    assert resumed.state_dict()["state"][0]["v_format"] == "ue2m2" and bool(torch.isfinite(q).all())
