"""FP4AdamW's compact master weights: ``master="split"`` is the fp32 master exactly, ``"bf16"`` rounds
stochastically and repeats itself (fp4offload/_optim/master.py, docs/numerics.md "Master weights")."""

import pytest
import torch

from fp4offload.errors import ConfigError
from fp4offload._ops import cpu_isa
from fp4offload._optim import FP4AdamW, NvmeOptions, StateFormat, StepOptions
from fp4offload._optim import master as MW
from fp4offload._optim import reference_step as R


# ---- the representation ---------------------------------------------------------------------------------

@pytest.mark.slow  # all 2^32 patterns per CPU path
def test_split_rebuilds_every_fp32_pattern_exhaustively(step_ext):
    """All 2**32 patterns in the C++ rules the fused step uses: finite ones rebuild bit for bit, NaN stays NaN."""
    assert step_ext.split_selfcheck(0, 1 << 32) == 0


def _patterns(hi: int) -> torch.Tensor:
    """Every fp32 pattern whose rounding can land on bf16 pattern `hi`: (hi << 16) + r for r in [-2**15, 2**15]."""
    b = (hi << 16) + torch.arange(-0x8000, 0x8001, dtype=torch.int64)
    return b[(b >= 0) & (b < 1 << 32)]


EDGE_HI = [0x0000, 0x0001, 0x0002, 0x007F, 0x0080, 0x0081, 0x3F7F, 0x3F80, 0x3F81, 0x7F7E, 0x7F7F, 0x7F80,
           0x8000, 0x8001, 0x807F, 0x8080, 0xBF80, 0xFF7F, 0xFF80]


@pytest.mark.parametrize("exponent", range(0, 256, 5))
def test_split_reference_is_exact_for_every_residual_code(exponent):
    """The torch reference on every residual code around bf16 patterns of this exponent (both signs, even and
    odd mantissas, the ends of the binade: subnormals at exponent 0, powers of two, the largest finite)."""
    his = [s | (exponent << 7) | mant for s in (0, 0x8000) for mant in (0, 1, 0x40, 0x7E, 0x7F)]
    his += EDGE_HI if exponent == 0 else []
    for hi in his:
        b = _patterns(hi)
        x = MW._f32(b)
        keep = ~torch.isnan(x)
        x, b = x[keep], b[keep]
        h, r, odd = MW.split(x)
        assert torch.equal(h.view(torch.int16), x.to(torch.bfloat16).view(torch.int16)), hex(hi)
        assert torch.equal(MW._u32(MW.join(h, r, odd)), b), hex(hi)
        ties = (b & 0xFFFF) == 0x8000
        assert torch.equal(odd, (ties & ((b >> 16) & 1 == 0)).nonzero().reshape(-1))


def test_split_random_patterns_and_special_values():
    g = torch.Generator().manual_seed(0)
    b = torch.randint(0, 1 << 32, (1 << 20,), generator=g, dtype=torch.int64)
    x = MW._f32(b)
    fin = ~torch.isnan(x)
    h, r, odd = MW.split(x)
    y = MW.join(h, r, odd)
    assert torch.equal(MW._u32(y)[fin], b[fin])
    assert bool(torch.isnan(y[~fin]).all())
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.4028235e38, -3.4028235e38,
                            1e-45, -1e-45, 1.17549435e-38])
    h, r, odd = MW.split(special)
    y = MW.join(h, r, odd)
    assert torch.equal(MW._u32(y)[[0, 1, 2, 3, 5, 6, 7, 8, 9]], MW._u32(special)[[0, 1, 2, 3, 5, 6, 7, 8, 9]])
    assert torch.isnan(y[4])
    # a parameter set to Inf from outside stays Inf whatever its residual
    assert MW.join(torch.tensor([float("inf")], dtype=torch.bfloat16), torch.tensor([5], dtype=torch.int16),
                   torch.zeros(0, dtype=torch.int64)).item() == float("inf")


def test_stochastic_bf16_is_unbiased_and_repeatable():
    x = torch.full((1 << 16,), 1.0 + 2 ** -10)  # a quarter of the way from 1.0 to the next bf16 value up
    h1 = MW.stochastic_bf16(x, 5, 9)
    assert torch.equal(h1.view(torch.int16), MW.stochastic_bf16(x, 5, 9).view(torch.int16))
    assert not torch.equal(h1.view(torch.int16), MW.stochastic_bf16(x, 6, 9).view(torch.int16))
    up = (h1.float() > 1.0).float().mean().item()
    assert abs(up - 0.125) < 0.01, up  # 2**-10 is 1/8 of bf16's step 2**-7 at 1.0
    assert set(h1.float().unique().tolist()) == {1.0, 1.0078125}
    assert torch.isnan(MW.stochastic_bf16(torch.tensor([float("nan")]), 0, 0).float()).all()


