"""Host RAM of one DeepSpeed rank, from its config: the memory model the preflight and ``plan --check`` share.

:func:`estimate_host` takes a DeepSpeed config (with or without the ``"fp4offload"`` block), the model's
parameter count, the accelerator and the world, and returns each consumer's bytes for one rank: what
DeepSpeed allocates for the ZeRO stage and offload targets (fp32 master, gradient partition, Adam's m and
v, the bf16 copy-back buffer, NVMe swap buffers), what the block changes in it (packed states, states on
its own NVMe tier, compact masters and split's residual in that tier's files, bf16 gradient partition, shared
bf16 staging, packed ZeRO-3 weights), and, on the CPU accelerator, the device-side buffers too (the bf16
parameters, gradient buckets, gathered ZeRO-3 parameters), since there the "device" is host RAM. The
process's own bytes (Python, torch, DeepSpeed, the data) are not modelled: the caller measures them
(``runtime_bytes``: the RSS before initialize, less the model's parameters, which DeepSpeed's flattening
replaces).

Byte sizes per element come from :mod:`fp4offload._memory.sizes`. What each term is in DeepSpeed (the
attribute holding it, 0.19.8) is written beside it; docs/guide.md, "Host preflight", has the table and how the
model compares with measured peaks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from fp4offload._config.grids import BY_NAME as V_GRID_NAMES
from fp4offload._memory.sizes import (BF16_BYTES, FP32_BYTES, RESIDUAL_NVME_BYTES, STATE_BYTES, WEIGHT_PACKED_BYTES,
                                      state_bytes)

__all__ = ["Inputs", "HostEstimate", "estimate_host", "inputs_from_config", "alternatives"]

#: DeepSpeed 0.19.8's defaults for the keys the model reads (DeepSpeedZeroConfig, the offload configs)
DS_DEFAULTS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
               "sub_group_size": 1_000_000_000, "stage3_prefetch_bucket_size": 50_000_000,
               "stage3_max_live_parameters": 1_000_000_000, "buffer_count": 4}
#: what initialize itself adds to a rank's process whatever the model: DeepSpeed's modules and JIT-built ops,
#: the communicator, the engine's objects, fp4offload's own modules. Measured 74-81 MB on the CPU accelerator
#: with a 0.1M-parameter model in every configuration of benchmarks/e2e_deepspeed.py (RESULTS.md).
INIT_BYTES = 80 << 20
#: What the terms above do not name, kept on top of them so that the estimate bounds the measured peak from above:
#: the batch's activations and logits, the step's transients (ZeRO-3's gradient sub-group on its way to the
#: optimizer, initialize's conversions), and the host cache's blocks beyond its modelled bound. Calibrated as
#: (fixed bytes, bytes per parameter of this rank's partition) per ZeRO family against the peak RSS from
#: initialize on, measured with benchmarks/e2e_deepspeed.py (26M and 77M, every master form), the cgroup peak
#: of benchmarks/preflight_cgroup.py (134M) and its linear script at 16.8M to 67M on another CPU (ZeRO-1/2: 109 MiB
#: at 16.8M, where 64 MiB + 1.25 B/param had kept 84): the largest shortfall of the named terms, rounded up
#: (docs/guide.md, "Host preflight", has the table).
UNMODELLED = {"zero3": (128 << 20, 2.75), "zero12": (112 << 20, 1.25)}
#: elements per segment of FP4AdamW's NVMe tier (fp4offload._optim.nvme), and segments in flight
NVME_SEGMENT = 1 << 20
NVME_SEGMENTS_IN_FLIGHT = 3


@dataclass(frozen=True)
class Inputs:
    """What the model reads. Built from a DeepSpeed config by :func:`inputs_from_config`.

    Attributes:
        params: parameters of the model (all ranks together). world: data-parallel ranks.
        local_ranks: ranks on this node. accelerator: ``"cpu"`` (DeepSpeed's CPU accelerator: device
        buffers are host RAM) or ``"gpu"``. stage: ZeRO stage. compute_bytes: 2 (bf16/fp16) or 4.
        offload_optimizer / offload_param: ``"none"``, ``"cpu"`` or ``"nvme"``, as DeepSpeed sees them
        (after the block's rewrites). grad_accum: micro-steps per step.
        states: the block's states, ``None`` (DeepSpeed's fp32 m and v) or (format, device). v_format: the
        block's ``optimizer_states.v_format`` (None: the default), which sizes v.
        bf16_grads / share_staging: the block's host settings, as they apply. allocator: ``"glibc"``
        (its adaptive mmap threshold: freed blocks under 32 MiB stay in the heap) or ``"fixed"`` (the
        block's ``host.mmap_threshold``: they go back to the kernel), with ``cache_fraction`` the block's
        ``host.allocator_cache`` (0 when off). packed_weights: ZeRO-3
        offload_param host partitions as NVFP4 (``weights``). reduce_bucket ... buffer_count: the
        DeepSpeed keys of the same names. master: the master partition's form: ``"fp32"``, ``"bf16"``
        (DeepSpeed's ``bf16_master_weights_and_grads``, or the block's bf16 master) or ``"split"`` (the
        block's: a bf16 partition and a 16-bit residual); with the block's compact masters the bf16 copy-back
        buffer is the master itself. master_device: the block's ``optimizer_states.master_device``; ``"nvme"``
        (with split and the states on NVMe) keeps split's residual in the NVMe state files, not in host RAM.
        ds_bf16_states: DeepSpeed's ``bf16_optimizer_states`` (bf16 m and v). activation_pool: the cap of the
        block's pinned activation pool (``activations`` with device cpu), counted whole since it may fill; -1 for
        the default cap, half of what is left of ``free_bytes`` (per local rank) once the rest is allocated, as
        offload.pinned_pool.default_max_host_bytes sizes it when the pool is created.
    """

    params: int
    world: int = 1
    local_ranks: int = 1
    accelerator: str = "gpu"
    stage: int = 0
    compute_bytes: int = BF16_BYTES
    offload_optimizer: str = "none"
    offload_param: str = "none"
    grad_accum: int = 1
    states: tuple[str, str] | None = None
    v_format: str | None = None
    bf16_grads: bool = False
    share_staging: bool = False
    packed_weights: bool = False
    allocator: str = "glibc"
    cache_fraction: float = 0.0
    reduce_bucket: int = DS_DEFAULTS["reduce_bucket_size"]
    sub_group: int = DS_DEFAULTS["sub_group_size"]
    prefetch_bucket: int = DS_DEFAULTS["stage3_prefetch_bucket_size"]
    max_live: int = DS_DEFAULTS["stage3_max_live_parameters"]
    buffer_count: int = DS_DEFAULTS["buffer_count"]
    master: str = "fp32"
    master_device: str = "same"
    ds_bf16_states: bool = False
    activation_pool: int = 0  # the block's pinned activation pool: its cap in bytes per rank, -1 the default cap
    free_bytes: int = 0  # what the node's processes may use (for the default cap)

    @property
    def block(self) -> bool:
        return self.states is not None or self.packed_weights

    @property
    def residual_on_nvme(self) -> bool:
        """Split's residual in the NVMe state files (the rule config.py enforces: split, states on NVMe)."""
        return (self.master_device == "nvme" and self.master == "split" and self.states is not None
                and self.states[1] == "nvme")


@dataclass(frozen=True)
class HostEstimate:
    """Bytes of host RAM for one rank, by consumer, beside what the process held before initialize.

    ``consumers`` are the new allocations (largest first in :meth:`largest`); ``runtime`` is the process's
    own share (measured by the caller, or assumed); ``nvme`` what goes to disk instead."""

    consumers: dict[str, int] = field(default_factory=dict)
    runtime: int = 0
    nvme: dict[str, int] = field(default_factory=dict)
    local_ranks: int = 1
    inputs: Inputs | None = None

    @property
    def added(self) -> int:
        """Bytes initialize and training add to this rank's process."""
        return sum(self.consumers.values())

    @property
    def per_rank(self) -> int:
        return self.runtime + self.added

    @property
    def node_total(self) -> int:
        return self.per_rank * self.local_ranks

    def largest(self, n: int = 3) -> list[tuple[str, int]]:
        return sorted(self.consumers.items(), key=lambda kv: -kv[1])[:n]


def _zero_key(zero: Mapping[str, Any], key: str) -> int:
    v = zero.get(key, DS_DEFAULTS[key])
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else DS_DEFAULTS[key]


def inputs_from_config(ds: Mapping[str, Any], params: int, *, world: int = 1, local_ranks: int = 1,
                       accelerator: str = "gpu", host: Any = None, states: Any = None,
                       free_bytes: int | None = None) -> Inputs:
    """:class:`Inputs` from a DeepSpeed config dict with the block's rewrites applied (as
    ``fp4offload._deepspeed.config.prepare_config`` returns it) or a plain one.

    ``host``: the block's effective host settings (``_deepspeed.config.HostSettings``), None for DeepSpeed's own
    behaviour. ``states``: the states' placement as prepare_config resolved it (``Prepared.states``: format,
    device, master, master_device), which wins over the block's keys: once it has turned DeepSpeed's NVMe
    offload into its own tier, the rewritten config says ``offload_optimizer.device "cpu"`` and no longer shows
    that the states (and split's residual) go to NVMe."""
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), Mapping) else {}
    stage = int(zero.get("stage", 0) or 0)

    def device(key: str) -> str:
        off = zero.get(key)
        d = off.get("device", "none") if isinstance(off, Mapping) else "none"
        return d if d in ("cpu", "nvme") else "none"

    mixed = any(isinstance(ds.get(k), Mapping) and ds[k].get("enabled") is True for k in ("bf16", "fp16"))
    block = ds.get("fp4offload") if isinstance(ds.get("fp4offload"), Mapping) else {}
    st = block.get("optimizer_states") if isinstance(block.get("optimizer_states"), Mapping) else None
    if states is not None:
        st = {"format": states.format, "device": states.device, "master": states.master,
              "master_device": states.master_device}
    offload_opt = device("offload_optimizer")
    placed = None
    if st is not None:
        fmt = st.get("format", "nvfp4")
        dev = st.get("device", "same")
        if offload_opt == "nvme":  # not rewritten yet: the block keeps the master on the host, the states in its tier
            offload_opt = "cpu"
            dev = "nvme" if dev == "same" else dev
        if dev == "same":
            dev = "cpu" if offload_opt != "none" else "device"
        placed = (fmt, dev)
    v_format = None
    if isinstance(block.get("optimizer_states"), Mapping):
        vf = block["optimizer_states"].get("v_format")
        v_format = vf if vf in V_GRID_NAMES else None
    weights = block.get("weights") if isinstance(block.get("weights"), Mapping) else None
    off = zero.get("offload_optimizer") if isinstance(zero.get("offload_optimizer"), Mapping) else {}
    grad_accum = ds.get("gradient_accumulation_steps", 1)
    grad_accum = grad_accum if isinstance(grad_accum, int) and grad_accum > 0 else 1
    bf16_grads = share = False
    allocator, cache = "glibc", 0.0
    if placed is not None and host is not None:  # the host settings apply with optimizer_states
        if host.mmap_threshold.value != "off":
            allocator = "fixed"
        cache = 0.0 if host.allocator_cache.value == "off" else float(host.allocator_cache.value)
        if stage in (1, 2) and offload_opt == "cpu":
            bf16_grads = bool(host.bf16_gradient_partition.value) and grad_accum == 1 and mixed
            share = bool(host.share_bf16_staging.value) and accelerator == "cpu"
        elif stage == 3 and offload_opt == "cpu":  # the fp32 master's gradient is the bf16 gradient partition
            fused = weights is not None and weights.get("format", "nvfp4") == "nvfp4"  # (not with the weights block)
            bf16_grads = bool(host.bf16_gradient_partition.value) and mixed and not fused
    buffers = off.get("buffer_count", DS_DEFAULTS["buffer_count"])
    bf16 = ds.get("bf16") if isinstance(ds.get("bf16"), Mapping) else {}
    master = st.get("master", "fp32") if st is not None else "fp32"
    if master == "fp32" and bf16.get("bf16_master_weights_and_grads") is True:
        master = "bf16"
    ds_bf16_states = placed is None and master == "bf16" and bf16.get("bf16_optimizer_states") is True
    master_device = "nvme" if st is not None and st.get("master_device") == "nvme" else "same"
    # the activation pool's cap: activations.max_host_bytes, else half of what this process may use over the
    # node's local ranks (offload.pinned_pool.default_max_host_bytes); `free_bytes`: that memory (default: now)
    acts = block.get("activations") if isinstance(block.get("activations"), Mapping) else None
    pool = 0
    if acts is not None and acts.get("device", "cpu") == "cpu":
        cap = acts.get("max_host_bytes")
        pool = cap if isinstance(cap, int) and not isinstance(cap, bool) else -1
        if pool == -1 and free_bytes is None:
            import psutil

            free_bytes = int(psutil.virtual_memory().available)
    return Inputs(activation_pool=pool, free_bytes=int(free_bytes or 0),
                  master=master if master in ("fp32", "bf16", "split") else "fp32", ds_bf16_states=ds_bf16_states,
        master_device=master_device,
        params=int(params), world=max(1, int(world)), local_ranks=max(1, int(local_ranks)), accelerator=accelerator,
        stage=stage, compute_bytes=BF16_BYTES if mixed else FP32_BYTES,
        offload_optimizer=offload_opt, offload_param=device("offload_param") if stage == 3 else "none",
        grad_accum=grad_accum, states=placed, v_format=v_format, bf16_grads=bf16_grads, share_staging=share,
        allocator=allocator,
        cache_fraction=cache,
        packed_weights=weights is not None and weights.get("format", "nvfp4") == "nvfp4" and stage == 3,
        reduce_bucket=_zero_key(zero, "reduce_bucket_size"), sub_group=_zero_key(zero, "sub_group_size"),
        prefetch_bucket=_zero_key(zero, "stage3_prefetch_bucket_size"),
        max_live=_zero_key(zero, "stage3_max_live_parameters"),
        buffer_count=int(buffers) if isinstance(buffers, int) and buffers > 0 else DS_DEFAULTS["buffer_count"])


