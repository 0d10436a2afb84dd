"""The block's host-memory settings (``host``) and what applies them to a DeepSpeed run.

With ``optimizer_states`` the offloaded fp32 master, the gradient partition and the packed states live in
host RAM, and what the host's allocator and DeepSpeed's own buffers do with it weighs as much as the
formats. Four settings (fp4offload.config.HostConfig) shape it, and a fifth says what the host-memory
preflight (:mod:`fp4offload.integrations.ds_preflight`) does; each has an environment override:

================================  ============================  =================================================
``host.`` key                     override                      what it does
================================  ============================  =================================================
``mmap_threshold``                ``FP4OFFLOAD_MMAP_THRESHOLD``   glibc's mmap threshold fixed (bytes, or off)
``allocator_cache``               ``FP4OFFLOAD_HOST_CACHE``       torch's large CPU blocks from a bounded cache
``share_bf16_staging``            ``FP4OFFLOAD_SHARE_STAGING``    CPU accelerator: no second bf16 copy
``bf16_gradient_partition``       ``FP4OFFLOAD_BF16_GRADS``       ZeRO-1/2 host gradient partition in bf16
``preflight``                     ``FP4OFFLOAD_PREFLIGHT``        error, warn or off when the estimate does not fit
================================  ============================  =================================================

:func:`resolve` gives the effective value of each and where it came from (``fp4offload doctor`` prints
it). Why each exists, with measurements: docs/design.md sections 7 and 8, and benchmarks/RESULTS.md.

DeepSpeed's private names used here go through :mod:`fp4offload.integrations.ds_internals`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from fp4offload.config import OFF_VALUES, HostConfig
from fp4offload.errors import ConfigError

from . import ds_internals as dsi

log = logging.getLogger("fp4offload.deepspeed")

__all__ = ["ENV", "Setting", "HostSettings", "resolve", "control_host_allocator", "share_bf16_staging",
           "bf16_gradient_partition", "bf16_grads_at_init", "zero3_grads_at_init", "zero3_gradient_partition",
           "release_free_host_memory"]

#: the environment override of each ``host`` key
ENV = {"mmap_threshold": "FP4OFFLOAD_MMAP_THRESHOLD", "allocator_cache": "FP4OFFLOAD_HOST_CACHE",
       "share_bf16_staging": "FP4OFFLOAD_SHARE_STAGING", "bf16_gradient_partition": "FP4OFFLOAD_BF16_GRADS",
       "preflight": "FP4OFFLOAD_PREFLIGHT"}

_M_MMAP_THRESHOLD = -3  # mallopt parameter number (malloc.h)
_ON = ("1", "on", "true", "yes")


@dataclass(frozen=True)
class Setting:
    """One effective host setting: its value and where it came from (``default``, the config key, or the
    environment variable)."""

    value: Any
    source: str


@dataclass(frozen=True)
class HostSettings:
    """The five effective host settings (see the module docstring)."""

    mmap_threshold: Setting
    allocator_cache: Setting
    share_bf16_staging: Setting
    bf16_gradient_partition: Setting
    preflight: Setting

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: {"value": getattr(self, f.name).value, "source": getattr(self, f.name).source}
                for f in fields(self)}


def _from_env(name: str, raw: str) -> Any:
    """An environment override, validated like the config key (the error names the variable)."""
    var = ENV[name]
    text = raw.strip().lower()
    if name in ("share_bf16_staging", "bf16_gradient_partition"):
        if text in OFF_VALUES:
            return False
        if text in _ON:
            return True
        raise ConfigError(var, raw, "0 or 1 (also off/on, false/true)", f"it overrides fp4offload.host.{name}")
    value: Any = text
    if name == "mmap_threshold" and text.isdigit():
        value = int(text) or "off"
    elif name == "allocator_cache":
        try:
            value = float(text) if text not in OFF_VALUES else text
        except ValueError:
            value = raw
    try:
        return getattr(HostConfig(**{name: value}), name)
    except ConfigError as exc:
        raise ConfigError(var, raw, exc.allowed, f"it overrides fp4offload.host.{name}") from None


def resolve(host: HostConfig | None, environ: Mapping[str, str] | None = None) -> HostSettings:
    """The effective host settings: the environment override, else the config's value, else the default."""
    environ = os.environ if environ is None else environ
    default = HostConfig()
    out = {}
    for f in fields(HostConfig):
        raw = environ.get(ENV[f.name], "")
        if raw.strip():
            out[f.name] = Setting(_from_env(f.name, raw), ENV[f.name])
        elif host is not None and getattr(host, f.name) != getattr(default, f.name):
            out[f.name] = Setting(getattr(host, f.name), f"fp4offload.host.{f.name}")
        else:
            out[f.name] = Setting(getattr(default, f.name), "default")
    return HostSettings(**out)


