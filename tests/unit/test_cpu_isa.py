"""The host kernels' vector path: read from the CPU, forced with FP4OFFLOAD_CPU_ISA, reported by doctor, planned for,
and every x86 path this CPU has loads and gives the reference's bits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from fp4offload._config import vocab
from fp4offload.errors import ConfigError
from fp4offload._config import isas
from fp4offload._ops import cpu_isa
from fp4offload._planner.hardware import CPU_FP4_PER_CORE, build_cluster


def test_available_paths_end_with_scalar_and_match_the_cpu():
    have = cpu_isa.available()
    assert have[-1] == "scalar" and len(set(have)) == len(have)
    assert all(p in vocab.CPU_ISAS for p in have)
    if cpu_isa.arch() == "x86":
        flags = open("/proc/cpuinfo").read()
        assert ("avx2" in have) == all(f" {f}" in flags for f in cpu_isa.row("avx2").cpu_flags)
        assert not {"neon", "sve"} & set(have)


def test_no_build_depends_on_the_build_host():
    for isa in isas.ISAS:
        flags = cpu_isa.flags(isa.name)
        assert not any("native" in f for f in flags), (isa, flags)
        assert f"-DFP4_CPU_ISA_ID={isa.id}" in flags
    assert cpu_isa.module_name("fp4offload_cpu", "avx2") != cpu_isa.module_name("fp4offload_cpu", "avx512")


def test_forcing_a_path(monkeypatch):
    monkeypatch.delenv(cpu_isa.ENV, raising=False)
    assert cpu_isa.chosen()[0] == cpu_isa.available()[0]
    monkeypatch.setenv(cpu_isa.ENV, "auto")
    assert cpu_isa.chosen()[0] == cpu_isa.available()[0]
    monkeypatch.setenv(cpu_isa.ENV, " Scalar")  # read as every FP4OFFLOAD_* variable is: any case, spaces ignored
    assert cpu_isa.chosen() == ("scalar", f"{cpu_isa.ENV}=scalar")


@pytest.mark.parametrize("value", ["avx3", "sse", "native"])
def test_an_unknown_path_is_a_config_error_naming_what_this_cpu_has(monkeypatch, value):
    monkeypatch.setenv(cpu_isa.ENV, value)
    with pytest.raises(ConfigError) as e:
        cpu_isa.chosen()
    msg = str(e.value)
    assert cpu_isa.ENV in msg and repr(value) in msg and all(p in msg for p in cpu_isa.available())


def test_a_path_this_cpu_lacks_is_a_config_error(monkeypatch):
    missing = next(p for p in vocab.CPU_ISAS if p not in cpu_isa.available())
    monkeypatch.setenv(cpu_isa.ENV, missing)
    with pytest.raises(ConfigError, match=f"{missing!r} is not allowed; expected a path this CPU has"):
        cpu_isa.chosen()


def _doctor(env_value):
    env = {**os.environ, cpu_isa.ENV: env_value}
    return subprocess.run([sys.executable, "-m", "fp4offload.cli", "doctor", "--json"], capture_output=True, text=True,
                          timeout=900, env=env)


@pytest.mark.skipif("avx2" not in cpu_isa.available(), reason="needs a CPU with AVX2")
def test_doctor_reports_the_forced_path():
    out = _doctor("avx2")
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["cpu_isa"] == "avx2" and r["cpu_isa_why"] == f"{cpu_isa.ENV}=avx2"
    assert r["backends"]["cpu"]["isa"] == "avx2" and r["cpu_isa_available"] == cpu_isa.available()


def test_doctor_refuses_a_bad_path_in_one_line():
    out = _doctor("avx1024")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "FP4OFFLOAD_CPU_ISA='avx1024'" in lines[0], out.stderr


# Each path forced in a fresh process: both extensions load as that build, FP4AdamW's fused step equals the torch
# reference step bit for bit (v on the default grid and on the 2-bit one), and the codec equals the reference codec.
_CHECK = textwrap.dedent("""
    import sys, torch
    import fp4offload
    from fp4offload import FP4AdamW
    from fp4offload._ops import cpu
    from fp4offload._optim import StateFormat, StepOptions, fused
    want = sys.argv[1]
    assert fused.cpu_extension().isa() == want and cpu.extension().isa() == want
    g = torch.Generator().manual_seed(0)
    base = torch.randn(5003, generator=g)
    for vf in ("ue2m2", "ue2m0"):
        ps = [torch.nn.Parameter(base.clone()) for _ in range(2)]
        opts = [FP4AdamW([ps[0]], lr=1e-2, state_format=StateFormat(v_format=vf),
                         step_options=StepOptions(backend="fused")),
                FP4AdamW([ps[1]], lr=1e-2, state_format=StateFormat(v_format=vf),
                         step_options=StepOptions(backend="reference"))]
        for t in range(3):
            grad = torch.randn(5003, generator=g) * 1e-2
            for p, o in zip(ps, opts):
                p.grad = grad.clone()
                o.step()
        assert torch.equal(ps[0].detach().view(torch.int32), ps[1].detach().view(torch.int32)), vf
        assert torch.equal(opts[0].state[ps[0]]["v_codes"], opts[1].state[ps[1]]["v_codes"]), vf
    x = torch.randn(64, 80, generator=g)
    sr = {"rounding": "stochastic", "seed": 3}
    for fmt, kw in (("nvfp4", {}), ("nvfp4", sr), ("mxfp4", {}), ("mxfp4", sr), ("mxfp8", {}), ("int2", {}),
                    ("int2", sr)):
        a = fp4offload.quantize(x, fmt, **kw)
        import os
        os.environ["FP4OFFLOAD_BACKEND"] = "reference"
        b = fp4offload.quantize(x, fmt, **kw)
        del os.environ["FP4OFFLOAD_BACKEND"]
        assert torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales), fmt
        assert (a.tensor_scale is None and b.tensor_scale is None) or torch.equal(a.tensor_scale, b.tensor_scale), fmt
    print("ok", want)
""")


@pytest.mark.parametrize("path", ["avx512", "avx2", "scalar"])
def test_each_x86_path_forced_loads_and_gives_the_reference_bits(path):
    if cpu_isa.arch() != "x86" or path not in cpu_isa.available():
        pytest.skip(f"this CPU has no {path} path")
    env = {**os.environ, cpu_isa.ENV: path}
    env.pop("FP4OFFLOAD_BACKEND", None)
    out = subprocess.run([sys.executable, "-c", _CHECK, path], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0 and f"ok {path}" in out.stdout, out.stderr[-3000:]


def test_the_planner_plans_the_host_cpu_path():
    a100 = build_cluster(gpu="a100-80gb")  # DGX A100: AMD EPYC 7742, AVX2 only
    h100 = build_cluster(gpu="h100-80gb")
    gh200 = build_cluster(gpu="gh200-96gb")
    assert (a100.cpu_isa, h100.cpu_isa, gh200.cpu_isa) == ("avx2", "avx512", "sve")
    per_core = {c.cpu_isa: c.cpu_adam["nvfp4"] / c.host_cores for c in (a100, h100, gh200)}
    assert per_core["avx2"] < per_core["avx512"]
    assert per_core["avx2"] <= CPU_FP4_PER_CORE["avx2"] and per_core["sve"] <= CPU_FP4_PER_CORE["sve"]
    assert any("avx2 path" in n for n in a100.notes) and not any("path:" in n for n in h100.notes)
