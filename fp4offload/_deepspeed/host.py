"""The process-level host settings of the block: glibc's mmap threshold and the host allocator cache.

With ``optimizer_states`` the offloaded fp32 master, the gradient partition and the packed states live in
host RAM, and what the host's allocator does with the memory a training step frees weighs as much as the
formats. ``host.mmap_threshold`` and ``host.allocator_cache`` (with their environment overrides,
:func:`fp4offload._deepspeed.config.resolve`) shape it, once per process: :func:`control_host_allocator`.
Why: docs/design.md section 7; how, with measurements: docs/guide.md, "Host memory".
"""

from __future__ import annotations

import logging
import os

from fp4offload._announce import announce

from .config import HostSettings, Setting, resolve

log = logging.getLogger("fp4offload.deepspeed")

__all__ = ["control_host_allocator", "release_free_host_memory"]

_M_MMAP_THRESHOLD = -3  # mallopt parameter number (malloc.h)


def _libc():
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        _ = libc.mallopt, libc.malloc_trim  # both must exist
    except (OSError, AttributeError):
        return None
    return libc


_allocator_state: dict | None = None


def control_host_allocator(settings: HostSettings | None = None) -> dict:
    """Keep the memory a training step frees from staying resident: glibc's mmap threshold fixed, and a
    bounded cache for torch's large CPU blocks (process-wide, once).

    glibc serves blocks below its mmap threshold from its heap. The threshold starts at 128 KiB and, each
    time an mmapped block is freed, rises to that block's size (up to 32 MiB); after the first backward every
    gradient, bucket slice and activation below 32 MiB comes from the heap, which then keeps the backward's
    transient memory resident after it is freed. Fixing the threshold turns that adjustment off: blocks at or
    above it are mmapped and unmapped on free. Alone, that costs page faults when the next layer asks for the
    same sizes again, so torch's blocks of 128 KiB and more go to :mod:`fp4offload.host_allocator`, which
    keeps freed blocks for reuse up to a share of the bytes in use and unmaps the rest.

    Args:
        settings: the effective host settings (:func:`resolve`); None resolves them from the environment
            and the defaults.

    Returns ``{"mmap_threshold": bytes or None, "reason": str, "host_cache": host_allocator.install()'s
    dict}``. The glibc part does nothing when the user already tuned glibc (``MALLOC_MMAP_THRESHOLD_`` or a
    ``glibc.malloc`` tunable) or off glibc. Called again, returns what the first call did.
    """
    global _allocator_state
    if _allocator_state is not None:
        return dict(_allocator_state)
    from fp4offload import host_allocator

    settings = resolve(None) if settings is None else settings
    state = _fix_mmap_threshold(settings.mmap_threshold)
    cache = settings.allocator_cache
    state["host_cache"] = (host_allocator.install(cache.value) if cache.value != "off"
                           else {"installed": False, "reason": f"{cache.source}=off"})
    _allocator_state = state
    return dict(state)


def _fix_mmap_threshold(setting: Setting) -> dict:
    if setting.value == "off":
        return {"mmap_threshold": None, "reason": f"{setting.source}=off"}
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return {"mmap_threshold": None, "reason": "glibc malloc already tuned by the environment"}
    libc = _libc()
    if libc is None:
        return {"mmap_threshold": None, "reason": "not glibc"}
    value = int(setting.value)
    if libc.mallopt(_M_MMAP_THRESHOLD, value) != 1:
        return {"mmap_threshold": None, "reason": f"mallopt(M_MMAP_THRESHOLD, {value}) refused"}
    announce(f"process: glibc mmap threshold fixed at {value} bytes with mallopt ({setting.source})")
    return {"mmap_threshold": value, "reason": "set"}


def release_free_host_memory() -> bool:
    """``malloc_trim(0)``: hand the free pages of glibc's heaps back to the OS. False off glibc."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True

