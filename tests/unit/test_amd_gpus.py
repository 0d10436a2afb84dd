"""AMD GPUs in the planner and doctor: AMD SMI readings when amdsmi loads, presets otherwise."""

from __future__ import annotations

import enum
import json
import sys
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


def _no_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError


def test_an_installed_amdsmi_feeds_the_planner_and_doctor(monkeypatch):
    """amdsmi found by import (a stand-in with the real API names in sys.modules) and NVML absent: the planner's
    probe reads both GPUs, plans for the matching MI300X preset with the measured memory (source amdsmi), and
    doctor lists them with their VRAM from amdsmi."""
    from fp4offload import _doctor as doctor
    from fp4offload._planner import hardware, probe

    _no_nvml(monkeypatch)
    mod = _fake_amdsmi()
    monkeypatch.setitem(sys.modules, "amdsmi", mod)
    readings = probe.probe()
    assert [(g.name, g.memory_total, g.memory_used, g.source) for g in readings.gpus] == [
        ("AMD Instinct MI300X", 192 * GiB, GiB, "amdsmi"), ("AMD Instinct MI300X", 192 * GiB, 2 * GiB, "amdsmi")]
    cluster = hardware.build_cluster(readings=readings)
    assert cluster.gpu.key == "mi300x-192gb" and cluster.source == "measured" and cluster.gpus_per_node == 2
    assert cluster.gpu_memory == 192 * GiB and cluster.gpu_memory_source == "amdsmi"
    assert cluster.gpu.bf16_tflops == 1307 and cluster.gpu.hbm_gbps == 5300 and cluster.gpu.pcie_gen == 5
    r = doctor.gpu_report()
    assert r["available"] and r["source"] == "amdsmi"
    assert [(d["name"], d["total_bytes"], d["free_bytes"], d["source"]) for d in r["gpus"]] == [
        ("AMD Instinct MI300X", 192 * GiB, 191 * GiB, "amdsmi"),
        ("AMD Instinct MI300X", 192 * GiB, 190 * GiB, "amdsmi")]
    text = doctor.render(doctor.report())
    assert "GPUs (driver unknown; memory from amdsmi):" in text, text
    assert "[1] AMD Instinct MI300X  192.0 GiB (190.0 free, amdsmi)  AMD: FP4 as storage/transfer format" in text, text
    assert mod.calls.count("init") == mod.calls.count("shut") >= 3  # every reading shuts amdsmi down again


def test_doctor_says_why_amdsmi_gives_nothing(monkeypatch):
    """Not installed, installed without ROCm's library (the package raises on import), or no driver: doctor's GPU
    line names which, beside NVML's reason."""
    from fp4offload import _doctor as doctor

    _no_nvml(monkeypatch)
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    r = doctor.gpu_report()
    assert not r["available"] and "pynvml (nvidia-ml-py) is not installed" in r["why"]
    assert "amdsmi is not installed" in r["why"], r["why"]

    monkeypatch.delitem(sys.modules, "amdsmi")
    real_import = __import__

    def fake_import(name, *args, **kwargs):
        if name == "amdsmi":
            raise KeyError("ROCM_PATH")  # what amdsmi raises when it cannot find libamd_smi.so
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr("builtins.__import__", fake_import)
    why = doctor.gpu_report()["why"]
    assert "amdsmi is installed but ROCm's library does not load (KeyError: 'ROCM_PATH')" in why, why
    monkeypatch.setattr("builtins.__import__", real_import)
    monkeypatch.setitem(sys.modules, "amdsmi", _fake_amdsmi(fail_init=True))
    text = doctor.render(doctor.report())
    assert "GPU: none (pynvml (nvidia-ml-py) is not installed; no AMD GPU driver for amdsmi here (amdgpu driver " \
           "not loaded))" in text, text


def test_amd_presets_hold_the_vendor_figures():
    """Memory, HBM bandwidth, dense bf16 peak and host link of each AMD preset (hardware.py cites the figures)."""
    want = {"mi250x-64gb": (64, 1638, 191.5, 4), "mi300x-192gb": (192, 5300, 1307, 5),
            "mi325x-256gb": (256, 6000, 1307, 5), "mi355x-288gb": (288, 8000, 2516, 5)}
    for key, (gib, hbm, tflops, gen) in want.items():
        g = GPU_PRESETS[key]
        got = (g.memory_bytes, g.hbm_gbps, g.bf16_tflops, g.pcie_gen, g.pcie_width)
        assert got == (gib * GiB, hbm, tflops, gen, 16), (key, got)
    assert match_gpu("AMD Instinct MI250X").key == "mi250x-64gb"
    assert match_gpu("AMD Instinct MI355X").key == "mi355x-288gb"
