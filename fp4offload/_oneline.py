"""Under a launcher, an fp4offload error is one line, not a traceback on every rank.

A ConfigError or CapacityError already names the key, the value and the fix; under torchrun, ``deepspeed`` or
``accelerate launch`` every rank raises the same one and prints its own traceback, so the message is lost among
them. :func:`install` (called when fp4offload is imported in a process a launcher started: ``WORLD_SIZE`` set)
wraps ``sys.excepthook`` so that an uncaught fp4offload error prints ``fp4offload: <Error>: <message>`` once per
job: the first rank to report a message writes it, the rest stay silent (a marker file in the temp folder, named
by the job and the message, decides). Every other exception, and every error with ``FP4OFFLOAD_TRACEBACK=1``,
goes to the hook that was there before. The process still exits with status 1.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile

__all__ = ["install", "first_to_report"]


def first_to_report(message: str) -> bool:
    """True for the first process of this launched job to report `message` (always True outside a launcher)."""
    job = os.environ.get("TORCHELASTIC_RUN_ID") or \
        f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}:{os.getppid()}"
    if "WORLD_SIZE" not in os.environ:
        return True
    key = hashlib.sha1(f"{os.getuid()}|{job}|{message}".encode()).hexdigest()[:20]
    try:
        fd = os.open(os.path.join(tempfile.gettempdir(), f"fp4offload-error-{key}"),
                     os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return False
    except OSError:
        return True  # no temp folder to agree in: say it, once per rank
    os.close(fd)
    return True


def install() -> None:
    """Wrap sys.excepthook (once) for fp4offload's errors; see the module docstring."""
    previous = sys.excepthook
    if getattr(previous, "_fp4offload_oneline", False):
        return

    def hook(tp, value, tb):
        from . import _switches
        from .errors import FP4OffloadError

        try:
            verbose = _switches.get("FP4OFFLOAD_TRACEBACK")
        except Exception:  # a bad value of the switch itself: show everything
            verbose = True
        if not isinstance(value, FP4OffloadError) or verbose:
            return previous(tp, value, tb)
        line = f"fp4offload: {tp.__name__}: {value}"
        if first_to_report(line):
            rank = os.environ.get("RANK", "?")
            print(f"{line}\n  (rank {rank}; the other ranks stopped on the same error; FP4OFFLOAD_TRACEBACK=1 shows "
                  "the traceback)", file=sys.stderr, flush=True)

    hook._fp4offload_oneline = True
    sys.excepthook = hook
