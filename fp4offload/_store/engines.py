"""The store's I/O: the engines that read and write one container file, and the worker threads that run those
reads ahead and writes behind.

A client asks for file s+1 while it works on file s and hands file s back to be written while it works on s+1;
``threads`` workers (:class:`Workers`) run those requests. What a worker does with the bytes depends on the engine
(``io``), each with the same small face (``write``, ``read``, ``release``, ``close``, ``name`` and ``bufs``):

- ``"threads"`` (:class:`ThreadEngine`): buffered reads and writes through the container module
  (read_container/write_container).
- ``"aio"`` (:class:`AioEngine`): DeepSpeed's async_io handle (libaio, O_DIRECT; one handle per worker) on files in
  the same container laid out for direct I/O, read into and written from page-locked buffers that a client may
  update in place (see aio.py). A write preallocates its temporary file, so a full disk fails there, before
  any byte is written. An engine with a `bounded` buffer pool reads and writes a file through the container
  module when no page-locked buffer can be had for it.
- ``"auto"`` (default): aio when DeepSpeed's async_io op loads, the page-locked memory can be had and a probe
  write/read works in the folder, else threads, with one warning saying why (:func:`start_engine`).

With ``max_pending_writes`` (FP4AdamW's store: ``2 * threads``) a write waits for the oldest beyond that, so the
memory held by write-behind stays a few files however much is written.
"""

from __future__ import annotations

import logging
import threading
import uuid
import warnings
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from ..errors import ConfigError
from ..formats.container import read_container, write_container
from .aio import NoLockedBuffer, aio_op, probe, read_file, write_file
from .pinned import LockedPool, can_lock

log = logging.getLogger("fp4offload._store")


class ThreadEngine:
    """Buffered reads and writes of container files through the container module."""

    name = "threads"
    bufs = None  # no page-locked buffers

    def write(self, path: Path, meta: dict, tensors: dict[str, torch.Tensor], fsync: bool) -> int:
        """Write a file (to a temporary name, then renamed; mode 0600); returns its size."""
        return write_container(path, meta, tensors, fsync=fsync)

    def read(self, path: Path, copy: bool) -> tuple[dict, dict[str, torch.Tensor]]:
        """(meta, tensors) of a file; the tensors are the caller's."""
        return read_container(path)

    def release(self, tensors: dict[str, torch.Tensor]) -> None:
        pass

    def close(self) -> None:
        pass


class AioEngine:
    """Reads and writes of container files through DeepSpeed's async_io op `op` (one handle per thread), in
    page-locked buffers (`bufs`; `max_idle_bytes` and `bounded` as LockedPool's)."""

    name = "aio"

    def __init__(self, op, block_size: int, queue_depth: int, *, max_idle_bytes: int | None = None,
                 bounded: bool = False):
        self._op = op
        self._args = (int(block_size), int(queue_depth), False, True, 1)
        self._local = threading.local()
        self.bufs = LockedPool(self.handle(), max_idle_bytes=max_idle_bytes, bounded=bounded)

    def handle(self):
        """This thread's aio handle."""
        h = getattr(self._local, "h", None)
        if h is None:
            h = self._local.h = self._op.aio_handle(*self._args)
        return h

    def write(self, path: Path, meta: dict, tensors: dict[str, torch.Tensor], fsync: bool) -> int:
        """Write a file in the direct-I/O layout (a preallocated temporary, then renamed); returns its size.
        Tensors that are views of a buffer read() handed out are written from it as they are."""
        tmp = path.with_name(f"{path.name}.tmp{uuid.uuid4().hex[:12]}")
        host = {k: t.detach().contiguous().cpu() for k, t in tensors.items()}
        try:
            return write_file(self.handle(), self.bufs, path, tmp, meta, host, fsync)
        except NoLockedBuffer:
            return write_container(path, meta, host, fsync=fsync)

    def read(self, path: Path, copy: bool) -> tuple[dict, dict[str, torch.Tensor]]:
        """(meta, tensors) of a file. Without `copy` the tensors of a direct-I/O file are views of a page-locked
        buffer that stays taken until it is written back or released; a file of another size is read by
        read_container."""
        got = read_file(self.handle(), self.bufs, path, copy)
        return got if got is not None else read_container(path)

    def release(self, tensors: dict[str, torch.Tensor]) -> None:
        """Hand back the buffer that `tensors` (of one read) lie in, if any."""
        if tensors:
            buf = self.bufs.owner(next(iter(tensors.values())))
            if buf is not None:
                self.bufs.put(buf)

    def close(self) -> None:
        self.bufs.close()