# ---- FP4AdamW -------------------------------------------------------------------------------------------

def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.GELU(), torch.nn.Linear(160, 8))


def _params(model, big: int):
    g = torch.Generator().manual_seed(1)
    extra = torch.nn.Parameter(torch.randn(big, generator=g) * 0.02)
    return list(model.parameters()) + [extra]


def _train(master: str, steps: int, *, backend="auto", big=(1 << 20) + 4097, dtype=torch.bfloat16, seed=0,
           opt_kwargs=None, start=None, return_opt=False):
    model = _model().to(dtype)
    params = _params(model, big)
    with torch.no_grad():
        params[-1].data = params[-1].data.to(dtype)
    opt = FP4AdamW(params, lr=3e-3, weight_decay=0.1, master=master, state_format=StateFormat(seed=seed),
                   step_options=StepOptions(backend=backend), **opt_kwargs or {})
    if start is not None:
        start(params, opt)
    g = torch.Generator().manual_seed(2)
    xs = torch.randn(steps, 32, 96, generator=g).to(dtype)
    losses = []
    for i in range(steps):
        loss = model(xs[i]).float().pow(2).mean() + params[-1].float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return (losses, params, opt) if return_opt else (losses, params)


def _masters(opt, params):
    out = []
    for p in params:
        st = opt.state[p]
        if "master_lo" in st:
            out.append(MW.join(p.data.view(-1), st["master_lo"], st["master_odd"]))
        else:
            out.append(st["master"].clone())
    return out


@pytest.mark.slow  # 200 steps twice on this CPU's own path, 60 on the others (the same bytes: test_optim_fused)
def test_split_trains_bit_for_bit_as_fp32_master_for_200_steps(step_ext, simd):
    steps = 200 if simd == cpu_isa.available()[0] else 60
    la, pa, oa = _train("fp32", steps, return_opt=True)
    lb, pb, ob = _train("split", steps, return_opt=True)
    assert la == lb
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(pa, pb))
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(_masters(oa, pa),
                                                                                       _masters(ob, pb)))
    mb = ob.master_bytes()
    n = sum(p.numel() for p in pb)
    assert 2 * n <= mb["host"] < 2 * n + 8 * n // 1000 and oa.master_bytes()["host"] == 4 * n


def _plant_ties(params, opt):
    """Masters that are exact ties (half-way between two bf16 values), half rounding down: odd positions."""
    g = torch.Generator().manual_seed(3)
    for p in params:
        st = opt.state.get(p)
        if st is None:
            continue
        k = torch.randint(0, p.numel(), (p.numel() // 8,), generator=g)
        b = p.data.view(-1).view(torch.int16).to(torch.int64)[k] & 0xFFFF
        st["master"].view(torch.int32)[k] = ((b << 16) | 0x8000).to(torch.int32)


def test_split_from_fp32_state_with_ties_keeps_training_identically(step_ext):
    """An fp32 master full of ties, loaded into split, trains exactly as it does in fp32 (the odd positions)."""
    odd_at_start = []

    def start_from_planted(params, opt):
        src = FP4AdamW(params, lr=3e-3, weight_decay=0.1, master="fp32")
        for p in params:  # one zero-lr step gives every parameter its state and an fp32 master
            p.grad = torch.zeros_like(p)
        src.param_groups[0]["lr"] = 0.0
        src.step()
        _plant_ties(params, src)
        with torch.no_grad():  # a consistent checkpoint: the parameters are the masters rounded to nearest
            for p in params:
                p.copy_(src.state[p]["master"].view(p.shape).to(torch.bfloat16))
        sd = src.state_dict()
        sd["param_groups"][0]["lr"] = 3e-3
        opt.load_state_dict(sd)
        if opt.master == "split":
            odd_at_start.append(sum(opt.state[p]["master_odd"].numel() for p in params))
        for p in params:
            p.grad = None

    la, pa, oa = _train("fp32", 30, start=start_from_planted, return_opt=True)
    lb, pb, ob = _train("split", 30, start=start_from_planted, return_opt=True)
    assert la == lb
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(pa, pb))
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(_masters(oa, pa),
                                                                                       _masters(ob, pb)))
    assert odd_at_start[0] > 50000  # about half of the planted ties (1/8 of the elements) rounded down