# ----------------------------------------------------------------------------------------------
# glibc and the allocator cache


def _libc():
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        _ = libc.mallopt, libc.malloc_trim  # both must exist
    except (OSError, AttributeError):
        return None
    return libc


_allocator_state: dict | None = None


def control_host_allocator(settings: HostSettings | None = None) -> dict:
    """Keep the memory a training step frees from staying resident: glibc's mmap threshold fixed, and a
    bounded cache for torch's large CPU blocks (process-wide, once).

    glibc serves blocks below its mmap threshold from its heap. The threshold starts at 128 KiB and, each
    time an mmapped block is freed, rises to that block's size (up to 32 MiB); after the first backward every
    gradient, bucket slice and activation below 32 MiB comes from the heap, which then keeps the backward's
    transient memory resident after it is freed. Fixing the threshold turns that adjustment off: blocks at or
    above it are mmapped and unmapped on free. Alone, that costs page faults when the next layer asks for the
    same sizes again, so torch's blocks of 128 KiB and more go to :mod:`fp4offload.host_allocator`, which
    keeps freed blocks for reuse up to a share of the bytes in use and unmaps the rest.

    Args:
        settings: the effective host settings (:func:`resolve`); None resolves them from the environment
            and the defaults.

    Returns ``{"mmap_threshold": bytes or None, "reason": str, "host_cache": host_allocator.install()'s
    dict}``. The glibc part does nothing when the user already tuned glibc (``MALLOC_MMAP_THRESHOLD_`` or a
    ``glibc.malloc`` tunable) or off glibc. Called again, returns what the first call did.
    """
    global _allocator_state
    if _allocator_state is not None:
        return dict(_allocator_state)
    from fp4offload import host_allocator

    settings = resolve(None) if settings is None else settings
    state = _fix_mmap_threshold(settings.mmap_threshold)
    cache = settings.allocator_cache
    state["host_cache"] = (host_allocator.install(cache.value) if cache.value != "off"
                           else {"installed": False, "reason": f"{cache.source}=off"})
    _allocator_state = state
    return dict(state)


def _fix_mmap_threshold(setting: Setting) -> dict:
    if setting.value == "off":
        return {"mmap_threshold": None, "reason": f"{setting.source}=off"}
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return {"mmap_threshold": None, "reason": "glibc malloc already tuned by the environment"}
    libc = _libc()
    if libc is None:
        return {"mmap_threshold": None, "reason": "not glibc"}
    value = int(setting.value)
    if libc.mallopt(_M_MMAP_THRESHOLD, value) != 1:
        return {"mmap_threshold": None, "reason": f"mallopt(M_MMAP_THRESHOLD, {value}) refused"}
    log.info("fp4offload: glibc mmap threshold fixed at %d bytes (%s)", value, setting.source)
    return {"mmap_threshold": value, "reason": "set"}


