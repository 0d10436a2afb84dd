"""What the DeepSpeed block measures, and how it reaches the engine's monitor.

- :func:`optimizer_host_bytes` counts, from the tensors themselves, the host memory a ZeRO optimizer
  holds: fp32 master partitions, their gradients, and the inner optimizer's states (packed or not).
- :func:`attach` wraps ``engine.step`` so that every ``monitor.every`` optimizer steps the counters are
  written through ``engine.monitor`` (csv_monitor, tensorboard, wandb, as configured); rank 0 writes.
  Without a configured monitor they go to Python logging.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import internals as dsi

log = logging.getLogger("fp4offload.deepspeed")

__all__ = ["optimizer_host_bytes", "tensor_bytes", "attach", "Writer"]


def tensor_bytes(obj: Any, seen: set[int] | None = None, *, device: str | None = "cpu") -> int:
    """Bytes of every tensor reachable from ``obj`` (tensors, PackedTensors, dicts, lists), each storage once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if device is not None and obj.device.type != device:
            return 0
        if obj.numel() == 0:
            return 0
        try:
            key = obj.untyped_storage().data_ptr()
            size = obj.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            key, size = id(obj), obj.numel() * obj.element_size()
        if key in seen:
            return 0
        seen.add(key)
        return size
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen, device=device) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen, device=device) for v in obj)
    tensors = getattr(obj, "tensors", None)  # PackedTensor and the state store expose their parts
    if callable(tensors):
        try:
            parts = tensors()
        except Exception:
            parts = None
        if parts is not None:
            return tensor_bytes(list(parts.values()) if isinstance(parts, dict) else list(parts), seen, device=device)
    for attr in ("data", "scales", "tensor_scale"):
        if isinstance(getattr(obj, attr, None), torch.Tensor):
            return sum(tensor_bytes(getattr(obj, a, None), seen, device=device)
                       for a in ("data", "scales", "tensor_scale"))
    return 0


def _masters(zero_opt: Any) -> list[torch.Tensor]:
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):  # ZeRO-1/2, ZeRO-3
        groups = dsi.read(zero_opt, name)
        if groups:
            return [g for g in groups if isinstance(g, torch.Tensor)]
    return []


def optimizer_host_bytes(engine: Any) -> dict[str, int]:
    """Host bytes held by the engine's optimizer, counted from its tensors.

    Returns ``{"master": fp32 partitions, "grad": their gradients, "states": the inner optimizer's
    states in host RAM (Adam's m and v, packed or not), "total": the sum of those three, "nvme": state
    bytes the inner optimizer keeps on NVMe (FP4AdamW's tier), "numel": elements of the master
    partitions}``. Tensors shared between parts are counted once.
    """
    zero_opt = engine.optimizer
    inner = dsi.read(engine, "basic_optimizer") or dsi.read(zero_opt, "optimizer")
    seen: set[int] = set()
    masters = _masters(zero_opt)
    master = sum(tensor_bytes(m, seen) for m in masters)
    grads = [m.grad for m in masters if m.grad is not None]
    grad = sum(tensor_bytes(g, seen) for g in grads)
    states = nvme = 0
    if inner is not None:
        states = sum(tensor_bytes(s, seen) for s in inner.state.values())
        custom = getattr(inner, "state_bytes", None)
        if callable(custom):
            out = custom()
            nvme = int(out.get("nvme", 0)) if isinstance(out, dict) else 0
    return {"master": master, "grad": grad, "states": states, "total": master + grad + states,
            "nvme": nvme, "numel": sum(m.numel() for m in masters)}


@dataclass
class Writer:
    """Writes the block's counters through the engine's monitor every ``every`` optimizer steps."""

    engine: Any
    every: int
    collect: Callable[[], dict[str, float]]
    written: int = 0
    last_step: int = 0
    last: dict[str, float] = field(default_factory=dict)

    def maybe_write(self) -> None:
        step = int(getattr(self.engine, "global_steps", 0))
        if step == 0 or step % self.every or step == self.last_step:
            return  # gradient-accumulation micro-steps call step() without a new optimizer step
        self.last_step = step
        values = self.collect()
        self.last = values
        mon = getattr(self.engine, "monitor", None)
        events = [(f"fp4offload/{k}", float(v), step) for k, v in sorted(values.items())]
        if mon is not None and getattr(mon, "enabled", False):
            mon.write_events(events)
        else:
            log.info("fp4offload step %d: %s", step, ", ".join(f"{k}={v:g}" for k, v in sorted(values.items())))
        self.written += 1


def _collector(engine: Any, attached: Any) -> Callable[[], dict[str, float]]:
    def collect() -> dict[str, float]:
        out: dict[str, float] = {}
        mem = optimizer_host_bytes(engine)
        for k in ("master", "grad", "states", "total", "nvme"):
            out[f"optimizer_host_bytes/{k}"] = float(mem[k])
        if mem["numel"]:
            out["optimizer_host_bytes/per_param"] = mem["total"] / mem["numel"]
        weights = getattr(attached, "weights", None)
        if weights is not None and hasattr(weights, "counters"):
            for k, v in weights.counters().items():
                out[f"weights/{k}"] = float(v)
        acts = getattr(attached, "activations", None)
        offloader = getattr(acts, "offloader", None)
        if offloader is not None and hasattr(offloader, "snapshot"):
            snap = offloader.snapshot()
            for k in ("bytes_in", "bytes_out", "compression_ratio"):
                if isinstance(snap.get(k), (int, float)):
                    out[f"activations/{k}"] = float(snap[k])
        inner = dsi.read(engine, "basic_optimizer")
        if isinstance(getattr(inner, "skipped_steps", None), int):  # written from step one, not from the first skip
            out["optimizer/skipped_steps"] = float(inner.skipped_steps)
        for name in ("metrics", "counters", "stats"):
            fn = getattr(inner, name, None)
            if callable(fn):
                try:
                    vals = fn()
                except Exception:
                    vals = None
                if isinstance(vals, dict):
                    out.update({f"optimizer/{k}": float(v) for k, v in vals.items() if isinstance(v, (int, float))})
                break
        try:
            from fp4offload import _metrics as metrics  # the project's counters, when present

            snap = metrics.snapshot()
            out.update({f"metrics/{k}": float(v) for k, v in snap.items() if isinstance(v, (int, float))})
        except Exception:
            pass
        return out

    return collect


def attach(engine: Any, monitor_cfg: Any, attached: Any) -> Writer:
    """Wrap ``engine.step`` to write the counters every ``monitor_cfg.every`` optimizer steps."""
    every = int(monitor_cfg.every)
    writer = Writer(engine=engine, every=every, collect=_collector(engine, attached))
    inner = dsi.read(engine, "basic_optimizer")
    if callable(getattr(inner, "sample_also_every", None)):
        # FP4AdamW samples its quantization error every metrics_every steps (100 by default): at each write too,
        # so the first write has one
        inner.sample_also_every(every)
    inner_step = engine.step

    def step(*args, **kwargs):
        out = inner_step(*args, **kwargs)
        writer.maybe_write()
        return out

    engine.step = step
    return writer
