"""CUDA paths of FP4AdamW (need a GPU; skipped without one). The CUDA sources are compile-checked elsewhere."""

import pytest
import torch
from helpers.extensions import fused_extension
from helpers.optim_cases import plant_ties, run_master, special_grads

from fp4offload._optim import reference_step as R

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_ext():
    return fused_extension(cuda=True)


@pytest.mark.parametrize("n", [1, 17, 1000, 1025, 70001, R.SEGMENT + 3000])
@pytest.mark.parametrize("v_format,stochastic,v_stochastic", [("ufp4", False, False), ("ufp4", True, False),
                                                              ("nvfp4", False, False), ("ufp4", True, True),
                                                              ("nvfp4", False, True), ("ue2m2", True, True),
                                                              ("ue2m2", False, False), ("ue2m0", True, True)])
def test_cuda_fused_equals_cpu_reference(cuda_ext, n, v_format, stochastic, v_stochastic):
    g0 = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=g0)
    pa, pb = p.clone(), p.clone().cuda()
    ma, va = R.empty_packed(n, "cpu"), R.empty_packed(n, "cpu", R.v_bits(v_format))
    mb, vb = R.empty_packed(n, "cuda"), R.empty_packed(n, "cuda", R.v_bits(v_format))
    for t in range(1, 4):
        g = torch.randn(n, generator=g0) * torch.exp(torch.randn(n, generator=g0) * 2)
        sc = R.StepScalars.make(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=t)
        seed = R.sr_seed(1, t)
        bfa = torch.empty(n, dtype=torch.bfloat16)
        bfb = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        for k, s0 in enumerate(range(0, n, R.SEGMENT)):
            s1 = min(n, s0 + R.SEGMENT)
            R.packed_step(pa[s0:s1], g[s0:s1], R.segment_view(ma, s0, s1), R.segment_view(va, s0, s1), sc,
                          v_format=v_format, m_stochastic=stochastic, seed=seed, stream=R.sr_stream(2, k),
                          bf16_out=bfa[s0:s1], v_stochastic=v_stochastic)
        cuda_ext.fused_step(pb, g.cuda(), *mb, *vb, sc.b1, sc.omb1, sc.b2, sc.omb2, sc.eps, sc.decay, sc.step_size,
                            sc.rsbc2, sc.weight_decay, False, R.V_KIND[v_format], stochastic, seed, R.sr_stream(2, 0),
                            bfb, v_stochastic=v_stochastic)
        torch.cuda.synchronize()
        assert torch.equal(pa.view(torch.int32), pb.cpu().view(torch.int32))
        assert torch.equal(bfa.view(torch.int16), bfb.cpu().view(torch.int16))
        for x, y in zip((*ma, *va), (*mb, *vb)):
            assert torch.equal(x, y.cpu())


class _OnGpu:
    """The CUDA extension's fused_step_master on CPU tensors: copies them to the GPU, steps, copies them back
    (so tests/helpers/optim_cases.py's run_master drives it beside the CPU step and the reference)."""

    def __init__(self, ext):
        self.ext = ext

    def fused_step_master(self, hi, lo, odd, grad, *rest, **kw):
        tensors = [hi, lo, grad, *rest[:6]]
        on_gpu = [None if t is None else t.cuda() for t in tensors]
        new = self.ext.fused_step_master(*on_gpu[:2], odd, *on_gpu[2:], *rest[6:], **kw)  # odd from the host: moved
        torch.cuda.synchronize()
        assert new.is_cuda and new.dtype == torch.int64
        for t, d in zip(tensors, on_gpu):
            if t is not None:
                t.copy_(d.cpu())
        return new.cpu()