_REFERENCE_RUNS: dict[str, tuple] = {}


def _reference_run(master: str) -> tuple:
    """The reference step's 4-step run: the same bits under every CPU path, so one run serves them all."""
    if master not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[master] = _train(master, 4, big=(1 << 20) + 1043, backend="reference")
    return _REFERENCE_RUNS[master]


@pytest.mark.parametrize("master", ["split", "bf16"])
def test_fused_master_step_equals_reference(step_ext, simd, master):
    la, pa = _train(master, 4, big=(1 << 20) + 1043)
    lb, pb = _reference_run(master)
    assert la == lb
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(pa, pb))


@pytest.mark.slow  # up to ~6 s on the scalar path
def test_bf16_master_is_deterministic_for_a_seed_and_trains(step_ext, simd):
    # every path: a seed repeats its run bit for bit, another seed differs; this CPU's own path: it trains as fp32
    steps = 40 if simd == cpu_isa.available()[0] else 12
    la, pa = _train("bf16", steps)
    lb, pb = _train("bf16", steps)
    lc, pc = _train("bf16", steps, seed=1)
    assert la == lb and all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(pa, pb))
    assert la != lc
    if steps == 40:
        lf, _ = _train("fp32", 40)
        assert la[-1] < 0.5 * la[0] and abs(la[-1] - lf[-1]) < 0.05 * lf[0]


@pytest.mark.parametrize("master", ["split", "bf16"])
def test_resume_from_state_dict_repeats_the_run(step_ext, master, tmp_path):
    full, pf = _train(master, 12)
    first, p1, o1 = _train(master, 6, return_opt=True)
    torch.save({"opt": o1.state_dict(), "params": [p.detach() for p in p1]}, tmp_path / "ck.pt")
    ck = torch.load(tmp_path / "ck.pt")

    def start(params, opt):
        with torch.no_grad():
            for p, saved in zip(params, ck["params"]):
                p.copy_(saved)
        opt.load_state_dict(ck["opt"])

    model_losses = _train_more(master, 6, start)
    assert first + model_losses[0] == full
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(pf, model_losses[1]))


def _train_more(master, steps, start):
    """Steps 7..12 of _train's data, from a checkpoint."""
    model = _model().to(torch.bfloat16)
    params = _params(model, (1 << 20) + 4097)
    with torch.no_grad():
        params[-1].data = params[-1].data.to(torch.bfloat16)
    opt = FP4AdamW(params, lr=3e-3, weight_decay=0.1, master=master)
    start(params, opt)
    g = torch.Generator().manual_seed(2)
    xs = torch.randn(12, 32, 96, generator=g).to(torch.bfloat16)
    losses = []
    for i in range(12 - steps, 12):
        loss = model(xs[i]).float().pow(2).mean() + params[-1].float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, params


def test_state_dict_survives_a_cast_and_converts_between_forms(step_ext):
    _, pa, oa = _train("split", 5, return_opt=True)
    sd = oa.state_dict()
    for e in sd["state"].values():  # DeepSpeed's loader casts state tensors to the parameter dtype
        for k in ("master_lo", "master_odd"):
            if k in e:
                e[k] = e[k].to(torch.bfloat16)
    masters = _masters(oa, pa)
    ob = FP4AdamW(pa, lr=3e-3, master="split")
    ob.load_state_dict(sd)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(masters, _masters(ob, pa)))
    of = FP4AdamW(pa, lr=3e-3, master="fp32")  # split -> fp32: the same master, exactly
    of.load_state_dict(oa.state_dict())
    assert all(torch.equal(a.view(torch.int32), of.state[p]["master"].view(torch.int32))
               for a, p in zip(masters, pa))
    back = FP4AdamW(pa, lr=3e-3, master="split")  # fp32 -> split
    back.load_state_dict(of.state_dict())
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(masters, _masters(back, pa)))


