"""What an engine (DeepSpeed, FSDP2) plugs into FP4AdamW: ``optimizer.hooks``, an :class:`EngineHooks`.

- :meth:`~EngineHooks.grad_norm_source`: where the step's global gradient norm can be read, so that the
  non-finite check reads it instead of every gradient;
- :meth:`~EngineHooks.scale_grad`: a factor the next step applies to one gradient in fp32 (clipping);
- :meth:`~EngineHooks.start_master`: start split's master of a parameter from the residual of the fp32 values
  it was cast from;
- :meth:`~EngineHooks.weight_regions`: NVFP4 copies of regions of a parameter the fused CPU step writes.

The hooks hold no reference that keeps the optimizer alive; copies and pickles of the optimizer start with
none set (as torch's optimizers drop their hooks).
"""

from __future__ import annotations

import math
import weakref
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import ConfigError
from .step import GRAD_LIMIT
from .working_copy import WeightRegion


class EngineHooks:
    """The engine hooks of one FP4AdamW (``optimizer.hooks``)."""

    def __init__(self, optimizer):
        self._opt = weakref.ref(optimizer)
        self.norm_source: Callable[[], float | None] | None = None
        #: tensor -> the gradient factor its next step applies (dropped when that step ends, however it ends)
        self.scales = WeakIdKeyDictionary()

    def grad_norm_source(self, fn: Callable[[], float | None] | None) -> None:
        """Where this step's global gradient norm can be read (an engine that computes it anyway, as DeepSpeed
        does for clipping): ``fn()`` returns it, or None when it was not computed. With a norm, the
        non-finite check reads it instead of every gradient (a norm that is not finite, or negative, as
        DeepSpeed reports Inf/NaN, skips the step). None removes the source."""
        if fn is not None and not callable(fn):
            raise ConfigError("fn", fn, "None or a function () -> float | None")
        self.norm_source = fn

    def scale_grad(self, p, scale) -> None:
        """The next step multiplies p's gradient by `scale` (a float or a 0-d tensor) in fp32, as it reads each
        segment: what an engine's clipping does to an fp32 gradient partition, kept exact for a bf16 gradient,
        which a multiply in place would round to bf16. The fused CPU step applies it as it reads each gradient and
        leaves the gradient as it was; the other backends multiply an fp32 gradient in place. DeepSpeed ZeRO-3
        clips this way when the master's gradient is its bf16 gradient partition, so its steps see the gradients
        of the run with an fp32 gradient buffer. A step that is skipped drops the scale. `p` need not be in
        param_groups yet (ZeRO-3 points them at each sub-group only for its step)."""
        if not torch.is_tensor(p):
            raise ConfigError("p", type(p).__name__, "a parameter tensor")
        v = float(scale.item() if torch.is_tensor(scale) else scale)
        if not (math.isfinite(v) and v > 0):
            raise ConfigError("scale", v, "a finite positive gradient scale")
        if v == 1.0:  # x * 1 is x for every float: no pass over the gradient (DeepSpeed's factor when not clipping)
            self.scales.pop(p, None)
            return
        self.scales[p] = scale

    def start_master(self, p, lo: torch.Tensor, odd: torch.Tensor | None = None) -> None:
        """Start the split master of `p` from a residual: `p` holds ``rne(x)`` of fp32 values x it was cast
        from, `lo` and `odd` are ``master.split(x)``'s (fp4offload/_optim/master.py), so the first step starts
        from x itself, as an fp32 master would. For p without state yet (``master="split"`` only)."""
        opt = self._opt()
        if opt.master != "split":
            raise ConfigError("master", opt.master, "'split' for start_master", "only split keeps a residual")
        group = next((g for g in opt.param_groups if any(q is p for q in g["params"])), None)
        if group is None or "step" in opt.state.get(p, {}):
            raise ConfigError("p", f"a tensor of shape {tuple(p.shape)}", "a parameter of this optimizer that has "
                              "no state yet")
        if lo.numel() != p.numel() or lo.dtype != torch.int16:
            raise ConfigError("lo", f"{lo.numel()} {lo.dtype} values", f"{p.numel()} int16 values")
        odd = odd if odd is not None else torch.zeros(0, dtype=torch.int64)
        opt.fresh_state(group, p, res=(lo.reshape(-1), odd))  # with master_device="nvme": written to the files

    def weight_regions(self, tensor: torch.Tensor, regions: list[WeightRegion]) -> None:
        """Ask the fused CPU step to write an NVFP4 16x16 copy of each region of `tensor` (a parameter this
        optimizer steps, held in host RAM) as it updates it. Before each step set ``region.amax``; after it,
        ``region.packed`` and ``region.new_amax`` hold the result (see WeightRegion). Replaces earlier regions
        of the tensor; an empty list removes them."""
        opt = self._opt()
        if regions and opt.master != "fp32":
            raise ConfigError("master", opt.master, "'fp32' for a step that writes NVFP4 weight regions",
                              "the fused step encodes regions from the fp32 master it holds")
        opt.stepper.copies.register(tensor, regions)

    # ---- read by the step -------------------------------------------------------------------------------

    def finite_from_norm(self, grad_norm) -> bool | None:
        """Whether the gradients are finite, from the norm given or the source's (None: unknown)."""
        if grad_norm is None and self.norm_source is not None:
            grad_norm = self.norm_source()
        if grad_norm is None:
            return None
        v = float(grad_norm.item() if torch.is_tensor(grad_norm) else grad_norm)
        return math.isfinite(v) and 0 <= v < GRAD_LIMIT  # no element is larger than the norm


__all__ = ["EngineHooks"]
