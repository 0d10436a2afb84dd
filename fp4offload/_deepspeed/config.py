"""The DeepSpeed config with the ``"fp4offload"`` block: read, rewritten, checked, and what it turns on.

:func:`prepare_config` reads the config (a dict or a JSON path), rewrites what the block implies
(``zero_force_ds_cpu_optimizer: false`` and ``zero_allow_untested_optimizer: true``, so ZeRO takes FP4AdamW as
its inner optimizer; an ``offload_optimizer`` on NVMe becomes ``cpu`` for DeepSpeed while FP4AdamW keeps its
packed states on NVMe itself; DeepSpeed's bf16 master mode for a compact master) and validates the result
(:func:`.schema.validate_deepspeed_config` plus DeepSpeed's own schema of ``zero_optimization``), raising
ConfigError with the key path, the value and what is allowed. It builds nothing and does not look at the disk;
:meth:`Prepared.checked_paths` checks the NVMe folders on this machine.

The block's ``host`` settings (fp4offload._config.HostConfig) each have an environment override:

================================  ============================  =================================================
``host.`` key                     override                      what it does
================================  ============================  =================================================
``mmap_threshold``                ``FP4OFFLOAD_MMAP_THRESHOLD``   glibc's mmap threshold fixed (bytes, or off)
``allocator_cache``               ``FP4OFFLOAD_HOST_CACHE``       torch's large CPU blocks from a bounded cache
``share_bf16_staging``            ``FP4OFFLOAD_SHARE_STAGING``    CPU accelerator: no second bf16 copy
``bf16_gradient_partition``       ``FP4OFFLOAD_BF16_GRADS``       ZeRO-1/2 host gradient partition in bf16
``preflight``                     ``FP4OFFLOAD_PREFLIGHT``        error, warn or off when the estimate does not fit
================================  ============================  =================================================

:func:`resolve` gives the effective value of each and where it came from (``fp4offload doctor`` prints
it); :mod:`fp4offload._deepspeed.host` applies the first two, :mod:`fp4offload._deepspeed.zero12` and
:mod:`fp4offload._deepspeed.zero3` the next two, :mod:`fp4offload._deepspeed.preflight` the last. Why each
exists: docs/design.md sections 7 and 8; how each works, with measurements: docs/guide.md, "Host memory".
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

from fp4offload._config import (Fp4OffloadConfig, HostConfig, prepare_path, check_path_syntax,
                               parse_block, with_checked_paths)
from fp4offload import _switches as switches
from fp4offload.errors import ConfigError
from fp4offload._deepspeed import optim as ds_optim
from fp4offload._jsonfile import read_json
from fp4offload._switches import Setting

from .schema import validate_deepspeed_config

__all__ = ["BLOCK_KEY", "Prepared", "read_config", "prepare_config", "ENV", "Setting", "HostSettings", "resolve"]

BLOCK_KEY = "fp4offload"

# ----------------------------------------------------------------------------------------------
# the host settings

#: the environment override of each ``host`` key (from fp4offload._switches, the table of every variable)
ENV = {sw.json_key.split(".", 1)[1]: sw.name for sw in switches.SWITCHES
       if sw.json_key is not None and sw.json_key.startswith("host.")}


@dataclass(frozen=True)
class HostSettings:
    """The five effective host settings (see the module docstring)."""

    mmap_threshold: Setting
    allocator_cache: Setting
    share_bf16_staging: Setting
    bf16_gradient_partition: Setting
    preflight: Setting

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: {"value": getattr(self, f.name).value, "source": getattr(self, f.name).source}
                for f in fields(self)}


def resolve(host: HostConfig | None, environ: Mapping[str, str] | None = None) -> HostSettings:
    """The effective host settings: the environment override (read by fp4offload._switches, checked as the key
    is), else the config's value, else the default."""
    default = HostConfig()
    out = {}
    for f in fields(HostConfig):
        got = switches.setting(ENV[f.name], environ)
        if got.source != "default":
            out[f.name] = got
        elif host is not None and getattr(host, f.name) != getattr(default, f.name):
            out[f.name] = Setting(getattr(host, f.name), f"fp4offload.host.{f.name}")
        else:
            out[f.name] = Setting(getattr(default, f.name), "default")
    return HostSettings(**out)


# ----------------------------------------------------------------------------------------------
# the block


