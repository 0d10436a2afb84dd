"""Time model: seconds per optimizer step for one strategy, and which term bounds it.

Terms (per GPU unless said otherwise):

- compute: training FLOPs (6 x weights per token + causal attention, one more forward of the
  blocks when checkpointing) over the GPU's dense bf16 peak x the achievable fraction (MFU);
  packing saved activations on the GPU adds two passes over them at HBM speed.
- collectives: ZeRO/FSDP all-gathers and reduce-scatters over NVLink (one node) or the network.
- pcie: host<->device bytes (weights fetched per layer, gradients out, updated weights back,
  offloaded activations both ways) over the measured or nominal link; the busier direction counts,
  or the node's host memory when all GPUs' copies together need more than its DMA share.
- nvme: bytes to and from the node's NVMe, per node, over its read/write bandwidth.
- cpu_optimizer: the node's share of parameters over the CPU optimizer step rate (``fp4offload
  bench`` measures it; else ``hardware.DEFAULT_CPU_ADAM_PER_CORE`` with a memory-bandwidth cap).
- gpu_optimizer: the step on the GPU, bound by HBM traffic.

compute, collectives, PCIe and activation/weight NVMe traffic overlap; the optimizer step does
not (DeepSpeed pipelines its NVMe swaps with the CPU step, so that phase is the larger of the two).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fp4offload._planner.hardware import Cluster
from fp4offload._planner.memory import MemoryEstimate, TrainSetup, weight_host_bytes
from fp4offload._planner.models import ModelSpec
from fp4offload._memory.sizes import ACT_BYTES, RESIDUAL_NVME_BYTES, STATE_BYTES, state_bytes, step_bytes_per_param
from fp4offload._planner.strategies import Strategy

__all__ = ["StepTime", "estimate_time", "GPU_STEP_BYTES_PER_PARAM"]

#: HBM bytes per parameter of an optimizer step on the GPU (fused Adam: read grad, read/write
#: master, m, v, write the bf16 weight): 30 for fp32 states, 16.265625 for packed ones.
GPU_STEP_BYTES_PER_PARAM = {fmt: step_bytes_per_param(fmt, bf16_copy=True) for fmt in STATE_BYTES}
#: Fraction of the host's memory bandwidth that host<->device copies of all GPUs can use together.
HOST_DMA_SHARE = 0.5
#: Fraction of HBM bandwidth the activation pack/unpack kernels reach.
CODEC_HBM_EFFICIENCY = 0.7


@dataclass(frozen=True)
class StepTime:
    """Seconds per optimizer step by term, the overlapped and serial parts, and the bound."""

    terms: dict[str, float] = field(default_factory=dict)
    step_s: float = 0.0
    bound: str = ""
    tokens_per_s: float = 0.0

    def share(self, term: str) -> float:
        return self.terms.get(term, 0.0) / self.step_s if self.step_s else 0.0


def estimate_time(strategy: Strategy, model: ModelSpec, cluster: Cluster, setup: TrainSetup,
                  mem: MemoryEstimate) -> StepTime:
    """Seconds per optimizer step of ``strategy`` (``mem`` supplies the activation bytes)."""
    s, m, c, t = strategy, model, cluster, setup
    e = t.compute_bytes
    P = m.param_count()
    N = c.world
    micro = t.grad_accum
    ring = (N - 1) / N if N > 1 else 0.0
    fsdp = s.engine == "fsdp2"
    stage = 3 if fsdp else s.zero_stage

    # Compute.
    flops = t.tokens * m.train_flops_per_token(t.seq_len, recompute=mem.checkpointing) * micro
    compute = flops / c.achievable_flops
    if s.activations.format != "bf16":
        packed = mem.saved_activations
        raw = packed * e / ACT_BYTES[s.activations.format]
        compute += micro * 2 * (raw + packed) / (c.gpu.hbm_gbps * 1e9 * CODEC_HBM_EFFICIENCY)

    # Collectives.
    w_bytes = weight_host_bytes(m, s.weights.format, e)  # bytes of the whole working copy
    if stage == 3:
        gathers = 2 if (not fsdp or s.fsdp_reshard) else 1
        grad_b = 4 if fsdp else e
        coll = micro * (gathers * w_bytes + grad_b * P) * ring
    elif stage == 2:
        coll = (micro * e * P + e * P) * ring
    else:
        coll = 2 * e * P * ring
    collectives = coll / c.peer_bps if N > 1 else 0.0

    # PCIe, per GPU, each direction.
    h2d = d2h = 0.0
    if s.weights.device != "gpu":
        fetch = (4 * P if fsdp and s.weights.format == "bf16" else w_bytes) / N  # FSDP2 copies the fp32 shard
        h2d += micro * (2 if (not fsdp or s.fsdp_reshard) else 1) * fetch
    if s.grads.device != "gpu":
        d2h += micro * (4 if fsdp else e) * P / N
    if s.optimizer_on_host and s.weights.device == "gpu" and not fsdp:
        h2d += e * P / N  # each rank's updated partition back (ZeRO-1/2 then all-gather it)
    if s.activations.device != "gpu":
        h2d += micro * mem.pcie_activation_bytes
        d2h += micro * mem.pcie_activation_bytes
    # Each GPU's link, and the node's host memory, which every GPU's DMA shares (a share of it).
    pcie = max(h2d / c.h2d_bps, d2h / c.d2h_bps,
               (h2d + d2h) * c.gpus_per_node / (c.host_mem_bps * HOST_DMA_SHARE))

    # NVMe, per node.
    node_share = P * c.gpus_per_node / N
    nv_read = nv_write = 0.0
    if s.optimizer_states.device == "nvme":
        o = s.optimizer_states
        per_param = (4 + STATE_BYTES["fp32"]) if o.format == "fp32" else state_bytes("nvfp4", o.v_format)
        if s.residual_on_nvme:  # split's residual is read and written with the states it sits beside
            per_param += RESIDUAL_NVME_BYTES
        nv_read += per_param * node_share
        nv_write += per_param * node_share
    act_nvme = 0.0
    if s.activations.device == "nvme":
        act_bytes = micro * mem.saved_activations * c.gpus_per_node
        act_nvme = act_bytes / c.nvme_write_bps + act_bytes / c.nvme_read_bps
    nvme_opt = nv_read / c.nvme_read_bps + nv_write / c.nvme_write_bps

    # Optimizer step.
    fmt = s.optimizer_states.format
    # The host step runs at the 4-bit step's rate whatever v's grid: with v on two bits it moves 0.5 B/param less
    # but decodes no faster (0.53x DeepSpeedCPUAdam against 0.54x, benchmarks/RESULTS.md, Two bits).
    cpu_opt = node_share / c.cpu_adam[fmt] if s.optimizer_on_host else 0.0
    gpu_step_bytes = step_bytes_per_param(fmt, bf16_copy=True, v_format=s.optimizer_states.v_format)
    gpu_opt = 0.0 if s.optimizer_on_host else gpu_step_bytes * P / (N if stage >= 1 else 1) / (c.gpu.hbm_gbps * 1e9)

    terms = {"compute": compute, "collectives": collectives, "pcie": pcie, "nvme": nvme_opt + act_nvme,
             "cpu_optimizer": cpu_opt, "gpu_optimizer": gpu_opt}
    overlapped = max(compute, collectives, pcie, act_nvme)
    serial = max(cpu_opt, nvme_opt) + gpu_opt
    step = overlapped + serial
    bound = max(terms, key=terms.get)
    tokens = t.tokens * micro * N
    return StepTime(terms=terms, step_s=step, bound=bound, tokens_per_s=tokens / step if step else 0.0)
