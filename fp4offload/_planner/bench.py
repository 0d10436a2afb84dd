"""Micro-benchmarks the time model uses: the CPU optimizer step rate (fp32 Adam, and the FP4 step
when ``fp4offload.FP4AdamW`` is importable), host<->device and NVMe bandwidth (see probe.py).
Results are :class:`Readings`, saved to the same file format ``plan --readings`` replays."""

from __future__ import annotations

import datetime as _dt
import socket
import time
from typing import Callable

from fp4offload._planner.probe import measure_disk, measure_h2d, probe_disk
from fp4offload._planner.readings import DiskReading, Readings

__all__ = ["bench_cpu_adam", "run_bench", "DEFAULT_BENCH_NUMEL"]

#: Parameters in the benchmark's flat tensor (large enough to leave the caches: 4M x 16 B = 64 MiB).
DEFAULT_BENCH_NUMEL = 4 << 20


def _rate(step: Callable[[], None], numel: int, max_seconds: float, min_steps: int = 3) -> float:
    step()  # warm-up: allocates states, builds kernels
    n, t0 = 0, time.perf_counter()
    while n < min_steps or time.perf_counter() - t0 < max_seconds / 2:
        step()
        n += 1
        if time.perf_counter() - t0 > max_seconds:
            break
    return numel * n / (time.perf_counter() - t0)


def _fp4_optimizer():
    """fp4offload.FP4AdamW if it imports, else None and why."""
    try:
        from .._optim import FP4AdamW
    except Exception as exc:  # ImportError: a build without the optimizer
        return None, f"FP4AdamW is not importable ({type(exc).__name__}); the nvfp4 rate keeps the default ratio"
    return FP4AdamW, None


def bench_cpu_adam(numel: int = DEFAULT_BENCH_NUMEL,
                   max_seconds: float = 3.0) -> tuple[dict[str, float], int, list[str]]:
    """CPU optimizer step rate, parameters/s, per state format; the thread count; notes.

    fp32: torch's fused AdamW on CPU (the same memory traffic as DeepSpeedCPUAdam).
    nvfp4: fp4offload.FP4AdamW when it imports and steps; otherwise left out (with a note).
    """
    import torch

    notes: list[str] = []
    rates: dict[str, float] = {}
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel) * 1e-3
    try:
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW([p], lr=1e-4, foreach=False)
        notes.append("torch has no fused CPU AdamW: fp32 rate measured with the per-tensor loop")
    rates["fp32"] = _rate(opt.step, numel, max_seconds)
    del opt
    cls, why = _fp4_optimizer()
    if cls is None:
        notes.append(why)
    else:
        try:
            q = torch.nn.Parameter(torch.randn(numel))
            q.grad = torch.randn(numel) * 1e-3
            fopt = cls([q], lr=1e-4)
            rates["nvfp4"] = _rate(fopt.step, numel, max_seconds)
        except Exception as exc:  # an optimizer still in the works must not break the benchmark
            notes.append(f"FP4AdamW failed to step ({type(exc).__name__}: {exc}); nvfp4 rate not measured")
    return rates, torch.get_num_threads(), notes


def run_bench(nvme_path: str | None = None, *, numel: int = DEFAULT_BENCH_NUMEL, max_seconds: float = 3.0,
              nvme_max_bytes: int | None = None, base: Readings | None = None) -> Readings:
    """Run every benchmark this machine allows and return readings (merged over ``base``)."""
    rates, threads, notes = bench_cpu_adam(numel, max_seconds)
    disk = None
    if nvme_path is not None:
        d = probe_disk(nvme_path)
        kw = {"max_bytes": nvme_max_bytes} if nvme_max_bytes else {}
        rd, wr = measure_disk(nvme_path, max_seconds=max_seconds, **kw)
        disk = DiskReading(d.path, d.total, d.free, rd, wr)
    h2d = measure_h2d()
    if h2d is None:
        notes.append("no CUDA device: host<->device bandwidth not measured")
    new = Readings(disk=disk, h2d_bps=h2d[0] if h2d else None, d2h_bps=h2d[1] if h2d else None, cpu_adam=rates,
                   cpu_adam_threads=threads, notes=tuple(notes), hostname=socket.gethostname(),
                   taken_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    return base.merged(new) if base is not None else new
