"""The strategy catalogue: one YAML file per strategy, shipped inside the wheel.

A strategy says which engine runs (DeepSpeed ZeRO stage, or FSDP2 with or without CPU offload)
and where each tensor class lives and in which format::

    name: zero2-opt-cpu-fp4
    title: ZeRO-2, optimizer states NVFP4 in host RAM
    engine: deepspeed            # deepspeed | fsdp2
    zero_stage: 2                # deepspeed only
    fsdp: {cpu_offload: false, reshard_after_forward: true}   # fsdp2 only
    tensors:
      weights:          {device: gpu, format: bf16}    # the working copy forward/backward use
      grads:            {device: gpu, format: bf16}
      master:           {device: cpu, format: fp32}
      optimizer_states: {device: cpu, format: nvfp4}
      activations:      {device: gpu, format: bf16, checkpointing: auto}
    summary: one paragraph for the plan's output

A split master may keep its 16-bit residual apart from its bf16 half: ``master: {device: cpu, format: split,
residual: nvme}`` puts it in the NVMe state files beside m and v (the block's ``optimizer_states.master_device:
"nvme"``), so it needs ``optimizer_states.device: nvme``. Without ``residual`` it lives with the master.

The files live in the top-level ``strategies/`` folder, which setuptools installs as the package
``fp4offload._strategies``; a source checkout reads the folder directly.
"""

from __future__ import annotations

import functools
import importlib.resources
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from fp4offload.errors import ConfigError
from fp4offload._jsonfile import read_text

__all__ = ["Placement", "Strategy", "load_catalogue", "parse_strategy", "catalogue_files", "TENSOR_CLASSES"]

DEVICES = ("gpu", "cpu", "nvme")
TENSOR_CLASSES: dict[str, tuple[str, ...]] = {
    "weights": ("bf16", "nvfp4"),
    "grads": ("bf16", "fp32"),
    "master": ("fp32", "split", "bf16"),
    "optimizer_states": ("fp32", "nvfp4"),
    "activations": ("bf16", "nvfp4", "mxfp8", "mxfp4", "int2"),
}
#: keys of a tensor class besides device and format
_CLASS_KEYS = {"master": ("residual",), "activations": ("checkpointing",)}
_TOP_KEYS = ("name", "title", "engine", "zero_stage", "fsdp", "tensors", "summary")


@dataclass(frozen=True)
class Placement:
    """Where one tensor class lives (``gpu``, ``cpu`` = host RAM, ``nvme``) and in which format.

    ``residual`` (master only): where split's 16-bit residual lives, ``None`` for beside the master or ``"nvme"``
    for FP4AdamW's NVMe state files (``master_device: "nvme"``); the bf16 half stays on ``device``."""

    device: str
    format: str
    residual: str | None = None
    v_format: str | None = None  #: optimizer_states only: FP4AdamW's v grid (None: the block's default)


@dataclass(frozen=True)
class Strategy:
    """One entry of the catalogue (validated on load).

    ``checkpointing`` is True, False or "auto" (the planner tries without, then with activation
    checkpointing). ``source`` is the file it came from.
    """

    name: str
    title: str
    engine: str
    zero_stage: int | None
    fsdp_cpu_offload: bool
    fsdp_reshard: bool
    weights: Placement
    grads: Placement
    master: Placement
    optimizer_states: Placement
    activations: Placement
    checkpointing: bool | str
    summary: str = ""
    source: str = ""

    @property
    def optimizer_on_host(self) -> bool:
        return self.master.device != "gpu"

    @property
    def residual_on_nvme(self) -> bool:
        """Split's residual in the NVMe state files beside m and v rather than with its bf16 half."""
        return self.master.residual == "nvme"

    @property
    def activation_offload(self) -> bool:
        return self.activations.device != "gpu"

    def placements(self) -> dict[str, Placement]:
        return {c: getattr(self, c) for c in TENSOR_CLASSES}

    def compressions(self) -> list[tuple[str, str]]:
        """(tensor class, format) for every 2-, 4- or 8-bit class."""
        return [(c, p.format) for c, p in self.placements().items()
                if p.format in ("nvfp4", "mxfp4", "mxfp8", "int2") or (c == "master" and p.format != "fp32")]


