"""DeepSpeed's private names: every one the block patches or reads, in one table, checked at initialize.

DeepSpeed has no public hooks for what the block changes (the dtype of ZeRO-1/2's host gradient partition,
its bf16 staging buffers, how a ZeRO-3 partition is fetched). The block reaches into DeepSpeed's classes
for those, and this module is the only place that does: the other DeepSpeed modules of fp4offload read,
write and patch private names through :func:`read`, :func:`require`, :func:`write`, :func:`patch_class` and
:func:`wrap_instance`, which accept only names listed in :data:`TABLE`. That includes the attributes ZeRO-3
sets on its parameters (``param.ds_tensor``, ``param.ds_status``, ...): ``tests/unit/test_ds_internals.py`` fails
on a read or write of a listed name anywhere else (names too common to search for, such as ``device``, aside).

Each row of the table names the attribute, the class (or module) DeepSpeed defines it in, what the block
does with it, and the block features that need it (the ``feature`` of the records of
:data:`fp4offload._deepspeed.surgeries.SURGERIES` that use it). :func:`check` runs at initialize, for the features the
config turns on, before DeepSpeed builds anything: an unsupported DeepSpeed version, or one where a name
the block needs is gone, is a :class:`~fp4offload.errors.ConfigError` naming the installed version, the
missing names and the supported range, instead of an AttributeError deep inside a training step.

How a name is checked depends on its kind:

- ``callable``: a function, method or enum member of the class; looked up on it.
- ``attribute``: an attribute DeepSpeed sets on instances (``self.<name>``); the class's source must
  assign it. Cheap, and it catches a rename, which is what DeepSpeed releases do to these names.
- ``param``: an attribute ZeRO-3 sets on the tensors it hands around (``param.<name>``, or the flat fp32
  masters' ``ds_id``), checked in the source of the module that sets it the same way.

:data:`SUPPORTED` is the one definition of the DeepSpeed releases the block has been run on (the
``deepspeed`` bound of pyproject.toml agrees with it; tests/unit/test_ds_internals.py checks that).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from fp4offload.errors import ConfigError

__all__ = ["SUPPORTED", "requirement", "TABLE", "Internal", "FEATURES", "check", "missing", "read",
           "require", "write", "patch_class", "wrap_instance", "installed_version", "supported", "ZERO12", "ZERO3"]

#: DeepSpeed releases the block is run on, [low, high); pyproject.toml's bound is built from the same numbers.
SUPPORTED = ((0, 19, 8), (0, 20, 0))

_ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
_Z12 = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
_Z3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
_PP = "deepspeed.runtime.zero.partition_parameters"

#: the owners of ZeRO-1/2's and ZeRO-3's rows, for :func:`patch_class`
ZERO12, ZERO3 = _Z12, _Z3


@dataclass(frozen=True)
class Internal:
    """One private DeepSpeed name: where it is defined, how it is checked, what the block does with it."""

    owner: str  # dotted path of the class (or module) that defines it
    name: str
    kind: str  # "callable" | "attribute" | "param"
    use: str
    features: tuple[str, ...]

    @property
    def qualname(self) -> str:
        return f"{self.owner.rsplit('.', 1)[-1]}.{self.name}"


_OPT = ("optimizer_states",)
_GRADS = ("bf16_gradient_partition",)
_STAGING = ("share_bf16_staging",)
_WEIGHTS = ("weights",)
_MASTER = ("compact_master",)

TABLE: tuple[Internal, ...] = (
    # the engine
    Internal(_ENGINE, "basic_optimizer", "attribute", "read: the client optimizer inside ZeRO (FP4AdamW)",
             ("monitor",)),
    # ZeRO-1/2 (stage_1_and_2.py)
    Internal(_Z12, "optimizer", "attribute", "read: the client optimizer ZeRO wraps (FP4AdamW or not)",
             _GRADS + ("monitor",)),
    Internal(_Z12, "initialize_optimizer_states", "callable",
             "replaced while deepspeed.initialize runs: allocates the host gradient partition in bf16", _GRADS),
    Internal(_Z12, "single_partition_of_fp32_groups", "attribute",
             "read: the fp32 master partitions; their .grad is set to the bf16 gradient partition",
             _GRADS + _MASTER + ("monitor",)),
    Internal(_Z12, "compute_grad_norm", "attribute", "read: whether the step computes the global gradient norm",
             _OPT),
    Internal(_Z12, "_global_grad_norm", "attribute",
             "read: this step's global gradient norm, which FP4AdamW's non-finite check uses instead of a pass "
             "over the gradients", _OPT),
    Internal(_Z12, "_configure_master_weights", "callable",
             "replaced while deepspeed.initialize runs: lets FP4AdamW step the bf16 master mode's partitions "
             "(DeepSpeed's check admits DeepSpeedCPUAdam only)", _MASTER),
    Internal(_Z12, "bit16_groups", "attribute", "read: the parameters' dtype (bf16 required)", _GRADS),
    Internal(_Z12, "partition_size", "attribute", "read: elements of each rank's partition", _GRADS),
    Internal(_Z12, "cpu_offload", "attribute", "read: whether offload_optimizer is on", _GRADS),
    Internal(_Z12, "cpu_offload_pin_memory", "attribute", "read: whether the gradient partition is pinned", _GRADS),
    Internal(_Z12, "gradient_accumulation_steps", "attribute", "read: 1 is required for a bf16 partition", _GRADS),
    Internal(_Z12, "device", "attribute", "read: where the gradient partition lives", _GRADS),
    Internal(_Z12, "param_buffer_of_bit16_for_cpu_offload_groups", "attribute",
             "entries replaced by the bf16 partitions on the CPU accelerator, or by the bf16 master partitions",
             _STAGING + _MASTER),
    Internal(_Z12, "parallel_partitioned_bit16_groups", "attribute", "read: this rank's bf16 partitions",
             _STAGING + _MASTER),
    Internal(_Z12, "_link_all_hp_params", "callable",
             "called once a compact master is the model's bf16 partition: each parameter's view of its master "
             "fragment (safe_get_full_fp32_param, checkpoints) is rebuilt on the tensor the step updates", _MASTER),
    Internal(_Z12, "real_dp_process_group", "attribute", "read: the data-parallel group of each partition",
             _STAGING + _MASTER),
    # ZeRO-3 (stage3.py)
    Internal(_Z3, "optimizer", "attribute", "read: the client optimizer ZeRO wraps (FP4AdamW or not)",
             _WEIGHTS + _GRADS + ("monitor",)),
    Internal("deepspeed.runtime.zero.stage3", "ds_id", "param",
             "read: the id stage3 gives each sub-group's flat fp32 master (names FP4AdamW's files and streams)", _OPT),
    Internal(_Z3, "_configure_master_weights", "callable",
             "replaced while deepspeed.initialize runs: lets FP4AdamW step the bf16 master mode's sub-group "
             "partitions (DeepSpeed's check admits DeepSpeedCPUAdam only)", _MASTER),
    Internal(_Z3, "unscale_and_clip_grads", "callable",
             "replaced per optimizer with a compact master, or a bf16 gradient for an fp32 master: its factor goes "
             "to FP4AdamW, applied in fp32", _MASTER + _GRADS),
    Internal(_Z3, "clip_grad", "attribute", "read: the gradient clipping threshold", _MASTER + _GRADS),
    Internal(_Z3, "loss_scale", "attribute", "read: the loss scale (1 under bf16)", _MASTER + _GRADS),
    Internal(_Z3, "_reassign_or_swap_out_partitioned_parameters", "callable",
             "wrapped per optimizer: packs the new weights after each sub-group's step", _WEIGHTS),
    Internal(_Z3, "fp16_groups", "attribute", "read: the parameters of each sub-group", _WEIGHTS + _GRADS),
    Internal(_Z3, "initialize_optimizer_states", "callable",
             "replaced while deepspeed.initialize runs: the master gradients are allocated, not zero-filled, when "
             "they will become slices of the gradient partition", _GRADS),
    Internal(_Z3, "fp16_partitioned_groups_flat_numel", "attribute", "read: elements of each sub-group's partition",
             _GRADS),
    Internal(_Z3, "offload_optimizer_pin_memory", "attribute", "read: whether DeepSpeed pins the master gradients",
             _GRADS),
    Internal(_Z3, "grad_partitions_flat_buffer", "attribute",
             "read: the flat gradient partition; each sub-group's master gradient becomes its slice", _GRADS),
    Internal(_Z3, "offload_optimizer", "attribute", "read: whether offload_optimizer is on", _GRADS),
    Internal(_Z3, "_swappable_optimizer_subgroup", "callable",
             "read: whether DeepSpeed's NVMe swapper holds a sub-group (its gradient is then swapped)", _GRADS),
    Internal(_Z3, "fp16_partitioned_groups_flat", "attribute", "read: where each partition sits in its sub-group "
             "(and, on the CPU accelerator, the storage a compact master shares)", _WEIGHTS + _MASTER),
    Internal(_Z3, "fp32_partitioned_groups_flat", "attribute", "read: the flat fp32 master of each sub-group",
             _WEIGHTS + _MASTER + _GRADS + ("monitor",)),
    # ZeRO-3 parameters (partition_parameters.py)
    Internal(f"{_PP}.Init", "_convert_to_deepspeed_param", "callable",
             "binds the per-parameter fetch functions that the block replaces", _WEIGHTS),
    *(Internal(f"{_PP}.ZeroParamStatus", s, "callable", "read and set: a parameter's fetch state", _WEIGHTS)
      for s in ("NOT_AVAILABLE", "INFLIGHT", "AVAILABLE")),
    *(Internal(_PP, n, "param", "replaced per parameter: fetch packed bytes and decode on the device", _WEIGHTS)
      for n in ("all_gather_coalesced", "all_gather", "partition")),
    *(Internal(_PP, n, "param", "read: the partition and its shape, size, state and group", _WEIGHTS)
      for n in ("ds_tensor", "ds_shape", "ds_numel", "ds_status", "ds_process_group",
                "ds_zero_partition_world_size", "ds_summary")),
    Internal(_PP, "ds_id", "param", "read: a parameter's stable id (names FP4AdamW's state files and streams)", _OPT),
)

#: The block's features that need private names: the tags of the table's rows, each the ``feature`` of records of
#: fp4offload._deepspeed.surgeries.SURGERIES.
FEATURES: tuple[str, ...] = tuple(dict.fromkeys(f for row in TABLE for f in row.features))

_BY_NAME: dict[str, Internal] = {}
for _row in TABLE:
    _BY_NAME.setdefault(_row.name, _row)


def _version_tuple(v: str) -> tuple[int, int, int]:
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        m = re.match(r"\d+", part)
        out.append(int(m.group()) if m else 0)
    out += [0] * (3 - len(out))
    return out[0], out[1], out[2]


def _fmt(v: tuple[int, ...]) -> str:
    parts = list(v)
    while len(parts) > 2 and parts[-1] == 0:
        parts.pop()
    return ".".join(map(str, parts))


def supported(version: str) -> bool:
    """Whether a DeepSpeed version string is inside :data:`SUPPORTED`."""
    lo, hi = SUPPORTED
    return lo <= _version_tuple(version) < hi


def requirement() -> str:
    """The pip requirement for a supported DeepSpeed, e.g. ``deepspeed>=0.19.0,<0.20``."""
    lo, hi = SUPPORTED
    return f"deepspeed>={_fmt(lo)},<{_fmt(hi)}"


def installed_version() -> str:
    import deepspeed

    return str(deepspeed.__version__)


def _resolve(path: str) -> Any:
    """The class or module at a dotted path (None if it does not import)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