@dataclass(frozen=True)
class Prepared:
    """A DeepSpeed config with the block applied.

    Attributes:
        ds_config: the dict handed to ``deepspeed.initialize`` (a copy; the caller's is not changed).
        block: the parsed block.
        states: where FP4AdamW keeps m and v (None when the block has no optimizer_states).
        rewrites: human-readable notes of what was changed in the DeepSpeed keys, in order.
        host: the effective host settings (the block's ``host`` sub-block with its environment overrides).
    """

    ds_config: dict
    block: Fp4OffloadConfig
    states: ds_optim.StatePlacement | None
    rewrites: tuple[str, ...] = field(default=())
    host: HostSettings = field(default_factory=lambda: resolve(None))

    def checked_paths(self, *, create: bool = True) -> "Prepared":
        """These settings with their NVMe folders checked on this machine and resolved (fp4offload._config.
        prepare_path: ``~`` and ``$VARS`` expanded, made absolute, created one level deep under an existing
        parent, refused when a file, a device, in /proc or /sys, unwritable or under a missing parent), for
        ``optimizer_states``, ``activations`` and DeepSpeed's ``offload_optimizer.nvme_path`` when the block takes
        it. :func:`initialize` calls it before anything is built; ``prepare_config`` does not look at the disk
        (a config may be prepared on one machine for another). ``create=False`` checks without making a folder
        (``plan --check``)."""
        block = with_checked_paths(self.block, f"{BLOCK_KEY}.", create=create)
        states = self.states
        if states is not None and states.device == "nvme":
            st = self.block.optimizer_states
            key = (f"{BLOCK_KEY}.optimizer_states.nvme_path" if st is not None and st.nvme_path is not None
                   else "zero_optimization.offload_optimizer.nvme_path")
            folder = prepare_path(key, str(Path(states.nvme_path).parent), create=create)
            states = replace(states, nvme_path=str(folder / "optimizer_states"))
        return replace(self, block=block, states=states)