def _err(src: str, key: str, value: Any, allowed: str, hint: str | None = None) -> ConfigError:
    return ConfigError(f"{src}: {key}", value, allowed, hint)


def parse_strategy(doc: Any, source: str = "<strategy>") -> Strategy:
    """Validate one strategy document (the parsed YAML) and return it."""
    if not isinstance(doc, Mapping):
        raise _err(source, "<document>", type(doc).__name__, "a mapping")
    for k in doc:
        if k not in _TOP_KEYS:
            raise _err(source, str(k), doc[k], "one of " + ", ".join(_TOP_KEYS), "unknown key")
    for k in ("name", "title", "engine", "tensors"):
        if k not in doc:
            raise _err(source, k, None, "present")
    name, engine = doc["name"], doc["engine"]
    if not isinstance(name, str) or not name:
        raise _err(source, "name", name, "a non-empty string")
    if engine not in ("deepspeed", "fsdp2"):
        raise _err(source, "engine", engine, "'deepspeed' or 'fsdp2'")
    stage = doc.get("zero_stage")
    fsdp = doc.get("fsdp") or {}
    if engine == "deepspeed":
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise _err(source, "zero_stage", stage, "0, 1, 2 or 3 for engine deepspeed")
        if doc.get("fsdp") is not None:
            raise _err(source, "fsdp", doc["fsdp"], "absent for engine deepspeed")
    else:
        if stage is not None:
            raise _err(source, "zero_stage", stage, "absent for engine fsdp2")
        if not isinstance(fsdp, Mapping) or set(fsdp) - {"cpu_offload", "reshard_after_forward"}:
            raise _err(source, "fsdp", fsdp, "a mapping with cpu_offload and reshard_after_forward")
        for k in ("cpu_offload", "reshard_after_forward"):
            if not isinstance(fsdp.get(k, False), bool):
                raise _err(source, f"fsdp.{k}", fsdp.get(k), "true or false")

    tensors = doc["tensors"]
    if not isinstance(tensors, Mapping):
        raise _err(source, "tensors", tensors, "a mapping of tensor class -> {device, format}")
    places: dict[str, Placement] = {}
    ckpt: bool | str = "auto"
    for cls, formats in TENSOR_CLASSES.items():
        t = tensors.get(cls)
        if not isinstance(t, Mapping):
            raise _err(source, f"tensors.{cls}", t, "a mapping {device, format}")
        keys = ("device", "format", *_CLASS_KEYS.get(cls, ()))
        extra = set(t) - set(keys)
        if extra:
            raise _err(source, f"tensors.{cls}.{sorted(extra)[0]}", t[sorted(extra)[0]], ", ".join(keys),
                       "unknown key")
        if t.get("device") not in DEVICES:
            raise _err(source, f"tensors.{cls}.device", t.get("device"), ", ".join(DEVICES))
        if t.get("format") not in formats:
            raise _err(source, f"tensors.{cls}.format", t.get("format"), ", ".join(formats))
        residual = t.get("residual")
        if "residual" in t and residual not in DEVICES:
            raise _err(source, f"tensors.{cls}.residual", residual, ", ".join(DEVICES), "or leave it out (with the "
                       "master)")
        # a residual stated where the master is says nothing more: stored as None, the one form of "with the master"
        places[cls] = Placement(t["device"], t["format"], None if residual == t["device"] else residual)
        if cls == "activations":
            ckpt = t.get("checkpointing", "auto")
            if ckpt not in (True, False, "auto"):
                raise _err(source, "tensors.activations.checkpointing", ckpt, "true, false or auto")
    unknown = set(tensors) - set(TENSOR_CLASSES)
    if unknown:
        k = sorted(unknown)[0]
        raise _err(source, f"tensors.{k}", tensors[k], "one of " + ", ".join(TENSOR_CLASSES), "unknown tensor class")

    s = Strategy(name=name, title=str(doc["title"]), engine=engine, zero_stage=stage,
                 fsdp_cpu_offload=bool(fsdp.get("cpu_offload", False)),
                 fsdp_reshard=bool(fsdp.get("reshard_after_forward", True)), checkpointing=ckpt,
                 summary=" ".join(str(doc.get("summary", "")).split()), source=source, **places)
    _check_consistent(s)
    return s


