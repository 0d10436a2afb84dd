"""The NVMe store's folder: made per store, locked while its store lives, swept once its owner is gone, kept on
request and read back once kept.

The folder: ``<nvme_path>/fp4adamw-XXXXXXXX/`` (mode 0700) holds a lock file (``owner.lock``: pid, process
start time, host, user) while its store lives. It is removed by the store's ``close()``, when the store is
collected and at normal interpreter exit (:class:`Folder` is what runs then). With ``keep=True`` it stays
instead, marked with a ``KEEP`` file (never swept) and, once closed, a ``manifest.json`` listing each key's
step, size and v format; :func:`read_kept` reads it back as state-dict entries. When a store starts it sweeps
``nvme_path`` for this user's folders whose owning process is gone (killed, crashed) and removes them
(:func:`sweep`), each reported with a warning on the ``fp4offload._optim.nvme`` logger.
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

import torch

from ..errors import CorruptionError
from ..formats.container import read_container
from .nvme_segment import KEY_RE, KIND, Record, check_residual, segment_name, segment_numel, segments_of
from .reference_step import SEGMENT
from .state import PACKED_KEYS, Residual

log = logging.getLogger("fp4offload._optim.nvme")

FOLDER_PREFIX = "fp4adamw-"
LOCK_NAME = "owner.lock"
KEEP_NAME = "KEEP"
MANIFEST_NAME = "manifest.json"
MANIFEST_KIND = "fp4offload._optim.nvme_folder"


# ---- the owner of a folder, the sweep of abandoned folders ----------------------------------------------------

def _start_time(pid: int) -> str | None:
    """The start time of process `pid` (field 22 of /proc/<pid>/stat), to tell a reused pid; None if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read(4096).decode("ascii", "replace")
        return raw[raw.rindex(")") + 2:].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def _lock_info() -> dict:
    return {"pid": os.getpid(), "start": _start_time(os.getpid()), "host": socket.gethostname(), "uid": os.getuid()}


def _owner_gone(info: dict) -> bool:
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


def sweep(root) -> list[Path]:
    """Remove this user's state folders under `root` whose owning process is gone; returns them.

    A folder is removed only when it is a real directory (not a link) owned by this user, is not kept (no
    ``KEEP`` file) and its lock file names a process on this host that no longer runs. Each removal is
    logged as a warning on ``fp4offload._optim.nvme``."""
    root = Path(root)
    removed = []
    try:
        candidates = sorted(root.glob(FOLDER_PREFIX + "*"))
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
        if not isinstance(info, dict) or not _owner_gone(info):
            continue
        size = _folder_bytes(d)
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            removed.append(d)
            log.warning("fp4offload: removed the abandoned NVMe optimizer-state folder %s (%.1f MiB) of process %s, "
                        "which is gone", d, size / 2**20, info.get("pid"))
    return removed


def _write_json(path: Path, obj) -> None:
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
    """A store's folder, made (mode 0700) in `root` on construction, and what releases it: `closers` first (the
    I/O threads, page-locked buffers), then the folder itself (or, when kept, its manifest, from `records`).
    Called once: by the store's close(), when the store is collected, or at interpreter exit."""

    def __init__(self, root: Path, keep: bool, run: str, records: dict[str, Record], residuals: bool = False):
        self.path = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=root))
        os.chmod(self.path, 0o700)
        self.keep, self.run, self.records, self.residuals = keep, run, records, residuals
        self.closers: list[Callable[[], None]] = []
        self.steps: dict[str, int] = {}  # the optimizer's step counts, given at close (kept folders)

    def lock(self) -> None:
        """Write the lock file naming this process (and the KEEP mark when kept)."""
        _write_json(self.path / LOCK_NAME, _lock_info())
        if self.keep:
            (self.path / KEEP_NAME).write_text("kept: FP4AdamW(nvme=NvmeOptions(keep=True)); remove the folder "
                                               "when done\n")

    def __call__(self) -> None:
        for close in self.closers:
            close()
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for f in self.path.glob(".*"):  # uncommitted generations, reservations, temporaries
            f.unlink(missing_ok=True)
        keys = {k: {"step": int(self.steps.get(k, r.step)), "numel": r.numel, "v_format": r.v_format,
                    "segments": segments_of(r.numel)} for k, r in sorted(self.records.items()) if r.gen > 0}
        try:
            _write_json(self.path / MANIFEST_NAME, {"kind": MANIFEST_KIND, "run": self.run, "keys": keys,
                                                    "residuals": self.residuals})
        finally:
            (self.path / LOCK_NAME).unlink(missing_ok=True)


# ---- a kept folder, read back ---------------------------------------------------------------------------------

def read_kept(folder) -> dict[str, dict]:
    """The states of a folder kept with ``keep=True`` (``FP4AdamW(nvme=NvmeOptions(keep=True))``), after its store
    closed.

    Returns ``{key: entry}``, each entry an FP4AdamW state-dict entry (``step``, ``v_format`` and the six packed
    uint8 tensors; split's ``master_lo`` and ``master_odd`` too when the files hold the residual) that
    ``fp4offload._optim.load_param_states(opt, {tensor: entry})`` loads (with the bf16 parameters of that moment).
    Every file is checked (checksums, identity, run id); anything missing or not matching raises
    CorruptionError."""
    folder = Path(folder)
    mpath = folder / MANIFEST_NAME
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise CorruptionError(mpath, "manifest is missing (the folder was not kept, or its store did not close)") \
            from None
    except (OSError, ValueError) as e:
        raise CorruptionError(mpath, f"unreadable manifest ({type(e).__name__}: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != MANIFEST_KIND:
        raise CorruptionError(mpath, "not a kept NVMe state folder's manifest", expected=MANIFEST_KIND,
                              found=manifest.get("kind") if isinstance(manifest, dict) else type(manifest).__name__)
    residuals = bool(manifest.get("residuals", False))
    out = {}
    for key, info in manifest.get("keys", {}).items():
        if not KEY_RE.fullmatch(str(key)):
            raise CorruptionError(mpath, f"bad key {key!r}")
        n, vf = int(info["numel"]), info["v_format"]
        parts = []
        for seg in range(segments_of(n)):
            path = folder / segment_name(key, seg)
            meta, t = read_container(path)
            m = segment_numel(n, seg)
            want = {"kind": KIND, "key": key, "segment": seg, "numel": m, "v_format": vf, "run": manifest.get("run")}
            got = {k: meta.get(k) for k in want}
            if got != want:
                raise CorruptionError(path, f"segment {seg} of tensor {key}: header does not match the manifest",
                                      expected=want, found=got)
            if residuals:
                check_residual(path, f"segment {seg} of tensor {key}", t, m)
            parts.append(t)
        entry = {"step": torch.tensor(float(info["step"])), "v_format": vf}
        if residuals:  # the state dict's form: int16 residual and int64 positions, as bytes
            entry["master_lo"] = torch.cat([pt["master_lo"].reshape(-1) for pt in parts])
            odd = [Residual(pt["master_lo"].view(torch.int16), pt["master_odd_bits"]).odd() + s * SEGMENT
                   for s, pt in enumerate(parts)]
            entry["master_odd"] = torch.cat(odd).view(torch.uint8)
        for k in PACKED_KEYS:
            entry[k] = torch.cat([pt[k].reshape(-1) for pt in parts])
        out[key] = entry
    return out
