"""Host memory for storage, in one place: the bounded slab pool and the aio engine's page-locked buffers.

- :class:`HostSlabPool`: a bounded pool of reused host slabs (pinned when CUDA is present). Pinned allocations
  are slow and the caching host allocator rounds each one up to a power of two, so the pool allocates few large
  power-of-two slabs and hands out aligned pieces of them with a bump pointer. A slab whose pieces are all freed
  is reset and reused. The bytes the pool reserves never exceed `max_bytes`; a request that does not fit returns
  ``None`` and the caller keeps its tensor where it is. Each piece remembers its slab's generation, so a piece
  used after it was freed (or after its slab was reset) raises instead of reading another tensor's bytes.
  :func:`shared_pool` gives the process-wide pool for a set of settings (the activations' host store and its
  staging for NVMe writes).
- :class:`LockedPool`: page-locked, page-aligned buffers from DeepSpeed's pinned-tensor manager, reused by size:
  what the aio engine (aio.py) reads into and writes from. Direct I/O needs them (DeepSpeed copies any other
  buffer through a page-locked bounce buffer of its own). Every LockedPool counts its bytes in one process-wide
  total (:func:`locked_total`); a `bounded` pool (the activations' files, whose sizes are not known up front)
  refuses a new buffer that would take the process past RLIMIT_MEMLOCK, and its caller uses buffered I/O for
  that file instead, since DeepSpeed aborts the process when mlock fails.

The two are separate allocators on purpose: the slab pool packs many small pieces into few pinned slabs under a
cap; the aio buffers must be whole page-locked allocations of the exact file size that DeepSpeed manages.
"""

from __future__ import annotations

import resource
import threading

import torch

from ..errors import FP4OffloadError

ALIGN = 512  # bytes; keeps every piece of a slab aligned for DMA and for fp32 views


class ReleasedBlockError(FP4OffloadError, RuntimeError):
    """A piece of a HostSlabPool was used after it went back to the pool (its bytes may be another's now)."""


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


# ---- the bounded slab pool ----------------------------------------------------------------------------------

class _Slab:
    __slots__ = ("buf", "size", "bump", "live", "gen")

    def __init__(self, size: int, pin: bool):
        self.buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        self.size, self.bump, self.live, self.gen = size, 0, 0, 0


