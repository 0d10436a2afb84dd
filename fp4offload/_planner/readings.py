"""Readings of a machine: what the probe and the benchmarks saw, saved to and replayed from JSON.

A readings file describes one node (its GPUs, host, NVMe and measured bandwidths), so a plan for
a cluster can be made elsewhere: ``fp4offload plan --readings node.json --nodes 16``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from fp4offload.errors import ConfigError
from fp4offload._jsonfile import read_json, write_text

__all__ = ["GpuReading", "HostReading", "DiskReading", "Readings", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class GpuReading:
    """One GPU as NVML (or AMD SMI: ``source``) reports it. Memory in bytes; PCIe generation and lane width of the
    link (the maximum the link trains to, which idle GPUs may undercut in the current values)."""

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
    source: str = "pynvml"


@dataclass(frozen=True)
class HostReading:
    """Host RAM (bytes) and CPU cores. ``memory_source``: where the RAM figures came from (a cgroup's limit and
    usage, or the machine's MemAvailable; empty in readings written before it was recorded)."""

    ram_total: int
    ram_available: int
    cores_physical: int
    cores_logical: int
    cpu_model: str = ""
    memory_source: str = ""


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
        if not _int(version) or version != SCHEMA_VERSION:
            raise ConfigError(f"{source}: version", version, str(SCHEMA_VERSION),
                              "write the readings again with this version of fp4offload")
        body = {k: v for k, v in d.items() if k != "version"}
        _check_keys(body, cls, source)
        kw: dict[str, Any] = dict(body)
        gpus = body.get("gpus") or []
        if not isinstance(gpus, list) or len(gpus) > 1024:
            raise ConfigError(f"{source}: gpus", gpus if not isinstance(gpus, list) else f"<{len(gpus)} entries>",
                              "a list of at most 1024 GPU readings")
        kw["gpus"] = tuple(_build(GpuReading, g, f"{source}: gpus[{i}]") for i, g in enumerate(gpus))
        for name, typ in (("host", HostReading), ("disk", DiskReading)):
            if body.get(name) is not None:
                kw[name] = _build(typ, body[name], f"{source}: {name}")
        ca = body.get("cpu_adam") or {}
        if not isinstance(ca, Mapping) or not all(_rate(v) for v in ca.values()):
            raise ConfigError(f"{source}: cpu_adam", ca, "a mapping of format -> parameters per second (finite, > 0)")
        kw["cpu_adam"] = {str(k): float(v) for k, v in ca.items()}
        notes = body.get("notes") or ()
        if not isinstance(notes, (list, tuple)) or not all(isinstance(n, str) for n in notes):
            raise ConfigError(f"{source}: notes", notes, "a list of strings")
        kw["notes"] = tuple(notes)
        for k in ("h2d_bps", "d2h_bps"):
            v = body.get(k)
            if v is not None and not _rate(v):
                raise ConfigError(f"{source}: {k}", v, "a bandwidth in bytes/s (finite, > 0) or null")
        t = body.get("cpu_adam_threads")
        if t is not None and not (_int(t) and 1 <= t <= _MAX_COUNT):
            raise ConfigError(f"{source}: cpu_adam_threads", t, f"an integer in 1..{_MAX_COUNT} or null")
        for k in ("driver_version", "cuda_version", "hostname", "taken_at"):
            if body.get(k) is not None and not isinstance(body[k], str):
                raise ConfigError(f"{source}: {k}", body[k], "a string or null")
        return cls(**kw)

    def save(self, path: str | Path, key: str = "readings") -> None:
        """Write as JSON, atomically (a new temporary file of random name, mode 0600, then rename); a path that
        cannot be written, or a non-finite number, is a ConfigError naming ``key`` (the flag)."""
        try:
            text = json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"
        except ValueError as exc:
            raise ConfigError(key, str(path), "readings of finite numbers", str(exc)) from None
        write_text(path, text, key)

    @classmethod
    def load(cls, path: str | Path, key: str = "--readings") -> "Readings":
        """Readings saved by :meth:`save`; every failure is a ConfigError naming ``key`` (the flag) and the file."""
        p = Path(path)
        doc = read_json(p, key, str(p), readable="a readable readings file", valid="a JSON readings file")
        return cls.from_dict(doc, source=f"{key} {p}")

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


#: bytes (RAM, GPU memory, disk) a reading may give: 1 EiB
_MAX_BYTES = 1 << 60
#: GPUs, cores, threads, link generations and widths
_MAX_COUNT = 1 << 20


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _rate(v: Any) -> bool:
    """A finite positive rate (bytes/s, parameters/s)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 < v < 1e30


def _check_value(source: str, name: str, typ: str, v: Any) -> None:
    """One field of a reading: the integers are integers in range, the rates finite and positive, the strings
    strings (``typ`` is the field's annotation)."""
    optional = typ.endswith("| None")
    if v is None:
        if optional:
            return
        raise ConfigError(f"{source}.{name}", v, "given")
    base = typ.removesuffix(" | None")
    if base == "int":
        sized = name.startswith(("memory", "ram", "total", "free"))
        high = _MAX_BYTES if sized else _MAX_COUNT
        low = 1 if name in ("memory_total", "ram_total", "total", "cores_physical", "cores_logical") else 0
        if not _int(v) or not low <= v <= high:
            raise ConfigError(f"{source}.{name}", v, f"an integer in {low}..{high}" + (" (bytes)" if sized else ""))
    elif base == "float":
        if not _rate(v):
            raise ConfigError(f"{source}.{name}", v, "a finite rate > 0 (bytes/s)" + (" or null" if optional else ""))
    elif base == "str":
        if not isinstance(v, str):
            raise ConfigError(f"{source}.{name}", v, "a string")
    elif base.startswith("tuple[int, int]"):
        if not (isinstance(v, tuple) and len(v) == 2 and all(_int(x) and 0 <= x < 100 for x in v)):
            raise ConfigError(f"{source}.{name}", list(v) if isinstance(v, tuple) else v,
                              "[major, minor] (two small integers) or null")


def _build(cls: type, d: Any, source: str) -> Any:
    if not isinstance(d, Mapping):
        raise ConfigError(source, d, "a JSON object")
    _check_keys(d, cls, source)
    kw = dict(d)
    if isinstance(kw.get("compute_capability"), list):
        kw["compute_capability"] = tuple(kw["compute_capability"])
    try:
        obj = cls(**kw)
    except TypeError as exc:
        raise ConfigError(source, d, f"the fields of {cls.__name__}", str(exc)) from None
    for f in fields(cls):
        _check_value(source, f.name, str(f.type), getattr(obj, f.name))
    return obj
