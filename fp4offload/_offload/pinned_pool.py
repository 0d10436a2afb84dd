"""The activations' host slab pool: fp4offload/_store/pinned.py's bounded pool of reused host slabs (pinned when
CUDA is present), whose freed blocks raise SavedTensorReleasedError, and the process-wide pools for the activation
policies' settings (one registry, _store.pinned.shared_pool).

The bytes the pool reserves never exceed `max_bytes`; a request that does not fit returns ``None`` and the
caller keeps its tensor where it is. A block used after it was freed (or after its slab was reset) raises
SavedTensorReleasedError instead of reading another tensor's bytes.
"""

from __future__ import annotations

import torch

from .._store import pinned as _pinned
from .._store.pinned import ALIGN, Block, default_max_host_bytes, local_ranks
from .errors import SavedTensorReleasedError

__all__ = ["ALIGN", "Block", "HostSlabPool", "default_max_host_bytes", "local_ranks", "shared_pool"]


class HostSlabPool(_pinned.HostSlabPool):
    """Host memory for offloaded tensors: bounded, reused, pinned when CUDA is present.

    Args:
        max_bytes: most bytes the pool may reserve (slabs created, in use or idle).
        slab_bytes: size of an ordinary slab (a power of two); bigger requests get a slab of the next
            power of two that goes back to the pool when freed.
        pin: pin the slabs (default: when ``torch.cuda.is_available()``); plain host memory otherwise.
    """

    def released(self, nbytes: int) -> Exception:
        return SavedTensorReleasedError((nbytes,), torch.uint8, "its host slot was freed and may hold another tensor "
                                        "now")


def shared_pool(max_bytes: int | None, slab_bytes: int = 1 << 25, pin: bool | None = None) -> HostSlabPool:
    """The process-wide pool for these settings, so slabs are reused from one training step to the next."""
    return _pinned.shared_pool(max_bytes, slab_bytes, pin, cls=HostSlabPool)
