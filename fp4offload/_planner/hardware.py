"""GPU and node presets, and the planning target (:class:`Cluster`) built from readings and presets.

Peak rates are the vendors' dense bf16 tensor-core figures; what a training step achieves is
``DEFAULT_MFU`` of that. Node defaults describe the usual server for each GPU (a DGX where one
exists) and are overridable from the command line; readings of the real machine replace them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

from fp4offload.errors import ConfigError
from fp4offload._config.isas import ISAS
from fp4offload._planner.readings import Readings
from fp4offload._memory.sizes import STATE_BYTES, step_bytes_per_param

__all__ = ["GpuSpec", "NodeSpec", "Cluster", "GPU_PRESETS", "NODE_PRESETS", "DEFAULT_MFU", "match_gpu",
           "pcie_bandwidth", "build_cluster", "DEFAULT_CPU_ADAM_PER_CORE", "CPU_ADAM_BYTES_PER_PARAM",
           "CPU_FP4_PER_CORE", "DEFAULT_GPU"]

GiB = 1 << 30
MiB = 1 << 20
TB = 10**12

#: Fraction of the dense bf16 peak a well-tuned transformer training step sustains.
DEFAULT_MFU = 0.45
#: The GPU preset planned for when none is named and the machine has none (``fp4offload plan``'s default).
DEFAULT_GPU = "h100-80gb"

#: Usable fraction of PCIe's raw rate for pinned copies (protocol overhead).
PCIE_EFFICIENCY = 0.8
_PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

#: CPU optimizer step rate per core (parameters/s) when nothing was measured: fp32 Adam (fused,
#: AVX-512, as DeepSpeedCPUAdam or torch's fused AdamW) and the FP4 step, which is bound by the
#: instructions it issues on few cores (docs/guide.md, "Kernels"). `fp4offload bench` measures the real rates.
#: Measured 2026-11-29 on a 2-core AMD EPYC VM, AVX-512, with `python benchmarks/optimizer.py --numel 16M
#: --threads 1 --rounds 5 --optimizers fp4adamw,deepspeed_cpu_adam`: DeepSpeedCPUAdam 1611 M/s, FP4AdamW
#: (defaults) 738 M/s; rounded down. On a many-core node the memory-bandwidth cap below binds first.
DEFAULT_CPU_ADAM_PER_CORE: dict[str, float] = {"fp32": 1.6e9, "nvfp4": 7.0e8}
#: The FP4 step's rate per core by the CPU path the host runs, parameters/s: the rows of fp4offload/_config/isas.py
#: (where each rate's measurement is told)
CPU_FP4_PER_CORE: dict[str, float] = {isa.name: isa.fp4_per_core for isa in ISAS}
#: Host memory traffic per parameter of one step: fp32 Adam reads/writes master, m, v and reads
#: the gradient (28 B); the FP4 step moves packed m and v instead (14.265625 B).
CPU_ADAM_BYTES_PER_PARAM: dict[str, float] = {fmt: step_bytes_per_param(fmt, bf16_copy=False) for fmt in STATE_BYTES}


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model. Bandwidths in GB/s (10^9 bytes/s), memory in bytes.

    ``nvlink_gbps`` is the per-GPU, one-direction peer bandwidth (0 = peers talk over PCIe);
    ``internode_gbps`` the usual network bandwidth per GPU; ``host_link_gbps`` replaces PCIe where
    the host link is not PCIe (NVLink-C2C).
    """

    key: str
    name: str
    memory_bytes: int
    compute_capability: tuple[int, int]
    bf16_tflops: float
    hbm_gbps: float
    pcie_gen: int
    pcie_width: int = 16
    nvlink_gbps: float = 0.0
    internode_gbps: float = 12.5
    fp4_tensor_cores: bool = False
    bf16: bool = True
    host_link_gbps: float | None = None


@dataclass(frozen=True)
class NodeSpec:
    """The usual server around a GPU: GPUs per node, host RAM (bytes), cores, local NVMe (bytes
    and GB/s), and host memory bandwidth (GB/s)."""

    gpus: int
    host_ram: int
    cores: int
    nvme_bytes: int
    nvme_read_gbps: float
    nvme_write_gbps: float
    host_mem_gbps: float
    cpu_isa: str = "avx512"  # the vector path of the host CPU (DGX A100: AMD EPYC 7742, AVX2; GH200: Grace, SVE2)


def _g(key, name, mib, cc, tflops, hbm, gen, **kw) -> GpuSpec:
    return GpuSpec(key, name, mib * MiB, cc, tflops, hbm, gen, **kw)


