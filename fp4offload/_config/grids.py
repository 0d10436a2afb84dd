"""The grids FP4AdamW can store its second moment on, one row each: the table every list of them derives from.

A row's ``name`` is a ``v_format``. An unsigned grid stores u = sqrt(v) as ``bits``-bit codes on the zero-free grid
with ``mbits`` mantissa bits (:mod:`fp4offload.formats.bits`' ``ugrid_*``: 2^bits >> mbits binades, the top one
[1, 2)); the one signed grid, ``nvfp4`` (4 bits, ``mbits == 0``), stores v itself in NVFP4 (E2M1). The 2-bit grid
``ue2m0`` holds 1/8, 1/4, 1/2 and 1, four codes a byte. Every grid has blocks of 16 elements with an E4M3 scale
each and one fp32 scale per chunk (reference_step.py). ``kid`` is the number the kernels know the grid by (their
``v_kind``); a row keeps its number for good.

Derived from the rows: the vocabulary's ``V_FORMATS`` (_config/vocab.py), ``reference_step.V_GRID`` and
``V_KIND``, and csrc/grids.h, whose X-macro ``FP4_V_GRIDS`` the CPU and CUDA steps
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
    mbits: int  #: mantissa bits of the unsigned grid of sqrt(v); 0 with 4 bits: v itself in NVFP4 (signed E2M1)
    block: int = 16  #: elements per block scale
    scale: str = "e4m3"  #: the block scale's format
    bits: int = 4  #: bits per code: 4 (two codes a byte) or 2 (four)
    cost: str = ""  #: what training on the grid costs, measured (benchmarks/RESULTS.md); plan prints it

    @property
    def signed(self) -> bool:
        """Signed E2M1 codes (v itself is stored), or an unsigned grid (sqrt(v) is)."""
        return self.mbits == 0 and self.bits == 4

    @property
    def binades(self) -> int:
        """The unsigned grid's binades (2^bits codes, 2^mbits a binade)."""
        return (1 << self.bits) >> self.mbits

    def code_bytes(self, n: int) -> int:
        """Bytes of the codes of n elements (n a whole number of blocks, or the last block padded)."""
        per = 8 // self.bits
        return -(-n // per)

    @property
    def bytes_per_element(self) -> float:
        """Stored bytes per element: the codes, the E4M3 scale per block, the fp32 scale per 1024."""
        return self.bits / 8 + 1 / self.block + 4 / 1024


#: every grid, the default (vocab.V_FORMAT_DEFAULT) first
V_GRIDS = (
    VGrid("ue2m2", 2, 2, cost="the default: +0.38% validation loss against fp32 AdamW at 10M parameters, "
                              "10,000 steps (benchmarks/RESULTS.md, Long horizon)"),
    VGrid("ufp4", 0, 1, cost="the default before ue2m2: +1.7% validation loss against fp32 AdamW at 10M parameters, "
                             "10,000 steps (benchmarks/RESULTS.md, Long horizon)"),
    VGrid("nvfp4", 1, 0, cost="v itself in NVFP4: not measured at long horizons"),
    VGrid("ue2m0", 3, 0, bits=2,
          cost="sqrt(v) on the 2-bit grid ue2m0, m and v 0.883 B/param (1.133 with the default); measured against "
               "fp32 AdamW: -0.20% validation loss at 10M parameters, 10,000 steps (one seed), -0.12% +- 0.41% at "
               "0.88M (3 seeds), +0.0 +- 0.5 points on a SmolLM2-135M fine-tune (3 seeds) (2026-12-05, AMD EPYC; "
               "benchmarks/RESULTS.md, Two bits); experimental"),
)

#: the rows by name
BY_NAME = {g.name: g for g in V_GRIDS}
#: the v_format of state dicts saved before the format was recorded in them
LEGACY_V_FORMAT = "ufp4"

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
        if not r.name.isidentifier() or r.kid < 0 or r.bits not in (2, 4) or not 0 <= r.mbits < r.bits:
            raise ValueError(f"v grid {r}: the name must be an identifier, the kid >= 0, bits 2 or 4, mbits in "
                             "[0, bits)")
        if (r.block, r.scale) != (16, "e4m3"):
            raise ValueError(f"v grid {r.name}: the kernels encode blocks of 16 with E4M3 scales")


def header(rows=V_GRIDS) -> str:
    """The text of csrc/grids.h for `rows`."""
    check(rows)
    return x_macro("grids", "V_GRIDS",
                   "FP4_V_GRIDS(X) calls X(name, kernel id, mantissa bits, block, code bits) for every grid of "
                   "FP4AdamW's second\nmoment: an unsigned zero-free grid of u = sqrt(v), except 0 mantissa bits with "
                   "4-bit codes: v itself in NVFP4 (E2M1).", "FP4_V_GRIDS(X)",
                   [f"X({r.name}, {r.kid}, {r.mbits}, {r.block}, {r.bits})" for r in rows],
                   (f"#define FP4_V_MBITS_MAX {max(r.mbits for r in rows if r.bits == 4)}",))


def write_header(csrc: Path | str = CSRC, rows=V_GRIDS) -> Path:
    """Write header(rows) as `csrc`/grids.h; returns its path."""
    path = Path(csrc) / HEADER
    path.write_text(header(rows))
    return path
