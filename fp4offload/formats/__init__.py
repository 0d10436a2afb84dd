"""Numerics only: E2M1, E4M3, E8M0, ufp4, NVFP4, MXFP4, MXFP8 and the PackedTensor that holds them.

No engine knowledge lives here, and nothing here imports fp4offload._codec (which sits above). Who owns what:
`bits` the scalar rules, `reference` the torch implementation every backend must match (with the one
nibble-packing helper of the torch side), `layout` the formats, the rows/cols view and every size in bytes,
`packed` the PackedTensor container, `container` its file format.
"""

from .layout import FORMATS
from .packed import PackedTensor

__all__ = ["FORMATS", "PackedTensor"]