GPU_PRESETS: dict[str, GpuSpec] = {g.key: g for g in (
    _g("h100-80gb", "NVIDIA H100 80GB HBM3 (SXM)", 81559, (9, 0), 989, 3350, 5, nvlink_gbps=450, internode_gbps=50),
    _g("h100-pcie-80gb", "NVIDIA H100 PCIe", 81559, (9, 0), 756, 2000, 5, internode_gbps=25),
    _g("h200-141gb", "NVIDIA H200", 143771, (9, 0), 989, 4800, 5, nvlink_gbps=450, internode_gbps=50),
    _g("gh200-96gb", "NVIDIA GH200 480GB", 97871, (9, 0), 989, 4000, 5, internode_gbps=50, host_link_gbps=450),
    _g("b200-180gb", "NVIDIA B200", 183359, (10, 0), 2250, 8000, 5, nvlink_gbps=900, internode_gbps=50,
       fp4_tensor_cores=True),
    _g("a100-80gb", "NVIDIA A100-SXM4-80GB", 81920, (8, 0), 312, 2039, 4, nvlink_gbps=300, internode_gbps=25),
    _g("a100-40gb", "NVIDIA A100-SXM4-40GB", 40960, (8, 0), 312, 1555, 4, nvlink_gbps=300, internode_gbps=25),
    _g("l40s-48gb", "NVIDIA L40S", 46068, (8, 9), 362, 864, 4, internode_gbps=25),
    _g("rtx-6000-ada-48gb", "NVIDIA RTX 6000 Ada Generation", 49140, (8, 9), 364, 960, 4),
    _g("rtx-4090-24gb", "NVIDIA GeForce RTX 4090", 24564, (8, 9), 165, 1008, 4, internode_gbps=3),
    _g("l4-24gb", "NVIDIA L4", 23034, (8, 9), 121, 300, 4),
    _g("a10g-24gb", "NVIDIA A10G", 23028, (8, 6), 70, 600, 4),
    _g("v100-32gb", "Tesla V100-SXM2-32GB", 32768, (7, 0), 125, 900, 3, nvlink_gbps=150, bf16=False),
    # AMD Instinct, vendor figures (dense bf16 matrix peak, HBM bandwidth, host link, Infinity Fabric to each peer as
    # the peer link), from AMD's product pages and datasheets (amd.com/en/products/accelerators/instinct/...):
    #   MI250X: 128 GB HBM2e, 3.2 TB/s, 383 TFLOPS bf16 (220 CUs x 1.7 GHz x 1024), PCIe 4.0 x16. ROCm sees its two
    #           GCDs as two devices, so the preset is one GCD: 64 GB, 1.6 TB/s, 191.5 TFLOPS.
    #   MI300X: 192 GB HBM3, 5.3 TB/s, 1307 TFLOPS bf16 (304 CUs x 2.1 GHz x 2048), PCIe 5.0 x16.
    #   MI325X: 256 GB HBM3E, 6.0 TB/s, 1307 TFLOPS bf16 (the MI300X's compute), PCIe 5.0 x16.
    #   MI355X: 288 GB HBM3E, 8.0 TB/s, 2.5 PFLOPS bf16 (256 CUs x 2.4 GHz x 4096 = 2516), PCIe 5.0 x16.
    # compute_capability is NVIDIA's notion: (0, 0) here.
    _g("mi250x-64gb", "AMD Instinct MI250X (one GCD)", 65536, (0, 0), 191.5, 1638, 4, nvlink_gbps=100,
       internode_gbps=25),
    _g("mi300x-192gb", "AMD Instinct MI300X", 196608, (0, 0), 1307, 5300, 5, nvlink_gbps=448, internode_gbps=50),
    _g("mi325x-256gb", "AMD Instinct MI325X", 262144, (0, 0), 1307, 6000, 5, nvlink_gbps=448, internode_gbps=50),
    _g("mi355x-288gb", "AMD Instinct MI355X", 294912, (0, 0), 2516, 8000, 5, nvlink_gbps=1075, internode_gbps=50,
       fp4_tensor_cores=True),
)}

