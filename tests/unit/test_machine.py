"""fp4offload._machine: host memory (MemAvailable and every cgroup v1/v2 limit on the path, less the working set),
GPU memory through pynvml, the ranks on this node and free disk space, each with its source; and the callers that
print them (probe, plan, doctor). Everything read is faked: a tmp tree for /proc and /sys/fs/cgroup, a fake
pynvml module, the environment."""

from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path

import pytest

from fp4offload import _machine as machine
from fp4offload.errors import ConfigError

GiB = 1 << 30
USAGE = GiB * 4 // 5  # 0.80 GiB
CACHE = GiB // 20  # 0.05 GiB
V1_UNLIMITED = str(9223372036854771712)


def _tree(tmp: Path, files: dict[str, str]) -> tuple[str, str]:
    """Write ``files`` under ``tmp``; returns the fake (/proc/self/cgroup, /sys/fs/cgroup)."""
    for rel, text in files.items():
        f = tmp / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return str(tmp / "proc"), str(tmp / "cg")


def _vm(total=64 * GiB, available=48 * GiB):
    return lambda: types.SimpleNamespace(total=total, available=available)


def _v1(tmp: Path, stat: bool = True) -> tuple[str, str]:
    files = {"proc": "12:cpu,cpuacct:/\n5:memory:/fp4t\n0::/\n",
             "cg/memory/memory.limit_in_bytes": V1_UNLIMITED,
             "cg/memory/fp4t/memory.limit_in_bytes": str(2 * GiB),
             "cg/memory/fp4t/memory.usage_in_bytes": str(USAGE)}
    if stat:  # inactive_file is this cgroup's alone; total_inactive_file (the hierarchy's) is the one to take off
        files["cg/memory/fp4t/memory.stat"] = f"cache 999\ninactive_file 4096\ntotal_inactive_file {CACHE}\n"
    return _tree(tmp, files)


def test_v1_limit_less_working_set_with_its_source(tmp_path):
    proc, root = _v1(tmp_path)
    lim = machine.limits(proc, root, _vm())
    assert (lim.cgroup_limit, lim.cgroup_usage, lim.reclaimable, lim.cgroup) == (2 * GiB, USAGE, CACHE, "v1:/fp4t")
    assert lim.free == 2 * GiB - (USAGE - CACHE)
    assert lim.total == 2 * GiB  # the limit, not the machine's 64 GiB
    assert lim.source == "cgroup v1:/fp4t limit 2.00 GiB, using 0.80 GiB (0.05 GiB page cache reclaimable)"
    assert "51 MiB of it reclaimable page cache" in lim.describe()
    assert machine.cgroup_limit(proc, root) == (2 * GiB, USAGE - CACHE, "v1:/fp4t")


def test_reclaimable_page_cache_raises_free_by_exactly_its_size(tmp_path):
    with_stat = machine.limits(*_v1(tmp_path / "a"), virtual_memory=_vm())
    without = machine.limits(*_v1(tmp_path / "b", stat=False), virtual_memory=_vm())
    assert without.reclaimable == 0 and without.free == 2 * GiB - USAGE
    assert with_stat.free - without.free == CACHE


def test_mapped_file_pages_stay_counted_as_used(tmp_path):
    proc, root = _v1(tmp_path)
    stat = Path(root) / "memory/fp4t/memory.stat"
    stat.write_text(stat.read_text() + f"total_mapped_file {CACHE // 4}\n")
    lim = machine.limits(proc, root, _vm())
    assert lim.reclaimable == CACHE - CACHE // 4 and lim.free == 2 * GiB - (USAGE - CACHE + CACHE // 4)
    stat.write_text(f"total_inactive_file {CACHE}\ntotal_mapped_file {2 * CACHE}\n")  # more mapped than inactive
    assert machine.limits(proc, root, _vm()).reclaimable == 0


