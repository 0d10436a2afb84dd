"""Numerics only: E2M1, E4M3, E8M0, ufp4, NVFP4, MXFP4, MXFP8 and the PackedTensor that holds them.

No engine knowledge lives here. `reference` is the torch implementation every backend must match.
"""

from .packed import FORMATS, PackedTensor

__all__ = ["FORMATS", "PackedTensor"]
