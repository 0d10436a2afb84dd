"""Probe, readings files and the planning target built from them (no GPU needed: NVML is faked)."""

from __future__ import annotations

import json
import sys
import types

import pytest

from fp4offload.errors import ConfigError
from fp4offload._planner import probe as probe_mod
from fp4offload._planner.hardware import GPU_PRESETS, NODE_PRESETS, build_cluster, match_gpu, pcie_bandwidth
from fp4offload._planner.readings import SCHEMA_VERSION, DiskReading, GpuReading, HostReading, Readings

GiB = 1 << 30


def fake_nvml(names=("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"), fail_init=False):
    """A stand-in for the pynvml module with the calls the probe makes."""
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def init():
        if fail_init:
            raise NVMLError("NVML Shared Library Not Found")

    mem = types.SimpleNamespace(total=85520809984, free=84000000000, used=1520809984)
    m.NVMLError = NVMLError
    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlSystemGetDriverVersion = lambda: b"560.35.03"
    m.nvmlSystemGetCudaDriverVersion = lambda: 12060
    m.nvmlDeviceGetCount = lambda: len(names)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: names[h]
    m.nvmlDeviceGetMemoryInfo = lambda h: mem
    m.nvmlDeviceGetCudaComputeCapability = lambda h: (9, 0)
    m.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 5
    m.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16

    def idle(h):
        raise NVMLError("Not Supported")

    m.nvmlDeviceGetCurrPcieLinkGeneration = idle  # a call that fails must not sink the probe
    m.nvmlDeviceGetCurrPcieLinkWidth = lambda h: 16
    return m


def test_probe_reads_gpus_through_nvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml())
    gpus, driver, cuda, note = probe_mod.probe_gpus()
    assert note is None and driver == "560.35.03" and cuda == "12.6"
    assert len(gpus) == 2
    g = gpus[0]
    assert g.name == "NVIDIA H100 80GB HBM3" and g.memory_total == 85520809984 and g.compute_capability == (9, 0)
    assert (g.pcie_gen, g.pcie_width, g.pcie_gen_current, g.pcie_width_current) == (5, 16, None, 16)


def test_no_nvml_gives_a_one_line_note(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(fail_init=True))
    gpus, driver, cuda, note = probe_mod.probe_gpus()
    assert gpus == [] and driver is None
    assert "\n" not in note and "--gpu" in note and "NVML" in note
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    gpus, _, _, note = probe_mod.probe_gpus()
    assert gpus == [] and "--gpu" in note


def test_probe_of_this_machine(tmp_path):
    r = probe_mod.probe(tmp_path)
    assert r.host.ram_total > 0 and r.host.cores_logical >= r.host.cores_physical >= 1
    assert r.disk.path == str(tmp_path) and r.disk.free > 0 and r.disk.read_bps is None
    assert r.taken_at and r.hostname
    with pytest.raises(ConfigError) as e:
        probe_mod.probe(tmp_path / "missing")
    assert e.value.key == "--nvme-path"


def test_disk_measurement_is_bounded_and_cleans_up(tmp_path):
    read_bps, write_bps = probe_mod.measure_disk(tmp_path, max_bytes=32 << 20, max_seconds=2.0)
    assert read_bps > 0 and write_bps > 0
    assert list(tmp_path.iterdir()) == []


def test_h2d_measurement_needs_cuda():
    import torch

    if not torch.cuda.is_available():
        assert probe_mod.measure_h2d(1 << 20) is None


# -- readings files ----------------------------------------------------------------------------