def test_torch_adamw_state_converts_into_split(step_ext):
    model = _model().to(torch.bfloat16)
    params = list(model.parameters())
    ta = torch.optim.AdamW(params, lr=1e-3)
    model(torch.randn(4, 96).to(torch.bfloat16)).float().sum().backward()
    ta.step()
    opt = FP4AdamW(params, lr=1e-3, master="split")
    opt.load_state_dict(ta.state_dict())
    before = [p.detach().clone() for p in params]
    opt.step()  # the grads are still there: a step from the converted state moves the weights
    assert any(not torch.equal(a, p) for a, p in zip(before, params))
    assert all(opt.state[p]["master_lo"].dtype == torch.int16 for p in params)


def test_split_on_the_nvme_tier_equals_fp32(step_ext, tmp_path):
    kw = dict(state_device="nvme", nvme_path=str(tmp_path), nvme=NvmeOptions(io="threads"))
    la, pa = _train("fp32", 6, big=(2 << 20) + 77, opt_kwargs=kw)
    lb, pb = _train("split", 6, big=(2 << 20) + 77, opt_kwargs=kw)
    assert la == lb and all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(pa, pb))


def test_bad_master_settings_are_refused_before_anything_is_built():
    p32 = torch.nn.Parameter(torch.zeros(10))
    with pytest.raises(ConfigError, match=r"master.*'sideways'.*one of 'fp32', 'split', 'bf16'"):
        FP4AdamW([p32], master="sideways")
    with pytest.raises(ConfigError, match=r"master.*split.*model.to\(torch.bfloat16\)"):
        FP4AdamW([p32], master="split")
    pb = torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))
    with pytest.raises(ConfigError, match="working_copy"):
        FP4AdamW([pb], master="split", step_options=StepOptions(working_copy="nvfp4"))
    opt = FP4AdamW([pb], master="bf16")
    with pytest.raises(ConfigError, match="master"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4))]})
    from fp4offload._optim import WeightRegion
    with pytest.raises(ConfigError, match="master"):
        opt.hooks.weight_regions(pb, [WeightRegion(0, 2, 5)])


def test_nonfinite_master_keeps_fp32_behaviour(step_ext):
    """A NaN or Inf weight stays so under split, as it does with the fp32 master."""
    res = {}
    for master in ("fp32", "split"):
        p = torch.nn.Parameter(torch.randn(5000, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16))
        with torch.no_grad():
            p[7], p[8] = float("nan"), float("inf")
        opt = FP4AdamW([p], lr=1e-3, master=master, step_options=StepOptions(skip_nonfinite=False))
        for _ in range(3):
            p.grad = torch.ones_like(p)
            opt.step()
        res[master] = p.detach().clone()
    assert torch.isnan(res["split"][7]) and torch.isinf(res["split"][8])
    a, b = res["fp32"], res["split"]
    assert torch.equal(torch.isnan(a), torch.isnan(b))  # a NaN's sign and payload are the arithmetic's
    assert torch.equal(a[~torch.isnan(a)].view(torch.int16), b[~torch.isnan(b)].view(torch.int16))


def test_reference_segments_match_fused_across_a_segment_boundary(step_ext):
    """Streams and odd positions per segment: a parameter of two segments and a tail."""
    la, pa = _train("bf16", 2, big=2 * R.SEGMENT + 5)
    lb, pb = _train("bf16", 2, big=2 * R.SEGMENT + 5, backend="reference")
    assert torch.equal(pa[-1].view(torch.int16), pb[-1].view(torch.int16))