def _start_aio(folder: Path, lock_bytes: int, block_size: int, queue_depth: int, max_idle_bytes: int | None,
               bounded: bool) -> tuple[AioEngine | None, str | None]:
    """(the aio engine, None) when the op loads, `lock_bytes` of page-locked memory can be had and a probe write
    and read in `folder` work; else (None, why not)."""
    op, why = aio_op()
    if op is None:
        return None, why
    why = can_lock(lock_bytes)
    if why is not None:
        return None, why
    engine = AioEngine(op, block_size, queue_depth, max_idle_bytes=max_idle_bytes, bounded=bounded)
    try:
        why = probe(engine.handle(), engine.bufs, folder)
    except BaseException:
        engine.close()
        raise
    if why is not None:
        engine.close()
        return None, why
    return engine, None


def start_engine(io: str, folder: Path, lock_bytes: int, block_size: int = 1 << 20, queue_depth: int = 8, *,
                 what: str = "the NVMe store", logger: logging.Logger | None = None, max_idle_bytes: int | None = None,
                 bounded: bool = False) -> tuple[ThreadEngine | AioEngine, str | None]:
    """The engine ``io`` (``"auto"`` | ``"aio"`` | ``"threads"``) asks for in `folder`, and why aio does not run
    (None when it does, or was not asked for). `lock_bytes`: the page-locked memory the aio engine must be able to
    have. ``"aio"`` that cannot run raises ConfigError; ``"auto"`` falls back to threads with one warning (`what`
    names the store in it, on `logger`)."""
    if io == "threads":
        return ThreadEngine(), None
    engine, why = _start_aio(folder, lock_bytes, block_size, queue_depth, max_idle_bytes, bounded)
    if engine is not None:
        return engine, None
    if io == "aio":
        raise ConfigError("nvme_io", "aio", "'auto' or 'threads' on this machine",
                          f"DeepSpeed's async_io cannot be used here: {why}")
    _warn_once(f"fp4offload: {what} uses its thread-pool I/O; DeepSpeed's async_io is not usable: {why}",
               logger or log)
    return ThreadEngine(), why


class Workers:
    """`threads` worker threads (named `name`-N) for reads ahead and writes behind; with `max_pending_writes`
    (default ``2 * threads``; None: no bound) at most that many writes run at once."""

    def __init__(self, threads: int, name: str = "fp4adamw-nvme", max_pending_writes: int | None = -1):
        self.threads = threads
        self.max_pending_writes = 2 * threads if max_pending_writes == -1 else max_pending_writes
        self.pending: list[Future] = []
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    def read(self, fn: Callable, *args) -> Future:
        return self._pool.submit(fn, *args)

    submit = read  # a job that is no tracked write

    def write(self, fn: Callable, *args) -> Future:
        """Run a write, waiting first while ``max_pending_writes`` writes are still running; failures are raised
        by wait_writes."""
        if self.max_pending_writes is not None:
            running = [f for f in self.pending if not f.done()]
            while len(running) >= self.max_pending_writes:
                wait(running, return_when=FIRST_COMPLETED)
                running = [f for f in running if not f.done()]
        fut = self._pool.submit(fn, *args)
        self.pending.append(fut)
        return fut

    def wait_writes(self) -> None:
        """Block until every write started so far is done; re-raise the first failure."""
        pending, self.pending = self.pending, []
        err = None
        for f in pending:
            try:
                f.result()
            except BaseException as e:  # keep waiting for the others, then raise the first
                err = err or e
        if err is not None:
            raise err

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


_warned = False


def _warn_once(msg: str, logger: logging.Logger) -> None:
    global _warned
    logger.warning(msg)
    if not _warned:
        _warned = True
        warnings.warn(msg, RuntimeWarning, stacklevel=4)
