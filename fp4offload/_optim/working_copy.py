"""Working copies of FP4AdamW's parameters and the weight regions its fused CPU step encodes.

Owns: :class:`WeightRegion` (a matrix inside a flat parameter whose NVFP4 copy an integration asked for),
:func:`copy_amax` (the amax an NVFP4 copy's tensor scale comes from) and :class:`WorkingCopies`, which keeps
each parameter's last bf16 / NVFP4 copy and the registered regions, hands the fused step the regions to write
and turns what the kernel wrote into PackedTensors.

NVFP4 copies inside the fused CPU step (the working copy, and regions an integration registered): the tensor
scale must be known before the step, but the amax of the new weight is known only after it. So a copy's
tensor scale comes from copy_amax(amax), the amax rounded up to a power of two: the step encodes with the
value the last step found, and keeps the result when the new weight's rounded amax is the same, which is
every step but those where the amax crosses a power of two (else the copy is encoded again in a pass of its
own). The copy is therefore always ``quantize(w, "nvfp4", block="16x16", amax=copy_amax(amax(w)))``: a
function of the weight alone, so a resumed run makes the same copies. The rounding costs nothing measurable:
block scales land in (224, 448] instead of at 448, and E4M3 is a floating format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import _metrics as metrics
from ..errors import ConfigError
from . import reference_step as R


@dataclass(eq=False)
class WeightRegion:
    """A (rows, cols) matrix at element `offset` of a flat parameter whose NVFP4 16x16 copy the fused CPU
    step writes (FP4AdamW.hooks.weight_regions).

    Set before a step: ``amax``, the amax the tensor scale comes from (None: the step leaves the region
    alone). Set by the step: ``packed`` (a PackedTensor of shape (rows, cols), equal to
    ``quantize(values, "nvfp4", block="16x16", amax=amax)``; None when the step did not write it) and
    ``new_amax`` (the finite amax of the region's new values; NaN when one is not finite or nothing was
    written). When ``new_amax > amax`` the largest tiles saturated: encode again with the right amax.
    """

    offset: int
    rows: int
    cols: int
    amax: float | None = None
    packed: Any = None
    new_amax: float = float("nan")
    _data: Any = field(default=None, repr=False)
    _scales: Any = field(default=None, repr=False)


def copy_amax(amax: float) -> float:
    """The amax an NVFP4 copy's tensor scale comes from: `amax` rounded up to a power of two (0 stays 0)."""
    if not math.isfinite(amax):
        return amax
    if not amax > 0:
        return 0.0
    m, e = math.frexp(amax)
    return amax if m == 0.5 else math.ldexp(1.0, e)


