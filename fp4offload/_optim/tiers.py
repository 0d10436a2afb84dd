"""Where FP4AdamW's packed m and v live between steps: the state tiers, behind one small interface.

- :class:`DeviceTier` (``state_device="same"``): tensors in ``optimizer.state`` beside the parameter; the
  step runs where the parameter is.
- :class:`HostTier` (``"cpu"``): tensors in ``optimizer.state`` in host RAM, pinned for GPU parameters; the
  CPU runs the step. For a GPU parameter it goes segment by segment through the copy pipeline: the gradient
  of segment s+1 comes down and the new weights of s go up on a side stream while s is updated.
- :class:`NvmeTier` (``"nvme"``): files of optim/nvme.py's store, one per (tensor key, segment), read ahead
  and written behind through the same segment pipeline; it also gives each tensor the key of its files. Its
  steps are transactions: a failed step is undone whole (see ``begin_step`` below and optim/nvme.py).

What the optimizer asks of a tier (``st`` is ``optimizer.state[p]``, whose ``"v_format"`` is set):

- ``compute_device(p)``, ``pinned(p)`` (host buffers of p are page-locked), ``segmented(p)`` (the step goes
  through :meth:`HostTier.step_segments` instead of one pass over :meth:`~DeviceTier.states`);
- ``put(st, p, m=None, v=None, res=None)``: make p's storage and fill it with (m, v) (whole packed states, CPU),
  or zeros; ``res``: split's whole residual ``(lo, odd)`` on a tier that keeps it in its files (zeros if None);
- ``states(st, p)``: p's whole (m, v): the live tensors on the RAM tiers (the step updates them in place),
  copies read from the files on the NVMe tier; ``states_and_residual(st, p)`` adds that residual (or None);
- ``step_segments(st, p, compute, new_values)``: ``compute(s0, s1, g, m, v, res)`` for each segment, m and v
  (and the segment's state.Residual ``res`` where the files keep it, else None) updated in place and handed
  back to the tier; for a GPU parameter each segment of ``new_values`` (flat, on the host) is copied into p
  once computed;
- ``end_step()``, ``sync()`` (pending writes done), ``disk_bytes()``, ``close()``;
- the step as one transaction (``transactional`` tiers, the NVMe one): ``begin_step(write_bytes, undo_bytes)``
  before anything changes (checks and reserves the disk space, CapacityError with nothing changed),
  ``undo`` (an :class:`UndoLog` while a step runs: the optimizer saves in it what it is about to change in
  place), ``finish_step()`` (every write landed; a failure here is still undone), then ``commit_step()``,
  or ``abort_step()`` after any error: the weights saved in ``undo`` are restored and the step's files
  deleted, so the states are those before the step. The RAM tiers do nothing there (their states change
  in place).
"""

from __future__ import annotations

import re
import weakref
import zlib
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .. import _metrics as metrics
from ..errors import ConfigError
from . import master as MW
from . import reference_step as R
from .state import PACKED_KEYS, Residual, step_of

SegmentFn = Callable[[int, int, torch.Tensor, R.Packed, R.Packed, Residual | None], None]


UNDO_RAM_BYTES = 256 << 20  # host RAM an NVMe step's undo log may use before it writes to the state disk


class UndoLog:
    """The values a step is about to change in place (weights, masters, residuals, small fp32 states), kept
    until the step commits so that a failed step can be undone.

    Each saved range is copied to host RAM while the log holds less than `ram_bytes`; beyond that it is
    appended to the transaction's undo file on the state disk (NvmeStore.undo_append, space reserved when the
    step began). :meth:`restore` writes every range back, newest first."""

    def __init__(self, store, ram_bytes: int):
        self.store, self.ram_left = store, int(ram_bytes)
        self.entries: list = []
        self.ram_bytes = self.disk_bytes = 0

    def save(self, t: torch.Tensor, s0: int = 0, s1: int | None = None) -> None:
        """Keep elements [s0, s1) of `t` (flat order; a non-contiguous `t` only whole)."""
        if t.is_contiguous():
            target = t.view(-1)
            part = target[s0:s1].detach()
        elif s0 == 0 and s1 is None:
            target, s0, part = t, None, t.detach()
        else:
            raise ValueError("a range of a non-contiguous tensor cannot be saved")
        nbytes = part.numel() * part.element_size()
        if nbytes <= self.ram_left:
            self.ram_left -= nbytes
            self.ram_bytes += nbytes
            self.entries.append((target, s0, s1, part.to("cpu", copy=True)))
            return
        host = part.cpu().contiguous().reshape(-1)
        off = self.store.undo_append(memoryview(host.view(torch.uint8).numpy()))
        self.disk_bytes += nbytes
        self.entries.append((target, s0, s1, (off, part.dtype, part.shape)))

    def restore(self) -> None:
        for target, s0, s1, saved in reversed(self.entries):
            if isinstance(saved, tuple):
                off, dtype, shape = saved
                buf = torch.empty(shape, dtype=dtype)
                self.store.undo_read(off, memoryview(buf.view(-1).view(torch.uint8).numpy()))
                saved = buf
            if s0 is None:
                target.copy_(saved)
            else:
                target[s0:s1].copy_(saved)
        self.entries = []


