"""The fused FP4AdamW step's byte-for-byte checks, run on every backend that has the step: the CPU extension
(tests/unit/test_optim_fused.py), the CUDA kernels under the host emulation (tests/emulation/test_cuda_emulated.py)
and on a GPU (tests/emulation/test_optim_cuda.py). Each check runs a few steps of the backend and of the torch
reference (fp4offload._optim.reference_step, and master.py for the compact masters) from the same start and asserts
that every byte agrees after each step."""

from __future__ import annotations

import torch

from fp4offload._optim import master as MW
from fp4offload._optim import reference_step as R


def _bits(t):
    return t.view(torch.uint8)


def run_fused(step_ext, n, v_format, stochastic, gdt, *, steps=3, wd=0.01, maximize=False, pid=3, special=None,
              v_stochastic=False, grad_scale=None):
    """Runs `steps` steps both ways on the same data; asserts every byte of p, bf16 copy, m and v agrees.
    `stochastic` / `v_stochastic`: m / the second moment rounded stochastically. `grad_scale`: the kernel scales
    each gradient as it reads it; the reference gets the gradient scaled in fp32 first (FP4AdamW's _scaled)."""
    g0 = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=g0)
    pa, pb = p.clone(), p.clone()
    ma, mb = (R.empty_packed(n, "cpu") for _ in range(2))
    va, vb = (R.empty_packed(n, "cpu", R.v_bits(v_format)) for _ in range(2))
    for t in range(1, steps + 1):
        g = (torch.randn(n, generator=g0) * torch.exp(torch.randn(n, generator=g0) * 2)).to(gdt)
        if n > 3:
            g[0], g[1] = 0.0, -0.0
        if special is not None:
            g = special(g, t).to(gdt)
        sc = R.StepScalars.make(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd, step=t)
        seed = R.sr_seed(7, t)
        bfa, bfb = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
        gr = g if grad_scale is None else g.to(torch.float32, copy=True).mul_(grad_scale)
        for k, s0 in enumerate(range(0, n, R.SEGMENT)):
            s1 = min(n, s0 + R.SEGMENT)
            R.packed_step(pa[s0:s1], gr[s0:s1], R.segment_view(ma, s0, s1), R.segment_view(va, s0, s1), sc,
                          v_format=v_format, m_stochastic=stochastic, seed=seed, stream=R.sr_stream(pid, k),
                          maximize=maximize, bf16_out=bfa[s0:s1], v_stochastic=v_stochastic)
        step_ext.fused_step(pb, g, *mb, *vb, sc.b1, sc.omb1, sc.b2, sc.omb2, sc.eps, sc.decay, sc.step_size, sc.rsbc2,
                       sc.weight_decay, maximize, R.V_KIND[v_format], stochastic, seed, R.sr_stream(pid, 0), bfb,
                       v_stochastic=v_stochastic, **({} if grad_scale is None else {"grad_scale": grad_scale}))
        assert torch.equal(_bits(pa), _bits(pb)), f"weights differ at step {t}"
        if special is not None:  # NaN weights: torch's bf16 cast keeps the NaN's sign/payload, the kernel writes 0x7FC0
            nan = pa.isnan()
            assert bfa[nan].isnan().all() and bfb[nan].isnan().all()
            bfa, bfb = bfa[~nan], bfb[~nan]
        assert torch.equal(_bits(bfa), _bits(bfb)), f"bf16 copies differ at step {t}"
        for name, x, y in zip(("m codes", "m scales", "m chunk scales"), ma, mb):
            assert torch.equal(x, y), f"{name} differ at step {t}"
        for name, x, y in zip(("v codes", "v scales", "v chunk scales"), va, vb):
            assert torch.equal(x, y), f"{name} differ at step {t}"
    assert pa.nan_to_num().abs().sum() > 0 and mb.codes.any()  # something happened


