"""Memory model: bytes per GPU, host bytes and NVMe bytes per node for one strategy.

Per GPU the peak is taken over three phases of a step: the loss (every saved activation alive,
plus the logits and their fp32 gradients), backward (gradients accumulating block by block while
saved activations are freed), and the optimizer step (resident gradients plus the fp32 gradient
partition). On top of the phase peak come the persistent tensors (weights, master, states placed
on the GPU), gathered ZeRO-3/FSDP units, communication buckets, the CUDA runtime, and a
fragmentation margin of the caching allocator.

Byte sizes per element come from fp4offload._memory.sizes, which derives them from the formats' size functions: bf16 2;
fp32 4; NVFP4 1x16 0.5625 (4-bit code + E4M3 scale per 16); NVFP4 16x16 weights 0.50390625; MXFP4
0.53125; MXFP8 1.03125; packed Adam states (m NVFP4 + sqrt(v) ufp4, one fp32 scale per 1024-element
chunk each) 1.1328125 per parameter; split's residual in the NVMe state files (16-bit half + a bitmap of tie
positions) 2.125 per parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fp4offload.errors import ConfigError
from fp4offload._planner.hardware import Cluster
from fp4offload._memory import host_model
from fp4offload._memory.host_model import NVME_SEGMENT, NVME_SEGMENTS_IN_FLIGHT
from fp4offload._planner.models import ModelSpec
from fp4offload._memory.sizes import (ACT_BYTES, BF16_BYTES, MASTER_BYTES, RESIDUAL_NVME_BYTES, STATE_BYTES,
                                      WEIGHT_PACKED_BYTES, state_bytes)
from fp4offload._planner.strategies import Strategy

__all__ = ["TrainSetup", "MemoryEstimate", "estimate_memory", "deepspeed_inputs", "ACT_BYTES", "STATE_BYTES",
           "WEIGHT_PACKED_BYTES", "weight_host_bytes"]

GiB = 1 << 30


@dataclass(frozen=True)
class TrainSetup:
    """What one training step looks like, and the engine buffer sizes the emitted configs use.

    Attributes:
        micro_batch: sequences per GPU per micro-step. seq_len: tokens per sequence.
        grad_accum: micro-steps per optimizer step.
        compute_bytes: bytes of the compute dtype: 2 (bf16 mixed precision, default) or 4 (pure
            fp32 training, where the weights are the master; used to check the model on CPU).
        reduce_bucket / allgather_bucket / prefetch_bucket: DeepSpeed bucket sizes, elements.
        sub_group_size: ZeRO-3 optimizer sub-group, elements (sets DeepSpeed's NVMe swap buffers).
        nvme_buffer_count: DeepSpeed's NVMe swap buffers per rank.
        act_window_layers: blocks of saved activations in flight on the GPU when they are offloaded.
        cuda_runtime_bytes: CUDA context, cuBLAS and NCCL workspaces per GPU. Default 1.5 GiB.
        host_runtime_bytes: host RAM of one rank's process before any tensor (Python, torch, CUDA
            host side, DeepSpeed). Default 4 GiB.
        fragmentation: headroom for the caching allocator, fraction of the GPU tensors. Default 0.10.
        pinned_pool_overhead: extra fraction of a pinned activation pool (slab rounding). Default 0.25.
    """

    micro_batch: int = 1
    seq_len: int = 4096
    grad_accum: int = 1
    compute_bytes: int = 2
    reduce_bucket: int = 100_000_000
    allgather_bucket: int = 100_000_000
    prefetch_bucket: int = 50_000_000
    sub_group_size: int = 100_000_000
    nvme_buffer_count: int = 4
    act_window_layers: int = 2
    cuda_runtime_bytes: int = int(1.5 * GiB)
    host_runtime_bytes: int = 4 * GiB
    fragmentation: float = 0.10
    pinned_pool_overhead: float = 0.25

    def __post_init__(self) -> None:
        for k in ("micro_batch", "seq_len", "grad_accum"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"--{k.replace('_', '-')}", v, "a positive integer")
        if self.compute_bytes not in (2, 4):
            raise ConfigError("compute_bytes", self.compute_bytes, "2 (bf16) or 4 (fp32)")

    @property
    def tokens(self) -> int:
        """Tokens per GPU per micro-step."""
        return self.micro_batch * self.seq_len


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes for one strategy. ``device`` per GPU at its peak phase, ``host`` and ``nvme`` per node
    (all ranks of the node). ``saved_activations`` is the per-GPU bytes autograd keeps at the
    loss (in its stored format, wherever it lives); ``pcie_activation_bytes`` what crosses PCIe
    each way per micro-step when activations are offloaded."""

    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)
    nvme: dict[str, int] = field(default_factory=dict)
    peak_phase: str = ""
    checkpointing: bool = False
    saved_activations: int = 0
    pcie_activation_bytes: int = 0

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def nvme_total(self) -> int:
        return sum(self.nvme.values())