NODE_PRESETS: dict[str, NodeSpec] = {
    "h100-80gb": NodeSpec(8, 2048 * GiB, 112, 30 * TB, 20, 12, 400),
    "h100-pcie-80gb": NodeSpec(8, 1024 * GiB, 64, 15 * TB, 12, 8, 300),
    "h200-141gb": NodeSpec(8, 2048 * GiB, 112, 30 * TB, 20, 12, 400),
    "gh200-96gb": NodeSpec(1, 480 * GiB, 72, 4 * TB, 6, 4, 450, "sve"),
    "b200-180gb": NodeSpec(8, 2048 * GiB, 112, 30 * TB, 25, 15, 500),
    "a100-80gb": NodeSpec(8, 1024 * GiB, 128, 15 * TB, 12, 8, 300, "avx2"),
    "a100-40gb": NodeSpec(8, 1024 * GiB, 128, 15 * TB, 12, 8, 300, "avx2"),
    "l40s-48gb": NodeSpec(8, 1024 * GiB, 64, 8 * TB, 12, 6, 300),
    "rtx-6000-ada-48gb": NodeSpec(4, 512 * GiB, 32, 4 * TB, 7, 5, 200),
    "rtx-4090-24gb": NodeSpec(1, 128 * GiB, 16, 2 * TB, 6, 4, 60),
    "l4-24gb": NodeSpec(4, 192 * GiB, 48, 2 * TB, 4, 3, 150),
    "a10g-24gb": NodeSpec(4, 192 * GiB, 48, 4 * TB, 4, 3, 150),
    "v100-32gb": NodeSpec(8, 512 * GiB, 40, 7 * TB, 6, 4, 150),
    "mi250x-64gb": NodeSpec(8, 512 * GiB, 64, 4 * TB, 6, 4, 200),  # 4 MI250X = 8 GCDs, one 64-core EPYC
    "mi300x-192gb": NodeSpec(8, 2048 * GiB, 192, 30 * TB, 25, 15, 700),  # 2 x EPYC 9654 (AVX-512)
    "mi325x-256gb": NodeSpec(8, 2048 * GiB, 192, 30 * TB, 25, 15, 700),
    "mi355x-288gb": NodeSpec(8, 3072 * GiB, 256, 30 * TB, 25, 15, 900),  # 2 x EPYC 9005
}

# NVML name -> preset, first match wins (order matters: GH200 before H200, L40S before L4).
_NVML_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"GH200", "gh200-96gb"), (r"H200", "h200-141gb"), (r"H100.*PCIe", "h100-pcie-80gb"),
    (r"H100|H800", "h100-80gb"), (r"B200|B100", "b200-180gb"), (r"A100.*80", "a100-80gb"), (r"A100", "a100-40gb"),
    (r"L40S|L40\b", "l40s-48gb"), (r"RTX 6000 Ada", "rtx-6000-ada-48gb"), (r"4090", "rtx-4090-24gb"),
    (r"\bL4\b", "l4-24gb"), (r"A10G|A10\b", "a10g-24gb"), (r"V100", "v100-32gb"),
    (r"MI355", "mi355x-288gb"), (r"MI325", "mi325x-256gb"), (r"MI300", "mi300x-192gb"), (r"MI250", "mi250x-64gb"),
)
# When a GPU matches no preset: dense bf16 TFLOPS by compute capability major/minor (conservative).
_TFLOPS_BY_CC = {(10, 0): 2250, (9, 0): 756, (8, 9): 180, (8, 6): 70, (8, 0): 312, (7, 0): 125, (7, 5): 65}


def match_gpu(name: str) -> GpuSpec | None:
    """The preset whose NVML name pattern matches ``name``, or None."""
    for pat, key in _NVML_PATTERNS:
        if re.search(pat, name, re.IGNORECASE):
            return GPU_PRESETS[key]
    return None


def pcie_bandwidth(gen: int | None, width: int | None) -> float:
    """Achievable pinned-copy bandwidth of a PCIe link, bytes/s."""
    lane = _PCIE_LANE_GBPS.get(gen or 4, 1.969)
    return lane * (width or 16) * PCIE_EFFICIENCY * 1e9