def test_v2_parent_tighter_than_the_child_wins(tmp_path):
    proc, root = _tree(tmp_path, {
        "proc": "0::/pod/job\n",
        "cg/pod/memory.max": str(3 * GiB), "cg/pod/memory.current": str(5 * GiB // 2),
        "cg/pod/memory.stat": f"anon 1\ninactive_file {GiB // 2}\nactive_file 7\n",
        "cg/pod/job/memory.max": str(4 * GiB), "cg/pod/job/memory.current": str(GiB),
        "cg/memory.max": "max"})
    found = machine.cgroups(proc, root)
    assert [c.path for c in found] == ["v2:/pod/job", "v2:/pod"]  # innermost first; "max" is no limit
    assert [c.free for c in found] == [3 * GiB, GiB]
    lim = machine.limits(proc, root, _vm())
    assert (lim.cgroup, lim.free, lim.reclaimable, lim.total) == ("v2:/pod", GiB, GiB // 2, 3 * GiB)
    assert lim.source.startswith("cgroup v2:/pod limit 3.00 GiB, using 2.50 GiB (0.50 GiB page cache")


def test_usage_below_the_cache_and_over_the_limit_never_go_negative(tmp_path):
    proc, root = _tree(tmp_path, {"proc": "0::/a\n", "cg/a/memory.max": str(GiB), "cg/a/memory.current": str(3 * GiB),
                                  "cg/a/memory.stat": f"inactive_file {GiB}\n"})
    lim = machine.limits(proc, root, _vm())
    assert lim.free == 0 and lim.cgroup_free == 0
    (tmp_path / "cg/a/memory.stat").write_text(f"inactive_file {5 * GiB}\n")  # clamped to the usage
    lim = machine.limits(proc, root, _vm())
    assert lim.reclaimable == 3 * GiB and lim.free == GiB


def test_hybrid_v1_and_v2_take_the_tighter(tmp_path):
    proc, root = _tree(tmp_path, {"proc": "4:memory:/x\n0::/y\n",
                                  "cg/memory/x/memory.limit_in_bytes": str(8 * GiB),
                                  "cg/memory/x/memory.usage_in_bytes": str(GiB),
                                  "cg/y/memory.max": str(4 * GiB), "cg/y/memory.current": str(GiB)})
    assert machine.cgroup_limit(proc, root) == (4 * GiB, GiB, "v2:/y")
    assert machine.limits(proc, root, _vm()).total == 4 * GiB


def test_machine_available_binds_when_smaller(tmp_path):
    proc, root = _v1(tmp_path)
    lim = machine.limits(proc, root, _vm(total=4 * GiB, available=GiB // 2))
    assert lim.free == GiB // 2 and lim.source == "machine MemAvailable (psutil)"
    assert lim.total == 2 * GiB and "cgroup v1:/fp4t" in lim.describe()


def test_no_cgroup_is_the_machine(tmp_path):
    lim = machine.limits(str(tmp_path / "missing"), str(tmp_path), _vm(total=16 * GiB, available=9 * GiB))
    assert (lim.free, lim.total, lim.cgroup_limit, lim.source) == (9 * GiB, 16 * GiB, None, machine.MACHINE_SOURCE)
    proc, root = _tree(tmp_path, {"proc": "5:memory:/docker\n", "cg/memory/docker/memory.limit_in_bytes": V1_UNLIMITED})
    assert machine.cgroups(proc, root) == [] and machine.cgroup_limit(proc, root) is None


def test_a_path_outside_the_namespace_starts_at_its_root(tmp_path):
    proc, root = _tree(tmp_path, {"proc": "0::/../../elsewhere\n", "cg/memory.max": str(GiB),
                                  "cg/memory.current": "0", "memory.max": "1"})  # tmp_path/memory.max: not read
    assert machine.cgroup_limit(proc, root) == (GiB, 0, "v2:/")


def test_limits_old_constructor_keeps_working():
    lim = machine.Limits(available=8 * GiB, cgroup_limit=3 * GiB, cgroup_usage=2 * GiB)
    assert lim.free == GiB and lim.total is None and lim.reclaimable == 0
    from fp4offload._deepspeed import preflight

    assert preflight.Limits is machine.Limits and preflight.cgroup_limit is machine.cgroup_limit
    assert preflight.limits is machine.limits


# -- GPUs -----------------------------------------------------------------------------------------


def _fake_nvml(count=2, fail_init=False):
    m = types.ModuleType("pynvml")

    def init():
        if fail_init:
            raise RuntimeError("Driver Not Loaded")

    mems = [types.SimpleNamespace(total=80 * GiB, free=70 * GiB, used=10 * GiB),
            types.SimpleNamespace(total=80 * GiB, free=5 * GiB, used=75 * GiB)]
    m.nvmlInit = init
    m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: count
    m.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    m.nvmlDeviceGetMemoryInfo = lambda h: mems[h[1]]
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    return m  # no driver, compute capability or PCIe calls: each reads as None


def test_gpus_per_device_free_and_total_from_pynvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml())
    got = machine.gpus()
    assert got.note is None and got.source == "pynvml" and got.driver is None and got.cuda is None
    assert [(g.index, g.total, g.free, g.used) for g in got.devices] == [(0, 80 * GiB, 70 * GiB, 10 * GiB),
                                                                        (1, 80 * GiB, 5 * GiB, 75 * GiB)]
    g = got.devices[0]
    assert g.name == "NVIDIA H100 80GB HBM3" and g.source == "pynvml" and g.compute_capability is None
    from fp4offload._planner import probe

    readings, _, _, note = probe.probe_gpus()  # the probe reads through the same place
    assert note is None and [r.memory_free for r in readings] == [70 * GiB, 5 * GiB]


@pytest.mark.parametrize("module, words", [(None, "nvidia-ml-py"), (_fake_nvml(fail_init=True), "Driver Not Loaded"),
                                           (_fake_nvml(count=0), "NVML found no GPU")])
def test_no_gpu_is_an_empty_list_and_a_note(monkeypatch, module, words):
    monkeypatch.setitem(sys.modules, "pynvml", module)
    got = machine.gpus()
    assert got.devices == () and words in got.note


# -- ranks, disk --------------------------------------------------------------------------------


def test_launcher_ranks_and_the_variable_they_came_from(monkeypatch):
    assert machine.launcher_ranks({"WORLD_SIZE": "16", "LOCAL_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}) == \
        (16, 4, "LOCAL_SIZE")
    assert machine.launcher_ranks({"LOCAL_WORLD_SIZE": "8", "LOCAL_SIZE": "4"}) == (1, 8, "LOCAL_WORLD_SIZE")
    r = machine.launcher_ranks({"LOCAL_WORLD_SIZE": "junk", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert r.local == 2 and r.source == "OMPI_COMM_WORLD_LOCAL_SIZE"
    r = machine.launcher_ranks({"LOCAL_WORLD_SIZE": "0"})
    assert r == (1, 1, "default: LOCAL_WORLD_SIZE='0' is not a positive integer")
    for var in ("WORLD_SIZE", *machine.LOCAL_RANK_VARIABLES):
        monkeypatch.delenv(var, raising=False)
    assert machine.launcher_ranks().source.startswith("default: none of LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_SIZE", "3")
    from fp4offload._offload import pinned_pool

    assert machine.launcher_ranks().local == 3 and pinned_pool.local_ranks() == 3  # the pool reads the same


def test_disk_space_at_a_path(tmp_path):
    d = machine.disk_space(tmp_path)
    usage = shutil.disk_usage(tmp_path)
    assert d.path == str(tmp_path) and d.total == usage.total and abs(d.free - usage.free) < 64 << 20
    assert d.source == "shutil.disk_usage"
    with pytest.raises(ConfigError) as e:
        machine.disk_space(tmp_path / "nope", "--nvme-path")
    assert e.value.key == "--nvme-path" and "nope" in str(e.value)


# -- callers: probe, readings, plan, doctor ---------------------------------------------------------


def test_probe_host_reports_the_cgroup_limit_and_readings_keep_the_source(tmp_path, monkeypatch):
    import psutil

    from fp4offload._planner.probe import probe_host
    from fp4offload._planner.readings import HostReading, Readings

    monkeypatch.setattr(psutil, "virtual_memory", _vm())
    proc, root = _v1(tmp_path)
    h = probe_host(proc_cgroup=proc, root=root)
    assert h.ram_total == 2 * GiB and h.ram_available == 2 * GiB - (USAGE - CACHE)
    assert h.memory_source.startswith("cgroup v1:/fp4t limit 2.00 GiB")
    path = tmp_path / "r.json"
    Readings(host=h).save(path)
    assert Readings.load(path).host == h
    doc = json.loads(path.read_text())
    del doc["host"]["memory_source"]  # a file written before the field existed
    assert Readings.from_dict(doc).host == HostReading(h.ram_total, h.ram_available, h.cores_physical,
                                                       h.cores_logical, h.cpu_model)
    doc["host"]["memory_source"] = 5
    with pytest.raises(ConfigError, match="memory_source"):
        Readings.from_dict(doc)


def test_plan_prints_where_host_and_gpu_memory_came_from(tmp_path, capsys):
    from fp4offload._planner import cli_plan
    from fp4offload._planner.readings import GpuReading, HostReading, Readings

    src = "cgroup v2:/pod limit 512.00 GiB, using 12.00 GiB (2.00 GiB page cache reclaimable)"
    gpu = GpuReading(0, "NVIDIA H100 80GB HBM3", 85520809984, 85000000000, 520809984, (9, 0), 5, 16)
    path = tmp_path / "node.json"
    Readings(gpus=(gpu,) * 8, host=HostReading(512 * GiB, 502 * GiB, 112, 224, memory_source=src)).save(path)
    assert cli_plan.main(["plan", "--model", "llama-3.1-8b", "--readings", str(path)]) == 0
    assert f"sources: host RAM from {src}; GPU memory from pynvml" in capsys.readouterr().out
    cli_plan.main(["plan", "--model", "llama-3.1-8b", "--readings", str(path), "--host-ram-gb", "100",
                   "--format", "json"])
    m = json.loads(capsys.readouterr().out)["machine"]
    assert m["host_ram_source"] == "--host-ram-gb" and m["gpu_memory_source"] == "pynvml"
    cli_plan.main(["plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--format", "json"])
    m = json.loads(capsys.readouterr().out)["machine"]
    assert m["gpu_memory_source"] == "GPU preset h100-80gb" and m["host_ram_source"].startswith("node preset")


def test_doctor_names_the_memory_sources(tmp_path, monkeypatch):
    from fp4offload import _doctor as doctor

    proc, root = _v1(tmp_path)
    real = machine.limits
    monkeypatch.setattr(machine, "limits", lambda: real(proc, root, _vm()))
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml())
    for var in machine.LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("WORLD_SIZE", "8")
    r = {"gpu": doctor.gpu_report(), "host": {"memory": doctor.memory_report(), "local_ranks": doctor.ranks_report()}}
    json.dumps(r)  # what --json prints
    assert r["host"]["memory"]["cgroup"] == "v1:/fp4t" and r["host"]["memory"]["reclaimable_bytes"] == CACHE
    assert r["host"]["local_ranks"] == {"world": 8, "local": 4, "source": "LOCAL_WORLD_SIZE"}
    assert [d["free_bytes"] for d in r["gpu"]["gpus"]] == [70 * GiB, 5 * GiB]
    full = doctor.report()
    text = doctor.render(full)
    assert ("host memory: 1.25 GiB free of 2.00 GiB, from cgroup v1:/fp4t limit 2.00 GiB, using 0.80 GiB "
            "(0.05 GiB page cache reclaimable)") in text, text
    assert "GPUs (driver unknown; memory from pynvml):" in text and "80.0 GiB (5.0 free, pynvml)" in text, text
    assert "local ranks: 4 (LOCAL_WORLD_SIZE); world size 8" in text, text