def weight_host_bytes(model: ModelSpec, fmt: str, e: int, keep_first: int = 1, keep_last: int = 1,
                      packed_only: bool = False) -> float:
    """Bytes of the whole weight working copy in ``fmt``. NVFP4 keeps embeddings, head, norms and
    the first/last blocks in bf16, as the default ``keep_bf16`` rule does. ``packed_only``: the NVFP4 part alone
    (what DeepSpeed ZeRO-3's packed partitions add beside its own bf16 partition)."""
    total = model.param_count()
    if fmt != "nvfp4":
        return 0.0 if packed_only else e * total
    kept_blocks = set(range(min(keep_first, model.layers))) | set(range(max(model.layers - keep_last, 0), model.layers))
    keep = model.embed_params + model.head_params + model.extra_params
    keep += sum(model.layer_params(i) for i in kept_blocks)
    keep += (model.layers - len(kept_blocks)) * model.norms_per_layer * model._norm()  # norms of the other blocks
    keep = min(keep, total)
    if packed_only:
        return WEIGHT_PACKED_BYTES * (total - keep)
    return 2 * keep + WEIGHT_PACKED_BYTES * (total - keep)


def _act_ratio(fmt: str, e: int) -> float:
    return 1.0 if fmt == "bf16" else ACT_BYTES[fmt] / e


def _stored_per_token(m: ModelSpec, moe: bool, fmt: str, e: int) -> float:
    """Bytes per token one block's saved activations take as the hooks store them in `fmt` ("bf16": as they are):
    each class in the form ActivationPolicy's defaults give it (fp4offload/_offload/ops.py), asked of the policy."""
    from fp4offload._offload.policy import ActivationPolicy

    parts = m.kind_saved_classes(moe, e)
    if fmt == "bf16":
        return float(sum(b for _, b in parts.values()))
    policy = ActivationPolicy(format=fmt, device="cpu")
    out = 0.0
    for cls, (n, raw) in parts.items():
        form = policy.class_format(cls, fmt)  # the default policy's op rule, the one the hooks apply
        out += raw if form == "keep" else n * (BF16_BYTES if form == "bf16" else ACT_BYTES[form])
    return out


@dataclass
class _Ledger:
    """Named byte terms, per GPU (static), per rank in host RAM, per rank on NVMe."""

    gpu: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)
    nvme: dict[str, float] = field(default_factory=dict)

    def put(self, where: str, key: str, nbytes: float) -> None:
        if nbytes <= 0:
            return
        target = self.gpu if where == "gpu" else self.host if where == "cpu" else self.nvme
        target[key] = target.get(key, 0) + nbytes


@dataclass(frozen=True)
class _Shape:
    """What every term below reads: the strategy, model and setup, with the sharding they imply."""

    s: Strategy
    m: ModelSpec
    t: TrainSetup
    world: int

    @property
    def e(self) -> int:
        return self.t.compute_bytes

    @property
    def P(self) -> int:
        return self.m.param_count()

    @property
    def fsdp(self) -> bool:
        return self.s.engine == "fsdp2"

    @property
    def stage(self) -> int:
        return 3 if self.fsdp else self.s.zero_stage

    @property
    def shard_g(self) -> int:
        return self.world if self.stage >= 2 else 1

    @property
    def shard_o(self) -> int:
        return self.world if self.stage >= 1 else 1


def _weights(x: _Shape, led: _Ledger) -> float:
    """The working copy; returns the bytes of gathered (live) weights on the GPU. Under FSDP2 the sharded
    parameter is the fp32 master itself."""
    s, m, e, P, N = x.s, x.m, x.e, x.P, x.world
    top2 = sum(m.largest_units(2))
    if x.fsdp:
        if s.weights.format == "nvfp4":  # the packed all-gather input, cached next to the fp32 shard
            led.put(s.weights.device, "weights", weight_host_bytes(m, "nvfp4", e) / N)
        return e * (top2 if s.fsdp_reshard else P)
    if x.stage == 3:
        # DeepSpeed keeps its bf16 partition; the block's packed NVFP4 partition (for the gathers) comes on top
        packed = weight_host_bytes(m, s.weights.format, e, packed_only=True)
        led.put(s.weights.device, "weights", e * P / N + packed / N)
        return min(e * (top2 + x.t.prefetch_bucket), e * P)
    led.put("gpu", "weights", e * P)
    return 0.0