def _check_consistent(s: Strategy) -> None:
    """Combinations the engines cannot run."""
    src = s.source
    w, m, o, g = s.weights, s.master, s.optimizer_states, s.grads
    if m.residual is not None:  # split's residual apart from its bf16 half: FP4AdamW's NVMe state files only
        if m.format != "split":
            raise _err(src, "tensors.master.residual", m.residual, f"absent with format {m.format}",
                       "only a split master has a residual; use format split, or drop residual")
        if m.residual != "nvme":
            raise _err(src, "tensors.master.residual", m.residual, f"nvme, or {m.device} (with the master)",
                       "the residual goes either with the bf16 half or into the NVMe state files")
        if o.device != "nvme":
            raise _err(src, "tensors.master.residual", "nvme", "absent unless optimizer_states.device is nvme",
                       "the residual is kept in the NVMe state files beside m and v: put optimizer_states on "
                       "nvme, or drop residual")
    if m.format != "fp32":  # the block's compact master: FP4AdamW's, on DeepSpeed's bf16 master mode or FSDP2
        if o.format != "nvfp4":
            raise _err(src, "tensors.master.format", m.format, "fp32 with fp32 optimizer states",
                       "a compact master is FP4AdamW's")
        if s.engine == "deepspeed" and m.device != "cpu":
            raise _err(src, "tensors.master", f"{m.device}/{m.format}", "device cpu (offload_optimizer)")
        if w.format == "nvfp4":
            raise _err(src, "tensors.weights.format", "nvfp4", f"bf16 with master {m.format}",
                       "packed weights are encoded from an fp32 master")
    if w.format == "nvfp4" and w.device == "gpu" and s.engine == "deepspeed":
        raise _err(src, "tensors.weights", "gpu/nvfp4", "device cpu or nvme for nvfp4 weights",
                   "the packed copy is the host/NVMe partition fetched per layer")
    if s.engine == "deepspeed":
        if w.device != "gpu" and s.zero_stage != 3:
            raise _err(src, "tensors.weights.device", w.device, "gpu unless zero_stage is 3")
        if o.device != m.device and not (o.format == "nvfp4" and o.device == "nvme" and m.device == "cpu"):
            raise _err(src, "tensors.optimizer_states.device", o.device, f"{m.device!r} (with the master)",
                       "only packed states go to NVMe apart from a host master (fp4offload's own NVMe tier)")
        if m.device == "nvme" and (o.format != "fp32" or s.zero_stage != 3):
            raise _err(src, "tensors.master.device", "nvme", "cpu or gpu",
                       "DeepSpeed's NVMe optimizer swapper needs ZeRO-3 and fp32 states")
        if m.device == "gpu" and g.device != "gpu":
            raise _err(src, "tensors.grads.device", g.device, "gpu when the master is on the GPU")
    else:
        off = s.fsdp_cpu_offload
        want = "cpu" if off else "gpu"
        for cls in ("master", "grads"):
            if getattr(s, cls).device != want:
                raise _err(src, f"tensors.{cls}.device", getattr(s, cls).device, f"{want!r} with cpu_offload={off}")
        if o.device not in (want, "nvme" if off else want):
            raise _err(src, "tensors.optimizer_states.device", o.device, f"{want!r} with cpu_offload={off}")
        if w.device not in ("gpu", "cpu") or (w.device == "cpu") != off:
            raise _err(src, "tensors.weights.device", w.device, f"{'cpu' if off else 'gpu'} with cpu_offload={off}")


# ---------------------------------------------------------------------------------------------
# Loading


