"""Activation files on a local disk: one checksummed container per tensor, in a private temporary folder.

Writes and reads run on a few IO threads so they overlap compute; files use
fp4offload.formats.container (atomic rename, mode 0600, CRC32 per tensor), so a damaged file raises
CorruptionError when backward reads it. The folder is removed by ``close()`` and, as a last resort,
when the store is garbage collected or the interpreter exits.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from ..errors import ConfigError, CorruptionError
from ..formats.container import read_container, write_container


def _cleanup(folder: Path, pool: ThreadPoolExecutor) -> None:
    pool.shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(folder, ignore_errors=True)


class ActivationFileStore:
    """Files of one offload context under ``<root>/fp4offload-act-XXXX/``."""

    def __init__(self, root, workers: int = 2):
        root = Path(root)
        if not root.is_dir():
            raise ConfigError("ActivationPolicy.nvme_path", str(root), "an existing folder",
                              "create it first, on a fast local disk")
        if not os.access(root, os.W_OK | os.X_OK):
            raise ConfigError("ActivationPolicy.nvme_path", str(root), "a folder this process can write to")
        self.folder = Path(tempfile.mkdtemp(prefix="fp4offload-act-", dir=root))  # mode 0700
        self._io = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fp4offload-nvme")
        self._finalizer = weakref.finalize(self, _cleanup, self.folder, self._io)
        self.closed = False

    def path(self, key: int) -> Path:
        return self.folder / f"act-{key:08d}.fp4c"

    def write(self, key: int, meta: dict, tensors: Callable[[], dict[str, torch.Tensor]],
              done: Callable[[], None] | None = None) -> Future:
        """Write the tensors that `tensors()` returns (called on the IO thread) to the file of `key`."""
        path = self.path(key)

        def job():
            try:
                return write_container(path, dict(meta, key=key), tensors(), fsync=False)
            finally:
                if done is not None:
                    done()

        return self._io.submit(job)

    def read(self, key: int, after: Future | None = None) -> Future:
        """Read the file of `key` (after `after`, its write, is done); the future raises CorruptionError."""
        path = self.path(key)

        def job():
            if after is not None:
                after.result()
            meta, tensors = read_container(path)
            if meta.get("key") != key:
                raise CorruptionError(path, "file holds another activation", expected=key, found=meta.get("key"))
            return tensors

        return self._io.submit(job)

    def delete(self, key: int, after: Future | None = None) -> None:
        """Remove the file of `key` (once its write is over, if one is in flight)."""
        path = self.path(key)

        def rm(_=None):
            try:
                path.unlink()
            except OSError:
                pass

        if after is not None and not after.done():
            after.add_done_callback(rm)
        else:
            rm()

    def files(self) -> list[Path]:
        return sorted(self.folder.glob("*")) if self.folder.exists() else []

    def close(self) -> None:
        """Wait for the IO threads, then remove the folder and everything in it."""
        self.closed = True
        self._finalizer()