def estimate_host(x: Inputs, runtime_bytes: int = 0, built_bytes: int = 0) -> HostEstimate:
    """Host bytes of one rank for ``x`` (see the module docstring). ``runtime_bytes``: the process's own;
    ``built_bytes``: the model's parameters as built in host RAM (freed when DeepSpeed flattens them)."""
    P, N, e = x.params, x.world, x.compute_bytes
    part = -(-P // N) if x.stage >= 1 else P  # this rank's partition of the optimizer (ZeRO-1 and up)
    on_cpu_accel = x.accelerator == "cpu"
    host: dict[str, float] = {}
    nvme: dict[str, float] = {}

    def put(key: str, nbytes: float, where: str = "host") -> None:
        if nbytes > 0:
            target = host if where == "host" else nvme
            target[key] = target.get(key, 0) + nbytes

    def device(key: str, nbytes: float) -> None:  # device memory: host RAM only on the CPU accelerator
        if on_cpu_accel:
            put(key, nbytes)

    offload_opt = x.offload_optimizer != "none"
    # Parameters in the compute dtype. ZeRO-0/1/2: every rank holds them all (bit16_groups_flat).
    # ZeRO-3: its partition (fp16_partitioned_groups_flat), host-side with offload_param, plus the
    # parameters gathered for the layers in flight (at most max_live, and a prefetch bucket ahead).
    if x.stage < 3:
        device("bf16 parameters", e * P)
    else:
        if x.offload_param == "none":
            device("bf16 parameter partition", e * part)
        else:
            put("bf16 parameter partition", e * part, "host" if x.offload_param == "cpu" else "nvme")
            if x.packed_weights:  # the block's NVFP4 partitions for the gathers, beside DeepSpeed's bf16 partition
                put("packed weight partition (NVFP4)", WEIGHT_PACKED_BYTES * part, "host" if x.offload_param == "cpu"
                    else "nvme")
        device("gathered parameters", e * min(P, x.max_live + x.prefetch_bucket))

    # fp32 master and gradients.
    master_where = "host" if offload_opt else "device"
    if x.offload_optimizer == "nvme" and x.states is None and x.stage == 3:
        master_where = "nvme"  # DeepSpeed's optimizer swapper holds master, m and v on disk
    if e == FP32_BYTES and x.stage < 3 and not offload_opt:
        pass  # pure fp32 without offload: the parameters are the master
    else:
        mb, label = (FP32_BYTES, "fp32") if x.master == "fp32" else (BF16_BYTES, "bf16")
        if on_cpu_accel and x.states is not None and x.master != "fp32" and e == BF16_BYTES and offload_opt \
                and x.offload_param == "none":
            mb = 0  # the block's compact master is the model's bf16 partition here (zero12.master_is_device_partition)
        where = {"host": "host", "nvme": "nvme"}.get(master_where)
        residual = BF16_BYTES * part if x.master == "split" and not x.residual_on_nvme else 0
        for key, nbytes in ((f"{label} master partition", mb * part), ("split master residual", residual)):
            put(key, nbytes, where) if where else device(key, nbytes)
        if x.residual_on_nvme:  # in the state files beside m and v, with a bitmap of its tie positions
            put("split master residual", RESIDUAL_NVME_BYTES * part, "nvme")

    sub = min(x.sub_group, part)  # ZeRO-3 steps one sub-group at a time
    if offload_opt and x.stage < 3:  # ZeRO-1/2: the host gradient partition the optimizer reads
        bf16_grads = x.bf16_grads or x.master != "fp32"  # DeepSpeed's bf16 master mode: bf16 gradients too
        g = BF16_BYTES if bf16_grads else FP32_BYTES
        put(("bf16" if bf16_grads else "fp32") + " gradient partition", g * part)
        block_compact = x.states is not None and x.master != "fp32"  # the copy-back buffer is the master
        if not x.share_staging and not block_compact:
            put("bf16 copy-back buffer", e * part)  # param_buffer_of_bit16_for_cpu_offload_groups
    elif offload_opt:  # ZeRO-3: the partition in the compute dtype, and the master's gradient in the master's dtype
        put("gradient partition", e * part)  # grad_partitions_flat_buffer
        # with the block the master's gradient is a slice of that partition when the dtypes agree, or when the fp32
        # master takes the bf16 partition (bf16_grads): zero3.zero3_gradient_partition
        if not (x.states is not None and (x.bf16_grads or (x.master != "fp32") == (e == BF16_BYTES))):
            label, gb = ("fp32", FP32_BYTES) if x.master == "fp32" else ("bf16", BF16_BYTES)
            put(f"{label} master gradient", gb * sub)
    else:
        device("gradients", e * (part if x.stage >= 2 else P))
    device("gradient bucket", e * min(x.reduce_bucket, P))

    # Adam's m and v.
    if x.states is None:
        if x.offload_optimizer == "nvme" and x.stage == 3:
            put("optimizer states (fp32 m, v)", 2 * FP32_BYTES * part, "nvme")
            put("NVMe swap buffers", x.buffer_count * FP32_BYTES * sub)  # SwapBufferManager: master, m, v, grad
        elif offload_opt:
            sb = BF16_BYTES if x.ds_bf16_states else FP32_BYTES
            put(f"optimizer states ({'bf16' if x.ds_bf16_states else 'fp32'} m, v)", 2 * sb * part)
        else:
            device("optimizer states (fp32 m, v)", 2 * FP32_BYTES * part)
    else:
        fmt, where = x.states
        b = state_bytes(fmt, x.v_format) if fmt in STATE_BYTES else STATE_BYTES["fp32"]
        if where == "nvme":
            put(f"optimizer states ({fmt})", b * part, "nvme")
            seg = b + (RESIDUAL_NVME_BYTES if x.residual_on_nvme else 0)  # a segment's residual travels with it
            put("NVMe state segments in flight", NVME_SEGMENTS_IN_FLIGHT * seg * min(NVME_SEGMENT, part))
        elif where == "cpu":
            put(f"optimizer states ({fmt})", b * part)
        else:
            device(f"optimizer states ({fmt})", b * part)
    put("initialize's own (modules, ops, communicator)", INIT_BYTES)
    if x.activation_pool == -1:  # the default cap: half of what is left per local rank
        left = x.free_bytes // max(1, x.local_ranks) - int(runtime_bytes) - int(sum(host.values()))
        put("activation pool (pinned, at most)", max(0, left) // 2)
    else:
        put("activation pool (pinned, at most)", x.activation_pool)
    # Memory freed but still resident. Under glibc's adaptive threshold the heap keeps the model as built
    # (replaced by DeepSpeed's flat buffers), the parameter gradients freed block by block in backward (in host RAM
    # on the CPU accelerator) and,
    # for ZeRO-3, the fp32 gradient buffer that initialize_optimizer_states drops. With the block's fixed
    # threshold those go back to the kernel, and its host cache keeps at most cache_fraction of the bytes in use.
    if x.allocator == "glibc":
        backward = e * P if on_cpu_accel else 0  # the parameter gradients: device memory on a GPU machine
        put("freed, kept in glibc's heap", built_bytes + backward + (FP32_BYTES * sub if x.stage == 3 else 0))
    elif x.cache_fraction > 0:
        put("host allocator cache (bound)", x.cache_fraction * (sum(host.values()) - INIT_BYTES))
    fixed, per_param = UNMODELLED["zero3" if x.stage == 3 else "zero12"]  # last: the other terms as calibrated
    put("unnamed terms (calibrated)", fixed + per_param * part)
    return HostEstimate(consumers={k: int(v) for k, v in host.items()}, runtime=int(runtime_bytes),
                        nvme={k: int(v) for k, v in nvme.items()}, local_ranks=x.local_ranks, inputs=x)


def alternatives(x: Inputs) -> list[tuple[str, Inputs]]:
    """Changes to the config that lower host RAM, each as (what to write, the inputs it gives); the caller
    estimates each with :func:`estimate_host` and keeps those that fit."""
    out: list[tuple[str, Inputs]] = []
    if x.states is None and x.offload_optimizer != "none":
        dev = "nvme" if x.offload_optimizer == "nvme" else "cpu"
        out.append(('add "fp4offload": {"optimizer_states": {"format": "nvfp4"}} (packed m and v)',
                    replace(x, states=("nvfp4", dev), offload_optimizer="cpu")))
    if x.states is not None and x.states[1] != "nvme" and x.offload_optimizer != "none":
        out.append(('fp4offload.optimizer_states.device "nvme" (with nvme_path)',
                    replace(x, states=(x.states[0], "nvme"))))
    if x.master == "split" and not x.residual_on_nvme and x.states is not None and x.offload_optimizer != "none":
        also = "" if x.states[1] == "nvme" else ' and device "nvme" (with nvme_path)'
        out.append((f'fp4offload.optimizer_states.master_device "nvme"{also} (split\'s residual in the state files)',
                    replace(x, states=(x.states[0], "nvme"), master_device="nvme")))
    if x.states is None and x.offload_optimizer == "cpu" and x.stage == 3:
        sub = min(x.sub_group, 100_000_000)  # DeepSpeed's swap buffers: buffer_count x the sub-group, in fp32
        out.append((f'zero_optimization.offload_optimizer.device "nvme" with sub_group_size {sub:.0e}',
                    replace(x, offload_optimizer="nvme", sub_group=sub)))
    if x.stage == 3 and x.offload_param == "cpu":
        out.append(('zero_optimization.offload_param.device "nvme"', replace(x, offload_param="nvme")))
    if x.stage in (1, 2) and x.world > 1:
        out.append(('zero_optimization.stage 3', replace(x, stage=3)))
    return out