def special_grads(kind):
    """Gradients that leave the AVX-512 fast path or hit its masking: g^2 overflow (v = inf in some blocks),
    non-finite values (the step is called directly, as with skip_nonfinite=False), all-zero blocks (block
    scale 0, codes of -0 must stay 0), and chunks whose range underflows the block scales."""
    def f(g, t):
        g = g.clone().float()
        n = g.numel()
        if kind == "overflow":
            g[5::997] = 3e19 * (-1) ** t
        elif kind == "nonfinite":
            g[7::1500] = float("inf")
            g[9::2100] = float("nan")
            g[11::2500] = -float("inf")
        elif kind == "zeros":
            g.view(-1)[: n - n % 16].view(-1, 16)[::3] = 0.0
            g[2::48] = -0.0
        elif kind == "range":
            g = g * 1e-30
            g[::16] = 1e3
            g[1024:2048] *= 1e-8
        return g
    return f


def clone_packed(x: R.Packed) -> R.Packed:
    return R.Packed(*(t.clone() for t in x))


def check_v_rounded_stochastically(ref_v: R.Packed, near_v: R.Packed, same: list) -> int:
    """The reference's stored v with v_stochastic against the nearest rounding of the same step from the same
    start: the scales agree and so does everything in `same` (pairs: the weights, m, ...; only v's codes may
    move); returns how many v code bytes differ (a kernel that ignored v_stochastic would give the nearest ones)."""
    for a, b in same:
        assert torch.equal(a, b), "v's rounding changed something besides v's codes"
    assert torch.equal(ref_v.scales, near_v.scales) and torch.equal(ref_v.tscale, near_v.tscale)
    return int((ref_v.codes != near_v.codes).sum())


def plant_ties(x: torch.Tensor) -> torch.Tensor:
    """x with exact bf16 ties planted: every 14th element rounds down to an even bf16 value (odd in split),
    every 14th from the 7th rounds up (not odd)."""
    b = x.view(torch.int32).clone()
    i = torch.arange(x.numel())
    b = torch.where(i % 14 == 0, (b & ~0x1FFFF) | 0x8000, b)
    b = torch.where(i % 14 == 7, (b & ~0x1FFFF) | 0x18000, b)
    return b.view(torch.float32)


def _plant_specials(h, lo, split):
    """Masters at the edges: +-Inf halves with a positive residual (stay infinite), +Inf with a negative one
    (the finite values that round up to Inf), a NaN."""
    hb = h.view(torch.int16)
    for i, hv, r in ((3, 0x7F80, 5), (4, -0x80, 7), (5, 0x7F80, -5), (6, 0x7FC0, 0)):  # -0x80: 0xFF80
        hb[i] = hv
        if split:
            lo[i] = r


def _compact_reference(h, lo, odd, g, m, v, sc, *, split, v_format, stochastic, seed, pid, maximize,
                       v_stochastic=False):
    """adamw.py's torch-op path, segment by segment (master.py and reference_step, normative)."""
    n = h.numel()
    new_odd = []
    for k, (s0, s1) in enumerate(R.segment_ranges(n)):
        x = MW.join(h[s0:s1], lo[s0:s1], MW.odd_in(odd, s0, s1)) if split else h[s0:s1].float()
        R.packed_step(x, g[s0:s1], R.segment_view(m, s0, s1), R.segment_view(v, s0, s1), sc, v_format=v_format,
                      m_stochastic=stochastic, seed=seed, stream=R.sr_stream(pid, k), maximize=maximize,
                      v_stochastic=v_stochastic)
        if split:
            hh, r, o = MW.split(x)
            h[s0:s1], lo[s0:s1] = hh, r
            new_odd.append(o + s0)
        else:
            h[s0:s1] = MW.stochastic_bf16(x, seed, R.sr_stream(pid, k))
    return torch.cat(new_odd) if new_odd else torch.zeros(0, dtype=torch.int64)


