"""A store's folder: made per store, locked while its store lives, swept once its owner is gone, kept on request.

The folder: ``<root>/<prefix>XXXXXXXX/`` (mode 0700) holds a lock file (``owner.lock``: pid, process start time,
host, user) while its store lives. It is removed by its store's ``close()``, when the store is collected and at
normal interpreter exit (:class:`Folder` is what runs then). A kept folder stays instead, marked with a ``KEEP``
file (never swept); a subclass writes what a kept folder needs once closed (:meth:`Folder.on_keep`: FP4AdamW's
manifest). When a store starts it sweeps its root for this user's folders of its prefix whose owning process is
gone (killed, crashed) and removes them (:func:`sweep`), each reported with a warning on the store's logger.
FP4AdamW's NVMe tier (``fp4adamw-``) and the activations' NVMe files (``fp4offload-act-``) both live in such folders.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

LOCK_NAME = "owner.lock"
KEEP_NAME = "KEEP"

log = logging.getLogger("fp4offload._store")


# ---- the owner of a folder, the sweep of abandoned folders ----------------------------------------------------

def _start_time(pid: int) -> str | None:
    """The start time of process `pid` (field 22 of /proc/<pid>/stat), to tell a reused pid; None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096).decode("ascii", "replace")
        return raw[raw.rindex(")") + 2:].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def lock_info() -> dict:
    """What a lock file says of this process."""
    return {"pid": os.getpid(), "start": _start_time(os.getpid()), "host": socket.gethostname(), "uid": os.getuid()}


def owner_gone(info: dict) -> bool:
    """True when the process named by a lock file is gone (or its pid now belongs to another process)."""
    if info.get("host") != socket.gethostname():
        return False  # another machine's folder on a shared disk: not ours to judge
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    start = _start_time(pid)
    return start is not None and info.get("start") is not None and start != info["start"]


def _folder_bytes(folder: Path) -> int:
    total = 0
    for f in folder.iterdir():
        try:
            total += f.lstat().st_size
        except OSError:
            pass
    return total


def sweep(root, prefix: str, what: str = "NVMe store folder", logger: logging.Logger | None = None) -> list[Path]:
    """Remove this user's folders ``<root>/<prefix>*`` whose owning process is gone; returns them.

    A folder is removed only when it is a real directory (not a link) owned by this user, is not kept (no
    ``KEEP`` file) and its lock file names a process on this host that no longer runs. Each removal is
    logged as a warning on `logger`, naming the folder as `what`."""
    root = Path(root)
    removed = []
    try:
        candidates = sorted(root.glob(prefix + "*"))
    except OSError:
        return removed
    for d in candidates:
        try:
            st = d.lstat()
            if not d.is_dir() or d.is_symlink() or st.st_uid != os.getuid() or (d / KEEP_NAME).exists():
                continue
            lock = d / LOCK_NAME
            if lock.is_symlink() or not lock.is_file() or lock.stat().st_size > 4096:
                continue  # no lock yet (a store starting), or not ours
            info = json.loads(lock.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(info, dict) or not owner_gone(info):
            continue
        size = _folder_bytes(d)
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            removed.append(d)
            (logger or log).warning("fp4offload: removed the abandoned %s %s (%.1f MiB) of process %s, which is "
                                    "gone", what, d, size / 2**20, info.get("pid"))
    return removed


def write_json(path: Path, obj) -> None:
    """Write `obj` as JSON to `path` atomically (an exclusive temporary of mode 0600, then renamed)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ---- the store's folder -------------------------------------------------------------------------------------

class Folder:
    """A store's folder, made (mode 0700) as ``<root>/<prefix>XXXXXXXX`` on construction, and what releases it:
    `closers` first (I/O threads, page-locked buffers), then the folder itself (or, when kept, the dot files left
    in it, then :meth:`on_keep`, then the lock file). Called once: by the store's close(), when the store is
    collected, or at interpreter exit. `keep_note`: the text of the ``KEEP`` mark of a kept folder."""

    def __init__(self, root: Path, prefix: str, keep: bool = False, keep_note: str = "kept; remove the folder when "
                 "done\n"):
        self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
        os.chmod(self.path, 0o700)
        self.keep, self.keep_note = keep, keep_note
        self.closers: list[Callable[[], None]] = []

    def lock(self) -> None:
        """Write the lock file naming this process (and the KEEP mark when kept)."""
        write_json(self.path / LOCK_NAME, lock_info())
        if self.keep:
            (self.path / KEEP_NAME).write_text(self.keep_note)

    def on_keep(self) -> None:
        """What a kept folder holds besides its files once its store closed (nothing here)."""

    def __call__(self) -> None:
        for close in self.closers:
            close()
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for f in self.path.glob(".*"):  # uncommitted generations, reservations, temporaries
            f.unlink(missing_ok=True)
        try:
            self.on_keep()
        finally:
            (self.path / LOCK_NAME).unlink(missing_ok=True)
