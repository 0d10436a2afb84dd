"""The way back to torch AdamW (fp4offload.to_torch_adamw): the moments FP4AdamW holds, decoded once, and a
torch AdamW that steps on from them as FP4AdamW would; masters are never dropped without being asked."""

from __future__ import annotations

import pytest
import torch

from fp4offload import ConfigError, FP4AdamW, StateFormat, to_torch_adamw
from fp4offload._optim import reference_step as R
from fp4offload._optim.state import decode_state, packed_from_entry
from fp4offload._optim.convert import saved_entry

SHAPES = [(96, 64), (64, 96), (64,)]  # two packed tensors (6144 elements) and a bias under min_numel: fp32 states


def _params(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _grads(params, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


def _train(opt, params, steps, first_seed=0):
    for s in range(first_seed, first_seed + steps):
        for p, gr in zip(params, _grads(params, s)):
            p.grad = gr
        opt.step()


HYPER = dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


@pytest.mark.parametrize("v_format", ["ue2m2", "ue2m0"])
def test_torch_adamw_holds_the_decoded_moments_and_steps_on_as_fp4adamw(v_format):
    params = _params()
    opt = FP4AdamW(params, **HYPER, state_format=StateFormat(v_format=v_format))
    _train(opt, params, 4)
    entries = [saved_entry(opt, p) for p in params]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    adamw = to_torch_adamw(opt)
    assert isinstance(adamw, torch.optim.AdamW) and len(adamw.param_groups) == 1
    g = adamw.param_groups[0]
    assert (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"], g["amsgrad"]) == (*HYPER.values(), False)
    for p, e in zip(params, entries):
        st = adamw.state[p]
        assert float(st["step"]) == 4 and st["exp_avg"].shape == p.shape and st["exp_avg"].dtype == torch.float32
        if "m_codes" in e:  # the packed moments, decoded by the reference codec
            m, v = decode_state(*packed_from_entry(e, p.numel()), p.numel(), v_format)
            assert torch.equal(st["exp_avg"].reshape(-1), m) and torch.equal(st["exp_avg_sq"].reshape(-1), v)
            assert e["v_format"] == v_format
        else:
            assert torch.equal(st["exp_avg"], e["exp_avg"]) and torch.equal(st["exp_avg_sq"], e["exp_avg_sq"])
    # one more step on the same gradient: FP4AdamW (decode, step, encode) and torch AdamW move the weights alike
    ref = FP4AdamW(twin, **HYPER, state_format=StateFormat(v_format=v_format))
    ref.load_state_dict(opt.state_dict())
    for ps in (params, twin):
        for p, gr in zip(ps, _grads(ps, 99)):
            p.grad = gr
    before = [p.detach().clone() for p in params]
    adamw.step()
    ref.step()
    for a, b, w in zip(params, twin, before):
        assert not torch.equal(a, w)
        torch.testing.assert_close(a - w, b - w, rtol=1e-4, atol=1e-6)  # two roundings of w (|w| < 4.4: ulp 4.8e-7)
    opt.close()


def test_a_state_on_nvme_exports_as_in_ram(tmp_path):
    ram_p, nvme_p = _params(), _params()
    ram = FP4AdamW(ram_p, **HYPER)
    nvme = FP4AdamW(nvme_p, **HYPER, state_device="nvme", nvme_path=tmp_path)
    _train(ram, ram_p, 3)
    _train(nvme, nvme_p, 3)
    a, b = to_torch_adamw(ram), to_torch_adamw(nvme)
    for p, q in zip(ram_p, nvme_p):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(a.state[p][k], b.state[q][k])
    nvme.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("master", ["fp32", "split"])
def test_a_master_beside_bf16_parameters_is_kept_or_dropped_only_when_asked(master):
    p16 = _params(torch.bfloat16)
    fp32_p = [torch.nn.Parameter(p.detach().float()) for p in p16]
    fmt = StateFormat(min_numel=R.CHUNK)
    fp32_run = FP4AdamW(fp32_p, **HYPER, state_format=fmt)
    run = FP4AdamW(p16, **HYPER, master=master, state_format=fmt)
    for s in range(3):  # the same gradients (bf16 values) on the fp32 run and the bf16 one
        grads = _grads(p16, s)
        for a, b, gr in zip(fp32_p, p16, grads):
            a.grad, b.grad = gr.float(), gr
        fp32_run.step()
        run.step()
    with pytest.raises(ConfigError, match="fp32_params") as e:
        to_torch_adamw(run)
    assert f"master={master!r}" in str(e.value) and "3 torch.bfloat16" in str(e.value)
    assert all(p.dtype == torch.bfloat16 for p in p16)  # nothing changed
    kept = [p.detach().clone() for p in p16]
    dropped = to_torch_adamw(run, fp32_params=False)
    assert all(torch.equal(p, k) for p, k in zip(p16, kept))
    assert all(dropped.state[p]["exp_avg"].dtype == torch.bfloat16 for p in p16)
    adamw = to_torch_adamw(run, fp32_params=True)
    for p, q, k in zip(p16, fp32_p, kept):
        assert p.dtype == torch.float32 and p.grad is None
        assert torch.equal(p.to(torch.bfloat16), k)  # the bf16 parameter is the master's rounding
        if master == "split":  # bf16 half and residual: the fp32 run's weight, bit for bit
            assert torch.equal(p, q)
        else:
            assert torch.equal(p, run.state[p]["master"].view(p.shape))
        assert adamw.state[p]["exp_avg"].dtype == torch.float32
    for p, gr in zip(p16, _grads(p16, 7)):
        p.grad = gr
    adamw.step()
    assert all(torch.isfinite(p).all() for p in p16)


def test_refusals_name_the_fix():
    params = _params()
    opt = FP4AdamW(params, **HYPER)
    with pytest.raises(ConfigError, match="foreach, fused"):
        to_torch_adamw(opt, lr=1e-3)
    with pytest.raises(ConfigError, match="FP4AdamW"):
        to_torch_adamw(torch.optim.AdamW(params))
    fresh = to_torch_adamw(opt, foreach=False)  # never stepped: torch AdamW starts fresh too
    assert fresh.state == {} and fresh.param_groups[0]["foreach"] is False


# -- a saved state dict, without the model (fp4offload.adamw_state_dict, fp4offload export-adamw) -------------

def test_a_saved_state_dict_converts_without_the_model_as_the_live_optimizer_does():
    from fp4offload._optim.export import adamw_state_dict

    params = _params()
    opt = FP4AdamW(params, **HYPER, state_format=StateFormat(v_format="ue2m0"))
    _train(opt, params, 3)
    saved = opt.state_dict()
    out = adamw_state_dict(saved)
    live = to_torch_adamw(opt)
    for i, p in enumerate(params):
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(out["state"][i][k], live.state[p][k]), (i, k)
    # torch AdamW over a copy of the model loads it and steps exactly as the live export does
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    adamw = torch.optim.AdamW(twin)
    adamw.load_state_dict(out)
    assert adamw.param_groups[0]["lr"] == HYPER["lr"] and "v_format" not in adamw.param_groups[0]
    for ps in (params, twin):
        for p, gr in zip(ps, _grads(ps, 5)):
            p.grad = gr
    live.step()
    adamw.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twin))


def test_a_saved_state_dict_is_checked_and_keeps_its_masters_unless_told():
    from fp4offload._optim.export import adamw_state_dict

    p16 = _params(torch.bfloat16)
    run = FP4AdamW(p16, **HYPER, master="split", state_format=StateFormat(min_numel=R.CHUNK))
    _train(run, p16, 2)
    saved = run.state_dict()
    with pytest.raises(ConfigError, match="drop_masters=True") as e:
        adamw_state_dict(saved)
    assert "split master" in str(e.value) and "to_torch_adamw" in str(e.value)
    out = adamw_state_dict(saved, drop_masters=True)
    assert out["state"][0]["exp_avg"].shape == p16[0].shape and "master_lo" not in out["state"][0]
    saved["state"][0]["m_codes"][3] ^= 0x11  # one changed byte
    from fp4offload import CorruptionError

    with pytest.raises(CorruptionError, match="checksum"):
        adamw_state_dict(saved, drop_masters=True)


def test_the_command_writes_torch_adamws_file(tmp_path, capsys):
    from fp4offload import cli
    from fp4offload._optim.export import adamw_state_dict

    params = _params()
    opt = FP4AdamW(params, **HYPER)
    _train(opt, params, 2)
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    assert cli.main(["export-adamw", str(tmp_path / "optimizer.pt"), str(tmp_path / "adamw.pt")]) == 0
    assert "3 parameter states as torch AdamW's" in capsys.readouterr().out
    got = torch.load(tmp_path / "adamw.pt", weights_only=True)
    want = adamw_state_dict(opt.state_dict())
    assert got["param_groups"] == want["param_groups"]
    assert all(torch.equal(got["state"][i][k], want["state"][i][k]) for i in want["state"] for k in want["state"][i])
    assert sorted(f.name for f in tmp_path.iterdir()) == ["adamw.pt", "optimizer.pt"]  # no temporary left
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert cli.main(["export-adamw", str(tmp_path / "junk.pt"), str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert "export-adamw IN" in err and "junk.pt" in err and not (tmp_path / "out.pt").exists()
