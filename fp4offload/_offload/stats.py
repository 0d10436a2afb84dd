"""Counters of one activation offloader: bytes before and after, bytes moved, time spent, sampled error."""

from __future__ import annotations

import threading
from collections import Counter

import torch

_COUNTERS = (
    "tensors_packed",      # pack-hook calls the offloader took over (dedup hits included)
    "tensors_stored",      # distinct tensors compressed and/or moved
    "tensors_deduped",     # pack-hook calls answered with an already stored tensor
    "bytes_in",            # bytes of the distinct stored tensors as autograd would have kept them
    "bytes_out",           # bytes kept for them after compression, wherever they are
    "bytes_passthrough",   # bytes of non-parameter tensors left as they were (too small, integer, ...)
    "bytes_to_host", "bytes_from_host", "bytes_to_nvme", "bytes_from_nvme",
    "bytes_on_device",     # compressed bytes that stayed on their device ("same", or past max_host_bytes)
    "overflow_tensors", "overflow_bytes",  # tensors kept on the device because the host pool was full
    "unpacks", "prefetches", "prefetch_hits", "decode_cache_hits",
    "error_samples",
)
_TIMERS = ("pack_seconds", "unpack_seconds", "wait_seconds")
PREFIX = "offload.activations."  # names in fp4offload._metrics

_live_lock = threading.Lock()
_live_total: Counter = Counter()  # process-wide gauges, summed over every live offloader


def _metrics():
    try:
        from .. import _metrics as metrics
    except ImportError:  # pragma: no cover - metrics.py is part of the package
        return None
    return metrics


class ActivationStats:
    """Thread-safe counters; ``snapshot()`` returns them with the derived ratios.

    Times are host wall-clock seconds inside the hooks (on CUDA, kernels they queue may still run).
    The relative error is ``||dequant(q(x)) - x|| / ||x||`` of every n-th compressed tensor.
    Everything is mirrored into ``fp4offload._metrics`` under ``offload.activations.*``: counters and
    timers (seconds) as counters, live bytes as gauges summed over live offloaders, and the sampled
    error as ``rel_error_sum`` / ``rel_error_count`` (folded in when ``snapshot()`` runs or every 256
    samples) and ``rel_error_last``.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.c = Counter()
        self.t = {k: 0.0 for k in _TIMERS}
        self.passthrough = Counter()  # reason -> count
        self.live = Counter()         # gauges: host_bytes, device_bytes, nvme_bytes, entries
        self.peak = Counter()
        self._errs: list[torch.Tensor] = []
        self._err_sum = 0.0
        self._err_max = 0.0

    def add(self, **kw) -> None:
        """Add to counters and timers (also to the process-wide ``offload.activations.*`` metrics)."""
        with self._lock:
            for k, v in kw.items():
                if k in self.t:
                    self.t[k] += v
                else:
                    self.c[k] += v
        m = _metrics()
        if m is not None:
            for k, v in kw.items():
                m.counter(PREFIX + k).add(v)

    def skip(self, reason: str, nbytes: int) -> None:
        with self._lock:
            self.passthrough[reason] += 1
            if reason != "parameter":
                self.c["bytes_passthrough"] += nbytes
        m = _metrics()
        if m is not None:
            m.counter(PREFIX + "passthrough." + reason).add(1)
            if reason != "parameter":
                m.counter(PREFIX + "bytes_passthrough").add(nbytes)

    def gauge(self, name: str, delta: int) -> None:
        """Move a live gauge (host_bytes, device_bytes, nvme_bytes, entries) by `delta`."""
        with self._lock:
            self.live[name] += delta
            if self.live[name] > self.peak[name]:
                self.peak[name] = self.live[name]
        with _live_lock:
            _live_total[name] += delta
            total = _live_total[name]
        m = _metrics()
        if m is not None:
            m.gauge(PREFIX + "live." + name).set(total)

    def error(self, rel: torch.Tensor) -> None:
        """Record a sampled relative error (a 0-d tensor; read back lazily so CUDA does not sync)."""
        with self._lock:
            self.c["error_samples"] += 1
            self._errs.append(rel.detach())
            if len(self._errs) >= 256:
                self._fold()

    def _fold(self) -> None:
        if self._errs:
            v = torch.stack([e.float().cpu() for e in self._errs])
            self._err_sum += float(v.sum())
            self._err_max = max(self._err_max, float(v.max()))
            self._errs.clear()
            m = _metrics()
            if m is not None:
                m.counter(PREFIX + "rel_error_sum").add(float(v.sum()))
                m.counter(PREFIX + "rel_error_count").add(int(v.numel()))
                m.gauge(PREFIX + "rel_error_last").set(float(v[-1]))

    def snapshot(self) -> dict:
        """Plain dict of every counter, timer and gauge, plus before/after bytes and their ratio."""
        with self._lock:
            self._fold()
            out = {k: int(self.c[k]) for k in _COUNTERS}
            out.update({k: float(v) for k, v in self.t.items()})
            out["passthrough"] = dict(self.passthrough)
            out["live"] = dict(self.live)
            out["peak"] = dict(self.peak)
            n = out["error_samples"]
            out["rel_error_mean"] = self._err_sum / n if n else None
            out["rel_error_max"] = self._err_max if n else None
            before = out["bytes_in"] + out["bytes_passthrough"]
            after = out["bytes_out"] + out["bytes_passthrough"]
            out["saved_bytes_before"] = before
            out["saved_bytes_after"] = after
            out["compression_ratio"] = out["bytes_in"] / out["bytes_out"] if out["bytes_out"] else None
            out["saved_ratio"] = before / after if after else None
            return out
