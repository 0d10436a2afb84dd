"""The records of the activation offloader: one :class:`Entry` per stored tensor, and the :class:`Saved` handle
autograd holds in its place (several handles may share an entry; the last one dropped releases it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .packing import Layout

if TYPE_CHECKING:
    from .hooks import ActivationOffloader

__all__ = ["Entry", "Saved"]


class Entry:
    """One stored tensor (shared by every handle that saved it)."""

    __slots__ = ("id", "layout", "where", "device", "parts", "ready", "block", "future", "fetched", "cache",
                 "waiting", "handles", "pos", "released", "why", "key", "base_ref", "version", "nbytes_in",
                 "nonfinite")

    def __init__(self, eid: int, device: torch.device, nbytes_in: int):
        self.id, self.device, self.nbytes_in = eid, device, nbytes_in
        self.layout: Layout | None = None
        self.where = "device"
        self.parts = self.ready = self.block = self.future = self.fetched = self.cache = None
        self.waiting: set[int] = set()
        self.handles: set[int] = set()
        self.pos, self.released, self.why, self.key = -1, False, "", None
        self.base_ref, self.version = None, -1
        self.nonfinite = None  # CUDA: (the codec's non-finite count, the event after which it can be read)


class Saved:
    """What autograd holds in place of a saved tensor."""

    __slots__ = ("entry", "owner", "shape", "__weakref__")

    def __init__(self, entry: Entry, owner: "ActivationOffloader", shape: torch.Size | None):
        self.entry, self.owner, self.shape = entry, owner, shape  # shape: a view's, when not the entry's

    def __del__(self):
        try:
            self.owner._drop(self.entry, id(self))
        except Exception:  # interpreter shutdown: nothing left to give back
            pass

    def __repr__(self) -> str:
        lay = self.entry.layout
        return f"<fp4offload saved activation {tuple(lay.shape) if lay else '?'} in {self.entry.where}>"
