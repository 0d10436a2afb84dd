"""Bytes per element and per parameter that the planner counts, derived from the formats' own sizes.

Owns the planner's byte sizes: :data:`STATE_BYTES` and :func:`state_bytes`, :data:`ACT_BYTES`,
:data:`WEIGHT_PACKED_BYTES` (the memory model, memory.py) and :func:`step_bytes_per_param` (the memory traffic of
one optimizer step: hardware.py's CPU rate cap, timing.py's GPU step). No packed size is typed in here: each comes from
:func:`fp4offload.formats.layout.bytes_per_element`, the function the codecs' own sizes come from (and split's
NVMe residual from :func:`fp4offload._optim.state.residual_sizes`, what the state files hold), so the planner
cannot disagree with what is allocated. Imports nothing of the planner or the runtime (the host model, the
planner's memory, hardware and timing, and the DeepSpeed block's announcement all import it).
"""

from __future__ import annotations

from fp4offload._config.grids import BY_NAME as V_GRID_BY_NAME
from fp4offload._config.vocab import V_FORMAT_DEFAULT
from fp4offload.formats.layout import bytes_per_element
from fp4offload._optim import CHUNK, SEGMENT
from fp4offload._optim.state import residual_sizes

__all__ = ["FP32_BYTES", "BF16_BYTES", "STATE_BYTES", "state_bytes", "MASTER_BYTES", "RESIDUAL_NVME_BYTES", "ACT_BYTES",
           "WEIGHT_PACKED_BYTES", "step_bytes_per_param"]

FP32_BYTES = 4
BF16_BYTES = 2

#: Bytes per parameter of Adam's m and v together, per state format: fp32 m and v; or FP4AdamW's packed
#: states, m as NVFP4 and sqrt(v) as ufp4, both 1x16 with one fp32 scale per CHUNK (1024) elements
#: (0.56640625 each, 1.1328125 together).
STATE_BYTES: dict[str, float] = {
    "fp32": 2.0 * FP32_BYTES,
    "nvfp4": bytes_per_element("nvfp4", "1x16", CHUNK) + bytes_per_element("ufp4", "1x16", CHUNK),
}


def state_bytes(state_format: str, v_format: str | None = None) -> float:
    """Bytes per parameter of m and v together: :data:`STATE_BYTES` of ``state_format``, with FP4AdamW's v in
    ``v_format`` (a grid of _config/grids.py, default the block's; the 2-bit ue2m0 makes 0.8828125)."""
    if state_format == "fp32":
        return STATE_BYTES["fp32"]
    v = V_GRID_BY_NAME[v_format or V_FORMAT_DEFAULT]
    return bytes_per_element("nvfp4", "1x16", CHUNK) + v.bytes_per_element


#: Bytes per parameter of the master weight in each form (FP4AdamW's ``master``): fp32; split = the bf16
#: partition (which is also the copy that goes to the device) plus a 16-bit residual; bf16.
MASTER_BYTES: dict[str, float] = {"fp32": float(FP32_BYTES), "split": 2.0 * BF16_BYTES, "bf16": float(BF16_BYTES)}
#: Bytes per parameter of split's residual in the NVMe state files (``master_device="nvme"``): the 16-bit low
#: half and a bitmap of the tie positions (the files keep a bitmap, not RAM's sparse list, so their size is
#: fixed), 2.125. Exact for whole segments; a tensor's last one rounds its bitmap up to a byte.
RESIDUAL_NVME_BYTES: float = sum(residual_sizes(SEGMENT)) / SEGMENT
#: Bytes per element of a saved activation in each packed format (default block, one tensor scale).
ACT_BYTES: dict[str, float] = {fmt: bytes_per_element(fmt) for fmt in ("nvfp4", "mxfp4", "mxfp8", "int2")}
#: Bytes per element of a weight packed as NVFP4 in 16x16 tiles (docs/design.md 3.3, 3.8).
WEIGHT_PACKED_BYTES: float = bytes_per_element("nvfp4", "16x16")


def step_bytes_per_param(state_format: str, *, bf16_copy: bool, v_format: str | None = None) -> float:
    """Memory traffic per parameter of one Adam step with ``state_format`` states (FP4AdamW's v on ``v_format``,
    default the block's): read the fp32 gradient, read and write the fp32 master and both states, and write a
    bf16 copy of the weight when ``bf16_copy``."""
    return (FP32_BYTES + 2 * FP32_BYTES + 2 * state_bytes(state_format, v_format)
            + (BF16_BYTES if bf16_copy else 0))
