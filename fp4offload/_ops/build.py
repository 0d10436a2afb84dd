"""JIT building of the C++/CUDA extensions with torch.utils.cpp_extension, cached in TORCH_EXTENSIONS_DIR.

Every build of an extension holds an advisory lock (``fcntl.flock``) on ``<build dir>/fp4offload.owner`` for as
long as torch's own lock file (``<build dir>/lock``) may exist. The kernel drops a flock when its process dies,
so a ``lock`` found while the flock is free was left by a build that was killed: it is removed, with a line
saying so, instead of making this process wait for it forever (torch waits on that file without a timeout).
A build is keyed by what it is made of (:func:`build_key`: every file under csrc/, the flags, torch's and Python's
versions, the compiler named by CXX), written beside the library. A library whose key matches is imported as it is,
whichever checkout or installation built it, so two copies of one version share their kernels; any other key is
built again, after one line saying what it builds and about how long it takes.

Every extension is loaded through :func:`load`: built (or loaded from the cache) once per process, and a build that
fails is not tried again in that process; its callers fall back (codec dispatch to the torch reference, FP4AdamW to
the reference step, the host allocator to torch's).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from .. import _switches as switches

# about how long a first build takes, seconds on one core of a 2-vCPU x86 server (2026-12-05, AMD EPYC, g++ 12)
BUILD_SECONDS = {"fp4offload_cpu": 35, "fp4offload_cpu_adam": 60, "fp4offload_host": 10,
                 "fp4offload_cuda": 150, "fp4offload_cuda_adam": 120}


def csrc_dir() -> Path:
    """The csrc/ folder: the top-level one in a source checkout, or the copy shipped in the wheel."""
    here = Path(__file__).resolve().parents[2] / "csrc"
    if (here / "fp4_codec.h").exists():
        return here
    return Path(str(resources.files("fp4offload._csrc")))


def extensions_root() -> Path:
    """Where torch caches JIT builds: ``TORCH_EXTENSIONS_DIR``, else torch's default root for this build."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    from torch.utils import cpp_extension

    try:  # private, but the one place that names torch's default root (py<ver>_<accelerator>)
        return Path(cpp_extension._get_build_directory("x", False)).parent
    except Exception:  # pragma: no cover - a torch without it
        return Path(cpp_extension.get_default_build_root())


def building_in(build_dir: Path) -> list[int]:
    """PIDs of live processes whose working directory is `build_dir` (ninja and the compilers it runs)."""
    pids, target = [], os.path.realpath(build_dir)
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.path.realpath(entry / "cwd") == target:
                pids.append(int(entry.name))
    return pids


def stale_locks(root: Path | None = None) -> list[Path]:
    """torch's ``lock`` files under the extensions root whose build is not running: no process holds this
    package's owner lock for that folder and no process works in it. Covers other packages' builds too (DeepSpeed's
    ops), for which only the second test applies, so a lock younger than a minute is never called stale."""
    root = extensions_root() if root is None else Path(root)
    found = []
    for lock in sorted(root.glob("*/lock")) if root.is_dir() else ():
        with contextlib.suppress(OSError):
            if time.time() - lock.stat().st_mtime < 60 and not (lock.parent / "fp4offload.owner").exists():
                continue
            if _owner_alive(lock.parent) or building_in(lock.parent):
                continue
            found.append(lock)
    return found


def _owner_alive(build_dir: Path) -> bool:
    path = build_dir / "fp4offload.owner"
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the flock if it was taken
    return False