@functools.lru_cache(maxsize=None)
def _source(path: str) -> str:
    obj = _resolve(path)
    if obj is None:
        return ""
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _present(row: Internal) -> bool:
    if row.kind == "callable":
        owner = _resolve(row.owner)
        return owner is not None and hasattr(owner, row.name)
    pattern = rf"\bself\.{re.escape(row.name)}\b" if row.kind == "attribute" else rf"\.{re.escape(row.name)}\b"
    return re.search(pattern, _source(row.owner)) is not None


def missing(features: Iterable[str]) -> list[Internal]:
    """Rows needed by ``features`` that the installed DeepSpeed lacks."""
    want = set(features)
    unknown = want - set(FEATURES)
    if unknown:
        raise ValueError(f"unknown block features {sorted(unknown)}; known: {FEATURES}")
    return [row for row in TABLE if want & set(row.features) and not _present(row)]


def check(features: Iterable[str]) -> None:
    """Raise ConfigError unless the installed DeepSpeed is supported and has every name ``features`` need.

    Called by ``fp4offload.deepspeed.initialize`` before ``deepspeed.initialize`` builds anything. The error
    names the feature's key, the installed version, the missing names and the supported range.
    """
    features = tuple(features)
    if not features:
        return
    version = installed_version()
    lo, hi = SUPPORTED
    gone = missing(features)
    if supported(version) and not gone:
        return
    feature = next((f for f in features if any(f in r.features for r in gone)), features[0])
    what = (f"DeepSpeed {version} lacks " + ", ".join(f"{r.qualname} ({r.owner.rsplit('.', 1)[0]})" for r in gone)
            if gone else f"DeepSpeed {version} is outside the releases this block is run on")
    raise ConfigError(f"fp4offload.{feature}", f"deepspeed {version}",
                      f"DeepSpeed >= {_fmt(lo)} and < {_fmt(hi)}",
                      f"{what}; the block patches private DeepSpeed names (fp4offload._deepspeed.internals): "
                      f"pip install '{requirement()}', or remove fp4offload.{feature}")


