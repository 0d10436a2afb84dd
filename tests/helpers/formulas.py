"""The published definitions of the element and scale formats, written independently of fp4offload.

Tests compare fp4offload's tables and bytes against these plain-Python formulas (docs/design.md section 3).
"""

from __future__ import annotations

import math


def e2m1_value(c: int) -> float:
    """E2M1: s e1 e0 m, bias 1; e == 0 is subnormal m * 2^0 * 0.5. Code 8 is -0."""
    e, m = (c >> 1) & 3, c & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if c & 8 else mag


def e4m3_value(c: int) -> float:
    """E4M3 'fn': bias 7, no Inf, S.1111.111 is NaN, subnormals m * 2^-9."""
    e, m = (c >> 3) & 15, c & 7
    if e == 15 and m == 7:
        return math.nan
    mag = m * 2.0 ** -9 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)
    return -mag if c & 0x80 else mag


def e8m0_value(c: int) -> float:
    """E8M0: 2^(c - 127), 0xFF is NaN."""
    return math.nan if c == 255 else 2.0 ** (c - 127)


def ufp4_value(c: int) -> float:
    """ufp4 (docs/design.md 3.7): c = 2e + m -> 2^(e-7) * (1 + m/2), unsigned, no zero."""
    return 2.0 ** ((c >> 1) - 7) * (1 + (c & 1) / 2)