@pytest.mark.parametrize("n", [1, 17, 1025, 70001, R.SEGMENT + 3000])
@pytest.mark.parametrize("mode", ["split", "bf16"])
@pytest.mark.parametrize("stochastic,v_format,gdt,v_stochastic", [(False, "ufp4", torch.float32, False),
                                                                   (True, "nvfp4", torch.bfloat16, False),
                                                                   (True, "ufp4", torch.bfloat16, True),
                                                                   (False, "nvfp4", torch.float32, True),
                                                                   (True, "ue2m2", torch.bfloat16, True),
                                                                   (True, "ue2m0", torch.bfloat16, True)])
def test_cuda_fused_step_master_equals_cpu_and_reference(cuda_ext, n, mode, stochastic, v_format, gdt, v_stochastic):
    """The compact masters in the CUDA kernel (the dense odd mask and its conversions included): the CPU
    fused_step_master's and the reference's bytes, with planted ties that stay odd in zero-gradient blocks."""
    from helpers.extensions import fused_extension as fx

    exts = {"cuda": _OnGpu(cuda_ext), "cpu": fx(cuda=False)}
    before, after = run_master(exts, n, mode, stochastic, v_format, gdt, 0.0, steps=2 if n > R.SEGMENT else 3,
                               v_stochastic=v_stochastic)
    if mode == "split" and n > 48:
        assert before > 0 and after > 0


@pytest.mark.parametrize("mode", ["split", "bf16"])
@pytest.mark.parametrize("kind", ["overflow", "nonfinite"])
def test_cuda_fused_step_master_special_values(cuda_ext, kind, mode):
    from helpers.extensions import fused_extension as fx

    run_master({"cuda": _OnGpu(cuda_ext), "cpu": fx(cuda=False)}, 5003, mode, mode == "bf16", "ufp4",
               torch.float32, 0.1, special=special_grads(kind))


def test_cuda_fused_step_master_refuses_bad_odd_and_changes_nothing(cuda_ext):
    n = 3000
    h = torch.randn(n, device="cuda").to(torch.bfloat16)
    lo = torch.arange(n, dtype=torch.int16, device="cuda")
    g = torch.randn(n, device="cuda")
    m, v = R.empty_packed(n, "cuda"), R.empty_packed(n, "cuda")
    sc = R.StepScalars.make(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1)
    for bad in ([5, 3], [7, 7], [n], [-1]):
        hh, ll = h.clone(), lo.clone()
        with pytest.raises(RuntimeError, match="odd must hold increasing positions"):
            cuda_ext.fused_step_master(hh, ll, torch.tensor(bad, device="cuda"), g, *m, *v, sc.b1, sc.omb1, sc.b2,
                                       sc.omb2, sc.eps, sc.decay, sc.step_size, sc.rsbc2, True, False, False, True, 1,
                                       2, 1)
        assert torch.equal(hh.view(torch.int16), h.view(torch.int16)) and torch.equal(ll, lo)
        assert not any(bool(t.any()) for t in (*m, *v))


