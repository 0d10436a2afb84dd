"""The fused CPU step (csrc/cpu/adam_cpu.cpp) equals the torch reference step bit for bit (the checks are
tests/helpers/optim_cases.py's, shared with the CUDA kernels)."""

import pytest
import torch
from helpers.optim_cases import run_fused, special_grads

from fp4offload._config import V_FORMATS
from fp4offload._optim import reference_step as R

SIZES = [1, 15, 16, 17, 1000, 1024, 1025, 4096, 5003, 70001]
ROUNDINGS = [(False, False), (True, False), (True, True), (False, True)]  # (m, v) stochastic
ROUNDING_IDS = ["m-nearest", "m-sr", "m-sr-v-sr", "v-sr"]


# the 2-bit grid (its own packing) on the sizes that reach a ragged block, a whole and a ragged chunk, and a
# partial last chunk beside full ones; the 4-bit grids on every size
SIZE_FORMATS = [(n, vf) for vf in V_FORMATS for n in SIZES
                if R.v_bits(vf) == 4 or n in (1, 17, 1024, 1025, 5003)]


@pytest.mark.parametrize("n,v_format", SIZE_FORMATS)
@pytest.mark.parametrize("stochastic,v_stochastic", ROUNDINGS, ids=ROUNDING_IDS)
def test_fused_equals_reference(step_ext, simd, n, v_format, stochastic, v_stochastic):
    run_fused(step_ext, n, v_format, stochastic, torch.float32, v_stochastic=v_stochastic)


@pytest.mark.parametrize("maximize,wd", [(False, 0.0), (True, 0.1)])
def test_fused_bf16_grad_maximize_no_decay(step_ext, simd, maximize, wd):
    run_fused(step_ext, 3001, "ue2m2", True, torch.bfloat16, wd=wd, maximize=maximize)


@pytest.mark.parametrize("kind", ["overflow", "nonfinite", "zeros", "range"])
@pytest.mark.parametrize("v_format", V_FORMATS)
@pytest.mark.parametrize("stochastic,v_stochastic", ROUNDINGS, ids=ROUNDING_IDS)
def test_fused_special_values(step_ext, simd, kind, v_format, stochastic, v_stochastic):
    run_fused(step_ext, 5003, v_format, stochastic, torch.float32, special=special_grads(kind),
              v_stochastic=v_stochastic)


@pytest.mark.parametrize("kind", ["overflow", "zeros"])
def test_fused_special_values_bf16(step_ext, simd, kind):
    run_fused(step_ext, 3001, "ue2m2", False, torch.bfloat16, special=special_grads(kind), maximize=True)


@pytest.mark.parametrize("v_stochastic", [False, True], ids=["v-nearest", "v-sr"])
def test_fused_multi_segment(step_ext, v_stochastic):
    """More than one segment: the stochastic-rounding stream changes at the segment boundary as specified."""
    run_fused(step_ext, R.SEGMENT + 5000, "ue2m2", True, torch.float32, steps=2, v_stochastic=v_stochastic)


def test_all_finite(step_ext):
    x = torch.randn(100_001)
    assert step_ext.all_finite(x) and step_ext.all_finite(x.bfloat16()) and step_ext.all_finite(x.half())
    for bad in (float("inf"), float("-inf"), float("nan")):
        y = x.clone()
        y[77_777] = bad
        assert not step_ext.all_finite(y) and not step_ext.all_finite(y.bfloat16())


@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16], ids=["g32", "g16"])
@pytest.mark.parametrize("scale", [0.3183, 0.999, 2.5])
@pytest.mark.parametrize("n", [17, 1025, 70001])
def test_fused_grad_scale_equals_scaling_first(step_ext, simd, gdt, scale, n):
    """The engine's clipping factor applied inside the step, as each gradient is read, gives the bits of the
    gradient scaled in fp32 first (how FP4AdamW scales it for every other backend)."""
    run_fused(step_ext, n, "ue2m2", True, gdt, maximize=n == 17, grad_scale=scale)


