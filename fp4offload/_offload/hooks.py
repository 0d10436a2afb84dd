"""The activation offloader: saved-tensor hooks that compress what autograd keeps and move it away.

``pack`` runs when autograd saves a tensor for backward. Parameters (and views and casts of them),
integer and bool tensors, tensors under ``min_numel``, outputs of the ops in ``skip_outputs_of``
(log-softmax), non-dense views and tensors saved while a backward pass runs (checkpoint recomputation)
are handed back untouched (``shield_hooks`` does the same for excluded modules and norm layers). Every
other tensor is compressed (stochastic rounding for the 4-bit formats by default; ``fmt="none"``:
taken as is) and stored:

- ``device="cpu"``: in a block of the host slab pool (pinned on CUDA machines). On CUDA the compress
  and the device-to-host copy run on a side stream; the compressed device copy is dropped right after
  the copy is queued (the caching allocator only reuses it on that stream, after the copy), and the
  source tensor is recorded on the side stream so its memory is not reused before the compress read it.
  Past ``max_host_bytes`` the compressed tensor stays on its device and ``overflow_tensors`` counts it.
- ``device="nvme"``: in a checksummed file written by an IO thread (staged through the pool on CUDA).
- ``device="same"``: compressed where it is.

Non-finite values: a 4-bit or MX block holding Inf or NaN decodes to NaN, so one -inf would silently spoil
its neighbours (and a clamp-like backward would zero their gradients). On the CPU, where the codec's count is
free, such a tensor is handed back untouched instead (counted as passed through for ``"nonfinite"``): exact,
at its full size. On CUDA the count is not read during forward (that would wait for the device at every
saved tensor); it comes down with the packed bytes, and unpacking a tensor that held any raises
NonFiniteError naming its shape and the count, so backward fails loudly rather than computing on NaN
blocks. Keep such tensors out with ``fmt="none"``/``"bf16"`` or an excluded module.

Autograd keeps a small ``Saved`` handle instead. ``unpack`` runs when backward needs the tensor: it
first starts bringing back the next ``prefetch`` tensors in reverse order of saving (host-to-device
copies on the side stream, file reads on the IO threads), then decodes this one. A tensor that
several operations saved is stored once and decoded once per backward pass. Stored copies live as
long as autograd holds a handle to them: after a backward without ``retain_graph`` autograd drops the
handles and the memory (or file) goes back at once; with ``retain_graph=True`` they stay, so a second
backward works. A handle whose copy was released (the context closed on an exception, ``close()``)
raises SavedTensorReleasedError instead of decoding bytes that now belong to someone else.
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import deque

import torch

from ..errors import NonFiniteError
from .errors import SavedTensorReleasedError
from .entries import Entry, Saved
from .nvme_store import ActivationFileStore
from .ops import classify as op_class
from .ops import scope as op_scope
from .packing import decode, encode_counted, read_parts, write_parts
from .pinned_pool import HostSlabPool, shared_pool
from .policy import ActivationPolicy
from .selection import KeepAsIs, alias, from_parameter, skip_reason, unpack_alias
from .stats import ActivationStats

_SALTS = itertools.count(1)


class _Hooks:
    """saved_tensors_hooks entered together with the op classes' scope (left in the reverse order)."""

    __slots__ = ("_hooks", "_ops")

    def __init__(self, hooks):
        self._hooks, self._ops = hooks, op_scope()

    def __enter__(self):
        self._ops.__enter__()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self._hooks.__exit__(*exc)
        finally:
            self._ops.__exit__(*exc)
        return False