def sample_readings() -> Readings:
    gpu = GpuReading(0, "NVIDIA H200", 150_000_000_000, 149_000_000_000, 1_000_000_000, (9, 0), 5, 16, 5, 16)
    return Readings(gpus=(gpu, gpu), host=HostReading(2 * 1024 * GiB, 1900 * GiB, 112, 224, "Xeon"),
                    disk=DiskReading("/local_nvme", 30 * 10**12, 29 * 10**12, 20e9, 12e9),
                    driver_version="560.35.03", cuda_version="12.6", h2d_bps=52e9, d2h_bps=50e9,
                    cpu_adam={"fp32": 9e9, "nvfp4": 15e9}, cpu_adam_threads=112, notes=("x",), hostname="node1",
                    taken_at="2026-11-29T00:00:00+00:00")


def test_readings_save_and_replay(tmp_path):
    r = sample_readings()
    path = tmp_path / "sub" / "node.json"
    r.save(path)
    doc = json.loads(path.read_text())
    assert doc["version"] == SCHEMA_VERSION and doc["gpus"][0]["compute_capability"] == [9, 0]
    back = Readings.load(path)
    assert back == r
    assert [p.name for p in path.parent.iterdir()] == ["node.json"]  # no temporary left behind


def test_readings_merge_keeps_what_the_newer_lacks():
    base = sample_readings()
    newer = Readings(cpu_adam={"fp32": 1e9}, cpu_adam_threads=2, notes=("y",))
    m = base.merged(newer)
    assert m.gpus == base.gpus and m.cpu_adam == {"fp32": 1e9, "nvfp4": 15e9} and m.cpu_adam_threads == 2
    assert m.notes == ("x", "y")


@pytest.mark.parametrize("mutate, fragment", [
    (lambda d: d.update(version=99), "version"),
    (lambda d: d.update(colour="red"), "colour"),
    (lambda d: d["gpus"][0].update(memory_total="80GB"), "memory_total"),
    (lambda d: d["gpus"][0].pop("name"), "gpus[0]"),
    (lambda d: d["host"].update(ram_total=0), "ram_total"),
    (lambda d: d.update(cpu_adam={"fp32": -1}), "cpu_adam"),
    (lambda d: d.update(h2d_bps="fast"), "h2d_bps"),
    (lambda d: d.update(gpus=[5]), "gpus[0]"),
])
def test_bad_readings_files_give_clear_errors(tmp_path, mutate, fragment):
    d = sample_readings().to_dict()
    mutate(d)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError) as e:
        Readings.load(path)
    assert fragment in str(e.value)


def test_unreadable_readings(tmp_path):
    with pytest.raises(ConfigError):
        Readings.load(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="JSON"):
        Readings.load(tmp_path / "bad.json")


# -- the planning target -----------------------------------------------------------------------


def test_cluster_from_replayed_readings_uses_what_was_measured():
    c = build_cluster(readings=sample_readings(), nodes=4)
    assert c.gpu.key == "h200-141gb" and c.gpus_per_node == 2 and c.world == 8 and c.source == "measured"
    assert c.gpu_memory == 150_000_000_000 and c.host_ram == 1900 * GiB and c.host_cores == 112
    assert c.nvme_free == 29 * 10**12 and c.nvme_read_bps == 20e9 and c.h2d_bps == 52e9
    assert c.cpu_adam == {"fp32": 9e9, "nvfp4": 15e9}  # measured on this very host: used as is


def test_cluster_from_presets():
    c = build_cluster(gpu="b200-180gb", gpus=4, nodes=2)
    node = NODE_PRESETS["b200-180gb"]
    assert c.world == 8 and c.gpu.fp4_tensor_cores and c.host_cores == node.cores
    assert c.nvme_free == node.nvme_bytes and c.h2d_bps == pcie_bandwidth(5, 16)
    assert 0 < c.cpu_adam["fp32"] < c.cpu_adam["nvfp4"]  # a big host is bandwidth-bound: FP4 moves half the bytes
    c2 = build_cluster(gpu="l40s-48gb", host_ram_gb=256, host_cores=32, nvme_path="/scratch", nvme_gb=1000, mfu=0.3)
    assert c2.host_ram == 256 * GiB and c2.host_cores == 32 and c2.nvme_path == "/scratch"
    assert c2.nvme_free == 1000 * 2**30 and c2.mfu == 0.3  # --nvme-gb is GiB, as --host-ram-gb