def run_master(exts, n, mode, stochastic, v_format, gdt, wd, *, special=None, steps=3, pid=5, v_stochastic=False):
    """`steps` steps of each fused_step_master in `exts` (name -> extension) and of the reference on the same
    data from the same start; asserts every byte of hi, lo, odd and packed m and v agrees after each step (with
    v_stochastic, also that v's codes are not those of nearest rounding). Returns the number of odd positions
    before the first step and after the last."""
    split = mode == "split"
    g0 = torch.Generator().manual_seed(n)
    x0 = plant_ties(torch.randn(n, generator=g0) * 0.02)
    if split:
        h0, lo0, odd0 = MW.split(x0)
    else:
        h0, lo0, odd0 = x0.to(torch.bfloat16), torch.zeros(n, dtype=torch.int16), torch.zeros(0, dtype=torch.int64)
    if special is not None and n > 8:
        _plant_specials(h0, lo0, split)
        odd0 = odd0[(odd0 < 3) | (odd0 > 6)]
    runs = {name: [h0.clone(), lo0.clone(), odd0.clone(), R.empty_packed(n, "cpu"),
                   R.empty_packed(n, "cpu", R.v_bits(v_format))]
            for name in ("ref", *exts)}
    still = (torch.arange(n) // 16) % 5 == 2  # whole blocks with zero gradients: m = v = 0, the update is 0
    odd_before = odd0.numel()
    moved = 0
    for t in range(1, steps + 1):
        g = torch.randn(n, generator=g0) * torch.exp(torch.randn(n, generator=g0) * 2)
        if special is not None:
            g = special(g, t)
        g = torch.where(still, torch.zeros_like(g), g).to(gdt)
        sc = R.StepScalars.make(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd, step=t)
        seed = R.sr_seed(7, t)
        kw = dict(split=split, v_format=v_format, stochastic=stochastic, seed=seed, pid=pid, maximize=False)
        if v_stochastic:  # the step with v rounded to nearest, from the same start
            near = [x.clone() for x in runs["ref"][:3]] + [clone_packed(x) for x in runs["ref"][3:]]
            near[2] = _compact_reference(*near[:3], g, *near[3:], sc, **kw)
        for name, run in runs.items():
            h, lo, odd, m, v = run
            if name == "ref":
                run[2] = _compact_reference(h, lo, odd, g, m, v, sc, v_stochastic=v_stochastic, **kw)
            else:
                run[2] = exts[name].fused_step_master(
                    h, lo if split else None, odd, g, *m, *v, sc.b1, sc.omb1, sc.b2, sc.omb2, sc.eps, sc.decay,
                    sc.step_size, sc.rsbc2, sc.weight_decay, False, R.V_KIND[v_format], stochastic, seed,
                    R.sr_stream(pid, 0), 1 if split else 2, v_stochastic=v_stochastic)
        ref = runs["ref"]
        if v_stochastic:
            moved += check_v_rounded_stochastically(ref[4], near[4], [
                (ref[0].view(torch.int16), near[0].view(torch.int16)), (ref[1], near[1]), (ref[2], near[2]),
                *zip(ref[3], near[3])])
        for name in exts:
            got = runs[name]
            for what, a, b in (("hi", ref[0].view(torch.int16), got[0].view(torch.int16)), ("lo", ref[1], got[1]),
                               ("odd", ref[2], got[2])):
                assert torch.equal(a, b), f"{name}: {what} differs at step {t} (n={n}, {mode})"
            for what, a, b in zip(("m codes", "m scales", "m chunk scales", "v codes", "v scales",
                                   "v chunk scales"), (*ref[3], *ref[4]), (*got[3], *got[4])):
                assert torch.equal(a, b), f"{name}: {what} differ at step {t} (n={n}, {mode})"
    h = runs["ref"][0]
    assert not torch.equal(h.view(torch.int16), h0.view(torch.int16)) and runs["ref"][3].codes.any()
    # stochastic rounding of v moved some code off the nearest one; a size of 1 or 17 may draw none in a few steps
    assert moved > 0 or not v_stochastic or n < 64
    return odd_before, runs["ref"][2].numel()
