"""CUDA paths of FP4AdamW (need a GPU; skipped without one). The CUDA sources are compile-checked elsewhere."""

import pytest
import torch
from _extensions import fused_extension

from fp4offload.optim import reference_step as R

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda_ext():
    return fused_extension(cuda=True)


@pytest.mark.parametrize("n", [1, 17, 1000, 1025, 70001, R.SEGMENT + 3000])
@pytest.mark.parametrize("v_format,stochastic", [("ufp4", False), ("ufp4", True), ("nvfp4", False)])
def test_cuda_fused_equals_cpu_reference(cuda_ext, n, v_format, stochastic):
    g0 = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=g0)
    pa, pb = p.clone(), p.clone().cuda()
    ma, va = R.empty_packed(n, "cpu"), R.empty_packed(n, "cpu")
    mb, vb = R.empty_packed(n, "cuda"), R.empty_packed(n, "cuda")
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
                          bf16_out=bfa[s0:s1])
        cuda_ext.fused_step(pb, g.cuda(), *mb, *vb, sc.b1, sc.omb1, sc.b2, sc.omb2, sc.eps, sc.decay, sc.step_size,
                            sc.rsbc2, sc.weight_decay, False, v_format == "nvfp4", stochastic, seed, R.sr_stream(2, 0),
                            bfb)
        torch.cuda.synchronize()
        assert torch.equal(pa.view(torch.int32), pb.cpu().view(torch.int32))
        assert torch.equal(bfa.view(torch.int16), bfb.cpu().view(torch.int16))
        for x, y in zip((*ma, *va), (*mb, *vb)):
            assert torch.equal(x, y.cpu())


@pytest.mark.parametrize("tier", ["same", "cpu"])
def test_gpu_params_match_cpu_params(tier, tmp_path):
    """GPU parameters with states on the GPU or on the host train bit-identically to CPU parameters."""
    from fp4offload import FP4AdamW

    def run(device, state_device):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(R.SEGMENT + 5000, device=device) * 0.1),
              torch.nn.Parameter(torch.randn(300, device=device))]
        opt = FP4AdamW(ps, lr=1e-2, state_device=state_device, m_rounding="stochastic")
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

    def run(device, state_device):
        torch.manual_seed(0)
        ps = [torch.nn.Parameter((torch.randn(R.SEGMENT + 5000) * 0.1).bfloat16().to(device)),
              torch.nn.Parameter(torch.randn(300).bfloat16().to(device))]
        opt = FP4AdamW(ps, lr=1e-2, state_device=state_device, m_rounding="stochastic")
        for s in range(3):
            for i, p in enumerate(ps):
                g = torch.Generator().manual_seed(10 * s + i)
                p.grad = torch.randn(p.shape, generator=g).bfloat16().to(device)
            opt.step()
        return [opt.state[p]["master"].cpu() for p in ps], [p.detach().cpu() for p in ps]

    (ref_master, ref_p), (got_master, got_p) = run("cpu", "same"), run("cuda", tier)
    assert torch.equal(ref_master[0], got_master[0]) and torch.equal(ref_p[0], got_p[0])
    assert torch.allclose(ref_master[1], got_master[1], rtol=0, atol=1e-6)