def test_gpu_less_readings_from_a_laptop_do_not_describe_the_cluster():
    laptop = Readings(host=HostReading(16 * GiB, 8 * GiB, 4, 8), cpu_adam={"fp32": 1e9}, cpu_adam_threads=4)
    c = build_cluster(readings=laptop, gpu="h100-80gb")
    assert c.host_ram > 1000 * GiB and c.host_cores == NODE_PRESETS["h100-80gb"].cores
    assert c.cpu_adam["fp32"] > 1e9  # the laptop's per-core rate, scaled to the node's cores


def test_nvml_names_map_to_presets():
    assert match_gpu("NVIDIA H100 80GB HBM3").key == "h100-80gb"
    assert match_gpu("NVIDIA H100 PCIe").key == "h100-pcie-80gb"
    assert match_gpu("NVIDIA GH200 480GB").key == "gh200-96gb"
    assert match_gpu("NVIDIA L40S").key == "l40s-48gb" and match_gpu("NVIDIA L4").key == "l4-24gb"
    assert match_gpu("NVIDIA A100-SXM4-80GB").key == "a100-80gb"
    assert match_gpu("Some Future GPU") is None
    for key in ("h100-80gb", "h200-141gb", "b200-180gb", "a100-80gb", "l40s-48gb"):
        assert key in GPU_PRESETS and key in NODE_PRESETS


def test_unknown_gpu_falls_back_by_compute_capability():
    g = GpuReading(0, "Mystery Accelerator", 48 * GiB, 48 * GiB, 0, (8, 9), 4, 16)
    c = build_cluster(readings=Readings(gpus=(g,), host=HostReading(64 * GiB, 60 * GiB, 8, 16)))
    assert c.gpu.key == "unknown" and c.gpu.bf16_tflops > 0 and any("no preset" in n for n in c.notes)


@pytest.mark.parametrize("kwargs, key", [
    (dict(gpu="h100"), "--gpu"),
    (dict(gpu="h100-80gb", nodes=0), "--nodes"),
    (dict(gpu="h100-80gb", gpus=0), "--gpus"),
    (dict(gpu="h100-80gb", mfu=1.5), "--mfu"),
])
def test_bad_machine_arguments(kwargs, key):
    """Each bad machine argument is refused with its own name (no GPU seen and none named is not an error:
    the default target is planned, see test_planner_cli)."""
    with pytest.raises(ConfigError) as e:
        build_cluster(readings=Readings(), **kwargs)
    assert e.value.key == key


def test_bench_measures_the_cpu_optimizer_step(tmp_path, monkeypatch):
    from fp4offload._planner import bench
    from fp4offload._planner.bench import run_bench

    # FP4AdamW's first step may build a C++ extension (minutes): the path is exercised with a
    # stand-in, and with one that fails to step (the benchmark must survive an optimizer in the works).
    class Broken:
        def __init__(self, params, lr):
            raise RuntimeError("not ready")

    monkeypatch.setattr(bench, "_fp4_optimizer", lambda: (Broken, None))

    r = run_bench(str(tmp_path), numel=1 << 16, max_seconds=0.3, nvme_max_bytes=16 << 20,
                  base=Readings(host=HostReading(1, 1, 1, 1)))
    assert r.cpu_adam["fp32"] > 0 and r.cpu_adam_threads >= 1
    assert r.disk.read_bps > 0 and r.host == HostReading(1, 1, 1, 1)
    assert "nvfp4" not in r.cpu_adam and any("FP4AdamW failed to step" in n for n in r.notes)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(bench, "_fp4_optimizer", lambda: (None, "FP4AdamW is not importable (ImportError)"))
    rates, threads, notes = bench.bench_cpu_adam(1 << 14, 0.1)
    assert set(rates) == {"fp32"} and "not importable" in notes[0]