def test_fused_grad_scale_is_checked(step_ext):
    p, g = torch.zeros(16), torch.zeros(16)
    m, v = R.empty_packed(16, "cpu"), R.empty_packed(16, "cpu")
    sc = R.StepScalars.make(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(RuntimeError, match="grad_scale must be finite and > 0"):
            step_ext.fused_step(p, g, *m, *v, sc.b1, sc.omb1, sc.b2, sc.omb2, sc.eps, sc.decay, sc.step_size,
                                sc.rsbc2, sc.weight_decay, False, 2, True, 1, 0, grad_scale=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grads_ok_is_the_aminmax_rule(step_ext, dtype):
    """grads_ok (FP4AdamW's gradient check on the CPU) agrees with the torch rule it replaces: finite and of
    magnitude below GRAD_LIMIT (2^64), at the boundary, for every special value and position."""
    from fp4offload._optim.adamw import GRAD_LIMIT

    def rule(t):
        lo, hi = torch.aminmax(t)
        return bool((hi < GRAD_LIMIT) & (lo > -GRAD_LIMIT))

    x = torch.randn(200_003)
    big = torch.tensor(GRAD_LIMIT)
    below = torch.nextafter(big, torch.tensor(0.0))
    specials = [float("inf"), float("-inf"), float("nan"), GRAD_LIMIT, -GRAD_LIMIT, float(below), -float(below),
                float(below.to(dtype)), 65504.0, -0.0, 1e-45]
    assert step_ext.grads_ok(x.to(dtype)) and rule(x.to(dtype))
    for pos in (0, 1, 65_535, 65_536, 131_071, 200_002):
        for v in specials:
            y = x.clone().to(dtype)
            y[pos] = v
            assert step_ext.grads_ok(y) == rule(y), (dtype, pos, v)
    assert step_ext.grads_ok(torch.empty(0, dtype=dtype))
    with pytest.raises(RuntimeError, match="fp32, bf16 or fp16"):
        step_ext.grads_ok(torch.zeros(3, dtype=torch.float64))


@pytest.mark.parametrize("n", [1, 15, 33, 64, 127, 129, 1000, 65_537, 200_003])
def test_all_finite_positions(step_ext, simd, n):
    """Both paths (vector loop, masked tail, several threads' ranges): one non-finite value anywhere is found."""
    x = torch.randn(n)
    for dt in (torch.float32, torch.bfloat16, torch.half):
        assert step_ext.all_finite(x.to(dt))
    for pos in sorted({0, n // 2, max(0, n - 17), n - 1}):
        for bad in (float("inf"), float("-inf"), float("nan")):
            y = x.clone()
            y[pos] = bad
            for dt in (torch.float32, torch.bfloat16, torch.half):
                assert not step_ext.all_finite(y.to(dt)), (n, pos, bad, dt)
    big = torch.full((n,), 65504.0)  # largest finite half: finite in every dtype
    assert step_ext.all_finite(big) and step_ext.all_finite(big.half()) and step_ext.all_finite(-big.bfloat16())


def test_optimizer_fused_equals_reference_backend():
    """The whole optimizer, fused vs torch-op backend, on a model with small and large tensors."""
    from fp4offload import FP4AdamW
    from fp4offload._optim import StateFormat, StepOptions

    def run(backend):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(100, 200), torch.nn.GELU(), torch.nn.Linear(200, 30))
        opt = FP4AdamW(model.parameters(), lr=3e-3, state_format=StateFormat(m_rounding="stochastic"),
                       step_options=StepOptions(backend=backend, working_copy="bf16"))
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            x = torch.randn(32, 100, generator=g)
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()], opt.state_dict()

    pa, sa = run("fused")
    pb, sb = run("reference")
    for a, b in zip(pa, pb):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for k in sa["state"]:
        for key, t in sa["state"][k].items():
            if torch.is_tensor(t):
                assert torch.equal(t.reshape(-1).view(torch.uint8),
                                   sb["state"][k][key].reshape(-1).view(torch.uint8)), key


@pytest.mark.parametrize("shape", [(40, 128), (16, 64), (300, 192), (3, 5, 64), (37, 50)], ids=str)
def test_fused_nvfp4_working_copy(step_ext, simd, shape):
    """The NVFP4 16x16 working copy is the codec's encode with the weight's amax rounded up to a power of two,
    byte for byte, at every step; the fused step writes it, except on the first step and where that rounded
    amax moved (then a pass of its own does); the step's own result (weights, states) is unchanged by it."""
    from fp4offload import FP4AdamW, quantize
    from fp4offload import _metrics as metrics
    from fp4offload._optim import StateFormat, StepOptions

    def run(copy):
        torch.manual_seed(1)
        p = torch.nn.Parameter(torch.randn(shape) * 0.02)
        with torch.no_grad():
            p.view(-1)[0] = 0.2  # amax 0.2: rounded up, 0.25
        opt = FP4AdamW([p], lr=1e-4, state_format=StateFormat(min_numel=16),
                       step_options=StepOptions(backend="fused", working_copy="nvfp4" if copy else None))
        g = torch.Generator().manual_seed(2)
        out = []
        for step in range(5):
            p.grad = torch.randn(shape, generator=g)
            if step == 3:
                with torch.no_grad():
                    p.mul_(1.5)  # amax 0.3: rounded up, 0.5, so this step's fused copy is dropped
            before = metrics.counter("optim.wcopy_reencodes").value
            opt.step()
            wc = opt.working_copy(p).get("nvfp4")
            out.append((p.detach().clone(), wc, metrics.counter("optim.wcopy_reencodes").value - before))
        return out, opt.state_dict()

    with_copy, sd_a = run(True)
    without, sd_b = run(False)
    for step, ((pa, wc, reenc), (pb, _, _)) in enumerate(zip(with_copy, without)):
        assert torch.equal(pa.view(torch.int32), pb.view(torch.int32)), step
        amax = FP4AdamW.copy_amax(float(pa.abs().max()))
        assert wc.meta["amax"] == amax == (0.5 if step >= 3 else 0.25), step
        assert reenc == (1 if step in (0, 3) else 0), step
        ref = quantize(pa, "nvfp4", block="16x16", amax=amax)
        assert torch.equal(wc.data, ref.data) and torch.equal(wc.scales, ref.scales), step
        assert torch.equal(wc.tensor_scale, ref.tensor_scale), step
    for key, t in sd_a["state"][0].items():
        if torch.is_tensor(t):
            assert torch.equal(t.reshape(-1).view(torch.uint8), sd_b["state"][0][key].reshape(-1).view(torch.uint8))


def test_copy_amax():
    from fp4offload import FP4AdamW

    assert [FP4AdamW.copy_amax(x) for x in (0.0, 0.2, 0.25, 0.2500001, 3.0, 2.0 ** -130, 1e30)] == \
        [0.0, 0.25, 0.25, 0.5, 4.0, 2.0 ** -130, 2.0 ** 100]


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_weight_regions(step_ext, simd, threads):
    """Registered regions of a flat parameter (offsets off the chunk grid, ragged rows and columns, bands
    that straddle the threads' chunk ranges) come out as the codec's encode of each slice with the given
    amax; the step's weights and states are the same bits as without regions; a region without an amax, or
    a step that was skipped, writes nothing."""
    from fp4offload import ConfigError, FP4AdamW, quantize
    from fp4offload._optim import StepOptions
    from fp4offload._optim import WeightRegion

    n = 200_003
    layout = [(1000, 40, 128), (1000 + 40 * 128 + 7, 33, 50), (60_001, 700, 192)]  # (offset, rows, cols)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        def run(with_regions):
            g = torch.Generator().manual_seed(5)
            p = torch.nn.Parameter(torch.randn(n, generator=g) * 0.05)
            opt = FP4AdamW([p], lr=1e-3, step_options=StepOptions(backend="fused"))
            regs = [WeightRegion(o, r, c) for o, r, c in layout] + [WeightRegion(195_000, 10, 64)]
            if with_regions:
                with pytest.raises(ConfigError, match="non-overlapping"):
                    opt.hooks.weight_regions(p, regs + [WeightRegion(194_000, 10, 64)])  # overlaps
                opt.hooks.weight_regions(p, regs)
            out = []
            for step in range(3):
                for r in regs[:3]:  # not an fp32 value: the step scales by its fp32 rounding and leaves it be
                    r.amax = float(p.detach()[r.offset:r.offset + r.rows * r.cols].abs().max()) * 2 + 1e-12
                set_amax = [r.amax for r in regs]
                p.grad = torch.randn(n, generator=g)
                if step == 2:
                    p.grad[12345] = float("inf")  # skipped: states, weights and regions untouched
                opt.step()
                assert [r.amax for r in regs] == set_amax
                out.append((p.detach().clone(), [(r.packed, r.new_amax, r.amax) for r in regs]))
            return out, opt.state_dict()

        got, sd_a = run(True)
        plain, sd_b = run(False)
    finally:
        torch.set_num_threads(before)
    for step, ((pa, regs), (pb, _)) in enumerate(zip(got, plain)):
        assert torch.equal(pa.view(torch.int32), pb.view(torch.int32)), step
        for i, (packed, new_amax, amax) in enumerate(regs):
            if step == 2 or i == 3:  # skipped step; region without an amax
                assert packed is None and new_amax != new_amax
                continue
            o, r, c = layout[i]
            sl = pa[o:o + r * c].view(r, c)
            ref = quantize(sl, "nvfp4", block="16x16", amax=amax)
            assert packed.shape == (r, c) and packed.meta["amax"] == float(torch.tensor(amax, dtype=torch.float32))
            assert torch.equal(packed.data, ref.data) and torch.equal(packed.scales, ref.scales), (step, i)
            assert torch.equal(packed.tensor_scale, ref.tensor_scale)
            assert new_amax == float(sl.abs().max())
    for key, t in sd_a["state"][0].items():
        if torch.is_tensor(t):
            assert torch.equal(t.reshape(-1).view(torch.uint8), sd_b["state"][0][key].reshape(-1).view(torch.uint8))