class Block:
    """A piece of a slab: `nbytes` bytes at `offset`. ``view()`` checks the piece is still this one's."""

    __slots__ = ("slab", "offset", "nbytes", "reserved", "gen", "freed", "_released")

    def __init__(self, slab: _Slab, offset: int, nbytes: int, reserved: int, released=None):
        self.slab, self.offset, self.nbytes, self.reserved = slab, offset, nbytes, reserved
        self.gen, self.freed = slab.gen, False
        self._released = released

    @property
    def valid(self) -> bool:
        return not self.freed and self.gen == self.slab.gen

    def view(self, start: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """uint8 view of the piece (or of `nbytes` at `start` inside it)."""
        if not self.valid:
            if self._released is not None:
                raise self._released(self.nbytes)
            raise ReleasedBlockError(f"a host block of {self.nbytes} bytes was freed and may hold another tensor now")
        n = self.nbytes - start if nbytes is None else nbytes
        return self.slab.buf[self.offset + start:self.offset + start + n]


class HostSlabPool:
    """Host memory for stored tensors: bounded, reused, pinned when CUDA is present.

    Args:
        max_bytes: most bytes the pool may reserve (slabs created, in use or idle).
        slab_bytes: size of an ordinary slab (a power of two); bigger requests get a slab of the next
            power of two that goes back to the pool when freed.
        pin: pin the slabs (default: when ``torch.cuda.is_available()``); plain host memory otherwise.

    A subclass names the error a freed block raises by overriding :meth:`released`.
    """

    def __init__(self, max_bytes: int, slab_bytes: int = 1 << 25, pin: bool | None = None):
        self.max_bytes, self.slab_bytes = int(max_bytes), int(slab_bytes)
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        self._lock = threading.Lock()
        self._slabs: list[_Slab] = []
        self._current: _Slab | None = None
        self.stats = {"slabs_created": 0, "slabs_released": 0, "allocs": 0, "failed_allocs": 0,
                      "reserved_bytes": 0, "in_use_bytes": 0, "peak_in_use_bytes": 0, "peak_reserved_bytes": 0}

    def released(self, nbytes: int) -> Exception:
        """The error a block of `nbytes` raises when used after it was freed."""
        return ReleasedBlockError(f"a host block of {nbytes} bytes was freed and may hold another tensor now")

    # -- allocation ------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Block | None:
        """A block of `nbytes` bytes, or ``None`` when the pool would pass `max_bytes`."""
        need = _round_up(max(int(nbytes), 1), ALIGN)
        with self._lock:
            slab = self._find(need)
            if slab is None:
                self.stats["failed_allocs"] += 1
                return None
            blk = Block(slab, slab.bump, int(nbytes), need, self.released)
            slab.bump += need
            slab.live += 1
            st = self.stats
            st["allocs"] += 1
            st["in_use_bytes"] += need
            st["peak_in_use_bytes"] = max(st["peak_in_use_bytes"], st["in_use_bytes"])
            return blk

    def _find(self, need: int) -> _Slab | None:
        cur = self._current
        if cur is not None and cur.size - cur.bump >= need:
            return cur
        empty = [s for s in self._slabs if s.live == 0 and s.size >= need]
        if empty:
            slab = min(empty, key=lambda s: s.size)
        else:
            size = self.slab_bytes if need <= self.slab_bytes else _next_pow2(need)
            if self.stats["reserved_bytes"] + size > self.max_bytes:
                self._trim(self.stats["reserved_bytes"] + size - self.max_bytes)
            if self.stats["reserved_bytes"] + size > self.max_bytes:
                # last resort: room left at the end of a slab still in use
                tails = [s for s in self._slabs if s.size - s.bump >= need]
                if not tails:
                    return None
                return min(tails, key=lambda s: s.size - s.bump)
            slab = _Slab(size, self.pin)
            self._slabs.append(slab)
            self.stats["slabs_created"] += 1
            self.stats["reserved_bytes"] += size
            self.stats["peak_reserved_bytes"] = max(self.stats["peak_reserved_bytes"], self.stats["reserved_bytes"])
        if slab.size == self.slab_bytes:
            self._current = slab  # ordinary slabs take the following small requests too
        return slab

    def _trim(self, want: int) -> int:
        """Give idle slabs back to the system until `want` bytes are released; returns bytes released."""
        freed = 0
        for s in sorted((s for s in self._slabs if s.live == 0), key=lambda s: -s.size):
            if freed >= want:
                break
            self._slabs.remove(s)
            if self._current is s:
                self._current = None
            s.gen += 1
            s.buf = torch.empty(0, dtype=torch.uint8)
            freed += s.size
            self.stats["reserved_bytes"] -= s.size
            self.stats["slabs_released"] += 1
        return freed

    def free(self, block: Block) -> None:
        """Return a block; its slab is reset and reused once all of its blocks are back."""
        with self._lock:
            if block.freed:
                return
            block.freed = True
            if block.gen != block.slab.gen:
                return
            slab = block.slab
            slab.live -= 1
            self.stats["in_use_bytes"] -= block.reserved
            if slab.live == 0:
                slab.bump = 0
                slab.gen += 1

    def trim(self) -> int:
        """Release every idle slab; returns the bytes released."""
        with self._lock:
            return self._trim(1 << 62)

    def snapshot(self) -> dict:
        with self._lock:
            out = dict(self.stats)
            out.update(slabs=len(self._slabs), max_bytes=self.max_bytes, slab_bytes=self.slab_bytes, pinned=self.pin)
            return out


_SHARED: dict[tuple, HostSlabPool] = {}
_SHARED_LOCK = threading.Lock()


def local_ranks() -> int:
    """The ranks on this node (:func:`fp4offload._machine.launcher_ranks`: ``LOCAL_WORLD_SIZE``, set by torchrun and
    the DeepSpeed launcher, ``LOCAL_SIZE``, ``OMPI_COMM_WORLD_LOCAL_SIZE``; 1 without)."""
    from fp4offload._machine import launcher_ranks

    return launcher_ranks().local


def default_max_host_bytes() -> int:
    """The default cap of the shared pools: half of the RAM this process may use right now (what the machine has
    available, within its cgroup's limit: :func:`fp4offload._machine.limits`), shared by the node's local ranks,
    so 8 ranks of a node do not each try to pin half of it."""
    from fp4offload._machine import limits

    return limits().free // 2 // local_ranks()


def shared_pool(max_bytes: int | None, slab_bytes: int = 1 << 25, pin: bool | None = None, *,
                cls: type[HostSlabPool] = HostSlabPool) -> HostSlabPool:
    """The process-wide pool (of class `cls`) for these settings, so slabs are reused from one step to the next."""
    pin = torch.cuda.is_available() if pin is None else bool(pin)
    with _SHARED_LOCK:
        key = (cls, max_bytes, slab_bytes, pin)
        pool = _SHARED.get(key)
        if pool is None:
            pool = _SHARED[key] = cls(default_max_host_bytes() if max_bytes is None else max_bytes, slab_bytes, pin)
        return pool


# ---- page-locked buffers (the aio engine's) -------------------------------------------------------------------

_locked_lock = threading.Lock()
_locked = 0  # bytes every LockedPool of this process holds now


def locked_total() -> int:
    """Page-locked bytes the LockedPools of this process hold now."""
    return _locked


def _count_locked(nbytes: int) -> None:
    global _locked
    with _locked_lock:
        _locked += nbytes


def _cap_ipc_lock() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool((int(line.split()[1], 16) >> 14) & 1)  # CAP_IPC_LOCK
    except (OSError, ValueError, IndexError):
        pass
    return False


def can_lock(nbytes: int) -> str | None:
    """None when `nbytes` of page-locked memory can be had (DeepSpeed aborts the process when mlock fails)."""
    if _cap_ipc_lock():
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= nbytes:
        return None
    return (f"RLIMIT_MEMLOCK is {soft} bytes, the aio engine's page-locked buffers need about {nbytes} "
            "(raise it with ulimit -l)")


class LockedPool:
    """Page-locked, page-aligned uint8 buffers from DeepSpeed's pinned-tensor manager, reused by size.

    `max_idle_bytes` (None: no limit): idle buffers beyond it are freed when one comes back. `bounded`: a new
    buffer that would take this process's page-locked bytes (:func:`locked_total`) past what RLIMIT_MEMLOCK allows
    is refused (:meth:`get` returns None) after the idle buffers are freed."""

    def __init__(self, handle, *, max_idle_bytes: int | None = None, bounded: bool = False):
        self._h = handle
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._busy: dict[int, torch.Tensor] = {}  # data_ptr -> buffer handed out
        self._all: list[torch.Tensor] = []
        self._example = torch.empty(0, dtype=torch.uint8)
        self.max_idle_bytes, self.bounded = max_idle_bytes, bounded
        self._idle = 0

    def get(self, nbytes: int) -> torch.Tensor | None:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                buf = free.pop()
                self._idle -= nbytes
            else:
                if self.bounded and can_lock(locked_total() + nbytes) is not None:
                    self._drop_idle(0)
                    if can_lock(locked_total() + nbytes) is not None:
                        return None
                buf = self._h.new_cpu_locked_tensor(nbytes, self._example)
                self._all.append(buf)
                _count_locked(nbytes)
            self._busy[buf.data_ptr()] = buf
            return buf

    def put(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self._busy.pop(buf.data_ptr(), None) is not None:
                self._free.setdefault(buf.numel(), []).append(buf)
                self._idle += buf.numel()
                if self.max_idle_bytes is not None and self._idle > self.max_idle_bytes:
                    self._drop_idle(self.max_idle_bytes)

    def _drop_idle(self, keep: int) -> None:
        """Free idle buffers, largest first, until at most `keep` idle bytes are left (lock held)."""
        for size in sorted(self._free, reverse=True):
            bufs = self._free[size]
            while bufs and self._idle > keep:
                buf = bufs.pop()
                self._all = [b for b in self._all if b is not buf]
                self._h.free_cpu_locked_tensor(buf)
                self._idle -= size
                _count_locked(-size)
            if not bufs:
                del self._free[size]
            if self._idle <= keep:
                return

    def owner(self, t: torch.Tensor) -> torch.Tensor | None:
        """The handed-out buffer that `t` lies in, if any."""
        p = t.data_ptr()
        with self._lock:
            for base, buf in self._busy.items():
                if base <= p < base + buf.numel():
                    return buf
        return None

    def close(self) -> None:
        with self._lock:
            for buf in self._all:
                self._h.free_cpu_locked_tensor(buf)
                _count_locked(-buf.numel())
            self._all, self._free, self._busy, self._idle = [], {}, {}, 0
