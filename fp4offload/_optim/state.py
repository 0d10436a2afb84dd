"""Per-parameter state of FP4AdamW: what it holds, and its tier-independent state-dict form.

A parameter with at least ``min_numel`` elements holds packed states (docs/design.md 3.7), all uint8 so that a
caller who casts state tensors to another floating dtype (DeepSpeed's checkpoint loader casts them to the
parameter's dtype) loses nothing: every value is an integer in [0, 255], exact in fp32, bf16 and fp16.

- ``m_codes``, ``m_scales``, ``m_tscale``: m in NVFP4 1x16 (codes, E4M3 block scales, the little-endian bytes of
  one fp32 decode scale per chunk of 1024 elements);
- ``v_codes``, ``v_scales``, ``v_tscale``: sqrt(v) on the ue2m2 or ufp4 grid (``v_format="ue2m2"``, ``"ufp4"``) or
  v in NVFP4 (``"nvfp4"``);
- ``v_format`` (str), ``step`` (fp32 0-dim tensor, as torch.optim.AdamW keeps it).

Smaller parameters hold fp32 ``exp_avg`` and ``exp_avg_sq`` shaped like the parameter (torch AdamW's names).
A parameter that is not fp32 or not contiguous, or on the GPU with states on the host, also holds ``master``:
its fp32 master copy, flat. On the NVMe tier the six packed tensors live in files and only ``step`` (and
``master``) stay in ``optimizer.state``; ``state_dict()`` reads them back, so its form is the same on every tier.

``master="split"`` adds ``master_lo`` (int16, one per element) and ``master_odd`` (sorted int64 positions); with
``master_device="nvme"`` a packed parameter's residual lives in its segment files instead (:class:`Residual`),
and its state-dict form is the same bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .._config.grids import LEGACY_V_FORMAT
from ..errors import ConfigError
from ..formats import reference
from . import reference_step as R

PACKED_KEYS = ("m_codes", "m_scales", "m_tscale", "v_codes", "v_scales", "v_tscale")
#: split's residual of one segment in its NVMe file: lo as bytes, and the odd positions as a bitmap
RESIDUAL_KEYS = ("master_lo", "master_odd_bits")
_BIT = np.array([1, 2, 4, 8, 16, 32, 64, 128], dtype=np.uint8)


def residual_sizes(n: int) -> tuple[int, int]:
    """Bytes of RESIDUAL_KEYS for a segment of n elements."""
    return 2 * n, -(-n // 8)


class Residual(NamedTuple):
    """Split's residual of one segment of n elements as its NVMe file holds it: ``lo`` (int16, n) and ``bits``
    (uint8, ceil(n / 8); bit ``i % 8`` of byte ``i // 8`` set where ``i`` is an odd position). A bitmap and not a
    list of positions, so that the file's size is fixed: a step reserves its disk space exactly, and the aio
    engine writes the segment back from the buffer it was read into. Both are updated in place."""

    lo: torch.Tensor
    bits: torch.Tensor

    @classmethod
    def zeros(cls, n: int) -> Residual:
        return cls(torch.zeros(n, dtype=torch.int16), torch.zeros(residual_sizes(n)[1], dtype=torch.uint8))

    def odd(self) -> torch.Tensor:
        """The odd positions (sorted int64, relative to the segment)."""
        # numpy: torch's intra-op threads cost more to wake than these small passes take
        b = self.bits.numpy()
        at = np.flatnonzero(b)  # bytes with a bit set: few
        hit = (b[at, None] & _BIT) != 0
        return torch.from_numpy((at[:, None] * 8 + np.arange(8))[hit])

    def set_odd(self, odd: torch.Tensor) -> None:
        o = odd.to(device="cpu", dtype=torch.int64).numpy()
        # distinct positions: the sum of their bits in a byte is their bitwise or
        self.bits.numpy()[:] = np.bincount(o >> 3, weights=_BIT[o & 7], minlength=self.bits.numel())


def as_u8(t: torch.Tensor, key: str, size: int) -> torch.Tensor:
    """A packed state tensor as uint8 on CPU, undoing a cast to a floating dtype; checks the size."""
    t = t.detach().reshape(-1).cpu()
    if t.numel() != size:
        raise ConfigError(f"state[{key!r}]", f"a tensor of {t.numel()} elements", f"{size} elements",
                          "the state dict belongs to a different model or chunk size")
    if t.dtype == torch.uint8:
        return t.clone()
    if t.is_floating_point():
        r = t.to(torch.float32)
        if not bool(((r >= 0) & (r <= 255) & (r == torch.round(r))).all()):
            raise ConfigError(f"state[{key!r}]", f"a {t.dtype} tensor that is not whole bytes",
                              "uint8, or uint8 values cast to a float dtype")
        return r.to(torch.uint8)
    return t.to(torch.uint8)


def step_of(value) -> int:
    """The step count from a state dict (a tensor or a number)."""
    return int(float(value.item() if torch.is_tensor(value) else value))


def packed_from_entry(entry: dict, n: int, v_format: str | None = None) -> tuple[R.Packed, R.Packed]:
    """The packed m and v of a state-dict entry of n elements, their sizes checked; v's code bytes are those of
    `v_format` (default: the entry's, else 4-bit)."""
    c, s, t = R.packed_sizes(n)
    cv = R.packed_sizes(n, R.v_bits(v_format or entry.get("v_format", LEGACY_V_FORMAT)))[0]
    u8 = {k: as_u8(entry[k], k, size) for k, size in zip(PACKED_KEYS, (c, s, t, cv, s, t))}
    return (R.Packed(u8["m_codes"], u8["m_scales"], u8["m_tscale"]),
            R.Packed(u8["v_codes"], u8["v_scales"], u8["v_tscale"]))


def encode_state(m: torch.Tensor, v: torch.Tensor, v_format: str, kern=reference) -> tuple[R.Packed, R.Packed]:
    """Quantize fp32 m and v (flat, CPU) once: m to NVFP4 (nearest), v to sqrt(v) on its unsigned grid (ue2m2,
    ufp4, ue2m0) or v in NVFP4."""
    n = m.numel()
    grid = R.V_GRID[v_format]
    pm, pv = R.empty_packed(n, "cpu"), R.empty_packed(n, "cpu", grid.bits)
    R.encode_into(kern, m.float().contiguous(), pm, False, False, 0, 0)
    if not grid.signed:
        R.encode_into(kern, R.sqrt_rn(v.float().clamp(min=0)).contiguous(), pv, grid, False, 0, 0)
    else:
        R.encode_into(kern, v.float().contiguous(), pv, False, False, 0, 0)
    return pm, pv


def entry_moments(entry, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 m and v (flat) of a state-dict entry of n elements: its packed states decoded in their ``v_format``,
    or its fp32 ``exp_avg`` and ``exp_avg_sq``."""
    if "exp_avg" in entry:
        return entry["exp_avg"].detach().reshape(-1).float(), entry["exp_avg_sq"].detach().reshape(-1).float()
    return decode_state(*packed_from_entry(entry, n), n, entry.get("v_format", LEGACY_V_FORMAT))


def decode_state(m: R.Packed, v: R.Packed, n: int, v_format: str, kern=reference) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 m and v (flat) of packed states."""
    md = R.decode(kern, m, n, False)
    grid = R.V_GRID[v_format]
    if not grid.signed:
        u = R.decode(kern, v, n, grid)
        return md, torch.mul(u, u)
    return md, R.decode(kern, v, n, False)