@contextlib.contextmanager
def owning(build_dir: Path, name: str):
    """Hold this package's build lock on `build_dir`; clear torch's lock if a dead build left it."""
    from .._announce import announce

    build_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(build_dir / "fp4offload.owner", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
            announce(f"waiting for process {other} to finish building {name} in {build_dir}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        lock = build_dir / "lock"
        if lock.exists() and not building_in(build_dir):
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
                announce(f"removed {lock}, left by a build of {name} that was killed; building it again")
        yield
    finally:
        os.close(fd)


KEY_FILE = "fp4offload.key"
#: the files under csrc/ a build can read: its sources and every header they may include
SOURCE_SUFFIXES = (".h", ".cuh", ".cpp", ".cu")


def build_key(name: str, root: Path, flags: list[str], device_flags: list[str]) -> str:
    """What a build of `name` is made of, as one digest: every source and header under `root` (by its path relative
    to `root` and its bytes), the host and device flags, torch's and Python's versions and the CXX compiler."""
    import torch

    h = hashlib.sha256()
    for part in (name, torch.__version__, sys.version, os.environ.get("CXX", ""), *flags, "|", *device_flags):
        h.update(part.encode() + b"\0")
    for f in sorted(f for f in root.rglob("*") if f.suffix in SOURCE_SUFFIXES and f.is_file()):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def cached(build_dir: Path, name: str, key: str) -> Path | None:
    """The library of `name` in `build_dir` when it was built from what `key` digests, else None."""
    so = build_dir / f"{name}.so"
    with contextlib.suppress(OSError):
        if so.is_file() and (build_dir / KEY_FILE).read_text().strip() == key:
            return so
    return None


def _import_library(name: str, so: Path):
    import importlib.util

    import torch  # noqa: F401  (the library links against libtorch, which must be loaded first)

    spec = importlib.util.spec_from_file_location(name, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(name: str, sources: list[str], *, cuda: bool = False, extra_cflags=(), extra_cuda_cflags=(),
          root: Path | None = None):
    """Compile (or load the cached build of) an extension from files under csrc/ (or under `root`, another copy of
    it: benchmarks build an earlier revision's under its own module name)."""
    from torch.utils import cpp_extension

    from .._announce import announce

    root = csrc_dir() if root is None else Path(root)
    verbose = switches.get("FP4OFFLOAD_VERBOSE_BUILD")
    # no fast math and no FMA contraction (every operation rounds as the reference's does); errno and FP traps off,
    # which change no value but let the compiler vectorize sqrt and turn selects of FP results into blends; hidden
    # visibility, so two builds of one source in a process (one per CPU path, or per grid table) keep their own
    # inline functions and their statics (GCC makes a default-visibility one process-wide, STB_GNU_UNIQUE, and the
    # second library would use the first one's tables)
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fvisibility=hidden",
             *extra_cflags]
    paths = [root / s for s in sources]
    kwargs = dict(name=name, sources=[str(p) for p in paths], extra_include_paths=[str(root)],
                  extra_cflags=flags, verbose=verbose)
    if cuda:
        kwargs["extra_cuda_cflags"] = device_cflags(extra_cuda_cflags)
    build_dir = extensions_root() / name
    key = build_key(name, root, flags, kwargs.get("extra_cuda_cflags", []))
    with owning(build_dir, name):
        so = cached(build_dir, name, key)
        if so is not None:
            return _import_library(name, so)
        base = next((v for k, v in sorted(BUILD_SECONDS.items(), key=lambda kv: -len(kv[0]))
                     if name.startswith(k)), 60)
        announce(f"building the {name} kernel for this machine (first use, about {base} s on one core; "
                 f"cached in {build_dir})")
        with contextlib.suppress(FileNotFoundError):
            (build_dir / KEY_FILE).unlink()
        module = cpp_extension.load(**kwargs)
        so = build_dir / f"{name}.so"
        if module is not None and Path(getattr(module, "__file__", "") or "").resolve() == so.resolve():
            (build_dir / KEY_FILE).write_text(key + "\n")  # only for the library this call really loaded
        return module


def device_cflags(extra=()) -> list[str]:
    """The device compiler's flags of a build: nvcc's ``-O3 --fmad=false`` and `extra`; on a ROCm build of torch
    (``torch.version.hip`` set), hipcc's ``-O3`` and :data:`fp4offload._ops.cuda.HIPCC_FLAGS`, then `extra` less the
    flags only nvcc takes, with one ``--offload-arch`` per target (:func:`fp4offload._ops.cuda.rocm_archs`) unless
    `extra` names them (torch would otherwise add every architecture it was built for)."""
    from . import cuda as backend

    extra = list(extra)
    if not backend.is_rocm():
        return ["-O3", "--fmad=false", *extra]
    kept = [f for f in extra if not f.startswith(backend.NVCC_ONLY_PREFIXES)]
    flags = ["-O3", *backend.HIPCC_FLAGS, *(f for f in kept if f not in backend.HIPCC_FLAGS)]
    if not any(f.startswith("--offload-arch") for f in kept):
        flags += [f for f in backend.hipcc_flags() if f.startswith("--offload-arch")]
    return flags


class BuildError(RuntimeError):
    """An extension that did not build in this process; the message says why (:func:`why` of the build's error)."""


_loaded: dict[str, Any] = {}
_failed: dict[str, str] = {}


def why(e: BaseException) -> str:
    """One line saying why `e` happened: its type and the last line of its message (a BuildError's message)."""
    if isinstance(e, BuildError):
        return str(e)
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1]}" if text else type(e).__name__


def load(name: str, sources: list[str], **kwargs):
    """The extension `name` (:func:`build`'s arguments), built or loaded once per process. When its build fails,
    this and every later call raise BuildError, without building again."""
    if name in _loaded:
        return _loaded[name]
    if name not in _failed:
        try:
            _loaded[name] = build(name, sources, **kwargs)
            return _loaded[name]
        except Exception as e:  # a compiler or toolchain problem: the caller falls back
            _failed[name] = why(e)
    raise BuildError(_failed[name])
