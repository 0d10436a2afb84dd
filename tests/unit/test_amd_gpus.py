"""AMD GPUs in the planner and doctor: AMD SMI readings when amdsmi loads, presets otherwise."""

from __future__ import annotations

import enum
import json
import types

from fp4offload import _machine
from fp4offload._planner import cli_plan
from fp4offload._planner.hardware import GPU_PRESETS, match_gpu

GiB = 1 << 30


def _fake_amdsmi(n: int = 2, fail_init: bool = False) -> types.SimpleNamespace:
    class MemType(enum.Enum):
        VRAM = 0
        VIS_VRAM = 1

    calls = []

    def init():
        calls.append("init")
        if fail_init:
            raise RuntimeError("amdgpu driver not loaded")

    return types.SimpleNamespace(
        AmdSmiMemoryType=MemType, calls=calls, amdsmi_init=init, amdsmi_shut_down=lambda: calls.append("shut"),
        amdsmi_get_processor_handles=lambda: [f"h{i}" for i in range(n)],
        amdsmi_get_gpu_memory_total=lambda h, t: 192 * GiB if t is MemType.VRAM else 0,
        amdsmi_get_gpu_memory_usage=lambda h, t: (2 if h == "h1" else 1) * GiB,
        amdsmi_get_gpu_asic_info=lambda h: {"market_name": "AMD Instinct MI300X"})


def test_amdsmi_readings_become_gpu_memory_and_match_the_preset():
    mod = _fake_amdsmi()
    got = _machine.amd_gpus(mod)
    assert got.source == "amdsmi" and got.note is None and len(got.devices) == 2
    d0, d1 = got.devices
    assert (d0.total, d0.used, d0.free) == (192 * GiB, GiB, 191 * GiB) and d1.used == 2 * GiB
    assert mod.calls == ["init", "shut"]  # shut down after reading
    assert match_gpu(d0.name).key == "mi300x-192gb"


def test_without_amdsmi_or_its_driver_doctor_says_why():
    got = _machine.amd_gpus(_fake_amdsmi(fail_init=True))
    assert not got.devices and "no AMD GPU driver for amdsmi here (amdgpu driver not loaded)" in got.note
    here = _machine.gpus()  # this machine: no NVIDIA and no AMD GPU, both reasons named
    if not here.devices:
        assert "amdsmi" in here.note and ("NVML" in here.note or "pynvml" in here.note)


def test_the_amd_presets_plan_by_their_short_names(capsys):
    for key in ("mi250x-64gb", "mi300x-192gb", "mi325x-256gb", "mi355x-288gb"):
        g = GPU_PRESETS[key]
        assert g.name.startswith("AMD Instinct") and g.memory_bytes >= 64 * GiB and g.bf16_tflops > 100
    assert cli_plan.main(["plan", "--gpu", "mi300x", "--model", "llama-3.1-8b", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["machine"]["gpu"] == "mi300x-192gb" and doc["winner"]
    assert cli_plan.main(["plan", "--gpu", "h100"]) == 2  # a prefix of two presets names neither
    assert "could be h100-80gb or h100-pcie-80gb" in capsys.readouterr().err