def _master_and_states(x: _Shape, led: _Ledger) -> None:
    """fp32 master (pure fp32 training: the weights are the master) and Adam states. Split's residual in the NVMe
    state files leaves the master's device with only the bf16 half, and is stored there with its tie bitmap."""
    s, P, N = x.s, x.P, x.world
    residual = s.residual_on_nvme
    master_bytes = MASTER_BYTES[s.master.format] - (BF16_BYTES if residual else 0)
    if x.fsdp and s.master.format != "fp32":  # the bf16 shard is the master's upper half
        led.put(s.master.device, "master", (master_bytes - BF16_BYTES) / N * P)
    elif x.fsdp or x.e != 4 or s.master.device != "gpu":
        led.put(s.master.device, "master", master_bytes * P / x.shard_o)
    if residual:
        led.put("nvme", "master_residual", RESIDUAL_NVME_BYTES * P / x.shard_o)
    o = s.optimizer_states
    led.put(o.device, "optimizer_states", state_bytes(o.format, o.v_format) * P / x.shard_o)


def _gradients(x: _Shape, led: _Ledger) -> tuple[float, float]:
    """Resident gradient bytes per parameter on the GPU, and the fp32 gradient partition at the step; the host copy
    of offloaded gradients goes into the ledger."""
    s, e, P, t = x.s, x.e, x.P, x.t
    if s.grads.device == "gpu":
        g_per_param = 4 / x.world if x.fsdp else (e / x.shard_g)
    else:
        g_per_param = 0.0
        # the DeepSpeed block keeps ZeRO-1/2's host gradient partition in bf16 when FP4AdamW runs the step and
        # nothing accumulates into it (_deepspeed.zero12.bf16_gradient_partition); under ZeRO-3 the master's gradient is
        # DeepSpeed's bf16 gradient partition (_deepspeed.zero3.zero3_gradient_partition)
        block_bf16 = (s.engine == "deepspeed" and s.optimizer_states.format == "nvfp4" and e == 2
                      and ((x.stage == 3 and s.weights.format != "nvfp4")
                           or (x.stage in (1, 2) and t.grad_accum == 1)))
        bf16_grads = block_bf16 or s.master.format != "fp32"
        led.put("cpu", "grads", (2 if bf16_grads else 4) * P / x.shard_o)
        if s.engine == "deepspeed" and x.stage in (1, 2) and s.master.format == "fp32":
            # ZeRO-1/2 offload's bf16 copy of the updated partition on its way to the GPU
            # (param_buffer_of_bit16_for_cpu_offload_groups); a compact master is that copy itself
            led.put("cpu", "staging", e * P / x.shard_o)
    fp32_grad_at_step = 4 * P / x.shard_o if (s.master.device == "gpu" and e != 4 and not x.fsdp) else 0.0
    return g_per_param, fp32_grad_at_step


def _buffers(x: _Shape) -> float:
    """Communication buffers on the GPU."""
    e, t = x.e, x.t
    if x.fsdp:
        return (4 + e) * x.m.largest_units(1)[0]
    if x.stage == 3:
        return e * 2 * t.reduce_bucket
    return 4.5 * e * max(t.reduce_bucket, t.allgather_bucket) if (t.reduce_bucket or t.allgather_bucket) else 0


@dataclass(frozen=True)
class _Activations:
    """Saved activations per block kind (False dense, True MoE): what the loss phase and backward hold."""

    count: dict[bool, int]
    layer_saved: dict[bool, float]  # per block, as autograd saves them (bytes of the compute dtype)
    on_gpu: dict[bool, float]  # per block, what stays on the GPU until backward reaches it
    final_saved: float
    window: float  # offloaded: the blocks in flight on the GPU
    gpu_all: float  # on the GPU at the loss
    saved_total: float  # in the stored format, wherever it lives
    offloaded: bool


