"""The schema of the ``"fp4offload"`` block of a DeepSpeed config: its sub-blocks and the block itself.

Each is a frozen dataclass; every sub-block is optional, and an absent sub-block means the feature is off.
Construction validates, so an object that exists is a valid one: every number finite, in range and of its type,
every word one of :mod:`fp4offload._config.vocab`'s, every path well formed (never looked up on the disk), and
settings that would be ignored are refused (``nvme_path`` without ``device: nvme``, ``format: fp32`` with
``device: nvme``). :func:`parse_block` reads the block from a JSON dict, refusing unknown keys.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping

from fp4offload.errors import ConfigError

from .checks import (_as_tuple, check_bool, check_choice, check_class_formats, check_int, _check_names, _check_path,
                     _error, _plain_float, _prefix, _under)
from .vocab import (ACTIVATION_DEVICES, ACTIVATION_FORMATS, ACTIVATION_MIN_NUMEL, ACTIVATION_MODULES,
                    ACTIVATION_NORM_CHOICES, ALLOCATOR_CACHE, KEEP_BF16, MASTER_DEVICES, MASTER_FORMS, MMAP_THRESHOLD,
                    MMAP_THRESHOLD_MAX, OFF_VALUES, OPTIMIZER_DEVICES, OPTIMIZER_FORMATS, PREFLIGHT_MODES, ROUNDINGS,
                    STATE_MIN_NUMEL, V_FORMAT_DEFAULT, V_FORMATS, V_ROUNDING_DEFAULT, WEIGHT_DEVICES, WEIGHT_FORMATS)

__all__ = ["OptimizerStatesConfig", "ActivationsConfig", "WeightsConfig", "MonitorConfig", "HostConfig",
           "Fp4OffloadConfig", "parse_block"]

_KEEP_RULE = re.compile(r"^(first|last):(\d+)$")


def _check_nvme(prefix: str, device: str, nvme_path: str | None) -> None:
    if device == "nvme" and nvme_path is None:
        raise _error(f"{prefix}.nvme_path", None, "a directory on an NVMe drive when device is 'nvme'",
                     f"set {_prefix.get()}{prefix}.nvme_path, e.g. \"/local_nvme/fp4offload\"")


# ---------------------------------------------------------------------------------------------
# The sub-blocks


@dataclass(frozen=True)
class OptimizerStatesConfig:
    """Adam's m and v in 4-bit (``optimizer_states``).

    Attributes:
        format: ``"nvfp4"`` (m in NVFP4 1x16, sqrt(v) on a 4-bit grid, see docs/design.md 3.7) or ``"fp32"``
            (unpacked; for ablations). Default ``"nvfp4"``.
        device: where the states live between steps. ``"same"`` (default): with the parameter
            partition the optimizer is handed (the GPU, or host RAM when DeepSpeed's
            ``offload_optimizer.device`` is ``"cpu"``). ``"cpu"``: pinned host RAM. ``"nvme"``:
            files under ``nvme_path``, staged through pinned host buffers.
        nvme_path: directory for the state files; required when device is ``"nvme"``. Default None.
        rounding: rounding of m, ``"stochastic"`` (default) or ``"nearest"``.
        v_rounding: rounding of the stored sqrt(v), ``"nearest"`` or ``"stochastic"`` (default
            :data:`V_ROUNDING_DEFAULT`; docs/numerics.md, "Rounding of the optimizer states").
        v_format: the grid of the stored sqrt(v), ``"ue2m2"`` (default, :data:`V_FORMAT_DEFAULT`) or ``"ufp4"``
            (the grid before 2026-12-03; docs/numerics.md, "The grid of sqrt(v)"); ``"nvfp4"`` stores v itself
            (ablation).
        min_numel: tensors with fewer elements keep fp32 states. Elements; default 4096.
        master: how the master weight is held (FP4AdamW's ``master``, docs/numerics.md "Master weights"):
            ``"fp32"`` (default: DeepSpeed's fp32 partition), ``"split"`` (a bf16 partition plus a 16-bit
            residual in the optimizer: the fp32 master exactly, 2 B/param less) or ``"bf16"`` (a bf16 partition
            updated with stochastic rounding, 4 B/param less). The compact forms run on DeepSpeed's bf16 master
            mode (``bf16.bf16_master_weights_and_grads``, which the block turns on) with ZeRO-1/2 and
            offload_optimizer.
        master_device: where split's residual lives between steps: ``"same"`` (default: host RAM) or ``"nvme"``
            (in the state files beside the packed m and v, read ahead and written behind with them; with master
            ``"split"`` and the states on NVMe only). Host RAM then holds no residual between steps.
    """

    format: str = "nvfp4"
    device: str = "same"
    nvme_path: str | None = None
    rounding: str = "stochastic"
    v_rounding: str = V_ROUNDING_DEFAULT
    v_format: str = V_FORMAT_DEFAULT
    min_numel: int = STATE_MIN_NUMEL
    master: str = "fp32"
    master_device: str = "same"

    def __post_init__(self) -> None:
        check_choice("optimizer_states.format", self.format, OPTIMIZER_FORMATS)
        check_choice("optimizer_states.device", self.device, OPTIMIZER_DEVICES)
        _check_path("optimizer_states.nvme_path", self.nvme_path)
        check_choice("optimizer_states.rounding", self.rounding, ROUNDINGS)
        check_choice("optimizer_states.v_rounding", self.v_rounding, ROUNDINGS)
        check_choice("optimizer_states.v_format", self.v_format, V_FORMATS)
        check_choice("optimizer_states.master", self.master, MASTER_FORMS)
        if self.master != "fp32" and self.format != "nvfp4":
            raise _error("optimizer_states.master", self.master, "'fp32' with format 'fp32'",
                              "a compact master is FP4AdamW's; set format 'nvfp4' or master 'fp32'")
        check_choice("optimizer_states.master_device", self.master_device, MASTER_DEVICES)
        if self.master_device == "nvme" and self.master != "split":
            raise _error("optimizer_states.master_device", "nvme", f"'same' with master {self.master!r}",
                         "only split keeps a residual, and it goes to NVMe beside the states: set master 'split', "
                         "or master_device 'same'")
        if self.master_device == "nvme" and self.device == "cpu":
            raise _error("optimizer_states.master_device", "nvme", "'same' with device 'cpu'",
                         "the residual goes into the NVMe state files: set device 'nvme', or master_device 'same'")
        check_int("optimizer_states.min_numel", self.min_numel)
        _check_nvme("optimizer_states", self.device, self.nvme_path)
        if self.format == "fp32" and self.device == "nvme":
            raise _error("optimizer_states.device", "nvme", "'same' or 'cpu' with format 'fp32'",
                         "format 'fp32' is torch AdamW, which keeps its states in memory beside the parameters and "
                         "never on NVMe: set format 'nvfp4' for NVMe states, or drop device 'nvme'")
        if self.nvme_path is not None and self.format == "fp32":
            raise _error("optimizer_states.nvme_path", self.nvme_path, "null with format 'fp32'",
                         "torch AdamW's fp32 states never go to NVMe, so the folder would be ignored: remove it, "
                         "or set format 'nvfp4' and device 'nvme'")
        if self.nvme_path is not None and self.device == "cpu":
            raise _error("optimizer_states.nvme_path", self.nvme_path, "null unless device is 'nvme'",
                         "device 'cpu' keeps the states in host RAM, so the folder would be ignored: remove it, or "
                         "set device 'nvme'")


@dataclass(frozen=True)
class ActivationsConfig:
    """Tensors autograd saves for backward, packed and moved (``activations``).

    Attributes:
        format: ``"nvfp4"`` (default), ``"mxfp4"``, ``"mxfp8"`` (gentler, 8-bit), ``"int2"`` (experimental:
            the linear layers' inputs in 2 bits, 0.3125 B/element; docs/design.md 3.11) or ``"none"`` (moved
            unpacked, in their own dtype).
        device: ``"cpu"`` (pinned host RAM, default), ``"nvme"`` (files under ``nvme_path``) or
            ``"same"`` (stay on the GPU, compressed only).
        nvme_path: directory for activation files; required when device is ``"nvme"``. Default None.
        min_numel: saved tensors with fewer elements are left alone. Elements; default 65536.
        modules: glob patterns (fnmatch) over module qualified names whose saved tensors are
            handled, e.g. ``["*.mlp"]``. Default ``[]``: every module (the whole forward).
        exclude: glob patterns of modules to leave alone even if ``modules`` matches. Default [].
        max_host_bytes: cap on the pinned host RAM each rank's activation pool may hold, in bytes; past it
            tensors stay on their device, compressed. Default None: half of the RAM available when the pool
            is created, divided by the node's local ranks (LOCAL_WORLD_SIZE), so the ranks of a node share half.
        attention_qk_format: the query and key fused attention saves (``"bf16"`` default): its backward
            recomputes the probabilities from them against the exact log-sum-exp, so 4 bits there wreck the
            gradient. ``"inherit"``: like the rest.
        attention_format: the value and output fused attention saves (``"mxfp8"`` default).
        mlp_format: what activation functions and the gate products save, the MLP's inner tensors
            (``"mxfp8"`` default; ``"inherit"``: like the rest).
    """

    format: str = "nvfp4"
    device: str = "cpu"
    nvme_path: str | None = None
    min_numel: int = ACTIVATION_MIN_NUMEL
    modules: tuple[str, ...] = ACTIVATION_MODULES
    exclude: tuple[str, ...] = ()
    max_host_bytes: int | None = None
    attention_qk_format: str = "bf16"
    attention_format: str = "mxfp8"
    mlp_format: str = "mxfp8"

    def __post_init__(self) -> None:
        _as_tuple(self, "modules")
        _as_tuple(self, "exclude")
        check_choice("activations.format", self.format, ACTIVATION_FORMATS)
        check_choice("activations.device", self.device, ACTIVATION_DEVICES)
        check_choice("activations.attention_qk_format", self.attention_qk_format, ACTIVATION_NORM_CHOICES)
        check_choice("activations.attention_format", self.attention_format, ACTIVATION_NORM_CHOICES)
        check_choice("activations.mlp_format", self.mlp_format, ACTIVATION_NORM_CHOICES)
        check_class_formats("activations.", self.format, (), {n: getattr(self, n) for n in (
            "attention_qk_format", "attention_format", "mlp_format")})
        _check_path("activations.nvme_path", self.nvme_path)
        check_int("activations.min_numel", self.min_numel)
        _check_names("activations.modules", self.modules)
        _check_names("activations.exclude", self.exclude)
        if self.max_host_bytes is not None:
            check_int("activations.max_host_bytes", self.max_host_bytes)
        _check_nvme("activations", self.device, self.nvme_path)
        if self.nvme_path is not None and self.device != "nvme":
            raise _error("activations.nvme_path", self.nvme_path, "null unless device is 'nvme'",
                         f"device {self.device!r} keeps activations "
                         f"{'in host RAM' if self.device == 'cpu' else 'where they are'}, so the folder would be "
                         "ignored: remove it, or set device 'nvme'")
        if self.format == "none" and self.device == "same":
            raise _error("activations.device", "same", "'cpu' or 'nvme' when format is 'none'",
                         "format 'none' with device 'same' does nothing: pick a 4-bit format or move them")


@dataclass(frozen=True)
class WeightsConfig:
    """The weight working copy that forward and backward compute with (``weights``).

    Under DeepSpeed this needs ZeRO stage 3 with ``offload_param`` on the same device (the host
    partition is stored packed and fetched per layer); under FSDP2 the shards are all-gathered packed, and with
    ``cpu_offload: true`` the host copy is the packed one too.

    Attributes:
        format: ``"nvfp4"`` (16x16 blocks, nearest; default) or ``"bf16"``.
        device: ``"cpu"`` (default, and the only choice: both engines keep packed shards in host RAM).
        keep_bf16: parameters that stay bf16: substrings of parameter names (``"embed"``,
            ``"lm_head"``, ``"norm"``, ``"bias"``) and ``"first:N"`` / ``"last:N"`` for the first and
            last N transformer blocks. Default: embeddings, head, norms, biases, first and last block.
    """

    format: str = "nvfp4"
    device: str = "cpu"
    keep_bf16: tuple[str, ...] = KEEP_BF16

    def __post_init__(self) -> None:
        _as_tuple(self, "keep_bf16")
        check_choice("weights.format", self.format, WEIGHT_FORMATS)
        check_choice("weights.device", self.device, WEIGHT_DEVICES)
        _check_names("weights.keep_bf16", self.keep_bf16)
        for rule in self.keep_bf16:
            if ":" in rule and not _KEEP_RULE.match(rule):
                raise _error("weights.keep_bf16", rule, "a name substring, or 'first:N' / 'last:N' with N >= 0")


@dataclass(frozen=True)
class MonitorConfig:
    """Metrics written through the engine's monitor (``monitor``).

    Attributes:
        every: write the counters every this many optimizer steps. Steps; default 10.
    """

    every: int = 10

    def __post_init__(self) -> None:
        check_int("monitor.every", self.every, minimum=1)


@dataclass(frozen=True)
class HostConfig:
    """Host-memory settings of the DeepSpeed block (``host``). They apply when ``optimizer_states`` is set.

    Each has an environment override that wins over the config (for a quick experiment without editing
    it; :data:`fp4offload._switches.SWITCHES` names them, and reads them as it reads every FP4OFFLOAD_* variable);
    ``fp4offload doctor --config`` shows the effective value of each and where it came from.

    Attributes:
        mmap_threshold: glibc's mmap threshold, fixed so memory freed during backward leaves the heap.
            Bytes (>= 4096), or ``"off"`` to leave glibc's adaptive default. Default 131072 (128 KiB).
            Override: ``FP4OFFLOAD_MMAP_THRESHOLD``.
        allocator_cache: torch's CPU blocks of 128 KiB and more come from fp4offload's host allocator cache,
            which keeps freed blocks for reuse up to this share of the bytes in use. A fraction in (0, 1],
            or ``"off"``. Default 0.125. Override: ``FP4OFFLOAD_HOST_CACHE``.
        share_bf16_staging: on the CPU accelerator, ZeRO-1/2 offload writes the updated weights straight
            into the bf16 partition instead of through a second bf16 copy (2 B/param). Default true.
            Override: ``FP4OFFLOAD_SHARE_STAGING`` (an on/off word).
        bf16_gradient_partition: with one micro-batch per step, ZeRO-1/2 offload's host gradient partition
            is bf16 instead of fp32 (2 B/param); under ZeRO-3 offload the fp32 master's gradient is DeepSpeed's
            own bf16 gradient partition instead of an fp32 copy of it (4 B/param), clipped in fp32 by FP4AdamW.
            Default true. Override: ``FP4OFFLOAD_BF16_GRADS`` (an on/off word).
        preflight: before DeepSpeed allocates, initialize estimates the host RAM this rank and the node's
            local ranks will hold and compares it with what the process may use (available memory, the
            cgroup limit). ``"error"`` (default) raises CapacityError when it does not fit, ``"warn"``
            logs and goes on, ``"off"`` skips the check. The one host key allowed without
            optimizer_states. Override: ``FP4OFFLOAD_PREFLIGHT``.
    """

    mmap_threshold: int | str = MMAP_THRESHOLD
    allocator_cache: float | str = ALLOCATOR_CACHE
    share_bf16_staging: bool = True
    bf16_gradient_partition: bool = True
    preflight: str = "error"

    def __post_init__(self) -> None:
        check_choice("host.preflight", self.preflight, PREFLIGHT_MODES,
                      "error stops before allocating when the estimate does not fit, warn logs it, off skips it")
        object.__setattr__(self, "mmap_threshold", _size_or_off("host.mmap_threshold", self.mmap_threshold))
        object.__setattr__(self, "allocator_cache", _fraction_or_off("host.allocator_cache", self.allocator_cache))
        check_bool("host.share_bf16_staging", self.share_bf16_staging)
        check_bool("host.bf16_gradient_partition", self.bf16_gradient_partition)


def _size_or_off(key: str, value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() in OFF_VALUES:
        return "off"
    if isinstance(value, bool) or not isinstance(value, int) or not 4096 <= value <= MMAP_THRESHOLD_MAX:
        raise _error(key, value, f"a size in bytes >= 4096 and <= {MMAP_THRESHOLD_MAX} (32 MiB), or \"off\"",
                     f"the default is {MMAP_THRESHOLD} (glibc's own starting threshold, kept fixed); 32 MiB is "
                     "glibc's upper limit on 64-bit machines (mallopt(3)), past which it may refuse it")
    return value


def _fraction_or_off(key: str, value: Any) -> float | str:
    if isinstance(value, str) and value.strip().lower() in OFF_VALUES:
        return "off"
    x = _plain_float(value) if isinstance(value, (int, float)) else None
    if x is None or not 0.0 < x <= 1.0:
        raise _error(key, value, "a fraction in (0, 1] of the bytes in use, or \"off\"",
                     f"it bounds the freed memory the host cache keeps resident; the default is {ALLOCATOR_CACHE}")
    return float(value)


_SUBBLOCKS: dict[str, type] = {
    "optimizer_states": OptimizerStatesConfig,
    "activations": ActivationsConfig,
    "weights": WeightsConfig,
    "monitor": MonitorConfig,
    "host": HostConfig,
}
#: FSDP2 policies take the same sub-blocks but host (the host settings are DeepSpeed's; under FSDP2
#: ``fp4offload.host_allocator.install()`` is a call of its own, since it is process-wide)
_FSDP_SUBBLOCKS = {n: c for n, c in _SUBBLOCKS.items() if n != "host"}


def _to_plain(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


@dataclass(frozen=True)
class Fp4OffloadConfig:
    """The whole ``"fp4offload"`` block of a DeepSpeed config. A None sub-block is a feature that is off."""

    optimizer_states: OptimizerStatesConfig | None = None
    activations: ActivationsConfig | None = None
    weights: WeightsConfig | None = None
    monitor: MonitorConfig | None = None
    host: HostConfig | None = None

    def __post_init__(self) -> None:
        for name, cls in _SUBBLOCKS.items():
            v = getattr(self, name)
            if v is not None and not isinstance(v, cls):
                raise _error(name, v, f"a {cls.__name__} or None")
        if self.host is not None and self.optimizer_states is None:
            default = HostConfig()
            set_keys = {f.name for f in fields(HostConfig) if getattr(self.host, f.name) != getattr(default, f.name)}
            if set_keys - {"preflight"}:
                raise _error("host", _to_plain(self.host), "only host.preflight without optimizer_states",
                             "the other host settings shape the memory of the offloaded optimizer step; add "
                             "optimizer_states or remove them")

    @property
    def enabled(self) -> bool:
        """True when at least one feature is on."""
        return any(getattr(self, n) is not None for n in _SUBBLOCKS if n != "host")

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (absent sub-blocks left out), as ``parse_block`` reads it back."""
        return {n: _to_plain(getattr(self, n)) for n in _SUBBLOCKS if getattr(self, n) is not None}




# ---------------------------------------------------------------------------------------------
# Parsing


def _unknown(key: str, value: Any, allowed: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"unknown key; did you mean {close[0]!r}?" if close else "unknown key; remove it"
    return _error(key, value, "one of the keys " + ", ".join(allowed), hint)


def _parse_sub(name: str, cls: type, raw: Any) -> Any:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise _error(name, raw, "a mapping of settings, or null to turn the feature off")
    names = [f.name for f in fields(cls)]
    kwargs: dict[str, Any] = {}
    for k, v in raw.items():
        if k not in names:
            with _under(name + "."):
                raise _unknown(str(k), v, names)
        if isinstance(v, list):
            v = tuple(v)
        kwargs[k] = v
    return cls(**kwargs)


def parse_block(block: Mapping[str, Any] | None, *, prefix: str = "") -> Fp4OffloadConfig:
    """Validate the ``"fp4offload"`` block (a dict from JSON) and return it as a dataclass.

    ``None`` or ``{}`` give a config with every feature off. ``prefix`` is prepended to key paths
    in error messages (``validate_deepspeed_config`` passes ``"fp4offload."``).
    """
    with _under(prefix):
        if block is None:
            return Fp4OffloadConfig()
        if not isinstance(block, Mapping):
            raise ConfigError(_prefix.get().rstrip(".") or "fp4offload", block,
                              "a JSON object with optional keys " + ", ".join(_SUBBLOCKS))
        for k in block:
            if k not in _SUBBLOCKS:
                raise _unknown(str(k), block[k], list(_SUBBLOCKS))
        return Fp4OffloadConfig(**{n: _parse_sub(n, c, block.get(n)) for n, c in _SUBBLOCKS.items()})

