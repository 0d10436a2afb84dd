"""Errors of the activation offload (candidates to move into fp4offload/errors.py)."""

from __future__ import annotations

from ..errors import FP4OffloadError


class SavedTensorReleasedError(FP4OffloadError, RuntimeError):
    """Backward asked for a saved activation whose stored copy is gone.

    Raised instead of handing back bytes that now belong to another tensor: the slot of the host pool
    (or the file) was released, because the offload context closed on an exception, ``close()`` was
    called, or the slot was reused.
    """

    def __init__(self, shape, dtype, why: str):
        self.shape, self.dtype, self.why = tuple(shape), dtype, why
        super().__init__(
            f"the activation saved for backward (shape {tuple(shape)}, dtype {dtype}) is no longer stored: {why}. "
            "Run backward before closing the offload context, and pass retain_graph=True to the first backward "
            "if you need to run backward through the same graph twice (retained graphs keep their stored copies)")