def _activations(x: _Shape, led: _Ledger, checkpointing: bool) -> _Activations:
    """Blocks come in runs of one kind (model.layer_runs: one run for a dense model), so every per-block sum is a
    sum over runs, and the work does not grow with the number of blocks."""
    s, m, t, e = x.s, x.m, x.t, x.e
    T = t.tokens
    n_moe = m.moe_layer_count
    count = {k: c for k, c in ((False, m.layers - n_moe), (True, n_moe)) if c}  # blocks of each kind
    kinds = set(count)
    layer_saved = {k: T * m.kind_saved_bytes_per_token(k, e) for k in kinds}
    final_saved = T * m._norm_saved(e)
    fmt = s.activations.format
    ratio = _act_ratio(fmt, e)
    # in their stored forms: under checkpointing each block keeps its input (a linear-layer input's form)
    stored = ({k: T * e * m.hidden * ratio for k in kinds} if checkpointing
              else {k: T * _stored_per_token(m, k, fmt, e) for k in kinds})
    max_saved = max(layer_saved.values())
    offloaded = s.activations.device != "gpu"
    final_stored = final_saved * (1.0 if fmt == "bf16" else max(BF16_BYTES / e, ratio))  # the final norm: bf16
    saved_total = sum(c * stored[k] for k, c in count.items()) + final_stored
    if offloaded:
        if s.activations.device == "cpu":
            led.put("cpu", "activations", saved_total * (1 + t.pinned_pool_overhead))
        else:
            led.put("nvme", "activations", saved_total)
            led.put("cpu", "staging", 2 * t.act_window_layers * max(stored.values()))
        window = t.act_window_layers * max_saved
        on_gpu = {k: 0.0 for k in kinds}
        gpu_all = window + final_stored
    else:
        on_gpu = dict(stored)
        window = 0.0
        gpu_all = sum(c * on_gpu[k] for k, c in count.items()) + final_stored
    return _Activations(count, layer_saved, on_gpu, final_saved, window, gpu_all, saved_total, offloaded)


def _backward_peak(x: _Shape, a: _Activations, g_per_param: float, g_end: float, g_accum: float, live: float,
                   checkpointing: bool) -> dict[str, float]:
    """Backward, block by block from the last: gradients of the blocks done so far grow, the saved activations of
    the blocks still to do shrink. Within a run of equal blocks the sum of the terms is convex in the block (a max
    of linear terms plus a linear one), so its largest value is at an end of the run or where the gradients
    overtake the accumulated ones: those blocks are the ones evaluated, in the order a walk over every block
    would meet them."""
    m = x.m
    logits_held = x.t.tokens * x.e * m.vocab
    grads_before = g_per_param * (m.head_params + m.hidden)
    worst: dict[str, float] = {"grads": max(g_end, g_accum), "logits": logits_held}
    worst_sum = sum(worst.values())
    below = sum(c * a.on_gpu[k] for k, c in a.count.items())  # on_gpu of every block up to the current one
    for _, n, k in reversed(m.layer_runs):
        step, o = g_per_param * m.kind_params(k), a.on_gpu[k]
        extra = a.layer_saved[k] if checkpointing else 0.0
        js = (0, n - 1) if n > 1 else (0,)
        if step > 0 and grads_before < g_accum:
            jc = min(max(math.ceil((g_accum - grads_before) / step), 0), n - 1)
            js = sorted({*js, max(jc - 1, 0), jc})
        for j in js:
            grads = max(grads_before + j * step, g_accum) + 0.5 * step
            act = (a.window if a.offloaded else below - j * o) + extra
            total = grads + act + logits_held + live  # the order sum(terms.values()) adds them in
            if total > worst_sum:
                worst = {"grads": grads, "activations": act, "logits": logits_held, "gathered_weights": live}
                worst_sum = total
        grads_before += n * step
        below -= n * o
    return worst


def _nvme_staging(x: _Shape, led: _Ledger) -> None:
    """Host staging of an NVMe-resident optimizer: DeepSpeed's swap buffers, or FP4AdamW's tier segments (as the
    preflight counts them; a residual rides along)."""
    s, t = x.s, x.t
    if s.optimizer_states.device != "nvme":
        return
    if s.optimizer_states.format == "fp32":
        led.host["staging"] = led.host.get("staging", 0) + t.nvme_buffer_count * t.sub_group_size * 4
    else:
        per_elem = state_bytes("nvfp4", s.optimizer_states.v_format) + (RESIDUAL_NVME_BYTES if s.residual_on_nvme
                                                                         else 0)
        led.host["staging"] = led.host.get("staging", 0) + NVME_SEGMENTS_IN_FLIGHT * per_elem * min(
            NVME_SEGMENT, x.P / x.shard_o)