@dataclass(frozen=True)
class Cluster:
    """The machine a plan is for. Per-GPU figures unless named per node; bytes and bytes/s.

    ``cpu_adam`` holds the CPU optimizer step rate per node, parameters/s, per state format.
    ``host_ram_source`` and ``gpu_memory_source`` say where ``host_ram`` and ``gpu_memory`` came from.
    """

    gpu: GpuSpec
    gpu_memory: int
    gpus_per_node: int
    nodes: int
    host_ram: int
    host_cores: int
    host_mem_bps: float
    nvme_path: str | None
    nvme_free: int | None
    nvme_read_bps: float
    nvme_write_bps: float
    h2d_bps: float
    d2h_bps: float
    cpu_adam: Mapping[str, float] = field(default_factory=dict)
    cpu_isa: str = "avx512"
    mfu: float = DEFAULT_MFU
    source: str = "preset"
    notes: tuple[str, ...] = ()
    host_ram_source: str = ""
    gpu_memory_source: str = ""

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def achievable_flops(self) -> float:
        return self.gpu.bf16_tflops * 1e12 * self.mfu

    @property
    def peer_bps(self) -> float:
        """Per-GPU bandwidth of the collectives: NVLink in one node, the network across nodes."""
        if self.nodes > 1:
            return self.gpu.internode_gbps * 1e9
        if self.gpu.nvlink_gbps:
            return self.gpu.nvlink_gbps * 1e9
        return pcie_bandwidth(self.gpu.pcie_gen, self.gpu.pcie_width) / 2

    def describe(self) -> str:
        nv = f", NVMe {self.nvme_free / GiB:,.0f} GiB free at {self.nvme_path}" if self.nvme_free else ", no NVMe"
        return (f"{self.nodes} node(s) x {self.gpus_per_node} x {self.gpu.name} ({self.gpu_memory / GiB:.0f} GiB), "
                f"host {self.host_ram / GiB:.0f} GiB RAM / {self.host_cores} cores per node{nv} [{self.source}]")


def _default_rate(fmt: str, cores: int, mem_gbps: float, isa: str = "avx512") -> float:
    if fmt == "nvfp4":
        per_core = CPU_FP4_PER_CORE.get(isa, CPU_FP4_PER_CORE["scalar"])
    else:
        per_core = DEFAULT_CPU_ADAM_PER_CORE[fmt]
    return min(per_core * cores, mem_gbps * 1e9 / CPU_ADAM_BYTES_PER_PARAM[fmt])


def _cpu_adam_rates(cores: int, mem_gbps: float, measured: Mapping[str, float], measured_threads: int | None,
                    same_host: bool, isa: str = "avx512") -> dict[str, float]:
    """Per-node CPU optimizer rates (parameters/s): the measured ones (scaled by cores and capped by
    memory bandwidth when the target host is another machine), else the defaults. When only the
    fp32 step was measured, the FP4 rate keeps the defaults' FP4/fp32 ratio."""
    out: dict[str, float] = {}
    for fmt in DEFAULT_CPU_ADAM_PER_CORE:
        if fmt in measured and measured_threads:
            cap = mem_gbps * 1e9 / CPU_ADAM_BYTES_PER_PARAM[fmt]
            out[fmt] = measured[fmt] if same_host else min(measured[fmt] / measured_threads * cores, cap)
        else:
            out[fmt] = _default_rate(fmt, cores, mem_gbps, isa)
    if "nvfp4" not in measured and "fp32" in measured and measured_threads:
        out["nvfp4"] = (out["fp32"] * _default_rate("nvfp4", cores, mem_gbps, isa)
                        / _default_rate("fp32", cores, mem_gbps, isa))
    return out