def undo_bytes(*tensors: torch.Tensor) -> int:
    """Bytes an undo log may write to disk for saving `tensors` whole (rounded to the disk's blocks)."""
    return sum(-(-(t.numel() * t.element_size()) // 4096) * 4096 + 4096 * (2 + t.numel() // R.SEGMENT)
               for t in tensors)


class DeviceTier:
    """States beside the parameter, in ``optimizer.state`` (the ``PACKED_KEYS`` tensors)."""

    name = "same"
    store = None  # the NVMe tier's file store
    transactional = False  # a failed step is undone (the NVMe tier)
    undo: UndoLog | None = None

    def compute_device(self, p) -> torch.device:
        return p.device

    def pinned(self, p) -> bool:
        return False

    def segmented(self, p) -> bool:
        return False

    def put(self, st: dict, p, m: R.Packed | None = None, v: R.Packed | None = None, res=None) -> None:
        if res is not None:
            raise ValueError(f"the {self.name} tier keeps no residual in its storage")
        n, dev = p.numel(), self.compute_device(p)
        new = (*R.empty_packed(n, dev), *R.empty_packed(n, dev, R.v_bits(st["v_format"])))
        if self.pinned(p):
            new = tuple(t.pin_memory() for t in new)
        for k, t, src in zip(PACKED_KEYS, new, (None,) * 6 if m is None else (*m, *v)):
            st[k] = t if src is None else t.copy_(src)

    def states(self, st: dict, p) -> tuple[R.Packed, R.Packed]:
        return R.Packed(*(st[k] for k in PACKED_KEYS[:3])), R.Packed(*(st[k] for k in PACKED_KEYS[3:]))

    def states_and_residual(self, st: dict, p) -> tuple[R.Packed, R.Packed, tuple | None]:
        return (*self.states(st, p), None)

    def step_segments(self, st: dict, p, compute: SegmentFn, new_values: torch.Tensor | None) -> None:
        raise NotImplementedError("the device tier steps a parameter in one pass")

    def step_in_place(self, st: dict, p, compute: SegmentFn, ranges: list[tuple[int, int]] | None = None) -> None:
        """`compute` over runs of p's states held whole beside it (views, updated in place) and its gradient;
        `ranges`: p's segments unless given (a run may span several)."""
        m, v = self.states(st, p)
        g = p.grad.reshape(-1)
        for s0, s1 in R.segment_ranges(p.numel()) if ranges is None else ranges:
            compute(s0, s1, g[s0:s1], R.segment_view(m, s0, s1), R.segment_view(v, s0, s1))

    def end_step(self) -> None:
        pass

    def begin_step(self, write_bytes: int, undo_bytes: int) -> None:
        pass

    def finish_step(self) -> None:
        self.end_step()

    def commit_step(self) -> None:
        pass

    def abort_step(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def disk_bytes(self) -> int:
        return 0

    def close(self, steps: dict[str, int] | None = None) -> None:
        pass


class _RamSegments:
    """Segments of states held whole in RAM: views, updated in place."""

    def __init__(self, m: R.Packed, v: R.Packed):
        self.m, self.v = m, v

    def get(self, s0: int, s1: int) -> tuple[R.Packed, R.Packed, None]:
        return R.segment_view(self.m, s0, s1), R.segment_view(self.v, s0, s1), None

    def put(self, s0: int, s1: int, m: R.Packed, v: R.Packed, res=None) -> None:
        pass

    def abandon(self) -> None:
        pass


class _GradDownload:
    """A GPU parameter's gradient, segment by segment into two pinned buffers on the copy stream: segment s+1
    comes down while s is stepped."""

    def __init__(self, g: torch.Tensor, stream, ranges: list[tuple[int, int]]):
        if g.dtype not in (torch.float32, torch.bfloat16):
            g = g.to(torch.float32)
        stream.wait_stream(torch.cuda.current_stream(g.device))  # after the gradient (and its conversion)
        self.g, self.stream, self.ranges = g, stream, ranges
        self.bufs = [torch.empty(ranges[0][1], dtype=g.dtype, pin_memory=True) for _ in range(min(2, len(ranges)))]
        self.pending = self._fetch(0)

    def _fetch(self, s: int):
        s0, s1 = self.ranges[s]
        with torch.cuda.stream(self.stream):
            self.bufs[s % 2][: s1 - s0].copy_(self.g[s0:s1], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    def get(self, s: int) -> torch.Tensor:
        nxt = self._fetch(s + 1) if s + 1 < len(self.ranges) else None
        with metrics.timer("optim.time.d2h_wait"):
            self.pending.synchronize()
        self.pending = nxt
        s0, s1 = self.ranges[s]
        g = self.bufs[s % 2][: s1 - s0]
        metrics.counter("optim.bytes_d2h").add(g.numel() * g.element_size())
        return g


class HostTier(DeviceTier):
    """States in host RAM, in ``optimizer.state``, pinned for GPU parameters; the CPU runs the step."""

    name = "cpu"

    def __init__(self):
        self._copy_stream = None

    def compute_device(self, p) -> torch.device:
        return torch.device("cpu")

    def pinned(self, p) -> bool:
        return p.is_cuda

    def segmented(self, p) -> bool:
        return p.is_cuda

    def _segments(self, st: dict, p):
        return _RamSegments(*self.states(st, p))

    def step_segments(self, st: dict, p, compute: SegmentFn, new_values: torch.Tensor | None) -> None:
        """Segment by segment on the CPU; for a GPU parameter the gradient comes down and `new_values` goes
        up on a side stream, overlapped with the updates."""
        ranges = R.segment_ranges(p.numel())
        gpu = p.is_cuda
        g_all = p.grad.reshape(-1)
        if gpu:
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(device=p.device)
            cs = self._copy_stream
            grads = _GradDownload(g_all, cs, ranges)
        states = self._segments(st, p)
        try:
            for s, (s0, s1) in enumerate(ranges):
                g = grads.get(s) if gpu else g_all[s0:s1]
                m, v, res = states.get(s0, s1)
                compute(s0, s1, g, m, v, res)
                states.put(s0, s1, m, v, res)
                if gpu:
                    src = new_values[s0:s1]
                    with torch.cuda.stream(cs):
                        p.data.view(-1)[s0:s1].copy_(src, non_blocking=True)
                    metrics.counter("optim.bytes_h2d").add(src.numel() * src.element_size())
        except BaseException:
            states.abandon()
            raise
        finally:
            if gpu:
                torch.cuda.current_stream(p.device).wait_stream(cs)


class _FileSegments:
    """Segments of states in the NVMe store: segment s+1 is read while s is updated, s written behind (into the
    step's generation, with the tensor's new step count). Split's residual, where the files keep it, travels
    with its segment's states."""

    def __init__(self, store, key: str, n: int, v_format: str, step: int):
        self.store, self.key, self.n, self.v_format, self.step = store, key, n, v_format, step
        self.held: R.Packed | None = None  # m of the segment being updated (its buffer goes back with the write)
        self.reading = self._read(0)

    def _read(self, s0: int):
        return self.store.read_async(self.key, s0 // R.SEGMENT, min(self.n, s0 + R.SEGMENT) - s0, self.v_format)

    def get(self, s0: int, s1: int) -> tuple[R.Packed, R.Packed, Residual | None]:
        cur, self.reading = self.reading, (self._read(s1) if s1 < self.n else None)
        with metrics.timer("optim.time.nvme_read_wait"):
            m, v, res = cur.result()
        self.held = m
        return m, v, res

    def put(self, s0: int, s1: int, m: R.Packed, v: R.Packed, res: Residual | None = None) -> None:
        self.held = None
        self.store.write_async(self.key, s0 // R.SEGMENT, s1 - s0, self.v_format, self.step, m, v, res)

    def abandon(self) -> None:
        """After an error: wait for the read ahead and hand back the buffers of segments that will not be
        written."""
        fut, self.reading = self.reading, None
        if fut is not None:
            try:
                self.store.release(fut.result()[0])
            except BaseException:
                pass
        if self.held is not None:
            self.store.release(self.held)
            self.held = None


class NvmeTier(HostTier):
    """Packed states in files of an NvmeStore (optim/nvme.py), named by each tensor's key; only ``step`` and
    ``master`` stay in ``optimizer.state``. A store made with ``residuals`` keeps split's residual of each
    tensor in its files too (NvmeOptions' ``master_device="nvme"``): a step's new residual goes to the step's
    generation with its states, so, like them, it needs no undo.

    A step is one store transaction: the space of all its files (and of the undo log beyond
    ``undo_ram_bytes``, default UNDO_RAM_BYTES) is reserved first, its segments go to a new generation, and
    ``abort_step`` puts back what the optimizer saved in ``undo`` and drops the generation. A fresh tensor's
    states are zeros without a file until its first step writes one.

    Keys: ``tensor_key(t)`` when given and not None (made a safe file name), else ``t<n>`` in order of first
    use; given once and kept while the tensor lives. `has_states(t)`: whether t holds states in the optimizer
    (two live tensors with states may not share a key; one without hands its key over).
    """

    name = "nvme"
    transactional = True

    def __init__(self, store, tensor_key: Callable | None, has_states: Callable[[torch.Tensor], bool]):
        super().__init__()
        self.undo_ram_bytes = UNDO_RAM_BYTES
        self.store = store
        self._tensor_key = tensor_key
        self._has_states = has_states
        self.keys = WeakIdKeyDictionary()  # tensor -> key of its files
        self._owner: dict[str, weakref.ref] = {}
        self._counter = 0

    def segmented(self, p) -> bool:
        return True

    def key(self, p) -> str:
        """The key of p's files: given once, kept while p lives (see StepOptions' ``tensor_key``)."""
        key = self.keys.get(p)
        if key is not None:
            return key
        raw = self._tensor_key(p) if self._tensor_key is not None else None
        if raw is None:
            while True:
                key = f"t{self._counter:05d}"
                self._counter += 1
                holder = self._owner.get(key)
                if holder is None or holder() is None:
                    break
        else:
            raw = str(raw)
            safe = re.sub(r"[^A-Za-z0-9_-]", "-", raw)[:100]
            key = "k" + safe + ("" if safe == raw else f"-{zlib.crc32(raw.encode()):08x}")
            holder = self._owner.get(key)
            other = holder() if holder is not None else None
            if other is not None and other is not p:
                if self._has_states(other):
                    raise ConfigError("step_options.tensor_key", raw, "a key no other tensor with states in this "
                                      "optimizer has",
                                      f"two tensors ({tuple(other.shape)} and {tuple(p.shape)}) would share NVMe "
                                      "files")
                self.keys.pop(other, None)  # a tensor without states hands its key over (re-created tensor)
        self.keys[p] = key
        self._owner[key] = weakref.ref(p)
        return key

    def put(self, st: dict, p, m: R.Packed | None = None, v: R.Packed | None = None, res=None) -> None:
        """p's states: zeros (a fresh tensor: no file until its first step writes one) or (m, v), and in a store
        that keeps residuals split's `res` (``(lo, odd)``, whole; None: zeros), written as a transaction of their
        own (or inside the open step's)."""
        from .nvme import Record, tensor_disk_bytes

        key, v_format, n = self.key(p), st["v_format"], p.numel()
        step = step_of(st.get("step", 0))
        store = self.store
        if res is not None and not store.residuals:
            raise ValueError("this NVMe store keeps no residuals in its files")
        if m is None and res is None:
            if not store.in_transaction:
                store.remove(key)  # a dead tensor's files under a key now reused
            store.set_record(key, Record(0, step, n, v_format))
            return
        if m is None:  # a residual to keep beside zero states
            m, v = R.empty_packed(n, "cpu"), R.empty_packed(n, "cpu", R.v_bits(v_format))
        own = not store.in_transaction
        if own:
            store.begin(tensor_disk_bytes(n, store.residuals, R.v_bits(v_format)), f"tensor {key}")
        try:
            for s, (s0, s1) in enumerate(R.segment_ranges(n)):
                r = None
                if store.residuals:
                    r = Residual.zeros(s1 - s0)
                    if res is not None:
                        r.lo.copy_(res[0].reshape(-1)[s0:s1])
                        r.set_odd(MW.odd_in(res[1], s0, s1))
                store.write(key, s, s1 - s0, v_format, step, R.segment_view(m, s0, s1), R.segment_view(v, s0, s1),
                            r)
            store.set_record(key, Record(store.generation, step, n, v_format))
            if own:
                store.commit()
        except BaseException:
            if own:
                store.abort()
            raise

    def states(self, st: dict, p) -> tuple[R.Packed, R.Packed]:
        return self.states_and_residual(st, p)[:2]

    def states_and_residual(self, st: dict, p) -> tuple[R.Packed, R.Packed, tuple | None]:
        """p's whole (m, v) and, where the files keep it, split's whole residual ``(lo, odd)`` (else None)."""
        key, v_format = self.key(p), st["v_format"]
        ranges = R.segment_ranges(p.numel())
        parts = [self.store.read(key, s, s1 - s0, v_format) for s, (s0, s1) in enumerate(ranges)]
        m, v = (R.Packed(*(torch.cat([pt[j][i] for pt in parts]) for i in range(3))) for j in range(2))
        if not self.store.residuals:
            return m, v, None
        lo = torch.cat([pt[2].lo for pt in parts])
        odd = torch.cat([pt[2].odd() + s0 for pt, (s0, _) in zip(parts, ranges)])
        return m, v, (lo, odd)

    def _segments(self, st: dict, p):
        return _FileSegments(self.store, self.key(p), p.numel(), st["v_format"], step_of(st["step"]))

    def step_segments(self, st: dict, p, compute: SegmentFn, new_values: torch.Tensor | None) -> None:
        """As the host tier's, reading p's committed states and writing the new ones into the step's
        generation, which becomes p's record (switched in by commit_step)."""
        from .nvme import Record

        if not self.store.in_transaction:
            raise RuntimeError("the NVMe tier steps inside a transaction (begin_step)")
        super().step_segments(st, p, compute, new_values)
        self.store.set_record(self.key(p), Record(self.store.generation, step_of(st["step"]), p.numel(),
                                                  st["v_format"]))

    # ---- the step as a transaction ----------------------------------------------------------------------

    def begin_step(self, write_bytes: int, undo_bytes: int) -> None:
        """Check and reserve the disk space of the whole step: `write_bytes` of state files, and what of
        `undo_bytes` the undo log cannot keep in RAM (CapacityError, with nothing changed)."""
        spill = max(0, int(undo_bytes) - self.undo_ram_bytes)
        self.store.begin(int(write_bytes) + (spill + 4096 * 64 if spill else 0), "this step", undo_file=spill > 0)
        self.undo = UndoLog(self.store, self.undo_ram_bytes)

    def finish_step(self) -> None:
        with metrics.timer("optim.time.nvme_write_wait"):
            self.store.wait_writes()

    def commit_step(self) -> None:
        self.undo = None
        self.store.commit()

    def abort_step(self) -> None:
        """Undo the open step: the weights saved in the undo log back, the step's files deleted, the records
        restored."""
        undo, self.undo = self.undo, None
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # copies of new values into GPU parameters are done before undoing them
            if undo is not None:
                undo.restore()
        finally:
            self.store.abort()

    def end_step(self) -> None:
        with metrics.timer("optim.time.nvme_write_wait"):
            self.sync()

    def sync(self) -> None:
        if self.store is not None:
            self.store.wait_writes()

    def disk_bytes(self) -> int:
        return 0 if self.store is None else self.store.bytes_on_disk()

    def close(self, steps: dict[str, int] | None = None) -> None:
        """Release the store's files and threads (a kept folder records `steps`: key -> step count)."""
        if self.store is not None:
            store, self.store = self.store, None
            store.close(steps=steps)


def _keep_from_env(nvme_keep):
    if nvme_keep is not None:
        if not isinstance(nvme_keep, bool):
            raise ConfigError("nvme.keep", nvme_keep, "True, False or None (None: the FP4OFFLOAD_NVME_KEEP "
                              "environment variable, default False)")
        return nvme_keep
    from fp4offload import _switches as switches

    return switches.get("FP4OFFLOAD_NVME_KEEP")


def make_tier(state_device: str, *, nvme_path=None, nvme_threads: int = 4, nvme_reserve_bytes: int = 0,
              nvme_io: str = "auto", tensor_key: Callable | None = None,
              has_states: Callable[[torch.Tensor], bool] = lambda t: False, nvme_keep: bool | None = None,
              residuals: bool = False) -> DeviceTier:
    """The tier of ``state_device`` (the NVMe arguments as NvmeOptions' fields; `nvme_keep` None reads
    FP4OFFLOAD_NVME_KEEP; `residuals`: the NVMe files keep split's residuals, NvmeOptions'
    ``master_device="nvme"``)."""
    if state_device == "same":
        return DeviceTier()
    if state_device == "cpu":
        return HostTier()
    from .nvme import NvmeStore

    store = NvmeStore(nvme_path, threads=nvme_threads, reserve_bytes=nvme_reserve_bytes, io=nvme_io,
                      keep=_keep_from_env(nvme_keep), residuals=residuals)
    return NvmeTier(store, tensor_key, has_states)