def _row(name: str) -> Internal:
    row = _BY_NAME.get(name)
    if row is None:
        raise KeyError(f"{name!r} is not in internals.TABLE: add it there (owner, use, features) first")
    return row


def read(obj: Any, name: str, default: Any = None) -> Any:
    """``getattr(obj, name, default)`` for a private DeepSpeed name listed in the table."""
    _row(name)
    return getattr(obj, name, default)


def require(obj: Any, name: str) -> Any:
    """``getattr(obj, name)`` for a listed name; a RuntimeError naming the version and range if it is gone."""
    row = _row(name)
    try:
        return getattr(obj, name)
    except AttributeError:
        raise RuntimeError(f"fp4offload: {type(obj).__name__}.{name} is gone in DeepSpeed {installed_version()} "
                           f"({row.use}); install {requirement()}") from None


def write(obj: Any, name: str, value: Any) -> None:
    """``setattr(obj, name, value)`` for a listed name (a ZeRO-3 parameter's fetch state or fetch function)."""
    _row(name)
    setattr(obj, name, value)


@contextlib.contextmanager
def patch_class(owner: str, name: str, make: Callable[[Callable], Callable]) -> Iterator[bool]:
    """Replace the listed method ``owner.name`` by ``make(original)`` for the duration of the block.

    Yields False (and changes nothing) when the class or method is not there."""
    _row(name)
    if not any(r.owner == owner and r.name == name and r.kind == "callable" for r in TABLE):
        raise KeyError(f"{owner}.{name} is not a patchable method of internals.TABLE")
    cls = _resolve(owner)
    orig = getattr(cls, name, None) if cls is not None else None
    if orig is None:
        yield False
        return
    setattr(cls, name, make(orig))
    try:
        yield True
    finally:
        setattr(cls, name, orig)


def wrap_instance(obj: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    """``obj.name = make(obj.name)`` for a listed name (a bound method or per-parameter function)."""
    setattr(obj, name, make(require(obj, name)))