def region_kernel_args(regions: list[WeightRegion]) -> dict:
    """The fused CPU step's keyword arguments that make it write `regions` (into buffers made here)."""
    if not regions:
        return {}
    for r in regions:
        rp, cp = -(-r.rows // 16) * 16, -(-r.cols // 16) * 16
        r._data = torch.empty(rp * cp // 2, dtype=torch.uint8)
        r._scales = torch.empty(rp // 16 * (cp // 16), dtype=torch.uint8)
    return dict(w_data=[r._data for r in regions], w_scales=[r._scales for r in regions],
                w_offsets=[r.offset for r in regions], w_rows=[r.rows for r in regions],
                w_cols=[r.cols for r in regions], w_amax=[R.f32(r.amax) for r in regions])


class WorkingCopies:
    """The working copies an FP4AdamW makes (``working_copy``: None, "bf16", "nvfp4" or "both") and the
    weight regions registered with it."""

    def __init__(self, fmt: str | None):
        self.format = fmt
        self.wanted: tuple[str, ...] = () if fmt is None else (("bf16", "nvfp4") if fmt == "both" else (fmt,))
        self._slots: dict[int, dict] = {}  # id(param) -> {"bf16": Tensor, "nvfp4": PackedTensor, "nvfp4_amax"}
        self._regions = WeakIdKeyDictionary()  # tensor -> its list[WeightRegion], by offset

    def get(self, p) -> dict:
        """``{"bf16": Tensor (flat), "nvfp4": PackedTensor}``: what the last step made of `p`."""
        return {k: v for k, v in self._slots.get(id(p), {}).items() if k in ("bf16", "nvfp4")}

    # ---- regions ----------------------------------------------------------------------------------------

    def register(self, tensor: torch.Tensor, regions: list[WeightRegion]) -> None:
        """See EngineHooks.weight_regions (hooks.py)."""
        end = 0
        for r in sorted(regions, key=lambda r: r.offset):
            if r.rows <= 0 or r.cols <= 0 or r.offset < end or r.offset + r.rows * r.cols > tensor.numel():
                raise ConfigError("regions", f"offset {r.offset}, {r.rows} x {r.cols}",
                                  f"non-overlapping matrices inside the tensor's {tensor.numel()} elements")
            end = r.offset + r.rows * r.cols
        if regions:
            self._regions[tensor] = sorted(regions, key=lambda r: r.offset)
        else:
            self._regions.pop(tensor, None)

    def clear_results(self, p) -> None:
        """Region results are per step: unset until this step writes them."""
        for r in self._regions.get(p, ()):
            r.packed, r.new_amax = None, float("nan")

    def _own_region(self, p, w, fused_cpu: bool) -> WeightRegion | None:
        """p's NVFP4 working copy as a region of the fused step, once an amax is known; else None."""
        from ..formats.layout import rows_cols

        amax = self._slots.get(id(p), {}).get("nvfp4_amax")
        if amax is None or w.device.type != "cpu" or p.is_cuda or not fused_cpu:
            return None
        rows, cols = rows_cols(p.shape)
        # one band of 16 rows is one thread's work: with too few bands a large copy would be encoded serially
        if not rows or not cols or (p.numel() >= 1 << 20 and -(-rows // 16) < 4 * torch.get_num_threads()):
            return None
        return WeightRegion(0, rows, cols, amax=amax)

    def fused_regions(self, p, w, fused_cpu: bool) -> tuple[list[WeightRegion], WeightRegion | None]:
        """The regions the fused CPU step over p (`w`: its fp32 values) writes this step (registered ones with
        an amax, and the working copy's), and the working copy's among them. `fused_cpu`: the step is the fused
        CPU one."""
        if w.device.type != "cpu":
            return [], None
        out = [r for r in self._regions.get(p, ()) if r.amax is not None]
        own = self._own_region(p, w, fused_cpu) if "nvfp4" in self.wanted else None
        if own is not None:
            if out:  # an integration's regions and a working copy of the same tensor: the copy goes separately
                own = None
            else:
                out = [own]
        return out, own

    def region_results(self, p, w, regions: list[WeightRegion], res, own: WeightRegion | None):
        """Stores what the step wrote in each region; returns (the working copy's PackedTensor, or None when
        finish must encode it, and the new weight's amax when the step measured it, else None)."""
        from ..formats.packed import PackedTensor

        for i, r in enumerate(regions):
            r.new_amax = float(res[2 * i])
            r.packed = PackedTensor(r._data, r._scales, torch.tensor([res[2 * i + 1]], dtype=torch.float32),
                                    torch.Size((r.rows, r.cols)), w.dtype, "nvfp4", "16x16", 0,
                                    meta={"amax": R.f32(r.amax)})  # the value the kernel scaled by
            r._data = r._scales = None
        if own is None:
            return None, None
        if not (math.isfinite(own.new_amax) and copy_amax(own.new_amax) == own.amax):
            return None, own.new_amax  # the amax crossed a power of two (or a value is not finite): finish encodes
        pk = own.packed
        return (PackedTensor(pk.data, pk.scales, pk.tensor_scale, p.shape, w.dtype, "nvfp4", "16x16", 0,
                             meta=pk.meta), own.new_amax)

    # ---- the copies -------------------------------------------------------------------------------------

    def bf16_out(self, p, w, needed: bool, pin: bool) -> torch.Tensor | None:
        """The buffer the packed step writes p's new weight into as bf16 (beside `w`, pinned when `pin`): the
        bf16 working copy's (reused), or a fresh one when only `needed` (a bf16 GPU parameter stepped on the
        host); None when neither."""
        if "bf16" not in self.wanted and not needed:
            return None
        bf = self._slots.setdefault(id(p), {}).get("bf16")
        if bf is None or bf.numel() != w.numel():
            bf = torch.empty(w.numel(), dtype=torch.bfloat16, device=w.device, pin_memory=pin)
        return bf

    def finish(self, p, w, bf, nvfp4=None, amax: float | None = None) -> None:
        """Keep the working copies of p's new weight `w` (`bf`: its bf16 rounding when the step wrote one;
        `nvfp4`: made by the fused step already; `amax`: the new weight's amax when the step measured it)."""
        if not self.wanted:
            return
        slot = self._slots.setdefault(id(p), {})
        if "bf16" in self.wanted:
            slot["bf16"] = bf if bf is not None else w.to(torch.bfloat16)
        if "nvfp4" in self.wanted:
            if nvfp4 is None:
                from .._codec import quantize

                # the amax the fused step would have used (a pass to measure it unless the step did), the encode
                if amax is None:
                    amax = float(w.abs().amax()) if w.numel() else 0.0
                amax = copy_amax(amax)
                nvfp4 = quantize(w.view(p.shape), "nvfp4", block="16x16", amax=amax if math.isfinite(amax) else None)
                nvfp4.meta["amax"] = amax
                slot["nvfp4_amax"] = amax  # the next step's fused encode starts from it
                metrics.counter("optim.wcopy_reencodes").add(1)
            slot["nvfp4"] = nvfp4