def test_a_given_gradient_norm_replaces_the_nonfinite_pass(monkeypatch):
    p = torch.nn.Parameter(torch.randn(5000).to(torch.bfloat16))
    opt = FP4AdamW([p], lr=1e-2, master="split")
    calls = []
    real = opt.stepper.grads_finite
    monkeypatch.setattr(opt.stepper, "grads_finite", lambda gs: calls.append(1) or real(gs))
    p.grad = torch.ones_like(p)
    before = p.detach().clone()
    opt.step(grad_norm=float("inf"))  # the caller's norm says non-finite: skipped, gradients not read
    assert opt.skipped_steps == 1 and torch.equal(before, p.detach()) and not calls
    opt.step(grad_norm=torch.tensor(3.0))
    assert opt.skipped_steps == 1 and not torch.equal(before, p.detach()) and not calls
    opt.hooks.grad_norm_source(lambda: -1.0)  # DeepSpeed reports Inf/NaN norms as -1
    opt.step()
    assert opt.skipped_steps == 2 and not calls
    opt.hooks.grad_norm_source(lambda: None)  # not computed this step: the pass runs
    p.grad[3] = float("nan")
    opt.step()
    assert opt.skipped_steps == 3 and calls == [1]
    with pytest.raises(ConfigError, match="fn"):
        opt.hooks.grad_norm_source(3.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("master", ["split", "bf16"])
def test_cuda_compact_master_equals_the_cpu_step(master):
    """On the GPU the fused CUDA kernel rebuilds, steps and splits the master itself: the same bits as the CPU
    step, and split the same as the fp32 master there."""
    res = {}
    for dev, form in (("cpu", master), ("cuda", master), ("cuda", "fp32")):
        g = torch.Generator().manual_seed(5)
        p = torch.nn.Parameter((torch.randn((1 << 20) + 333, generator=g) * 0.02).to(torch.bfloat16).to(dev))
        opt = FP4AdamW([p], lr=1e-2, weight_decay=0.1, master=form)
        for _ in range(3):
            p.grad = (torch.randn(p.numel(), generator=g) * 1e-3).to(torch.bfloat16).to(dev)
            opt.step()
        res[(dev, form)] = p.detach().cpu().view(torch.int16)
    assert torch.equal(res[("cpu", master)], res[("cuda", master)])
    if master == "split":
        assert torch.equal(res[("cuda", "split")], res[("cuda", "fp32")])


def test_a_grad_scale_is_applied_in_fp32_so_split_stays_the_fp32_run(step_ext):
    """hooks.scale_grad (DeepSpeed ZeRO-3's clipping when the master's gradient is its bf16 gradient partition):
    split with bf16 gradients, and the fp32 master with bf16 gradients (scaled in fp32 segment by segment, the
    gradient left as it is), step exactly as the fp32 master whose fp32 gradients were multiplied by the scale
    in place; a skipped step drops its scale."""
    from fp4offload._deepspeed.at_init import set_grad as _set_grad

    g = torch.Generator().manual_seed(7)
    sizes = (5000, 100, (1 << 20) + 3000)  # packed states, fp32 states (small), two segments
    start = [torch.randn(n, generator=g).to(torch.bfloat16) for n in sizes]
    p32 = [torch.nn.Parameter(x.float()) for x in start]
    p16 = [torch.nn.Parameter(x.clone()) for x in start]
    pmix = [torch.nn.Parameter(x.float()) for x in start]  # fp32 master, bf16 gradient
    o32 = FP4AdamW(p32, lr=1e-2, weight_decay=0.1, master="fp32", state_format=StateFormat(min_numel=4096))
    o16 = FP4AdamW(p16, lr=1e-2, weight_decay=0.1, master="split", state_format=StateFormat(min_numel=4096))
    omix = FP4AdamW(pmix, lr=1e-2, weight_decay=0.1, master="fp32", state_format=StateFormat(min_numel=4096))
    for step in range(6):
        grads = [torch.randn(n, generator=g).to(torch.bfloat16) for n in sizes]
        if step == 3:
            grads[0][7] = float("nan")  # this step is skipped, and its scale with it
        scale = torch.tensor(0.37 + 0.1 * step)
        for a, b, c, gr in zip(p32, p16, pmix, grads):
            a.grad, b.grad = gr.float(), gr.clone()
            _set_grad(c, gr.clone())
            for o, q in ((o32, a), (o16, b), (omix, c)):
                o.hooks.scale_grad(q, scale)
        o32.step()
        o16.step()
        omix.step()
        for a, b, c in zip(p32, p16, pmix):
            assert torch.equal(a.data.view(torch.int32), _masters(o16, [b])[0].view(torch.int32)), step
            assert torch.equal(a.data.view(torch.int32), c.data.view(torch.int32)), step
            assert c.grad.dtype == torch.bfloat16
    assert o16.skipped_steps == o32.skipped_steps == omix.skipped_steps == 1
    # the fused CPU step applies the scale as it reads the gradient, leaving it as it was (other backends multiply
    # an fp32 gradient in place); the weights above show the scale was applied
    assert torch.equal(p32[0].grad, grads[0].float())
    assert torch.equal(pmix[0].grad, grads[0])  # ... and left the bf16 gradient as it was
    with pytest.raises(ConfigError, match="scale"):
        o16.hooks.scale_grad(p16[0], float("nan"))
    # a factor of 1 (DeepSpeed's when it does not clip) changes no value: nothing is pending, no pass is made
    o32.hooks.scale_grad(p32[0], 0.5)
    o32.hooks.scale_grad(p32[0], torch.tensor(1.0))
    assert p32[0] not in o32.hooks.scales