class ActivationOffloader:
    """Pack and unpack hooks with their store, prefetcher and counters.

    Use it through ``offload_activations`` (a context manager) or ``wrap_modules``; ``hooks(fmt)``
    returns a ``torch.autograd.graph.saved_tensors_hooks`` bound to this offloader and a format.

    Args:
        policy: the ActivationPolicy.
        pool: host slab pool to use (default: the process-wide pool for the policy's settings).
    """

    def __init__(self, policy: ActivationPolicy | None = None, *, pool: HostSlabPool | None = None):
        self.policy = policy or ActivationPolicy()
        self.stats = ActivationStats()
        self._pool = pool
        self._nvme = (ActivationFileStore(self.policy.nvme_path, self.policy.io_workers)
                      if self.policy.device == "nvme" else None)
        self._lock = threading.Lock()
        self._drops: deque = deque()
        self._entries: dict[int, Entry] = {}
        self._order: list[Entry | None] = []
        self._dedup: dict[tuple, Entry] = {}
        # bases of the tensors kept as they are, while they live: one kept by several ops holds its bytes once
        self._kept = weakref.WeakValueDictionary()
        self._next_id = 0
        self._salt = next(_SALTS)  # new random bits for every offloader (every step), reproducible per process
        self._sample = 0
        self._sealed = False
        self._closed: str | None = None
        self._finished = False
        self._streams: dict[int, object] = {}
        self._hook_fns: dict[str, object] = {}

    # -- public -----------------------------------------------------------------------------------
    def hooks(self, fmt: str | None = None) -> _Hooks:
        """A context that stores what autograd saves in `fmt` (default: the policy's): saved_tensors_hooks, and
        the op classes (fp4offload._offload.ops) that give attention's and norms' tensors their own forms."""
        fmt = fmt or self.policy.format
        pack = self._hook_fns.get(fmt)
        if pack is None:
            self_ref = weakref.ref(self)

            def pack(t, _fmt=fmt, _self=self_ref):
                off = _self()
                return alias(t) if off is None else off.pack(t, _fmt)

            pack._fp4offload_hook = True
            self._hook_fns[fmt] = pack
        return _Hooks(torch.autograd.graph.saved_tensors_hooks(pack, self.unpack))

    def shield_hooks(self, reason: str) -> torch.autograd.graph.saved_tensors_hooks:
        """A saved_tensors_hooks context that leaves every tensor alone (counted as passed through for `reason`).

        Used around excluded modules and normalization layers inside an offloaded region (the innermost
        saved-tensor hooks win).
        """
        fn = self._hook_fns.get("shield:" + reason)
        if fn is None:
            self_ref = weakref.ref(self)

            def fn(t, _reason=reason, _self=self_ref):
                off = _self()
                if off is not None and type(t) is torch.Tensor and not from_parameter(t):
                    off.stats.skip(_reason, off.kept_bytes(t))
                return alias(t)

            fn._fp4offload_hook = True
            self._hook_fns["shield:" + reason] = fn
        return torch.autograd.graph.saved_tensors_hooks(fn, unpack_alias)

    @property
    def pool(self) -> HostSlabPool:
        if self._pool is None:
            self._pool = shared_pool(self.policy.max_host_bytes, self.policy.slab_bytes)
        return self._pool

    @property
    def nvme_folder(self):
        """The private folder of this offloader's files (``device="nvme"``), else None."""
        return None if self._nvme is None else self._nvme.folder

    @property
    def live_entries(self) -> int:
        return len(self._entries)

    def snapshot(self) -> dict:
        """Counters (see ActivationStats), plus the pool's and the policy's settings."""
        out = self.stats.snapshot()
        out["live_entries"] = len(self._entries)
        if self._pool is not None:
            out["pool"] = self._pool.snapshot()
        out["format"], out["device"] = self.policy.format, self.policy.device
        return out

    def synchronize(self) -> None:
        """Wait until every queued copy and file write is done (for tests and measurements)."""
        with self._lock:
            entries = list(self._entries.values())
        for e in entries:
            if e.future is not None:
                try:
                    e.future.result()
                except Exception:
                    pass
        if torch.cuda.is_available():
            for s in self._streams.values():
                s.synchronize()

    def seal(self) -> None:
        """No more tensors will be packed; the files folder goes once the last stored tensor is released."""
        with self._lock:
            self._sealed = True
            done = not self._entries
        if done:
            self._finish()

    def close(self, why: str = "the offload context was closed before backward ran") -> None:
        """Release every stored tensor now (backward through what was saved then raises), remove the files."""
        with self._lock:
            self._sealed = True
            self._closed = why
            for e in list(self._entries.values()):
                self._release(e, why)
        self._finish()

    def prefetch_tail(self) -> None:
        """Start bringing back the last tensors saved, which backward needs first."""
        with self._lock:
            self._prefetch_before(len(self._order))

    # -- pack -------------------------------------------------------------------------------------
    def _skip_reason(self, t: torch.Tensor) -> str | None:
        reason = skip_reason(t, self.policy)
        if reason is None and self._closed is not None:
            return "closed"
        return reason

    def kept_bytes(self, t: torch.Tensor) -> int:
        """The bytes a tensor kept as it is adds: 0 when a live tensor of the same base was kept already (an op's
        input that another op saved too), else its own."""
        base = t._base if t._base is not None else t
        try:
            if self._kept.get(id(base)) is base:
                return 0
            self._kept[id(base)] = base
        except TypeError:  # a tensor subclass that takes no weak reference: counted each time
            pass
        return t.numel() * t.element_size()

    def pack(self, t: torch.Tensor, fmt: str | None = None):
        """The pack hook: returns `t` itself, or a handle to its stored copy."""
        fmt = fmt or self.policy.format
        reason = self._skip_reason(t)
        if reason is None:
            cls = op_class(t)  # saved by an op whose backward recombines it with a statistic
            if cls is not None:
                fmt = self.policy.class_format(cls, fmt)
                if fmt == "keep":
                    reason = cls
        if reason is not None:
            self.stats.skip(reason, self.kept_bytes(t))
            return alias(t)
        t0 = time.perf_counter()
        with self._lock:
            try:
                h = self._pack_locked(t, fmt)
            except KeepAsIs:  # Inf/NaN on the CPU: kept exact (see the module docstring)
                h = None
        if h is None:
            self.stats.skip("nonfinite", t.numel() * t.element_size())
            self._drain()
            return alias(t)
        self._drain()
        self.stats.add(pack_seconds=time.perf_counter() - t0, tensors_packed=1)
        return h

    def _handle(self, e: Entry, shape: torch.Size) -> Saved:
        h = Saved(e, self, None if shape == e.layout.shape else shape)
        e.handles.add(id(h))
        return h

    def _pack_locked(self, t: torch.Tensor, fmt: str) -> Saved:
        base = t._base if t._base is not None else t
        key = None
        if self.policy.dedup:
            # contiguous views of the same bytes (x and x.view(-1, d), as linear layers save them) are one
            # entry: the 1x16 and 1x32 blocks run over the flattened bytes, so the copy is the same
            if t.is_contiguous():
                key = (id(base), t.storage_offset(), t.numel(), t.dtype, fmt)
            else:
                key = (id(base), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, fmt)
            e = self._dedup.get(key)
            if e is not None and not e.released and e.base_ref() is base and e.version == t._version:
                self.stats.add(tensors_deduped=1)
                return self._handle(e, t.shape)
        e = Entry(self._next_id, t.device, t.numel() * t.element_size())
        self._next_id += 1
        with torch.no_grad(), torch.autocast(t.device.type, enabled=False):
            if self.policy.device == "same":
                parts, e.layout = self._encode(t, fmt, e)
                e.parts = parts
                self._kept_on_device(e, overflow=False)
            elif t.device.type == "cuda":
                self._store_cuda(e, t, fmt)
            else:
                self._store_cpu(e, t, fmt)
        self.stats.add(tensors_stored=1, bytes_in=e.nbytes_in, bytes_out=e.layout.nbytes)
        self.stats.gauge("entries", 1)
        if key is not None:
            e.key, e.base_ref, e.version = key, weakref.ref(base), t._version
            self._dedup[key] = e
        e.pos = len(self._order)
        self._order.append(e)
        self._entries[e.id] = e
        return self._handle(e, t.shape)

    def _encode(self, t: torch.Tensor, fmt: str, e: Entry | None = None):
        """Compress `t`. A non-finite count known now (CPU) raises KeepAsIs; one on the device goes to `e`
        (copied to the host behind the encode, on the current stream; _materialize reads it)."""
        salt = self._salt if self.policy.seed is None else self.policy.seed
        parts, layout, count = encode_counted(t, fmt, self.policy.stochastic(fmt),
                                              seed=salt * 1_000_003 + self._next_id)
        if torch.is_tensor(count) and count.device.type == "cpu":
            count = int(count)
        if torch.is_tensor(count):  # CUDA: down to pinned memory behind the encode, read at unpack (no wait now)
            if e is not None:
                cnt = torch.empty((), dtype=torch.int64, pin_memory=True)
                cnt.copy_(count, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(count.device))
                e.nonfinite = (cnt, ev)
        elif count:
            raise KeepAsIs()
        every = self.policy.error_sample_every
        if fmt != "none" and every:
            self._sample += 1
            if (self._sample - 1) % every == 0:
                x = t.detach().float()
                err = decode(parts, layout, copy=False).float() - x
                self.stats.error(err.norm() / x.norm().clamp_min(torch.finfo(torch.float32).tiny))
        return parts, layout

    def _kept_on_device(self, e: Entry, overflow: bool) -> None:
        e.where = "device"
        n = e.layout.nbytes
        self.stats.add(bytes_on_device=n)
        if overflow:
            self.stats.add(overflow_tensors=1, overflow_bytes=n)
        self.stats.gauge("device_bytes", n)

    def _store_cpu(self, e: Entry, t: torch.Tensor, fmt: str) -> None:
        parts, e.layout = self._encode(t, fmt)
        lay = e.layout
        if self.policy.device == "cpu":
            blk = self.pool.alloc(lay.buffer_bytes)
            if blk is None:
                e.parts = parts
                self._kept_on_device(e, overflow=True)
                return
            write_parts(parts, lay, blk.view())
            e.block, e.where = blk, "host"
            self.stats.add(bytes_to_host=lay.nbytes)
            self.stats.gauge("host_bytes", lay.buffer_bytes)
        else:
            raw = parts.get("raw")
            if raw is not None and raw.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                parts = {"raw": raw.clone()}  # written later by an IO thread: take a copy now
            e.where = "nvme"
            e.future = self._nvme.write(e.id, {"kind": "activation"}, lambda p=parts: p)
            self.stats.add(bytes_to_nvme=lay.nbytes)
            self.stats.gauge("nvme_bytes", lay.nbytes)

    def _side_stream(self, device: torch.device):
        idx = device.index if device.index is not None else torch.cuda.current_device()
        s = self._streams.get(idx)
        if s is None:
            s = self._streams[idx] = torch.cuda.Stream(device=idx)
        return s

    def _store_cuda(self, e: Entry, t: torch.Tensor, fmt: str) -> None:
        side = self._side_stream(t.device)
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            parts, e.layout = self._encode(t, fmt, e)
            lay = e.layout
            blk = self.pool.alloc(lay.buffer_bytes)
            if blk is not None:
                write_parts(parts, lay, blk.view(), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
        t.record_stream(side)  # made on the compute stream, read on the side stream
        if blk is None:
            if self.policy.device == "nvme":  # no staging room: copy synchronously, then write
                with torch.cuda.stream(side):
                    cpu_parts = {k: v.to("cpu") for k, v in parts.items()}
                e.where = "nvme"
                e.future = self._nvme.write(e.id, {"kind": "activation"}, lambda p=cpu_parts: p)
                self.stats.add(bytes_to_nvme=lay.nbytes)
                self.stats.gauge("nvme_bytes", lay.nbytes)
                return
            e.parts, e.ready = parts, ev
            self._kept_on_device(e, overflow=True)
            return
        # the compressed device copy is dropped here: its memory is only reused on the side stream,
        # which runs after the copy that reads it
        if self.policy.device == "cpu":
            e.block, e.ready, e.where = blk, ev, "host"
            self.stats.add(bytes_to_host=lay.nbytes)
            self.stats.gauge("host_bytes", lay.buffer_bytes)
        else:
            pool = self.pool

            def staged(ev=ev, blk=blk, lay=lay):
                ev.synchronize()
                return read_parts(blk.view(), lay)

            e.where = "nvme"
            e.future = self._nvme.write(e.id, {"kind": "activation"}, staged, done=lambda: pool.free(blk))
            self.stats.add(bytes_to_host=lay.nbytes, bytes_to_nvme=lay.nbytes)
            self.stats.gauge("nvme_bytes", lay.nbytes)

    # -- unpack -----------------------------------------------------------------------------------
    def unpack(self, h):
        """The unpack hook: the tensor back, on its device, with its dtype, shape and strides."""
        if not isinstance(h, Saved):
            return h
        t0 = time.perf_counter()
        with self._lock:
            e = h.entry
            if e.released:
                raise SavedTensorReleasedError(e.layout.shape, e.layout.dtype, e.why)
            hid = id(h)
            if e.cache is not None:
                out = e.cache.detach()  # a fresh alias: autograd may attach its node to what it gets
                e.waiting.discard(hid)
                if not e.waiting:
                    e.cache = None
                self.stats.add(decode_cache_hits=1)
            else:
                self._prefetch_before(e.pos)
                with torch.no_grad(), torch.autocast(e.device.type, enabled=False):
                    out = self._materialize(e)
                waiting = e.handles - {hid}
                if waiting:  # the cache must not be the object autograd gets (that would make a cycle)
                    e.cache, e.waiting = out.detach(), waiting
        self._drain()
        self.stats.add(unpack_seconds=time.perf_counter() - t0, unpacks=1)
        return out if h.shape is None else out.view(h.shape)

    def _fetch(self, e: Entry):
        """Start bringing `e` back: (device buffer, event) for host entries on CUDA, a Future for files."""
        if e.where == "nvme":
            return self._nvme.read(e.id, e.future)
        side = self._side_stream(e.device)
        with torch.cuda.stream(side):
            buf = torch.empty(e.layout.buffer_bytes, dtype=torch.uint8, device=e.device)
            buf.copy_(e.block.view(), non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
        return buf, ev

    def _prefetch_before(self, pos: int) -> None:
        depth = self.policy.prefetch
        i, n, scanned = pos - 1, 0, 0
        while depth and i >= 0 and n < depth and scanned < 8 * depth + 16:
            e = self._order[i] if i < len(self._order) else None
            i -= 1
            scanned += 1
            if e is None or e.released:
                continue
            if e.where == "nvme" or (e.where == "host" and e.device.type == "cuda"):
                n += 1
                if e.fetched is None and e.cache is None:
                    e.fetched = self._fetch(e)
                    self.stats.add(prefetches=1)

    def _materialize(self, e: Entry) -> torch.Tensor:
        lay = e.layout
        if e.nonfinite is not None:  # CUDA: how many Inf/NaN the codec met, known only now
            cnt, ev = e.nonfinite
            ev.synchronize()  # recorded right after the encode in forward: long done
            n = int(cnt)
            if n:
                raise NonFiniteError(f"saved activation of shape {tuple(lay.shape)} (its {lay.fmt} blocks holding "
                                     "them decode to NaN; keep it with fmt='none' or 'bf16', or exclude its module)",
                                     n, lay.shape.numel())
            e.nonfinite = None
        if e.where == "device":
            if e.ready is not None:  # made on the side stream
                cur = torch.cuda.current_stream(e.device)
                cur.wait_event(e.ready)
                for p in e.parts.values():
                    p.record_stream(cur)
                e.ready = None
            return decode(e.parts, lay, copy=False)
        fetched, e.fetched = e.fetched, None
        if fetched is not None:
            self.stats.add(prefetch_hits=1)
        if e.where == "host":
            self.stats.add(bytes_from_host=lay.nbytes)
            if e.device.type == "cuda":
                buf, ev = fetched if fetched is not None else self._fetch(e)
                cur = torch.cuda.current_stream(e.device)
                cur.wait_event(ev)
                buf.record_stream(cur)
                return decode(read_parts(buf, lay), lay, copy=False)
            return decode(read_parts(e.block.view(), lay), lay, copy=True)
        fut = fetched if fetched is not None else self._fetch(e)
        t0 = time.perf_counter()
        tensors = fut.result()
        self.stats.add(wait_seconds=time.perf_counter() - t0, bytes_from_nvme=lay.nbytes)
        parts = {name: tensors[name] for name, *_ in lay.spans}
        if e.device.type == "cuda":
            parts = {k: v.to(e.device) for k, v in parts.items()}
        return decode(parts, lay, copy=False)

    # -- release ----------------------------------------------------------------------------------
    def _drop(self, e: Entry, hid: int) -> None:
        self._drops.append((e, hid))
        self._drain()

    def _drain(self) -> None:
        finish = False
        while self._drops:
            if not self._lock.acquire(blocking=False):
                return  # the thread holding the lock drains after it lets go
            try:
                while self._drops:
                    e, hid = self._drops.popleft()
                    e.handles.discard(hid)
                    e.waiting.discard(hid)
                    if not e.waiting:
                        e.cache = None
                    if not e.handles and not e.released:
                        self._release(e, "autograd released it")
                finish = self._sealed and not self._entries
            finally:
                self._lock.release()
        if finish:
            self._finish()

    def _release(self, e: Entry, why: str) -> None:
        e.released, e.why = True, why
        lay = e.layout
        if e.block is not None:
            if e.ready is not None:
                e.ready.synchronize()  # the device-to-host copy into the block is done
            self.pool.free(e.block)
            self.stats.gauge("host_bytes", -lay.buffer_bytes)
        elif e.where == "nvme":
            self._nvme.delete(e.id, e.future)
            self.stats.gauge("nvme_bytes", -lay.nbytes)
        elif e.where == "device":
            self.stats.gauge("device_bytes", -lay.nbytes)
        e.parts = e.cache = e.fetched = e.ready = e.block = e.nonfinite = None
        if e.key is not None and self._dedup.get(e.key) is e:
            del self._dedup[e.key]
        if 0 <= e.pos < len(self._order) and self._order[e.pos] is e:
            self._order[e.pos] = None
        self._entries.pop(e.id, None)
        self.stats.gauge("entries", -1)
        if not self._entries:
            self._order.clear()

    def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        if self._nvme is not None:
            self._nvme.close()
