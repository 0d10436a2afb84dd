"""ZeRO-3 offload with FP4AdamW: the master gradients as slices of DeepSpeed's gradient partition.

Under ``offload_optimizer`` ZeRO-3 keeps each sub-group's flat master gradient beside its flat gradient
partition, two host copies of the same numbers. :func:`zero3_gradient_partition` makes each master gradient
its slice of the partition (one copy, or a bf16 gradient for an fp32 master); :class:`zero3_grads_at_init`
has DeepSpeed allocate the master gradients without zero-filling them while ``deepspeed.initialize`` runs, so
that their pages are not resident at its peak; :func:`fp32_clip` moves DeepSpeed's clipping and loss-scale
factor into FP4AdamW, applied in fp32, where the gradient DeepSpeed would scale in place is bf16. Why: docs/design.md
section 8; how, with measurements: docs/guide.md, "Host memory".
"""

from __future__ import annotations

import logging
from typing import Any

from . import internals as dsi
from .at_init import WhileInitializing, set_grad
from .config import HostSettings, resolve

log = logging.getLogger("fp4offload.deepspeed")

__all__ = ["zero3_grads_at_init", "zero3_gradient_partition", "fp32_clip"]


class zero3_grads_at_init(WhileInitializing):
    """While ``deepspeed.initialize`` runs, ZeRO-3 offload with FP4AdamW allocates each sub-group master's gradient
    without zero-filling it (``DeepSpeedZeroOptimizer_Stage3.initialize_optimizer_states``, which under offload
    does nothing else for FP4AdamW; restored on exit). DeepSpeed zero-fills them, and a sub-group-sized scratch
    besides, so their pages are resident at initialize's peak, although :func:`zero3_gradient_partition` replaces
    them right after by slices of the gradient partition: 4 (fp32 master) or 2 B/param, twice, at that peak.
    Where that function then keeps them, :meth:`zero_fill` does what DeepSpeed did (zero-filled, pinned when
    DeepSpeed pins them; a shared gradient is the partition, which DeepSpeed pins itself). DeepSpeed's NVMe swapper
    and parameters on NVMe keep DeepSpeed's method. ``applied`` counts the optimizers it served."""

    OWNERS = (dsi.ZERO3,)
    METHOD = "initialize_optimizer_states"

    def __init__(self, enabled: bool):
        super().__init__(enabled)
        self.pinned = False

    @staticmethod
    def _fits(zo) -> bool:
        from fp4offload._optim import FP4AdamW

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

    from fp4offload._optim import FP4AdamW

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
        set_grad(flat, part)
    if narrowing and freed:
        if not fp32_clip(engine, any_master=True):
            raise RuntimeError("fp4offload: ZeRO-3's clipping could not be moved into FP4AdamW")
    if freed:
        log.info("fp4offload: ZeRO-3 master gradients are DeepSpeed's gradient partition, %d bytes less (%s)", freed,
                 "bf16 gradients for the fp32 master" if narrowing else "one copy")
    return freed


def fp32_clip(engine: Any, any_master: bool = False) -> bool:
    """ZeRO-3 with a compact master (or, ``any_master``, an fp32 master whose gradient is DeepSpeed's bf16
    gradient partition, :func:`zero3_gradient_partition`): the clipping and loss-scale factor goes to FP4AdamW
    (``hooks.scale_grad``), which applies it in fp32 as it reads each gradient segment, instead of DeepSpeed's
    multiply in place. DeepSpeed's bf16 master mode keeps ZeRO-3's gradient partition in bf16, so its own
    multiply would round every clipped gradient to bf16; the fp32-master run multiplies an fp32 partition
    holding the same bf16 values by the same factor. With the factor applied in fp32 the two runs step with
    the same gradients, and split is the fp32-master run bit for bit. The factor is DeepSpeed's
    (``unscale_and_clip_grads`` in stage3.py): ``clip = max(1, (norm / loss_scale + 1e-6) / clip_grad)`` when
    ``clip_grad > 0``, the gradient multiplied by ``1 / (clip * loss_scale)``. Returns whether it applied."""
    import torch

    from fp4offload._optim import FP4AdamW

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
            inner.hooks.scale_grad(flats[sub_group_id], 1.0 / combined)

        return unscale_and_clip_grads

    dsi.wrap_instance(zo, "unscale_and_clip_grads", make)
    return True
