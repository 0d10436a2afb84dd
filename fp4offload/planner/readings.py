"""Readings of a machine: what the probe and the benchmarks saw, saved to and replayed from JSON.

A readings file describes one node (its GPUs, host, NVMe and measured bandwidths), so a plan for
a cluster can be made elsewhere: ``fp4offload plan --readings node.json --nodes 16``.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from fp4offload.errors import ConfigError
from fp4offload.jsonfile import read_json

__all__ = ["GpuReading", "HostReading", "DiskReading", "Readings", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class GpuReading:
    """One GPU as NVML reports it. Memory in bytes; PCIe generation and lane width of the link
    (the maximum the link trains to, which idle GPUs may undercut in the current values)."""

    index: int
    name: str
    memory_total: int
    memory_free: int
    memory_used: int
    compute_capability: tuple[int, int] | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_gen_current: int | None = None
    pcie_width_current: int | None = None


@dataclass(frozen=True)
class HostReading:
    """Host RAM (bytes) and CPU cores."""

    ram_total: int
    ram_available: int
    cores_physical: int
    cores_logical: int
    cpu_model: str = ""


@dataclass(frozen=True)
class DiskReading:
    """The filesystem at the NVMe path: space in bytes, measured sequential bandwidth in bytes/s
    (None when not measured)."""

    path: str
    total: int
    free: int
    read_bps: float | None = None
    write_bps: float | None = None


@dataclass(frozen=True)
class Readings:
    """Everything known about one node.

    Attributes:
        gpus: one entry per GPU (empty when there is none or NVML is missing).
        host, disk: host RAM/cores and the NVMe path (None when unknown).
        driver_version, cuda_version: from NVML.
        h2d_bps, d2h_bps: measured pinned host<->device copy bandwidth per GPU, bytes/s.
        cpu_adam: measured CPU optimizer step rate, parameters per second for the whole host,
            per state format (``"fp32"``, ``"nvfp4"``), with ``cpu_adam_threads`` threads.
        notes: what could not be read and why.
        hostname, taken_at: where and when (ISO 8601).
    """

    gpus: tuple[GpuReading, ...] = ()
    host: HostReading | None = None
    disk: DiskReading | None = None
    driver_version: str | None = None
    cuda_version: str | None = None
    h2d_bps: float | None = None
    d2h_bps: float | None = None
    cpu_adam: Mapping[str, float] = field(default_factory=dict)
    cpu_adam_threads: int | None = None
    notes: tuple[str, ...] = ()
    hostname: str | None = None
    taken_at: str | None = None

    # -- JSON ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cpu_adam"] = dict(self.cpu_adam)
        d["notes"] = list(self.notes)
        for g in d["gpus"]:
            if g["compute_capability"] is not None:
                g["compute_capability"] = list(g["compute_capability"])
        return {"version": SCHEMA_VERSION, **d}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "readings") -> "Readings":
        if not isinstance(d, Mapping):
            raise ConfigError(source, type(d).__name__, "a JSON object written by `fp4offload plan --save-readings` "
                              "or `fp4offload bench`")
        version = d.get("version")
        if version != SCHEMA_VERSION:
            raise ConfigError(f"{source}: version", version, str(SCHEMA_VERSION),
                              "write the readings again with this version of fp4offload")
        body = {k: v for k, v in d.items() if k != "version"}
        _check_keys(body, cls, source)
        kw: dict[str, Any] = dict(body)
        kw["gpus"] = tuple(_build(GpuReading, g, f"{source}: gpus[{i}]") for i, g in enumerate(body.get("gpus") or []))
        for name, typ in (("host", HostReading), ("disk", DiskReading)):
            if body.get(name) is not None:
                kw[name] = _build(typ, body[name], f"{source}: {name}")
        ca = body.get("cpu_adam") or {}
        if not isinstance(ca, Mapping) or not all(isinstance(v, (int, float)) and v > 0 for v in ca.values()):
            raise ConfigError(f"{source}: cpu_adam", ca, "a mapping of format -> parameters per second (> 0)")
        kw["cpu_adam"] = {str(k): float(v) for k, v in ca.items()}
        kw["notes"] = tuple(str(n) for n in body.get("notes") or ())
        for k in ("h2d_bps", "d2h_bps"):
            v = body.get(k)
            if v is not None and (not isinstance(v, (int, float)) or v <= 0):
                raise ConfigError(f"{source}: {k}", v, "a bandwidth in bytes/s (> 0) or null")
        return cls(**kw)

    def save(self, path: str | Path) -> None:
        """Write as JSON, atomically (temporary file, then rename)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_dict(), f, indent=2)
                f.write("\n")
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path) -> "Readings":
        p = Path(path)
        doc = read_json(p, "--readings", str(p), readable="a readable readings file", valid="a JSON readings file")
        return cls.from_dict(doc, source=str(p))

    def merged(self, newer: "Readings") -> "Readings":
        """These readings with every field ``newer`` knows replaced (benchmarks over a probe)."""
        kw: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(newer, f.name)
            if f.name == "cpu_adam":
                kw[f.name] = {**self.cpu_adam, **newer.cpu_adam}
            elif f.name == "notes":
                kw[f.name] = tuple(dict.fromkeys(self.notes + newer.notes))
            elif v not in (None, (), {}):
                kw[f.name] = v
        return replace(self, **kw)


def _check_keys(d: Mapping[str, Any], cls: type, source: str) -> None:
    names = {f.name for f in fields(cls)}
    for k in d:
        if k not in names:
            raise ConfigError(f"{source}: {k}", d[k], "one of " + ", ".join(sorted(names)), "unknown key")


def _build(cls: type, d: Any, source: str) -> Any:
    if not isinstance(d, Mapping):
        raise ConfigError(source, d, "a JSON object")
    _check_keys(d, cls, source)
    kw = dict(d)
    if "compute_capability" in kw and kw["compute_capability"] is not None:
        kw["compute_capability"] = tuple(kw["compute_capability"])
    try:
        obj = cls(**kw)
    except TypeError as exc:
        raise ConfigError(source, d, f"the fields of {cls.__name__}", str(exc)) from None
    for f in fields(cls):
        v = getattr(obj, f.name)
        if f.type in ("int",) and (isinstance(v, bool) or not isinstance(v, int)):
            raise ConfigError(f"{source}.{f.name}", v, "an integer")
        if f.name in ("memory_total", "ram_total", "total") and v <= 0:
            raise ConfigError(f"{source}.{f.name}", v, "a size in bytes (> 0)")
    return obj
