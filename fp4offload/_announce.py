"""One line on rank 0 for every change fp4offload makes to the user's config or to the process.

The DeepSpeed block rewrites keys of the config it is given, fixes glibc's mmap threshold, puts a cache in front
of torch's CPU allocator and hands free heap pages back to the OS. Each of those is printed once per process, on
the first rank only (``RANK``, or the default process group's rank once it exists), to stderr, one line each and
prefixed ``fp4offload:``; the same line also goes to the ``fp4offload`` logger at INFO.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["announce", "is_first_rank"]

log = logging.getLogger("fp4offload")
_said: set[str] = set()


def is_first_rank() -> bool:
    """True on the process of global rank 0 (or outside a distributed run)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except Exception:  # pragma: no cover - torch without distributed
        pass
    raw = os.environ.get("RANK", "0").strip()
    return not raw.isdigit() or int(raw) == 0


def announce(line: str) -> bool:
    """Print ``fp4offload: <line>`` once per process on rank 0; True when it printed."""
    log.info("fp4offload: %s", line)
    if line in _said or not is_first_rank():
        return False
    _said.add(line)
    print(f"fp4offload: {line}", file=sys.stderr, flush=True)
    return True
