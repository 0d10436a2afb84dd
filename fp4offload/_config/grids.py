"""The grids FP4AdamW can store its second moment on, one row each: the table every list of them derives from.

A row's ``name`` is a ``v_format``. ``mbits > 0``: u = sqrt(v) is stored on the unsigned zero-free 4-bit grid with
that many mantissa bits (:mod:`fp4offload.formats.bits`' ``ugrid_*``: 16 >> mbits binades, the top one [1, 2));
``mbits == 0``: v itself is stored in NVFP4 (signed E2M1). Every grid has blocks of 16 elements with an E4M3 scale
each and one fp32 scale per chunk (reference_step.py). ``kid`` is the number the kernels know the grid by (their
``v_kind``); a row keeps its number for good.

Derived from the rows: the vocabulary's ``V_FORMATS`` (_config/vocab.py), ``bits.UGRID_MBITS``,
``reference_step.V_MBITS`` and ``V_KIND``, and csrc/grids.h, whose X-macro ``FP4_V_GRIDS`` the CPU and CUDA steps
expand into their dispatch and checks. The header is generated (:func:`write_header`) and
committed; tests/unit/test_registries.py checks it is current. This module imports nothing of the package.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from .cheader import x_macro


class VGrid(NamedTuple):
    name: str  #: FP4AdamW's v_format
    kid: int  #: the kernels' v_kind
    mbits: int  #: mantissa bits of the unsigned grid of sqrt(v); 0: v itself in NVFP4 (signed E2M1)
    block: int = 16  #: elements per block scale
    scale: str = "e4m3"  #: the block scale's format

    @property
    def signed(self) -> bool:
        """Signed E2M1 codes (v itself is stored), or an unsigned grid (sqrt(v) is)."""
        return self.mbits == 0


#: every grid, the default (vocab.V_FORMAT_DEFAULT) first
V_GRIDS = (
    VGrid("ue2m2", 2, 2),
    VGrid("ufp4", 0, 1),
    VGrid("nvfp4", 1, 0),
)

HEADER = "grids.h"  # under csrc/
CSRC = Path(__file__).resolve().parents[2] / "csrc"  # the source checkout's


def check(rows=V_GRIDS) -> None:
    """ValueError unless `rows` is a table the kernels implement: names that are C identifiers, distinct names and
    kernel ids, at most 4 mantissa bits (at least one binade), blocks of 16 with E4M3 scales."""
    for field in ("name", "kid"):
        seen = [getattr(r, field) for r in rows]
        if len(set(seen)) != len(seen):
            raise ValueError(f"v grids: a {field} appears twice: {seen}")
    for r in rows:
        if not r.name.isidentifier() or r.kid < 0 or not 0 <= r.mbits <= 4:
            raise ValueError(f"v grid {r}: the name must be an identifier, the kid >= 0, mbits in [0, 4]")
        if (r.block, r.scale) != (16, "e4m3"):
            raise ValueError(f"v grid {r.name}: the kernels encode blocks of 16 with E4M3 scales")


def header(rows=V_GRIDS) -> str:
    """The text of csrc/grids.h for `rows`."""
    check(rows)
    return x_macro("grids", "V_GRIDS",
                   "FP4_V_GRIDS(X) calls X(name, kernel id, mantissa bits, block) for every grid of FP4AdamW's second "
                   "moment:\nmantissa bits > 0 store u = sqrt(v) on that unsigned zero-free grid, 0 stores v itself "
                   "in NVFP4 (E2M1).", "FP4_V_GRIDS(X)", [f"X({r.name}, {r.kid}, {r.mbits}, {r.block})" for r in rows],
                   (f"#define FP4_V_MBITS_MAX {max(r.mbits for r in rows)}",))


def write_header(csrc: Path | str = CSRC, rows=V_GRIDS) -> Path:
    """Write header(rows) as `csrc`/grids.h; returns its path."""
    path = Path(csrc) / HEADER
    path.write_text(header(rows))
    return path
