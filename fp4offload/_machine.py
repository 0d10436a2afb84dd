"""The machine's memory, read live, each figure with where it came from.

- Host memory (:func:`limits`): the tightest of the machine's available memory (psutil, MemAvailable, which
  counts reclaimable page cache as available) and every cgroup v1 and v2 memory limit on this process's cgroup
  path up to the root of the hierarchy, each less that cgroup's working set (its usage less the inactive file
  cache that no process maps; kubelet and docker take off all of the inactive file cache, but the mapped part is
  running code, reclaimed only to be faulted back).
- GPU memory (:func:`gpus`): per device, through NVML (pynvml).
- Ranks on this node (:func:`launcher_ranks`): from the launcher's environment.
- Free space at a path (:func:`disk_space`).

The planner's probe, the DeepSpeed preflight, the activation pool's default cap and ``fp4offload doctor`` read
the machine here and nowhere else. Nothing here needs a GPU or imports torch.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, NamedTuple

from fp4offload.errors import ConfigError

__all__ = ["Limits", "CgroupMemory", "cgroups", "cgroup_limit", "limits", "GpuMemory", "Gpus", "gpus", "Ranks",
           "launcher_ranks", "LOCAL_RANK_VARIABLES", "DiskSpace", "disk_space"]

GiB = float(1 << 30)
_UNLIMITED = 1 << 60  # cgroup v1 writes a page-aligned 2**63-1 for "no limit"
MACHINE_SOURCE = "machine MemAvailable (psutil)"


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


# -- host memory --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupMemory:
    """One memory limit on this process's cgroup path, bytes. ``usage``: what the kernel charges the cgroup,
    page cache included; ``reclaimable``: its inactive file cache less the mapped file pages (v1
    ``total_inactive_file - total_mapped_file``, v2 ``inactive_file - file_mapped`` of ``memory.stat``);
    ``path``: ``"v1:/docker/abc"`` or ``"v2:/pod"``."""

    limit: int
    usage: int
    reclaimable: int
    path: str

    @property
    def working_set(self) -> int:
        """Usage less the reclaimable page cache."""
        return max(0, self.usage - self.reclaimable)

    @property
    def free(self) -> int:
        """The limit less the working set, never negative."""
        return max(0, self.limit - self.working_set)


@dataclass(frozen=True)
class Limits:
    """What this process may still allocate, bytes, and where the figure came from.

    ``available``: the machine's MemAvailable. ``cgroup_limit``, ``cgroup_usage``, ``reclaimable``, ``cgroup``:
    the limit, usage (page cache included), reclaimable (unmapped inactive) file cache and path (``"v1:/path"``,
    ``"v2:/path"``) of the cgroup that leaves the least, or None/0/"" outside a memory cgroup. ``total``: the
    smaller of the machine's RAM and the smallest cgroup limit (None when not read).
    ``free`` = min(available, cgroup_limit - (cgroup_usage - reclaimable)), never negative."""

    available: int
    cgroup_limit: int | None = None
    cgroup_usage: int | None = None
    cgroup: str = ""
    reclaimable: int = 0
    total: int | None = None

    @property
    def cgroup_free(self) -> int | None:
        """The cgroup's limit less its working set; None outside a memory cgroup."""
        if self.cgroup_limit is None:
            return None
        return max(0, self.cgroup_limit - max(0, (self.cgroup_usage or 0) - self.reclaimable))

    @property
    def free(self) -> int:
        cg = self.cgroup_free
        return self.available if cg is None else max(0, min(self.available, cg))

    @property
    def source(self) -> str:
        """Which figure ``free`` is: the cgroup's (path, limit, usage, reclaimable cache) or the machine's."""
        cg = self.cgroup_free
        if cg is None or cg >= self.available:
            return MACHINE_SOURCE
        return (f"cgroup {self.cgroup} limit {_gib(self.cgroup_limit or 0)}, using {_gib(self.cgroup_usage or 0)} "
                f"({_gib(self.reclaimable)} page cache reclaimable)")

    def describe(self) -> str:
        """``free`` with both figures it is the smaller of."""
        text = f"{_size(self.free)} (machine available {_size(self.available)}"
        if self.cgroup_limit is not None:
            text += f"; cgroup {self.cgroup} limit {_size(self.cgroup_limit)}, using {_size(self.cgroup_usage or 0)}"
            if self.reclaimable:
                text += f", {_size(self.reclaimable)} of it reclaimable page cache"
        return text + ")"