def build_cluster(*, readings: Readings | None = None, gpu: str | None = None, gpus: int | None = None,
                  nodes: int = 1, host_ram_gb: float | None = None, host_cores: int | None = None,
                  nvme_path: str | None = None, nvme_gb: float | None = None, mfu: float | None = None) -> Cluster:
    """The planning target: readings of the real machine where present, the ``gpu`` preset and its
    node defaults elsewhere, and explicit overrides on top."""
    notes: list[str] = list(readings.notes) if readings else []
    if nodes is None or nodes < 1:
        raise ConfigError("--nodes", nodes, "an integer >= 1")
    if gpus is not None and gpus < 1:
        raise ConfigError("--gpus", gpus, "an integer >= 1 (GPUs per node)")
    if mfu is not None and not 0 < mfu <= 1:
        raise ConfigError("--mfu", mfu, "a fraction in (0, 1]")
    seen = readings.gpus if readings else ()
    if gpu is None and not seen:  # no GPU here: plan for the default target node, as if --gpu named it
        gpu = DEFAULT_GPU
        notes.append(f"no GPU was found on this machine: planning for a {DEFAULT_GPU} node "
                     "(name the target with --gpu PRESET, --gpus N, --nodes N)")
    if gpu is not None:
        key = gpu.lower()
        if key not in GPU_PRESETS:  # a unique prefix names its preset: mi300x, b200, h200
            starts = [k for k in GPU_PRESETS if k.startswith(key + "-")]
            if len(starts) != 1:
                raise ConfigError("--gpu", gpu, ", ".join(GPU_PRESETS),
                                  f"{gpu!r} could be {' or '.join(starts)}" if starts else "unknown GPU preset")
            key = starts[0]
        spec = GPU_PRESETS[key]
        memory = spec.memory_bytes
        source = "preset"
        gpu_src = f"GPU preset {key}"
        if seen:
            notes.append(f"--gpu {key} overrides the {len(seen)} GPU(s) in the readings")
    elif seen:
        first = seen[0]
        spec = match_gpu(first.name)
        if spec is None:
            cc = first.compute_capability or (8, 0)
            tflops = _TFLOPS_BY_CC.get(tuple(cc), 100)
            spec = GpuSpec("unknown", first.name, first.memory_total, tuple(cc), tflops, 1000, first.pcie_gen or 4,
                           first.pcie_width or 16)
            notes.append(f"{first.name} matches no preset; assuming {tflops} dense bf16 TFLOPS")
        memory = min(g.memory_total for g in seen)
        source = "measured"
        gpu_src = first.source
    node = NODE_PRESETS.get(spec.key, NodeSpec(gpus or 1, 256 * GiB, 32, 2 * TB, 5, 3, 150))
    n_gpus = gpus or (len(seen) if seen and gpu is None else node.gpus)

    # Readings without GPUs next to a --gpu preset come from another machine (a laptop planning
    # for a cluster): its host is not the target's, unless the NVMe path was named explicitly.
    target = readings is not None and (bool(seen) or gpu is None)
    host = readings.host if target and readings else None
    same_host = host is not None and host_cores is None
    ram = host.ram_available if host else node.host_ram * 0.9
    if host is not None:
        ram_src = host.memory_source or "readings (source not recorded)"
    else:
        ram_src = f"node preset {spec.key}: 90% of {node.host_ram / GiB:.0f} GiB"
    cores = host.cores_physical if host else node.cores
    if host_ram_gb is not None:
        ram, ram_src = host_ram_gb * GiB, "--host-ram-gb"
    if host_cores is not None:
        cores = host_cores
    mem_gbps = node.host_mem_gbps

    disk = readings.disk if readings and (target or nvme_path) else None
    if nvme_path is not None and disk is not None and disk.path != nvme_path:
        disk = None
    path = nvme_path or (disk.path if disk else None)
    if nvme_gb is not None:
        nv_free: int | None = int(nvme_gb * GiB)
    elif disk is not None:
        nv_free = disk.free
    elif not target and path is not None:
        nv_free = node.nvme_bytes
    elif not target and gpu is not None:
        nv_free, path = node.nvme_bytes, "/local_nvme"
        notes.append("NVMe assumed from the node preset at /local_nvme; pass --nvme-path (and --nvme-gb) to set it")
    else:
        nv_free = None
    rd = (disk.read_bps if disk and disk.read_bps else node.nvme_read_gbps * 1e9)
    wr = (disk.write_bps if disk and disk.write_bps else node.nvme_write_gbps * 1e9)

    if spec.host_link_gbps:
        link = spec.host_link_gbps * 1e9
    else:
        g0 = seen[0] if seen and gpu is None else None
        link = pcie_bandwidth(g0.pcie_gen if g0 else spec.pcie_gen, g0.pcie_width if g0 else spec.pcie_width)
    h2d = readings.h2d_bps if readings and readings.h2d_bps and gpu is None else link
    d2h = readings.d2h_bps if readings and readings.d2h_bps and gpu is None else link

    measured = readings.cpu_adam if readings else {}
    threads = readings.cpu_adam_threads if readings else None
    if host is not None:  # planning for this machine: the path its CPU runs (or FP4OFFLOAD_CPU_ISA forces)
        from fp4offload._ops import cpu_isa

        isa = cpu_isa.chosen()[0]
    else:
        isa = node.cpu_isa
    if isa != "avx512" and "nvfp4" not in measured:
        notes.append(f"the host CPU runs the {isa} path: FP4 step planned at {CPU_FP4_PER_CORE[isa] / 1e6:.0f} M "
                     f"parameters/s per core (AVX-512: {CPU_FP4_PER_CORE['avx512'] / 1e6:.0f} M)")
    rates = _cpu_adam_rates(cores, mem_gbps, measured, threads, same_host, isa)
    return Cluster(gpu=spec, gpu_memory=int(memory), gpus_per_node=n_gpus, nodes=nodes, host_ram=int(ram),
                   host_cores=int(cores), host_mem_bps=mem_gbps * 1e9, nvme_path=path, nvme_free=nv_free,
                   nvme_read_bps=rd, nvme_write_bps=wr, h2d_bps=h2d, d2h_bps=d2h, cpu_adam=rates, cpu_isa=isa,
                   mfu=mfu or DEFAULT_MFU, source=source, notes=tuple(notes), host_ram_source=ram_src,
                   gpu_memory_source=gpu_src)