def read_config(config: str | os.PathLike | Mapping[str, Any]) -> dict:
    """A deep copy of a DeepSpeed config given as a dict or a path to a JSON file."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, os.PathLike)):
        return read_json(Path(config), "config", str(config), readable="a readable DeepSpeed JSON file or a dict",
                         valid="valid JSON", detail="line {exc.lineno} column {exc.colno}: {exc.msg}",
                         top="a JSON object at the top level")
    raise ConfigError("config", type(config).__name__, "a dict or a path to a DeepSpeed JSON file")


def _zero(ds: dict) -> dict:
    z = ds.get("zero_optimization")
    return z if isinstance(z, dict) else {}


def prepare_config(config: str | os.PathLike | Mapping[str, Any], *, world_size: int | None = None) -> Prepared:
    """Read, rewrite and validate a DeepSpeed config carrying the block. Raises ConfigError; builds nothing."""
    ds = read_config(config)
    block = parse_block(ds.get(BLOCK_KEY), prefix=f"{BLOCK_KEY}.")
    notes: list[str] = []
    states = None
    if block.optimizer_states is not None:
        st = block.optimizer_states
        for key, want in (("zero_force_ds_cpu_optimizer", False), ("zero_allow_untested_optimizer", True)):
            if ds.get(key) is not want:
                notes.append(f"{key}: {ds.get(key)!r} -> {want!r}")
                ds[key] = want
        device, nvme_path = st.device, st.nvme_path
        zero = _zero(ds)
        off = zero.get("offload_optimizer")
        if isinstance(off, dict) and off.get("device") == "nvme":
            ds_path = off.get("nvme_path")
            if device == "same" and st.format == "fp32":  # torch AdamW's states would stay in RAM, not on NVMe
                raise ConfigError(f"{BLOCK_KEY}.optimizer_states.format", "fp32",
                                  "'nvfp4' when zero_optimization.offload_optimizer.device is 'nvme'",
                                  "format 'fp32' is torch AdamW, which keeps its states in host RAM: set format "
                                  "'nvfp4' for packed states on NVMe, or drop optimizer_states for DeepSpeed's swapper")
            if device == "same":
                device, nvme_path = "nvme", nvme_path or ds_path
            if device == "nvme" and not nvme_path:
                raise ConfigError("zero_optimization.offload_optimizer.nvme_path", ds_path,
                                  "a directory on an NVMe drive when the optimizer is offloaded to 'nvme'",
                                  "set it, or fp4offload.optimizer_states.nvme_path")
            if device == "nvme" and nvme_path is ds_path:  # the block takes DeepSpeed's folder: checked like its own
                check_path_syntax("zero_optimization.offload_optimizer.nvme_path", ds_path)
            new_off = {k: v for k, v in off.items() if k in ("pin_memory", "ratio")}
            new_off["device"] = "cpu"
            zero["offload_optimizer"] = new_off
            held = {"fp32": "fp32 master", "bf16": "bf16 master"}.get(st.master, "split master's bf16 half" + (
                "" if st.master_device == "nvme" else " and residual"))
            notes.append(f"zero_optimization.offload_optimizer.device: 'nvme' -> 'cpu' ({held} in host RAM); "
                         f"packed states on {device!r}" + (f" under {nvme_path}" if device == "nvme" else "")
                         + (" with the residual" if st.master_device == "nvme" else ""))
        if nvme_path is not None and device != "nvme":  # device 'same' without DeepSpeed's NVMe offload
            raise ConfigError(f"{BLOCK_KEY}.optimizer_states.nvme_path", nvme_path, "null unless the states go to NVMe",
                              f"device {device!r} keeps the states in memory, so the folder would be ignored (device "
                              "'same' uses it only with zero_optimization.offload_optimizer.device 'nvme'): remove "
                              "it, or set device 'nvme'")
        if ds.get("optimizer") is not None:
            ds_optim.settings_from_ds_section(ds["optimizer"])  # Adam/AdamW only; raises before anything is built
        if st.master != "fp32":
            if block.weights is not None and block.weights.format == "nvfp4":
                raise ConfigError(f"{BLOCK_KEY}.optimizer_states.master", st.master, "'fp32' with the weights block",
                                  "the NVFP4 weight shards are encoded by the step from an fp32 master; drop "
                                  "fp4offload.weights or use master 'fp32'")
            notes += _compact_master(ds, st.master)
        if st.master_device == "nvme" and device != "nvme":
            raise ConfigError(f"{BLOCK_KEY}.optimizer_states.master_device", "nvme", "'same' unless the states go to "
                              "NVMe", f"the states stay in {'host RAM' if device == 'cpu' else 'memory'} (device "
                              f"{device!r}), so there are no state files for the residual: set "
                              "zero_optimization.offload_optimizer.device 'nvme' (or optimizer_states.device 'nvme'), "
                              "or master_device 'same'")
        if device == "nvme" and nvme_path:
            nvme_path = str(Path(nvme_path) / "optimizer_states")
        states = replace(st, device=device, nvme_path=nvme_path)
    if world_size is None and os.environ.get("WORLD_SIZE", "").isdigit():
        world_size = int(os.environ["WORLD_SIZE"])
    validate_deepspeed_config(ds, world_size=world_size, check_with_deepspeed=True)
    return Prepared(ds_config=ds, block=block, states=states, rewrites=tuple(notes), host=resolve(block.host))


def _compact_master(ds: dict, master: str) -> list[str]:
    """Check that DeepSpeed's config can take a compact master and turn on DeepSpeed's bf16 master mode, which
    gives the optimizer bf16 master partitions (and bf16 gradient partitions) to step. Returns the notes."""
    key = f"{BLOCK_KEY}.optimizer_states.master"
    zero = _zero(ds)
    stage = zero.get("stage", 0)
    if stage not in (1, 2, 3):
        raise ConfigError(key, master, "'fp32' with ZeRO stage " + repr(stage),
                          "a compact master steps ZeRO's flat master partitions in DeepSpeed's bf16 master mode, "
                          "which needs ZeRO-1, 2 or 3")
    off = zero.get("offload_optimizer")
    if not (isinstance(off, dict) and off.get("device") in ("cpu", "nvme")):
        raise ConfigError("zero_optimization.offload_optimizer", off, f"device 'cpu' or 'nvme' with {key}={master!r}",
                          "DeepSpeed's bf16 master mode keeps the master partition on the host; without offload use "
                          "master 'fp32'")
    bf16 = ds.get("bf16")
    if not (isinstance(bf16, Mapping) and bf16.get("enabled") is True):
        raise ConfigError("bf16.enabled", None if not isinstance(bf16, Mapping) else bf16.get("enabled"),
                          f"true with {key}={master!r}", "a compact master is the bf16 parameters' own; enable bf16")
    if bf16.get("bf16_optimizer_states"):
        raise ConfigError("bf16.bf16_optimizer_states", bf16.get("bf16_optimizer_states"),
                          f"false (or absent) with {key}={master!r}",
                          "the block keeps Adam's states in 4 bits; remove the key")
    ga = ds.get("gradient_accumulation_steps", 1)
    if ga not in (1, None, "auto"):
        raise ConfigError("gradient_accumulation_steps", ga, f"1 with {key}={master!r}",
                          "DeepSpeed's bf16 master mode accumulates gradients in bf16; use master 'fp32' to "
                          "accumulate in fp32")
    notes = []
    if stage == 3:
        notes.append(f"ZeRO-3 with master {master!r}: DeepSpeed's bf16 master mode keeps the gradient partition in "
                     "bf16 as well (2 B/param; the fp32-master block keeps ZeRO-3's in fp32); FP4AdamW applies the "
                     "clipping factor in fp32, so the steps see the fp32 run's gradients")
    if bf16.get("bf16_master_weights_and_grads") is not True:
        ds["bf16"] = {**bf16, "bf16_master_weights_and_grads": True}
        notes.append(f"bf16.bf16_master_weights_and_grads: {bf16.get('bf16_master_weights_and_grads')!r} -> True "
                     f"(master {master!r}: bf16 master and gradient partitions)")
    return notes