def catalogue_files(directory: str | Path | None = None) -> list[tuple[str, str]]:
    """(file name, text) of every ``*.yaml`` in the catalogue, sorted by name.

    From ``directory`` if given; else the installed package ``fp4offload._strategies``; else (a
    source checkout) the ``strategies/`` folder next to the ``fp4offload`` package. A file of a given
    ``directory`` must be a regular UTF-8 file of at most ``jsonfile.MAX_INPUT_BYTES`` (a FIFO, a device, a
    folder named ``*.yaml`` is refused unread, as ConfigError naming it).
    """
    if directory is not None:
        d = Path(directory)
        if not d.is_dir():
            raise ConfigError("--strategies", str(directory), "a directory of strategy YAML files")
        return [(p.name, read_text(p, p.name, str(p), readable="a readable strategy YAML file"))
                for p in sorted(d.glob("*.yaml"))]
    try:
        root = importlib.resources.files("fp4offload._strategies")
        files = [(r.name, r.read_text()) for r in root.iterdir() if r.name.endswith(".yaml")]
        if files:
            return sorted(files)
    except ModuleNotFoundError:
        pass
    src = Path(__file__).resolve().parents[2] / "strategies"
    if src.is_dir():
        return [(p.name, p.read_text()) for p in sorted(src.glob("*.yaml"))]
    raise ConfigError("strategies", None, "the strategy catalogue installed with fp4offload",
                      "reinstall the package: its strategies/*.yaml files are missing")


@functools.lru_cache(maxsize=1)
def _yaml_loader():
    """A safe YAML loader (libyaml's when there is one) that refuses a mapping key given twice."""
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class Unique(base):  # type: ignore[misc, valid-type]
        def construct_mapping(self, node, deep=False):
            seen: dict = {}
            for k, _ in node.value:
                key = self.construct_object(k, deep=True)
                try:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {key!r} is given twice (lines {seen[key] + 1} and "
                            f"{k.start_mark.line + 1})", k.start_mark)
                    seen[key] = k.start_mark.line
                except TypeError:  # an unhashable key: the base constructor says so
                    pass
            return super().construct_mapping(node, deep=deep)

    return Unique


def _parse(fname: str, text: str) -> Strategy:
    import yaml

    try:
        doc = yaml.load(text, Loader=_yaml_loader())  # a safe loader
    except yaml.YAMLError as exc:
        raise ConfigError(fname, "<invalid YAML>", "a YAML mapping, each key once",
                          " ".join(str(exc).split())[:300]) from None
    except RecursionError:
        raise ConfigError(fname, "<invalid YAML>", "a YAML mapping", "it nests too deeply") from None
    return parse_strategy(doc, fname)


def _check_names(parsed: list[tuple[str, Strategy]]) -> dict[str, Strategy]:
    out: dict[str, Strategy] = {}
    for fname, s in parsed:
        if s.name in out:
            raise ConfigError(f"{fname}: name", s.name, "a name no other strategy file uses")
        if Path(fname).stem != s.name:
            raise ConfigError(f"{fname}: name", s.name, f"{Path(fname).stem!r} (the file name)")
        out[s.name] = s
    if not out:
        raise ConfigError("strategies", None, "at least one strategy file")
    return out


@functools.lru_cache(maxsize=1)
def _installed() -> tuple[tuple[str, Strategy], ...]:
    return tuple((fname, _parse(fname, text)) for fname, text in catalogue_files(None))


def load_catalogue(directory: str | Path | None = None) -> dict[str, Strategy]:
    """Every strategy of the catalogue by name (file order), validated. The installed catalogue is read once
    per process; a ``directory`` is read every time."""
    if directory is None:
        return _check_names(list(_installed()))
    return _check_names([(fname, _parse(fname, text)) for fname, text in catalogue_files(directory)])


def select(catalogue: Mapping[str, Strategy], names: Iterable[str] | None = None,
           engine: str | None = None) -> list[Strategy]:
    """Strategies by name (all when None) and engine (any when None)."""
    picked = list(catalogue.values())
    if names:
        missing = [n for n in names if n not in catalogue]
        if missing:
            raise ConfigError("--strategy", missing[0], ", ".join(catalogue))
        picked = [catalogue[n] for n in names]
    if engine:
        picked = [s for s in picked if s.engine == engine]
    return picked