def release_free_host_memory() -> bool:
    """``malloc_trim(0)``: hand the free pages of glibc's heaps back to the OS. False off glibc."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


# ----------------------------------------------------------------------------------------------
# DeepSpeed's buffers


def share_bf16_staging(engine: Any, settings: HostSettings | None = None) -> int:
    """On the CPU accelerator, let ZeRO-1/2 offload write the updated weights straight into the bf16
    partition instead of through a second bf16 copy of it. Returns the bytes no longer held.

    After its CPU optimizer step ZeRO-1/2 offload casts the fp32 master into a staging buffer
    (``param_buffer_of_bit16_for_cpu_offload_groups``, 2 B/param) and copies that into the bf16 partition:
    the buffer is where the weights wait to cross to a GPU. When the bf16 partition is itself in host RAM
    (the CPU accelerator) the buffer is a second copy of it: each one is replaced by the partition, so the
    cast lands in place (same rounding, same bits) and the copy after it is a copy onto itself. Skipped for
    a buffer DeepSpeed's native pinned-memory backend owns, and when ``host.share_bf16_staging`` is false.
    """
    settings = resolve(None) if settings is None else settings
    if not settings.share_bf16_staging.value:
        return 0
    opt = getattr(engine, "optimizer", None)
    bufs = dsi.read(opt, "param_buffer_of_bit16_for_cpu_offload_groups")
    parts = dsi.read(opt, "parallel_partitioned_bit16_groups")
    if not bufs or not parts:
        return 0
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    groups = dsi.require(opt, "real_dp_process_group")
    freed = 0
    for i, buf in enumerate(bufs):
        target = parts[i][dist.get_rank(group=groups[i])]
        if (target.device.type != "cpu" or buf.device.type != "cpu" or target.dtype != buf.dtype
                or target.numel() != buf.numel() or target.data_ptr() == buf.data_ptr()
                or get_accelerator().is_pinned(buf)):
            continue
        bufs[i] = target.view(buf.shape)
        freed += buf.numel() * buf.element_size()
    if freed:
        log.info("fp4offload: %d bytes of bf16 staging buffers shared with the bf16 partitions (%s)",
                 freed, settings.share_bf16_staging.source)
    return freed


def bf16_gradient_partition(engine: Any, settings: HostSettings | None = None) -> int:
    """Bytes the block saves by keeping ZeRO-1/2 offload's host gradient partition in bf16 instead of fp32.

    Under ``offload_optimizer`` DeepSpeed keeps an fp32 copy of each rank's gradient partition in host RAM
    (``single_partition_of_fp32_groups[i].grad``, 4 B/param, on a GPU machine too) and copies the bf16
    gradients into it. With one micro-batch per step (no accumulation into it) every value it holds is a
    bf16 value, and FP4AdamW's step reads bf16 gradients directly, so a bf16 partition holds the same
    numbers in half the bytes. The one operation DeepSpeed applies to it in place is gradient clipping's
    scale, which then rounds to bf16 (relative 2^-9, far below the 4-bit states' own rounding); without
    clipping, or below the clip norm, training is the same bits. Applied when the inner optimizer is
    FP4AdamW, the parameters are bf16, gradient_accumulation_steps is 1, and
    ``host.bf16_gradient_partition`` is true.

    ``initialize`` has DeepSpeed allocate the partition in bf16 to begin with (:class:`bf16_grads_at_init`):
    an fp32 one, zero-filled while DeepSpeed builds its buffers, would set the process's peak RSS for large
    models even if it were replaced right after. This counts what that saved.
    """
    import torch

    settings = resolve(None) if settings is None else settings
    opt = getattr(engine, "optimizer", None)
    if not _wants_bf16_grads(opt, settings):
        return 0
    saved = sum(m.grad.numel() * 2 for m in dsi.require(opt, "single_partition_of_fp32_groups")
                if m.grad is not None and m.grad.dtype == torch.bfloat16)
    if saved:
        log.info("fp4offload: host gradient partitions kept in bf16, %d bytes less (%s)", saved,
                 settings.bf16_gradient_partition.source)
    return saved


def _wants_bf16_grads(zero_opt: Any, settings: HostSettings) -> bool:
    """Whether a ZeRO-1/2 optimizer's host gradient partition may be bf16 (bf16_gradient_partition)."""
    if not settings.bf16_gradient_partition.value:
        return False
    import torch

    from fp4offload.optim import FP4AdamW

    return (bool(dsi.read(zero_opt, "single_partition_of_fp32_groups"))
            and bool(dsi.read(zero_opt, "cpu_offload", False))
            and dsi.read(zero_opt, "gradient_accumulation_steps") == 1
            and isinstance(dsi.read(zero_opt, "optimizer"), FP4AdamW)
            and all(p.dtype == torch.bfloat16 for g in dsi.read(zero_opt, "bit16_groups", []) for p in g))


def _set_grad(master, grad) -> None:
    """``master.grad = grad`` for a gradient of another dtype than the tensor's (torch >= 2.9 checks it)."""
    master.grad = None
    if hasattr(master, "grad_dtype"):
        master.grad_dtype = grad.dtype
    master.grad = grad


_Z12 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
_Z3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"


class _WhileInitializing:
    """A DeepSpeed method (``METHOD`` of each class in ``OWNERS``) replaced by ``self._make(original)`` while
    ``deepspeed.initialize`` runs, when ``enabled``; restored on exit. ``applied`` counts what it served."""

    OWNERS: tuple[str, ...] = ()
    METHOD = ""

    def __init__(self, enabled: bool):
        self.enabled, self.applied = enabled, 0
        self._stack = None

    def _make(self, orig):
        raise NotImplementedError

    def __enter__(self):
        if self.enabled:
            self._stack = contextlib.ExitStack()
            for owner in self.OWNERS:
                self._stack.enter_context(dsi.patch_class(owner, self.METHOD, self._make))
        return self

    def __exit__(self, *exc):
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        return False


class bf16_grads_at_init(_WhileInitializing):
    """While ``deepspeed.initialize`` runs, ZeRO-1/2 allocates its host gradient partition in bf16 when
    :func:`_wants_bf16_grads` says it may (``DeepSpeedZeroOptimizer.initialize_optimizer_states``, which under
    offload does nothing else for FP4AdamW; the method is restored on exit). ``applied`` counts the
    optimizers it served; the tests require it for ZeRO-1/2 with FP4AdamW, so a DeepSpeed that stops calling
    the method fails them instead of silently keeping fp32."""

    OWNERS = (_Z12,)
    METHOD = "initialize_optimizer_states"

    def __init__(self, enabled: bool, settings: HostSettings | None = None):
        self.settings = resolve(None) if settings is None else settings
        super().__init__(enabled and bool(self.settings.bf16_gradient_partition.value))

    def _make(self, orig):
        outer = self

        def initialize_optimizer_states(zo):
            if not _wants_bf16_grads(zo, outer.settings):
                return orig(zo)
            import torch
            from deepspeed.accelerator import get_accelerator

            masters = dsi.require(zo, "single_partition_of_fp32_groups")
            sizes = dsi.require(zo, "partition_size")
            for i, _ in enumerate(dsi.require(zo, "bit16_groups")):
                grad = torch.zeros(int(sizes[i]), dtype=torch.bfloat16, device=dsi.require(zo, "device"))
                pin = dsi.require(zo, "cpu_offload_pin_memory")
                _set_grad(masters[i], get_accelerator().pin_memory(grad) if pin else grad)
            outer.applied += 1

        return initialize_optimizer_states



class compact_master_at_init(_WhileInitializing):
    """While ``deepspeed.initialize`` runs with a compact master (``optimizer_states.master`` "split" or
    "bf16"), DeepSpeed's bf16 master mode accepts FP4AdamW: its ``_configure_master_weights`` checks that the
    optimizer is DeepSpeedCPUAdam, which is how that mode gets an optimizer able to step bf16 partitions;
    FP4AdamW with a compact master is one too. The rest of the mode is DeepSpeed's own (bf16 master and gradient
    partitions, their reduction and clipping). ``applied`` counts the optimizers it served."""

    OWNERS = (_Z12, _Z3)
    METHOD = "_configure_master_weights"

    def _make(self, orig):
        outer = self

        def _configure_master_weights(zo, *args, **kwargs):
            from fp4offload.optim import FP4AdamW

            inner = getattr(zo, "optimizer", None)
            compact = isinstance(inner, FP4AdamW) and inner.master != "fp32"
            if compact and kwargs.get("bf16_master_weights_and_gradients"):
                kwargs["bf16_offload_validator"] = None
                outer.applied += 1
            return orig(zo, *args, **kwargs)

        return _configure_master_weights


def staging_is_master(engine: Any) -> int:
    """With a compact master, DeepSpeed's bf16 staging buffer of each partition (the copy its step makes of the
    master before sending it to the device) becomes the bf16 master partition itself: the master is already
    the bf16 weight, so the copy is the tensor onto itself and 2 B/param of host RAM go. Returns the bytes."""
    import torch

    opt = getattr(engine, "optimizer", None)
    masters = dsi.read(opt, "single_partition_of_fp32_groups", None)
    bufs = dsi.read(opt, "param_buffer_of_bit16_for_cpu_offload_groups", None)
    if not masters or not bufs:
        return 0
    freed = 0
    for i, (m, buf) in enumerate(zip(masters, bufs)):
        if m.dtype != torch.bfloat16 or buf.shape != m.shape or buf.dtype != m.dtype:
            raise ConfigError("fp4offload.optimizer_states.master", "a compact master",
                              "DeepSpeed's bf16 master mode (bf16 master partitions)",
                              f"partition {i} is {m.dtype}, its staging buffer {buf.dtype} {tuple(buf.shape)}: this "
                              "DeepSpeed did not build bf16 masters")
        if buf.data_ptr() != m.data_ptr():
            freed += buf.numel() * buf.element_size()
            bufs[i] = m
    if freed:
        log.info("fp4offload: %d bytes of bf16 staging buffers are the bf16 master partitions", freed)
    return freed


def fp32_clip(engine: Any, any_master: bool = False) -> bool:
    """ZeRO-3 with a compact master (or, ``any_master``, an fp32 master whose gradient is DeepSpeed's bf16
    gradient partition, :func:`zero3_gradient_partition`): the clipping and loss-scale factor goes to FP4AdamW
    (``set_grad_scale``), which applies it in fp32 as it reads each gradient segment, instead of DeepSpeed's
    multiply in place. DeepSpeed's bf16 master mode keeps ZeRO-3's gradient partition in bf16, so its own
    multiply would round every clipped gradient to bf16; the fp32-master run multiplies an fp32 partition
    holding the same bf16 values by the same factor. With the factor applied in fp32 the two runs step with
    the same gradients, and split is the fp32-master run bit for bit. The factor is DeepSpeed's
    (``unscale_and_clip_grads`` in stage3.py): ``clip = max(1, (norm / loss_scale + 1e-6) / clip_grad)`` when
    ``clip_grad > 0``, the gradient multiplied by ``1 / (clip * loss_scale)``. Returns whether it applied."""
    import torch

    from fp4offload.optim import FP4AdamW

    zo = getattr(engine, "optimizer", None)
    inner = dsi.read(zo, "optimizer", None)
    flats = dsi.read(zo, "fp32_partitioned_groups_flat", None)
    if not (isinstance(inner, FP4AdamW) and (any_master or inner.master != "fp32") and flats
            and callable(dsi.read(zo, "unscale_and_clip_grads", None))):
        return False

    def make(_orig):
        def unscale_and_clip_grads(sub_group_id, total_norm):
            loss_scale, clip_grad = dsi.require(zo, "loss_scale"), dsi.require(zo, "clip_grad")
            combined = loss_scale
            if clip_grad > 0.0:
                combined = torch.clamp(((total_norm / loss_scale) + 1e-6) / clip_grad, min=1.0) * loss_scale
            inner.set_grad_scale(flats[sub_group_id], 1.0 / combined)

        return unscale_and_clip_grads

    dsi.wrap_instance(zo, "unscale_and_clip_grads", make)
    return True


def master_is_device_partition(engine: Any) -> int:
    """With a compact master on the CPU accelerator, each bf16 master partition becomes this rank's bf16
    partition of the model itself (ZeRO-1/2: ``parallel_partitioned_bit16_groups[i][rank]``; ZeRO-3: the
    sub-group's ``fp16_partitioned_groups_flat[i]``). A compact master's bf16 half is what the model computes
    with (split: its rounding to nearest, bf16: the master itself), and DeepSpeed copies it into that partition
    after every step, so on a host that is also the device the two are always equal and one tensor serves both:
    the copy after the step is a copy onto itself. DeepSpeed makes the same choice when master and partition
    already share dtype and device without offload (stage3.py, _create_fp32_partitions). On a GPU the partition
    is on the device and nothing changes. Returns the host bytes freed."""
    import torch

    zo = getattr(engine, "optimizer", None)
    pairs = []
    masters = dsi.read(zo, "single_partition_of_fp32_groups", None)
    if masters:  # ZeRO-1/2
        rank = torch.distributed.get_rank(dsi.read(zo, "real_dp_process_group")[0])
        pairs = [(masters, i, dsi.read(zo, "parallel_partitioned_bit16_groups")[i][rank]) for i in range(len(masters))]
    else:
        masters = dsi.read(zo, "fp32_partitioned_groups_flat", None)
        if masters:  # ZeRO-3
            pairs = [(masters, i, dev) for i, dev in enumerate(dsi.read(zo, "fp16_partitioned_groups_flat"))]
    freed = 0
    for masters, i, dev in pairs:
        m = masters[i]
        if (dev is None or m.dtype != torch.bfloat16 or dev.dtype != m.dtype or m.device.type != "cpu"
                or dev.device.type != "cpu" or dev.numel() != m.numel() or not dev.is_contiguous()):
            continue
        if m.data_ptr() == dev.data_ptr():
            continue
        if not torch.equal(m.view(torch.int16), dev.view(-1).view(torch.int16)):
            raise ConfigError("fp4offload.optimizer_states.master", "a compact master",
                              "a master partition equal to the model's bf16 partition at initialize",
                              f"partition {i} differs from DeepSpeed's bf16 copy of it; use master 'fp32'")
        freed += m.numel() * m.element_size()
        m.data = dev.data.view(-1)  # the same tensor object (the optimizer's key, its .grad, its ds_id)
    if freed and dsi.read(zo, "single_partition_of_fp32_groups", None):
        # ZeRO-1/2's parameters hold views of their master fragments (``_hp_mapping``, what
        # safe_get_full_fp32_param and checkpoint conversion read): made at initialize on the old storage, they
        # would read the initial master for ever and keep its 2 B/param alive. DeepSpeed relinks the same way
        # after it moves the masters itself (reload_states). ZeRO-3 looks its partitions up at each call.
        dsi.require(zo, "_link_all_hp_params")()
    if freed:
        log.info("fp4offload: %d bytes of bf16 master partitions are the model's own bf16 partitions", freed)
    return freed


class zero3_grads_at_init(_WhileInitializing):
    """While ``deepspeed.initialize`` runs, ZeRO-3 offload with FP4AdamW allocates each sub-group master's gradient
    without zero-filling it (``DeepSpeedZeroOptimizer_Stage3.initialize_optimizer_states``, which under offload
    does nothing else for FP4AdamW; restored on exit). DeepSpeed zero-fills them, and a sub-group-sized scratch
    besides, so their pages are resident at initialize's peak, although :func:`zero3_gradient_partition` replaces
    them right after by slices of the gradient partition: 4 (fp32 master) or 2 B/param, twice, at that peak.
    Where that function then keeps them, :meth:`zero_fill` does what DeepSpeed did (zero-filled, pinned when
    DeepSpeed pins them; a shared gradient is the partition, which DeepSpeed pins itself). DeepSpeed's NVMe swapper
    and parameters on NVMe keep DeepSpeed's method. ``applied`` counts the optimizers it served."""

    OWNERS = (_Z3,)
    METHOD = "initialize_optimizer_states"

    def __init__(self, enabled: bool):
        super().__init__(enabled)
        self.pinned = False

    @staticmethod
    def _fits(zo) -> bool:
        from fp4offload.optim import FP4AdamW

        groups = dsi.read(zo, "fp16_groups", None) or []
        return (isinstance(dsi.read(zo, "optimizer", None), FP4AdamW) and bool(dsi.read(zo, "offload_optimizer", False))
                and all(dsi.require(zo, "fp16_partitioned_groups_flat")[i] is not None
                        and not dsi.require(zo, "_swappable_optimizer_subgroup")(i) for i in range(len(groups))))

    def _make(self, orig):
        outer = self

        def initialize_optimizer_states(zo):
            if not outer._fits(zo):
                return orig(zo)
            import torch

            flats = dsi.require(zo, "fp32_partitioned_groups_flat")
            for i, n in enumerate(dsi.require(zo, "fp16_partitioned_groups_flat_numel")):
                flats[i].grad = torch.empty(int(n), dtype=flats[i].dtype, device=flats[i].device)
            outer.pinned = outer.pinned or bool(dsi.read(zo, "offload_optimizer_pin_memory", False))
            outer.applied += 1

        return initialize_optimizer_states

    def zero_fill(self, engine: Any) -> None:
        """The master gradients zero-filled (and pinned where DeepSpeed pins them), as DeepSpeed's initialize leaves
        them: for gradients that were not shared."""
        import torch

        for m in dsi.read(getattr(engine, "optimizer", None), "fp32_partitioned_groups_flat", None) or []:
            if m.grad is None:
                continue
            if self.pinned and m.grad.device.type == "cpu":  # (partial offload keeps some sub-groups on the device)
                from deepspeed.accelerator import get_accelerator

                m.grad = get_accelerator().pin_memory(torch.zeros_like(m.grad))
            else:
                m.grad.zero_()


def zero3_gradient_partition(engine: Any, settings: HostSettings | None = None, fused_weights: bool = False) -> int:
    """ZeRO-3 offload with FP4AdamW: each sub-group's master gradient (``fp32_partitioned_groups_flat[i].grad``)
    becomes its slice of DeepSpeed's flat gradient partition (``grad_partitions_flat_buffer``) instead of a
    buffer of its own. Returns the host bytes freed.

    Under ``offload_optimizer`` ZeRO-3 reduces each gradient into its partition buffer (accumulating there across
    micro-batches) and, at the accumulation boundary, copies the buffer into the master's gradient: two host
    copies of the same numbers. The sub-groups' parameters lie in the buffer in the order and at the offsets of
    the sub-group's flat master (both are laid out from ``fp16_groups`` by ``partition_numel``), so the master's
    gradient can be that slice: the boundary copy becomes a copy onto itself.

    - Master and buffer of one dtype (a compact master in DeepSpeed's bf16 master mode; an fp32 master with
      ``data_types.grad_accum_dtype`` fp32): the same numbers in one tensor, always applied.
    - An fp32 master over DeepSpeed's default bf16 partition buffer (``host.bf16_gradient_partition``, default
      on): the master's gradient becomes bf16, 4 B/param less. Every value it held was a bf16 value copied up,
      and FP4AdamW reads bf16 gradients, converting to fp32 as it reads. DeepSpeed's clipping would multiply the
      gradient in place, which in bf16 would round it, so the factor goes to FP4AdamW instead (:func:`fp32_clip`)
      and the steps see the fp32 gradients of the run without this, bit for bit.

    Not applied with DeepSpeed's own NVMe optimizer swapper (its sub-groups swap their gradients), or when the
    layout does not match (logged). With ``fused_weights`` (the ZeRO-3 weights block, whose NVFP4 shards FP4AdamW
    encodes inside its fused step over the whole sub-group) an fp32 master keeps its fp32 gradient: the step
    over a scaled bf16 gradient goes segment by segment, outside that fusion."""
    import torch

    from fp4offload.optim import FP4AdamW

    settings = resolve(None) if settings is None else settings
    zo = getattr(engine, "optimizer", None)
    inner = dsi.read(zo, "optimizer", None)
    flats = dsi.read(zo, "fp32_partitioned_groups_flat", None)
    buf = dsi.read(zo, "grad_partitions_flat_buffer", None)
    if not (isinstance(inner, FP4AdamW) and flats and buf is not None and dsi.read(zo, "offload_optimizer", False)):
        return 0
    groups = dsi.require(zo, "fp16_groups")
    swappable = dsi.require(zo, "_swappable_optimizer_subgroup")
    plan, offset = [], 0
    for i, group in enumerate(groups):
        numel = sum(int(p.partition_numel()) for p in group)
        flat, grad = flats[i], flats[i].grad
        if (swappable(i) or grad is None or grad.numel() != numel or flat.numel() != numel
                or offset + numel > buf.numel() or grad.device != buf.device):
            log.info("fp4offload: ZeRO-3 sub-group %d keeps its own gradient buffer (layout or swapping differs)", i)
            return 0
        plan.append((flat, grad, buf.narrow(0, offset, numel)))
        offset += numel
    if offset != buf.numel():
        log.info("fp4offload: ZeRO-3 gradient partitions not laid out as the sub-groups; not shared")
        return 0
    narrowing = any(grad.dtype != part.dtype for _, grad, part in plan)
    if narrowing and not (settings.bf16_gradient_partition.value and inner.master == "fp32" and not fused_weights
                          and all(part.dtype == torch.bfloat16 and flat.dtype == torch.float32
                                  for flat, _, part in plan)):
        return 0
    freed = 0
    for flat, grad, part in plan:
        if grad.data_ptr() == part.data_ptr():
            continue
        freed += grad.numel() * grad.element_size()
        _set_grad(flat, part)
    if narrowing and freed:
        if not fp32_clip(engine, any_master=True):
            raise RuntimeError("fp4offload: ZeRO-3's clipping could not be moved into FP4AdamW")
    if freed:
        log.info("fp4offload: ZeRO-3 master gradients are DeepSpeed's gradient partition, %d bytes less (%s)", freed,
                 "bf16 gradients for the fp32 master" if narrowing else "one copy")
    return freed
