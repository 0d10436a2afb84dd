"""Read the machine: GPUs through NVML (pynvml) or AMD SMI (amdsmi), the host RAM this process may use (the
machine's and its cgroups' limits) and free space at the NVMe path through :mod:`fp4offload._machine`, cores through
psutil, and on request short bandwidth measurements (NVMe read/write, host<->device).

Nothing here needs a GPU: without NVML and AMD SMI the GPU list is empty and a one-line note says why.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shutil
import socket
import time
import uuid
from pathlib import Path

from fp4offload import _machine as machine
from fp4offload.errors import ConfigError
from fp4offload._planner.readings import DiskReading, GpuReading, HostReading, Readings

__all__ = ["probe", "probe_gpus", "probe_host", "probe_disk", "measure_disk", "measure_h2d",
           "DEFAULT_MEASURE_BYTES", "DEFAULT_MEASURE_SECONDS"]

#: Largest file the NVMe test writes, bytes (also capped at 5% of the free space).
DEFAULT_MEASURE_BYTES = 512 << 20
#: Time budget of each direction of the NVMe test, seconds.
DEFAULT_MEASURE_SECONDS = 5.0
_CHUNK = 8 << 20


_PLAN_FROM_PRESETS = "planning from --gpu PRESET, --gpus N, --nodes N"


def probe_gpus() -> tuple[list[GpuReading], str | None, str | None, str | None]:
    """(GPUs, driver version, CUDA driver version, note), read by :func:`fp4offload._machine.gpus` (pynvml, else
    amdsmi). The note is None when NVML or AMD SMI answered with at least one GPU."""
    got = machine.gpus()
    out = [GpuReading(index=g.index, name=g.name, memory_total=g.total, memory_free=g.free, memory_used=g.used,
                      compute_capability=g.compute_capability, pcie_gen=g.pcie_gen, pcie_width=g.pcie_width,
                      pcie_gen_current=g.pcie_gen_current, pcie_width_current=g.pcie_width_current, source=g.source)
           for g in got.devices]
    note = f"{got.note}: {_PLAN_FROM_PRESETS}" if got.note else None
    return out, got.driver, got.cuda, note


def probe_host(*, proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> HostReading:
    """Host RAM this process may use and cores. RAM (:func:`fp4offload._machine.limits`): ``ram_available`` the
    smaller of the machine's MemAvailable and the tightest cgroup limit less its working set, ``ram_total`` the
    smaller of the machine's RAM and the smallest cgroup limit, ``memory_source`` which of them it is. Cores:
    psutil."""
    import psutil

    lim = machine.limits(proc_cgroup, root)
    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) or logical
    total = lim.total or int(psutil.virtual_memory().total)
    return HostReading(ram_total=int(total), ram_available=min(int(lim.free), int(total)),
                       cores_physical=int(physical), cores_logical=int(logical),
                       cpu_model=platform.processor() or platform.machine(), memory_source=lim.source)


def probe_disk(path: str | os.PathLike) -> DiskReading:
    """Space at ``path`` (which must exist and be a directory; :func:`fp4offload._machine.disk_space`)."""
    d = machine.disk_space(path, "--nvme-path")
    return DiskReading(path=d.path, total=d.total, free=d.free)


def measure_disk(path: str | os.PathLike, max_bytes: int = DEFAULT_MEASURE_BYTES,
                 max_seconds: float = DEFAULT_MEASURE_SECONDS) -> tuple[float, float]:
    """Sequential write then read bandwidth at ``path`` in bytes/s, with one scratch file of at most
    ``max_bytes`` (and at most 5% of the free space), each direction stopped after
    ``max_seconds``. The file is fsync'ed, dropped from the page cache before reading, and removed."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError("--nvme-path", str(path), "an existing directory")
    if not os.access(p, os.W_OK):
        raise ConfigError("--nvme-path", str(path), "a writable directory", "the bandwidth test writes a scratch file")
    limit = min(max_bytes, int(shutil.disk_usage(p).free * 0.05))
    limit -= limit % _CHUNK
    if limit < _CHUNK:
        raise ConfigError("--nvme-path", str(path), f"a directory with at least {20 * _CHUNK >> 20} MiB free")
    buf = os.urandom(_CHUNK)
    scratch = p / f".fp4offload-bench-{uuid.uuid4().hex}.tmp"
    try:
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        written = 0
        t0 = time.perf_counter()
        try:
            while written < limit and time.perf_counter() - t0 < max_seconds:
                written += os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        write_bps = written / max(time.perf_counter() - t0, 1e-9)
        fd = os.open(scratch, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            read = 0
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < max_seconds:
                got = os.read(fd, _CHUNK)
                if not got:
                    break
                read += len(got)
            read_bps = read / max(time.perf_counter() - t0, 1e-9)
        finally:
            os.close(fd)
    finally:
        scratch.unlink(missing_ok=True)
    return read_bps, write_bps


def measure_h2d(nbytes: int = 256 << 20, repeats: int = 5) -> tuple[float, float] | None:
    """Pinned host->device and device->host copy bandwidth of GPU 0, bytes/s; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    rates = []
    for src, dst in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(nbytes * repeats / (start.elapsed_time(end) / 1e3))
    del host, dev
    torch.cuda.empty_cache()
    return rates[0], rates[1]


def probe(nvme_path: str | os.PathLike | None = None, measure: bool = False) -> Readings:
    """Everything readable about this node; with ``measure`` also the bandwidth tests."""
    gpus, driver, cuda, note = probe_gpus()
    notes = [note] if note else []
    disk = probe_disk(nvme_path) if nvme_path is not None else None
    h2d = d2h = None
    if measure:
        if disk is not None:
            rd, wr = measure_disk(disk.path)
            disk = DiskReading(disk.path, disk.total, disk.free, rd, wr)
        got = measure_h2d()
        if got:
            h2d, d2h = got
        elif gpus:
            notes.append("torch sees no CUDA device: host<->device bandwidth not measured")
    return Readings(gpus=tuple(gpus), host=probe_host(), disk=disk, driver_version=driver, cuda_version=cuda,
                    h2d_bps=h2d, d2h_bps=d2h, notes=tuple(notes), hostname=socket.gethostname(),
                    taken_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
