"""ZeRO-1/2 offload with FP4AdamW: the host gradient partition in bf16, and the bf16 copies it need not keep.

- :func:`bf16_gradient_partition` (with :class:`bf16_grads_at_init`, which has DeepSpeed allocate it so):
  the fp32 host gradient partition of ZeRO-1/2 offload kept in bf16 (``host.bf16_gradient_partition``);
- :func:`share_bf16_staging`: on the CPU accelerator, the bf16 staging buffers become the bf16 partitions
  (``host.share_bf16_staging``);
- a compact master (``optimizer_states.master`` "split" or "bf16"): :func:`staging_is_master` makes each staging
  buffer the bf16 master partition, and :func:`master_is_device_partition` makes the master, on the CPU
  accelerator, the model's own bf16 partition (under ZeRO-3 too), relinking ZeRO-1/2's ``_hp_mapping`` views.

Why: docs/design.md section 8; how, with measurements: docs/guide.md, "Host memory". DeepSpeed's private names used
here go through :mod:`fp4offload._deepspeed.internals`.
"""

from __future__ import annotations

import logging
from typing import Any

from fp4offload.errors import ConfigError

from . import internals as dsi
from .at_init import WhileInitializing, set_grad
from .config import HostSettings, resolve

log = logging.getLogger("fp4offload.deepspeed")

__all__ = ["share_bf16_staging", "bf16_gradient_partition", "bf16_grads_at_init", "staging_is_master",
           "master_is_device_partition"]


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

    from fp4offload._optim import FP4AdamW

    return (bool(dsi.read(zero_opt, "single_partition_of_fp32_groups"))
            and bool(dsi.read(zero_opt, "cpu_offload", False))
            and dsi.read(zero_opt, "gradient_accumulation_steps") == 1
            and isinstance(dsi.read(zero_opt, "optimizer"), FP4AdamW)
            and all(p.dtype == torch.bfloat16 for g in dsi.read(zero_opt, "bit16_groups", []) for p in g))


class bf16_grads_at_init(WhileInitializing):
    """While ``deepspeed.initialize`` runs, ZeRO-1/2 allocates its host gradient partition in bf16 when
    :func:`_wants_bf16_grads` says it may (``DeepSpeedZeroOptimizer.initialize_optimizer_states``, which under
    offload does nothing else for FP4AdamW; the method is restored on exit). ``applied`` counts the
    optimizers it served; the tests require it for ZeRO-1/2 with FP4AdamW, so a DeepSpeed that stops calling
    the method fails them instead of silently keeping fp32."""

    OWNERS = (dsi.ZERO12,)
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
                set_grad(masters[i], get_accelerator().pin_memory(grad) if pin else grad)
            outer.applied += 1

        return initialize_optimizer_states


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