def deepspeed_inputs(strategy: Strategy, model: ModelSpec, cluster: Cluster, setup: TrainSetup) -> host_model.Inputs:
    """The preflight model's inputs (:class:`host_model.Inputs`) for a DeepSpeed strategy on a GPU cluster: the
    ZeRO stage and offload targets the emitted config sets, the block's states, master and default host settings
    (fixed mmap threshold, the host cache, the bf16 gradient partition), and the setup's bucket sizes."""
    s, e = strategy, setup.compute_bytes
    stage = s.zero_stage or 0
    block = s.optimizer_states.format != "fp32"
    if s.master.device == "gpu":
        offload_opt = "none"
    elif s.optimizer_states.device == "nvme" and not block:
        offload_opt = "nvme"  # DeepSpeed's swapper
    else:
        offload_opt = "cpu"
    states = None
    if block:
        dev = s.optimizer_states.device
        states = (s.optimizer_states.format, "device" if dev == "gpu" else dev)
    v_format = s.optimizer_states.v_format if block else None
    bf16_grads = block and e == BF16_BYTES and offload_opt != "none" and (
        (stage in (1, 2) and setup.grad_accum == 1) or (stage == 3 and s.weights.format != "nvfp4"))
    return host_model.Inputs(
        params=model.param_count(), world=cluster.world, local_ranks=cluster.gpus_per_node, accelerator="gpu",
        stage=stage, compute_bytes=e, offload_optimizer=offload_opt,
        offload_param={"gpu": "none"}.get(s.weights.device, s.weights.device) if stage == 3 else "none",
        grad_accum=setup.grad_accum, states=states, v_format=v_format, bf16_grads=bf16_grads, share_staging=False,
        packed_weights=stage == 3 and s.weights.format == "nvfp4",
        allocator="fixed" if block else "glibc", cache_fraction=0.125 if block else 0.0,
        reduce_bucket=setup.reduce_bucket, sub_group=setup.sub_group_size, prefetch_bucket=setup.prefetch_bucket,
        buffer_count=setup.nvme_buffer_count, master=s.master.format,
        master_device="nvme" if s.residual_on_nvme else "same")


def estimate_memory(strategy: Strategy, model: ModelSpec, cluster: Cluster, setup: TrainSetup,
                    checkpointing: bool) -> MemoryEstimate:
    """Bytes per GPU (peak), per node in host RAM and on NVMe, for ``strategy``: the persistent terms, then the
    largest of three phases (the loss, backward, the optimizer step) on top."""
    x = _Shape(strategy, model, setup, cluster.world)
    led = _Ledger(host={"runtime": setup.host_runtime_bytes})
    live = _weights(x, led)
    _master_and_states(x, led)
    g_per_param, fp32_grad_at_step = _gradients(x, led)
    before = dict(led.host)
    a = _activations(x, led, checkpointing)
    activation_host = {k: v - before.get(k, 0) for k, v in led.host.items() if v != before.get(k, 0)}
    g_end = g_per_param * x.P
    g_accum = g_end if setup.grad_accum > 1 else 0.0
    phases: dict[str, dict[str, float]] = {
        "loss": {"activations": a.gpu_all, "logits": setup.tokens * model.logits_peak_bytes_per_token(x.e),
                 "grads": g_accum, "gathered_weights": live},
        "optimizer step": {"grads": g_end, "fp32_grads": fp32_grad_at_step},
        "backward": _backward_peak(x, a, g_per_param, g_end, g_accum, live, checkpointing),
    }
    phase = max(phases, key=lambda k: sum(phases[k].values()))

    device: dict[str, float] = dict(led.gpu)
    for k, v in phases[phase].items():
        device[k] = device.get(k, 0.0) + v
    device["buffers"] = _buffers(x)
    device["fragmentation"] = setup.fragmentation * sum(device.values())
    device["runtime"] = setup.cuda_runtime_bytes
    _nvme_staging(x, led)
    if strategy.engine == "deepspeed":  # host RAM and NVMe by the preflight's model, the one the block checks with
        est = host_model.estimate_host(deepspeed_inputs(strategy, model, cluster, setup), setup.host_runtime_bytes)
        led.host = {"runtime": float(est.runtime), **{k: float(v) for k, v in est.consumers.items()}}
        for k, v in activation_host.items():  # the pinned activation pool and its staging, sized by the batch
            led.host["activations" if k == "activations" else "activation staging"] = v
        led.nvme = {k: float(v) for k, v in est.nvme.items()}

    per_node = cluster.gpus_per_node
    return MemoryEstimate(
        device={k: int(v) for k, v in device.items() if v > 0},
        host={k: int(v * per_node) for k, v in led.host.items() if v > 0},
        nvme={k: int(v * per_node) for k, v in led.nvme.items() if v > 0},
        peak_phase=phase, checkpointing=checkpointing, saved_activations=int(a.saved_total),
        pcie_activation_bytes=int(a.saved_total if a.offloaded else 0.0),
    )