@pytest.mark.parametrize("master", ["split", "bf16"])
def test_fp4adamw_compact_master_on_cuda_takes_the_fused_kernel(master, monkeypatch):
    """FP4AdamW on a GPU with master="split"/"bf16" steps through the kernel (no torch-op join or split; the
    reference backend still uses them) and gives the CPU step's bits: parameter, residual and odd positions."""
    from fp4offload import FP4AdamW
    from fp4offload._optim import StepOptions
    from fp4offload._optim import master as MW

    calls = []
    for name in ("join", "split", "stochastic_bf16"):
        real = getattr(MW, name)
        monkeypatch.setattr(MW, name, lambda *a, _r=real, _n=name, **k: calls.append(_n) or _r(*a, **k))
    n = 2 * R.SEGMENT + 333
    still = (torch.arange(n) // 16) % 5 == 2
    res, used = {}, {}
    for dev, backend in (("cpu", "auto"), ("cuda", "auto"), ("cuda", "reference")):
        gen = torch.Generator().manual_seed(5)
        x = plant_ties(torch.randn(n, generator=gen) * 0.02)
        h, lo, odd = MW.split(x)
        p = torch.nn.Parameter((h if master == "split" else x.to(torch.bfloat16)).to(dev))
        opt = FP4AdamW([p], lr=1e-2, weight_decay=0.0, master=master, step_options=StepOptions(backend=backend))
        if master == "split":
            opt.hooks.start_master(p, lo.to(dev), odd.to(dev))
        calls.clear()
        for _ in range(3):
            gr = torch.randn(n, generator=gen) * 1e-3
            p.grad = torch.where(still, torch.zeros_like(gr), gr).to(torch.bfloat16).to(dev)
            opt.step()
        used[(dev, backend)] = list(calls)
        st = opt.state[p]
        if master == "split":
            assert st["master_lo"].device == p.device and st["master_odd"].device == p.device
        res[(dev, backend)] = [p.detach().cpu().view(torch.int16)] + (
            [st["master_lo"].cpu(), st["master_odd"].cpu()] if master == "split" else [])
    assert used[("cuda", "auto")] == [] and used[("cuda", "reference")]
    for key in (("cuda", "auto"), ("cuda", "reference")):
        assert all(torch.equal(a, b) for a, b in zip(res[("cpu", "auto")], res[key])), key
    if master == "split":  # the still blocks kept their planted ties: odd positions came back from the kernel
        assert res[("cuda", "auto")][2].numel() >= 1000


@pytest.mark.parametrize("v_rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("tier", ["same", "cpu"])
def test_gpu_params_match_cpu_params(tier, v_rounding, tmp_path):
    """GPU parameters with states on the GPU or on the host train bit-identically to CPU parameters."""
    from fp4offload import FP4AdamW
    from fp4offload._optim import StateFormat

    def run(device, state_device):
        torch.manual_seed(0)
        # drawn on the CPU and moved: torch.randn on "cuda" draws from the GPU's generator, other numbers
        ps = [torch.nn.Parameter((torch.randn(R.SEGMENT + 5000) * 0.1).to(device)),
              torch.nn.Parameter(torch.randn(300).to(device))]
        opt = FP4AdamW(ps, lr=1e-2, state_device=state_device,
                       state_format=StateFormat(m_rounding="stochastic", v_rounding=v_rounding))
        for s in range(3):
            for i, p in enumerate(ps):
                g = torch.Generator().manual_seed(10 * s + i)
                p.grad = torch.randn(p.shape, generator=g).to(device)
            opt.step()
        return [p.detach().cpu() for p in ps]

    ref = run("cpu", "same")
    got = run("cuda", tier)
    assert torch.equal(ref[0], got[0])
    assert torch.allclose(ref[1], got[1], rtol=0, atol=1e-6)  # fp32 small-tensor path: torch ops on two devices


@pytest.mark.parametrize("tier", ["same", "cpu"])
def test_bf16_gpu_params_match_bf16_cpu_params(tier):
    """bf16 GPU parameters keep an fp32 master on the compute device and train like bf16 CPU parameters."""
    from fp4offload import FP4AdamW
    from fp4offload._optim import StateFormat

    def run(device, state_device):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter((torch.randn(R.SEGMENT + 5000) * 0.1).bfloat16().to(device)),
              torch.nn.Parameter(torch.randn(300).bfloat16().to(device))]
        opt = FP4AdamW(ps, lr=1e-2, state_device=state_device, state_format=StateFormat(m_rounding="stochastic"))
        for s in range(3):
            for i, p in enumerate(ps):
                g = torch.Generator().manual_seed(10 * s + i)
                p.grad = torch.randn(p.shape, generator=g).bfloat16().to(device)
            opt.step()
        return [opt.state[p]["master"].cpu() for p in ps], [p.detach().cpu() for p in ps]

    (ref_master, ref_p), (got_master, got_p) = run("cpu", "same"), run("cuda", tier)
    assert torch.equal(ref_master[0], got_master[0]) and torch.equal(ref_p[0], got_p[0])
    assert torch.allclose(ref_master[1], got_master[1], rtol=0, atol=1e-6)