def _size(n: float) -> str:
    return _gib(n) if abs(n) >= GiB else f"{n / (1 << 20):.0f} MiB"


def _read_int(path: Path) -> int | None:
    """The integer in a cgroup file; None when missing, "max", unlimited or not a number."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.lstrip("-").isdigit():
        return None
    v = int(text)
    return v if 0 <= v < _UNLIMITED else None


def _stat(path: Path, key: str) -> int:
    """The value of ``key`` in a ``memory.stat`` file; 0 when missing."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def _cgroup_dirs(controller: str, proc_cgroup: str, root: str):
    """(tag "v2"/"v1", hierarchy root, folder) for this process's cgroup of `controller` and each parent, innermost
    first: the ``0::/path`` line (v2) and the v1 line whose controllers include `controller`. A path with ``..``
    (a cgroup outside this namespace) starts at the root of the hierarchy."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":
            base, tag = Path(root), "v2"
        elif controller in controllers.split(","):
            base, tag = Path(root) / controller, "v1"
            if not base.is_dir():
                base = Path(root) / controllers  # mounted as "cpu,cpuacct"
        else:
            continue
        names = [p for p in rel.split("/") if p and p != "."]
        d = base if ".." in names else base.joinpath(*names)
        while True:
            yield tag, base, d
            if d == base:
                break
            d = d.parent


def _cgroup_name(tag: str, base: Path, d: Path) -> str:
    return f"{tag}:/{d.relative_to(base)}" if d != base else f"{tag}:/"


def cgroups(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> list[CgroupMemory]:
    """Every memory limit on this process's cgroup path, innermost first, v2 and v1.

    cgroup v2 (the ``0::/path`` line of ``proc_cgroup``): ``memory.max``, ``memory.current`` and ``inactive_file``
    less ``file_mapped`` of ``memory.stat`` under ``root``/path and each parent. v1 (the line whose controllers
    include ``memory``): ``memory.limit_in_bytes``, ``memory.usage_in_bytes`` and ``total_inactive_file`` less
    ``total_mapped_file`` under ``root``/memory/path and each parent. A path with ``..`` (a cgroup outside this
    namespace) starts at the root of the hierarchy."""
    out: list[CgroupMemory] = []
    for tag, base, d in _cgroup_dirs("memory", proc_cgroup, root):
        if tag == "v2":
            lim_name, use_name, cache_key, mapped_key = "memory.max", "memory.current", "inactive_file", "file_mapped"
        else:
            lim_name, use_name = "memory.limit_in_bytes", "memory.usage_in_bytes"
            cache_key, mapped_key = "total_inactive_file", "total_mapped_file"
        lim = _read_int(d / lim_name)
        if lim is not None:
            use = _read_int(d / use_name) or 0
            # inactive page cache that no process maps: the code pages of the running processes are
            # reclaimable only by faulting them back in, so they count as used (the safe side)
            stat = d / "memory.stat"
            cache = min(use, max(0, _stat(stat, cache_key) - _stat(stat, mapped_key)))
            out.append(CgroupMemory(lim, use, cache, _cgroup_name(tag, base, d)))
    return out


def _tightest(found: list[CgroupMemory]) -> CgroupMemory | None:
    best = None
    for c in found:
        if best is None or c.free < best.free:
            best = c
    return best


def cgroup_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> tuple[int, int, str] | None:
    """(limit, working set, path) of the memory cgroup on this process's path that leaves the least, or None
    outside one (:func:`cgroups`; the working set is the usage less the reclaimable page cache)."""
    best = _tightest(cgroups(proc_cgroup, root))
    return None if best is None else (best.limit, best.working_set, best.path)


def limits(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup",
           virtual_memory: Callable[[], Any] | None = None) -> Limits:
    """What this process may allocate now: the machine's MemAvailable (``virtual_memory``, default
    ``psutil.virtual_memory``) and the tightest cgroup limit of :func:`cgroups`."""
    if virtual_memory is None:
        import psutil

        virtual_memory = psutil.virtual_memory
    vm = virtual_memory()
    avail = int(vm.available)
    machine_total = getattr(vm, "total", None)
    found = cgroups(proc_cgroup, root)
    caps = [c.limit for c in found] + ([int(machine_total)] if machine_total else [])
    total = min(caps) if caps else None
    best = _tightest(found)
    if best is None:
        return Limits(available=avail, total=total)
    return Limits(available=avail, cgroup_limit=best.limit, cgroup_usage=best.usage, cgroup=best.path,
                  reclaimable=best.reclaimable, total=total)


# -- GPU memory ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuMemory:
    """One GPU as NVML (or AMD SMI: ``source`` says) reports it: memory in bytes; compute capability and PCIe link
    (the maximum it trains to, and the current one) where NVML answered, else None (always None from AMD SMI)."""

    index: int
    name: str
    total: int
    free: int
    used: int
    compute_capability: tuple[int, int] | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_gen_current: int | None = None
    pcie_width_current: int | None = None
    source: str = "pynvml"


@dataclass(frozen=True)
class Gpus:
    """The GPUs NVML (or AMD SMI: ``source`` says) sees, the driver and CUDA driver versions, and ``note``: why the
    list is empty (None when one answered with at least one GPU)."""

    devices: tuple[GpuMemory, ...] = ()
    driver: str | None = None
    cuda: str | None = None
    note: str | None = None
    source: str = "pynvml"


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _nvml(mod: Any, name: str, *args: Any) -> Any:
    """``mod.name(*args)``, or None when the call is missing or fails (not supported on this GPU)."""
    try:
        return getattr(mod, name)(*args)
    except Exception:
        return None


def gpus() -> Gpus:
    """Every GPU's memory, name, compute capability and link: NVIDIA's through NVML (the ``pynvml`` module), else
    AMD's through AMD SMI (the ``amdsmi`` module, which needs ROCm's library), else none with both reasons."""
    nv = _nvidia_gpus()
    if nv.devices:
        return nv
    amd = amd_gpus()
    if amd.devices:
        return amd
    return Gpus(note=f"{nv.note}; {amd.note}")


def amd_gpus(module: Any = None) -> Gpus:
    """AMD GPUs through AMD SMI: name (the ASIC's market name), VRAM total, used and free. ``module``: the
    ``amdsmi`` module (default: imported here; the tests pass a stand-in)."""
    if module is None:
        try:
            import amdsmi as module
        except ModuleNotFoundError as exc:
            if exc.name not in (None, "amdsmi"):  # amdsmi is there, one of its own imports is not
                return Gpus(note=f"amdsmi does not load ({type(exc).__name__}: {exc})"[:200], source="amdsmi")
            return Gpus(note="amdsmi is not installed (AMD GPUs are read through ROCm's amdsmi package)",
                        source="amdsmi")
        except Exception as exc:  # installed, but ROCm's libamd_smi.so is missing or does not load
            return Gpus(note=f"amdsmi is installed but ROCm's library does not load ({type(exc).__name__}: {exc})"
                        [:200], source="amdsmi")
    try:
        module.amdsmi_init()
    except Exception as exc:
        return Gpus(note=f"no AMD GPU driver for amdsmi here ({exc})"[:200], source="amdsmi")
    try:
        vram = module.AmdSmiMemoryType.VRAM
        out: list[GpuMemory] = []
        for i, h in enumerate(module.amdsmi_get_processor_handles()):
            total = int(module.amdsmi_get_gpu_memory_total(h, vram))
            used = int(module.amdsmi_get_gpu_memory_usage(h, vram))
            try:
                name = str(module.amdsmi_get_gpu_asic_info(h).get("market_name") or "AMD GPU")
            except Exception:
                name = "AMD GPU"
            out.append(GpuMemory(index=i, name=name, total=total, free=max(0, total - used), used=used,
                                 compute_capability=None, source="amdsmi"))
        return Gpus(devices=tuple(out), note=None if out else "amdsmi found no GPU", source="amdsmi")
    except Exception as exc:
        return Gpus(note=f"amdsmi could not read the GPUs ({type(exc).__name__}: {exc})"[:200], source="amdsmi")
    finally:
        try:
            module.amdsmi_shut_down()
        except Exception:
            pass


def _nvidia_gpus() -> Gpus:
    """NVIDIA GPUs through NVML."""
    try:
        import pynvml
    except ImportError:
        return Gpus(note="pynvml (nvidia-ml-py) is not installed")
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        msg = str(exc) or type(exc).__name__
        return Gpus(note=f"no NVIDIA driver/NVML here ({msg})")
    try:
        driver = _nvml(pynvml, "nvmlSystemGetDriverVersion")
        cuda = _nvml(pynvml, "nvmlSystemGetCudaDriverVersion")
        out: list[GpuMemory] = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            cc = _nvml(pynvml, "nvmlDeviceGetCudaComputeCapability", h)
            out.append(GpuMemory(
                index=i, name=_text(pynvml.nvmlDeviceGetName(h)), total=int(mem.total), free=int(mem.free),
                used=int(mem.used), compute_capability=(int(cc[0]), int(cc[1])) if cc else None,
                pcie_gen=_nvml(pynvml, "nvmlDeviceGetMaxPcieLinkGeneration", h),
                pcie_width=_nvml(pynvml, "nvmlDeviceGetMaxPcieLinkWidth", h),
                pcie_gen_current=_nvml(pynvml, "nvmlDeviceGetCurrPcieLinkGeneration", h),
                pcie_width_current=_nvml(pynvml, "nvmlDeviceGetCurrPcieLinkWidth", h)))
        return Gpus(devices=tuple(out), driver=_text(driver) if driver else None,
                    cuda=f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None,
                    note=None if out else "NVML found no GPU")
    finally:
        _nvml(pynvml, "nvmlShutdown")


# -- ranks on this node -------------------------------------------------------------------------

#: the launchers' variables for the ranks on this node, in the order read: torchrun and DeepSpeed's launcher,
#: DeepSpeed's MPI discovery, Open MPI
LOCAL_RANK_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


class Ranks(NamedTuple):
    """World size, ranks on this node, and the variable the ranks on this node came from."""

    world: int
    local: int
    source: str


def launcher_ranks(environ: Mapping[str, str] | None = None) -> Ranks:
    """(world size, ranks on this node, source) from ``environ`` (default ``os.environ``): WORLD_SIZE, and the
    first of :data:`LOCAL_RANK_VARIABLES` that is a positive integer. One rank each when unset; the source then
    says so, naming a variable whose value was not a positive integer."""
    env = os.environ if environ is None else environ
    ws = env.get("WORLD_SIZE", "")
    world = int(ws) if ws.isdigit() and int(ws) > 0 else 1
    ignored = []
    for var in LOCAL_RANK_VARIABLES:
        v = env.get(var)
        if v is None:
            continue
        if v.isdigit() and int(v) > 0:
            return Ranks(world, int(v), var)
        ignored.append(f"{var}={v!r} is not a positive integer")
    why = "; ".join(ignored) if ignored else "none of " + ", ".join(LOCAL_RANK_VARIABLES) + " is set"
    return Ranks(world, 1, f"default: {why}")


# -- CPU threads for the host optimizer step --------------------------------------------------------


def cgroup_cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> tuple[float, str] | None:
    """(CPUs, cgroup path) of the tightest CPU quota on this process's cgroup path, v2 (``cpu.max``) and v1
    (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, -1 for none); None when no quota is set."""
    best: tuple[float, str] | None = None
    for tag, base, d in _cgroup_dirs("cpu", proc_cgroup, root):
        try:
            if tag == "v2":
                quota, period = (d / "cpu.max").read_text().split()[:2]
                cpus = None if quota == "max" else int(quota) / int(period)
            else:
                quota, period = _read_int(d / "cpu.cfs_quota_us"), _read_int(d / "cpu.cfs_period_us")
                cpus = quota / period if quota is not None and quota > 0 and period else None
        except (OSError, ValueError):
            cpus = None
        if cpus is not None and (best is None or cpus < best[0]):
            best = (cpus, _cgroup_name(tag, base, d))
    return best


@dataclass(frozen=True)
class StepThreads:
    """The threads one rank's host optimizer step uses, and why: ``cpus`` the CPUs the rank may run on (affinity,
    capped by a cgroup quota), ``local_ranks`` the ranks sharing them, ``source`` where the figure came from."""

    threads: int
    cpus: int
    local_ranks: int
    source: str

    def describe(self) -> str:
        return f"{self.threads} thread(s) ({self.source})"


def step_threads(environ: Mapping[str, str] | None = None, proc_cgroup: str = "/proc/self/cgroup",
                 root: str = "/sys/fs/cgroup") -> StepThreads:
    """How many threads a rank's host optimizer step should use: ``FP4OFFLOAD_STEP_THREADS`` when set; else SLURM's
    ``SLURM_CPUS_PER_TASK`` (CPUs given to each task) within what the rank may run on; else the CPUs it may run on
    (its affinity mask, capped by the cgroup's CPU quota) shared by the ranks of this node. Never the machine's
    total core count, and never OMP_NUM_THREADS, which launchers set to 1 for every rank."""
    env = os.environ if environ is None else environ
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count() or 1
    quota = cgroup_cpu_quota(proc_cgroup, root)
    cpus, why = affinity, f"{affinity} CPU(s) in this process's affinity"
    if quota is not None and math.floor(quota[0]) < affinity:  # 1.5 CPUs of time: one thread is never throttled
        cpus, why = max(1, math.floor(quota[0])), f"cgroup {quota[1]} CPU quota {quota[0]:g}"
    local = launcher_ranks(env).local
    from . import _switches

    forced = _switches.get("FP4OFFLOAD_STEP_THREADS", env)
    if forced is not None:
        return StepThreads(int(forced), cpus, local, "FP4OFFLOAD_STEP_THREADS")
    slurm = env.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        n = min(int(slurm), cpus)
        return StepThreads(n, cpus, local, f"SLURM_CPUS_PER_TASK={slurm}, {why}")
    n = max(1, cpus // local)
    return StepThreads(n, cpus, local, f"{why}, shared by {local} local rank(s)")


# -- disk space ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiskSpace:
    """The filesystem holding ``path``: its size and free space, bytes."""

    path: str
    total: int
    free: int
    source: str = "shutil.disk_usage"


def disk_space(path: str | os.PathLike, key: str = "path") -> DiskSpace:
    """Size and free space of the filesystem at ``path``, an existing directory (else a ConfigError naming
    ``key``, the flag or setting that gave the path)."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(key, str(path), "an existing directory", "create it or point at the NVMe mount")
    usage = shutil.disk_usage(p)
    return DiskSpace(path=str(p), total=int(usage.total), free=int(usage.free))
