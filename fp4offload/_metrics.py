"""Process-wide counters, timers and gauges (docs/design.md section 6).

The API is deliberately small:

- ``counter(name).add(n=1)``: a monotonically increasing number (bytes moved, steps skipped, ...).
- ``with timer(name): ...``: accumulates wall-clock seconds and a call count under ``name``.
- ``gauge(name).set(value)``: the latest value of something (state bytes held, a sampled error, ...).
- ``snapshot(prefix="")``: a flat ``{name: number}`` dict of everything recorded so far. A timer ``t`` shows
  up as ``t.seconds`` and ``t.calls``.
- ``reset(prefix="")``: forget what was recorded (under ``prefix``).

Names are dotted paths, owner first: ``optim.nvme.bytes_written``, ``optim.time.step``,
``offload.activations.bytes_packed``. Units go in the name when not obvious (``bytes``, ``seconds``).
Everything is thread-safe; the cost of a counter add is a lock and an addition, so count per chunk or
per tensor, not per element. Writers to DeepSpeed's monitor, TensorBoard or CSV read ``snapshot()``.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

_lock = threading.Lock()
_values: dict[str, float] = {}


class Counter:
    """A named running total. Get one with :func:`counter`."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def add(self, n: float = 1) -> None:
        """Add `n` (default 1) to the total."""
        with _lock:
            _values[self.name] = _values.get(self.name, 0) + n

    @property
    def value(self) -> float:
        with _lock:
            return _values.get(self.name, 0)


class Gauge:
    """A named latest value. Get one with :func:`gauge`."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def set(self, value: float) -> None:
        with _lock:
            _values[self.name] = value

    @property
    def value(self) -> float:
        with _lock:
            return _values.get(self.name, 0)


def counter(name: str) -> Counter:
    """The counter called `name` (created at zero on first use)."""
    return Counter(name)


def gauge(name: str) -> Gauge:
    """The gauge called `name`."""
    return Gauge(name)


@contextmanager
def timer(name: str) -> Iterator[None]:
    """Time the body: adds the elapsed seconds to ``name.seconds`` and 1 to ``name.calls``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        dt = time.perf_counter() - t0
        with _lock:
            _values[name + ".seconds"] = _values.get(name + ".seconds", 0.0) + dt
            _values[name + ".calls"] = _values.get(name + ".calls", 0) + 1


def snapshot(prefix: str = "") -> dict[str, float]:
    """A copy of every value whose name starts with `prefix`, sorted by name."""
    with _lock:
        return {k: _values[k] for k in sorted(_values) if k.startswith(prefix)}


def reset(prefix: str = "") -> None:
    """Drop every value whose name starts with `prefix` (all of them by default)."""
    with _lock:
        for k in [k for k in _values if k.startswith(prefix)]:
            del _values[k]
