"""A caching allocator for torch's large CPU tensors: backward's transient blocks reused, not kept.

When a training step lives in host RAM (offloaded optimizer states, and on a CPU accelerator the whole
step), backward allocates the same block sizes once per layer and frees each before the next layer asks
again. glibc serves that in one of two bad ways: it keeps the freed blocks in its heap (resident, and
fragmented, for the rest of the process: several bytes per parameter at the backward peak), or, with its
mmap threshold fixed, it unmaps each block on free and the next layer faults the same pages in again,
4 KiB at a time (the page faults per step and the step times, with and without this cache, are in
benchmarks/RESULTS.md).

:func:`install` puts a small cache in front of torch's CPU allocator (csrc/cpu/host_allocator.cpp). Blocks
of at least ``min_bytes`` are mapped by the cache and, when freed, kept for reuse while the freed bytes it
holds stay under ``fraction`` of the bytes in use (at least ``floor_bytes``; at most ``ceiling_bytes`` if
set); beyond that the least recently freed blocks are unmapped. Blocks of ``huge_bytes`` or more are aligned
to 2 MiB and advised for transparent huge pages. Freed-but-resident memory is thus bounded by the fraction
(1/8 by default), and it shrinks with the step's transients. Smaller requests go to the allocator that was
there before (glibc's malloc through torch).

The DeepSpeed block installs it together with its glibc setting
(:func:`fp4offload._deepspeed.host.control_host_allocator`, the block's ``host.allocator_cache``);
called directly, ``FP4OFFLOAD_HOST_CACHE`` sets the fraction, or an off word (:mod:`fp4offload._switches`). It
is process-wide, Linux only, and changes no tensor's values: only where the bytes of new CPU tensors come from.

    >>> from fp4offload import host_allocator
    >>> host_allocator.install()                   # doctest: +SKIP
    {'installed': True, 'fraction': 0.125, ...}
    >>> host_allocator.stats()["hits"]            # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
import platform

from . import _switches as switches
from ._config import ALLOCATOR_CACHE
from .errors import ConfigError

log = logging.getLogger("fp4offload.host_allocator")

__all__ = ["install", "uninstall", "installed", "stats", "empty_cache", "ENV", "DEFAULT_FRACTION"]

ENV = "FP4OFFLOAD_HOST_CACHE"
DEFAULT_FRACTION = ALLOCATOR_CACHE  # freed bytes kept, as a share of the bytes in use
DEFAULT_FLOOR = 64 << 20  # ... but at least this many (a small model's per-layer gradients)
MIN_BYTES = 128 << 10  # glibc's own starting mmap threshold: smaller blocks stay with malloc
HUGE_BYTES = 4 << 20  # blocks from here on get 2 MiB alignment and MADV_HUGEPAGE
_PRIORITY = 1  # above torch's own registration (0)


@functools.lru_cache(maxsize=None)
def _extension():
    from ._ops.build import load

    return load("fp4offload_host", ["cpu/host_allocator.cpp"])


def _fraction_from_env() -> float | None:
    """FP4OFFLOAD_HOST_CACHE's fraction (default 0.125), or None for an off word; ConfigError naming the variable
    for anything else."""
    value = switches.get(ENV)
    return None if value == "off" else float(value)


def install(fraction: float | None = None, *, floor_bytes: int = DEFAULT_FLOOR, ceiling_bytes: int = 0,
            min_bytes: int = MIN_BYTES, huge_bytes: int = HUGE_BYTES) -> dict:
    """Make the caching allocator torch's CPU allocator (again: reconfigure it). Process-wide.

    Args:
        fraction: freed bytes kept for reuse, as a share of the bytes in use through the cache; None reads
            ``FP4OFFLOAD_HOST_CACHE`` (default 0.125; an off word installs nothing).
        floor_bytes, ceiling_bytes: bounds on the freed bytes kept (ceiling 0: none).
        min_bytes: smaller blocks go to the previous allocator.
        huge_bytes: blocks at least this large are 2 MiB aligned and advised MADV_HUGEPAGE (0: never).

    Returns ``stats()`` plus ``reason``; ``installed`` is False, with the reason, when the environment says
    off, off Linux, when the extension does not build, or when a higher-priority allocator is registered.
    Never raises for those: the cache is an optimization. A bad value raises ConfigError.
    """
    if fraction is None:
        fraction = _fraction_from_env()
        if fraction is None:
            return {"installed": False, "reason": f"{ENV}=off"}
    elif not 0.0 < float(fraction) <= 1.0:
        raise ConfigError("fraction", fraction, "a share in (0, 1] of the bytes in use")
    for key, value in (("floor_bytes", floor_bytes), ("ceiling_bytes", ceiling_bytes), ("min_bytes", min_bytes),
                       ("huge_bytes", huge_bytes)):
        if int(value) < 0:
            raise ConfigError(key, value, "a size in bytes >= 0")
    if platform.system() != "Linux":
        return {"installed": False, "reason": "not Linux"}
    try:
        ext = _extension()
    except Exception as exc:
        log.warning("fp4offload: host allocator cache not built (%s); torch's allocator stays", exc)
        return {"installed": False, "reason": f"extension did not build: {exc}"}
    ok = ext.install(int(min_bytes), float(fraction), int(floor_bytes), int(ceiling_bytes), int(huge_bytes),
                     _PRIORITY)
    out = dict(ext.stats())
    out["reason"] = "installed" if ok else "a higher-priority CPU allocator is registered"
    if ok:
        from fp4offload._announce import announce

        announce(f"process: host allocator cache placed ahead of torch's CPU allocator (keeps freed blocks up to "
                 f"{fraction:.3g} of the bytes in use; {ENV}=off leaves torch's allocator alone)")
    return out


def _loaded():
    """The extension if install() has built it, else None (the queries below never build it)."""
    return _extension() if _extension.cache_info().currsize else None


def installed() -> bool:
    """Whether the cache is torch's CPU allocator now."""
    ext = _loaded()
    return ext is not None and bool(ext.installed())


def uninstall() -> bool:
    """Give torch back the allocator it had; cached blocks are unmapped. False if it was not installed.

    Tensors allocated through the cache stay valid and are unmapped when freed."""
    ext = _loaded()
    return ext is not None and bool(ext.uninstall())


def stats() -> dict:
    """Counters: ``allocs``/``hits``/``maps``/``unmaps`` and bytes ``in_use``/``cached``/``mapped`` (and peaks)."""
    ext = _loaded()
    return dict(ext.stats()) if ext is not None else {"installed": False}


def empty_cache() -> int:
    """Unmap every cached (freed) block now; returns the bytes released."""
    ext = _loaded()
    return int(ext.empty_cache()) if ext is not None else 0
