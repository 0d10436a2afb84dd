"""The ``"fp4offload"`` block of a DeepSpeed config: read, validate, apply.

``initialize`` takes the arguments of ``deepspeed.initialize`` and returns what it returns. When the
config carries the block it, in this order, before DeepSpeed builds anything:

1. reads the config (dict or JSON path, from ``config``, ``config_params`` or ``args.deepspeed_config``);
2. rewrites what the block implies: ``zero_force_ds_cpu_optimizer: false`` and
   ``zero_allow_untested_optimizer: true`` (so ZeRO takes FP4AdamW as its inner optimizer), and an
   ``offload_optimizer`` on NVMe becomes ``cpu`` for DeepSpeed while FP4AdamW keeps its packed states
   on NVMe itself (DeepSpeed's swapper cannot hold uint8 states; the fp32 master stays in host RAM);
3. validates the result (``fp4offload.config.validate_deepspeed_config`` plus DeepSpeed's own schema
   of ``zero_optimization``), raising ConfigError with the key path, the value and what is allowed;
4. checks that the host RAM the config needs fits (``ds_preflight``; CapacityError, ``host.preflight``);
5. builds FP4AdamW from the client optimizer or the config's ``optimizer`` section;

then calls the real ``deepspeed.initialize`` and attaches what needs the engine: packed ZeRO-3 weight
shards (``ds_weights``), saved-activation packing, and the metrics writer (``ds_monitor``).

With ``optimizer_states`` set it also applies the ``host`` settings (:mod:`fp4offload.integrations.ds_host`):
glibc's mmap threshold, the host allocator cache, the bf16 host gradient partition and, on the CPU
accelerator, the shared bf16 staging buffers.

Every private DeepSpeed name the block touches is listed and checked, before anything is built, by
:mod:`fp4offload.integrations.ds_internals`.

A plain ``deepspeed.initialize`` (the user's own, Accelerate's, the HF Trainer's) comes here with no code
change: the start-up hook ``_fp4offload_auto`` (``fp4offload-auto.pth`` in site-packages) wraps it when
deepspeed is first imported; ``FP4OFFLOAD_AUTO=0`` turns that off, and ``install()`` does the same by
hand. A config without the block is passed through untouched.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from fp4offload.config import (Fp4OffloadConfig, check_directory, check_path_syntax, parse_block,
                               validate_deepspeed_config, with_checked_paths)
from fp4offload.errors import ConfigError
from fp4offload.jsonfile import read_json

from . import ds_host, ds_internals, ds_optim, ds_preflight

log = logging.getLogger("fp4offload.deepspeed")

__all__ = ["initialize", "install", "uninstall", "installed", "prepare_config", "Prepared", "read_config",
           "features", "auto_status"]

BLOCK_KEY = "fp4offload"
_TORCH_DISTRIBUTED_DEFAULT_PORT = 29500


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
    host: ds_host.HostSettings = field(default_factory=lambda: ds_host.resolve(None))

    def checked_paths(self) -> "Prepared":
        """These settings with their NVMe folders checked on this machine and resolved (fp4offload.config.
        check_directory: ``~`` and ``$VARS`` expanded, made absolute, created one level deep under an existing
        parent, refused when a file, a device, in /proc or /sys, unwritable or under a missing parent), for
        ``optimizer_states``, ``activations`` and DeepSpeed's ``offload_optimizer.nvme_path`` when the block takes
        it. :func:`initialize` calls it before anything is built; ``prepare_config`` does not look at the disk
        (a config may be prepared on one machine for another)."""
        block = with_checked_paths(self.block, f"{BLOCK_KEY}.")
        states = self.states
        if states is not None and states.device == "nvme":
            st = self.block.optimizer_states
            key = (f"{BLOCK_KEY}.optimizer_states.nvme_path" if st is not None and st.nvme_path is not None
                   else "zero_optimization.offload_optimizer.nvme_path")
            folder = check_directory(key, str(Path(states.nvme_path).parent))
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
        states = ds_optim.StatePlacement(format=st.format, device=device, nvme_path=nvme_path, rounding=st.rounding,
                                         v_rounding=st.v_rounding, v_format=st.v_format, min_numel=st.min_numel,
                                         master=st.master,
                                         master_device=st.master_device)
    if world_size is None and os.environ.get("WORLD_SIZE", "").isdigit():
        world_size = int(os.environ["WORLD_SIZE"])
    validate_deepspeed_config(ds, world_size=world_size, check_with_deepspeed=True)
    return Prepared(ds_config=ds, block=block, states=states, rewrites=tuple(notes), host=ds_host.resolve(block.host))


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


# ----------------------------------------------------------------------------------------------
# initialize


def _unwrap(fn: Any) -> Any:
    """DeepSpeed's own initialize under the start-up hook's wrapper (_fp4offload_auto) and install()'s."""
    while getattr(fn, "_fp4offload_hook", False) or fn is _patched_initialize:
        fn = _ORIGINAL if fn is _patched_initialize else fn.__wrapped__
    return fn


def _original_initialize():
    import deepspeed

    return _unwrap(_ORIGINAL or deepspeed.initialize)


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    if config is None and config_params is not None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    return config


def _has_block(config: Any) -> bool:
    if config is None:
        return False
    if isinstance(config, Mapping):
        return BLOCK_KEY in config
    try:
        return BLOCK_KEY in read_config(config)
    except ConfigError:
        return False  # let DeepSpeed report its own error


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = _TORCH_DISTRIBUTED_DEFAULT_PORT, mpu: Any = None,
               dist_init_required: bool | None = None, collate_fn: Any = None, config: Any = None,
               mesh_param: Any = None, config_params: Any = None):
    """``deepspeed.initialize`` with the ``"fp4offload"`` block applied.

    Same arguments and return value ``(engine, optimizer, training_dataloader, lr_scheduler)``. The
    engine gets an ``fp4offload`` attribute (an :class:`Attached`) describing what was applied.
    """
    source = _config_source(args, config, config_params)
    kwargs = dict(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                  training_data=training_data, lr_scheduler=lr_scheduler, distributed_port=distributed_port, mpu=mpu,
                  dist_init_required=dist_init_required, collate_fn=collate_fn, mesh_param=mesh_param)
    if not _has_block(source):
        return _original_initialize()(config=config, config_params=config_params, **kwargs)

    prepared = prepare_config(source).checked_paths()  # its folders too, before anything is built
    for note in prepared.rewrites:
        log.info("fp4offload: %s", note)
    ds_internals.check(features(prepared))  # DeepSpeed's private names: fail before anything is built
    preflight = ds_preflight.check(prepared, model)  # host RAM: fail before DeepSpeed allocates
    block, host, states = prepared.block, prepared.host, prepared.block.optimizer_states is not None
    if states:
        kwargs["optimizer"], kwargs["lr_scheduler"] = _client_optimizer(prepared, optimizer, lr_scheduler, model,
                                                                        model_parameters)
    allocator = ds_host.control_host_allocator(host) if states else None
    acts = None
    if block.activations is not None:
        acts = _attach_activations(model, block)

    # Hand DeepSpeed the rewritten dict; args.deepspeed_config would conflict with it.
    saved = {}
    if args is not None:
        for name in ("deepspeed_config", "deepscale_config"):
            if getattr(args, name, None) is not None:
                saved[name] = getattr(args, name)
                setattr(args, name, None)
    try:
        compact = states and prepared.states.master != "fp32"
        stage3 = _zero(prepared.ds_config).get("stage", 0) == 3
        with ds_host.bf16_grads_at_init(states, host) as at_init, ds_host.compact_master_at_init(compact), \
                ds_host.zero3_grads_at_init(states and stage3) as at_init3:
            result = _original_initialize()(config=prepared.ds_config, **kwargs)
    finally:
        for name, v in saved.items():
            setattr(args, name, v)
    engine = result[0]
    master_shared = 0
    if compact:
        shared = ds_host.staging_is_master(engine)
        master_shared = ds_host.master_is_device_partition(engine)
        ds_host.fp32_clip(engine)
    else:
        shared = ds_host.share_bf16_staging(engine, host) if states else 0
    bf16_grads = ds_host.bf16_gradient_partition(engine, host) if states else 0
    if states:
        fused = block.weights is not None and block.weights.format == "nvfp4"
        shared3 = ds_host.zero3_gradient_partition(engine, host, fused_weights=fused)
        if at_init3.applied and not shared3:
            at_init3.zero_fill(engine)  # kept as DeepSpeed's own: zero-filled, as DeepSpeed leaves them
        bf16_grads += shared3
    if states:
        _norm_source(engine)
        _close_on_destroy(engine)
    if allocator is not None and allocator.get("mmap_threshold"):
        ds_host.release_free_host_memory()  # the model's own tensors, freed when DeepSpeed flattened them
    attached = Attached(prepared=prepared, activations=acts, allocator=allocator, staging_shared_bytes=shared,
                        master_shared_bytes=master_shared,
                        bf16_grad_bytes_saved=bf16_grads, bf16_grads_at_init=at_init.applied > 0,
                        zero3_grads_at_init=at_init3.applied > 0,
                        preflight=preflight)
    if block.weights is not None and block.weights.format == "nvfp4":
        from . import ds_weights

        attached.weights = ds_weights.attach(engine, block.weights)
    if block.monitor is not None:
        from . import ds_monitor

        attached.monitor = ds_monitor.attach(engine, block.monitor, attached)
    engine.fp4offload = attached
    return result


def _close_on_destroy(engine: Any) -> bool:
    """``engine.destroy()`` also closes FP4AdamW: its NVMe state folder goes (or stays, kept with its manifest,
    under ``FP4OFFLOAD_NVME_KEEP=1``). Normal interpreter exit removes it as well (the tier's atexit)."""
    from fp4offload.optim import FP4AdamW

    zo = getattr(engine, "optimizer", None)
    opt = zo if isinstance(zo, FP4AdamW) else ds_internals.read(zo, "optimizer")
    destroy = getattr(engine, "destroy", None)
    if not isinstance(opt, FP4AdamW) or not callable(destroy):
        return False

    def destroy_and_close(*args, **kwargs):
        try:
            return destroy(*args, **kwargs)
        finally:
            opt.close()

    engine.destroy = destroy_and_close
    return True


def _norm_source(engine: Any) -> bool:
    """ZeRO-1/2 computes the global gradient norm before the optimizer steps (for clipping, and always under
    offload): FP4AdamW's non-finite check reads it instead of every gradient (set_grad_norm_source)."""
    import weakref

    from fp4offload.optim import FP4AdamW

    zo = getattr(engine, "optimizer", None)
    inner = ds_internals.read(zo, "optimizer")
    if not (isinstance(inner, FP4AdamW) and ds_internals.read(zo, "compute_grad_norm", False)
            and ds_internals.read(zo, "single_partition_of_fp32_groups")):
        return False
    ref = weakref.ref(zo)

    def norm():
        z = ref()
        return None if z is None else ds_internals.read(z, "_global_grad_norm")

    inner.set_grad_norm_source(norm)
    return True


def features(prepared: Prepared) -> tuple[str, ...]:
    """The block features (ds_internals.FEATURES) a prepared config turns on, for ds_internals.check."""
    block, out = prepared.block, []
    stage = _zero(prepared.ds_config).get("stage", 0)
    if block.optimizer_states is not None:
        out.append("optimizer_states")
        # ZeRO-3 shares its gradient partition whenever the dtypes agree (ds_host.zero3_gradient_partition)
        if stage in (1, 2, 3) and (prepared.host.bf16_gradient_partition.value or stage == 3):
            out.append("bf16_gradient_partition")
        if stage in (1, 2) and prepared.host.share_bf16_staging.value:
            out.append("share_bf16_staging")
        if prepared.states is not None and prepared.states.master != "fp32":
            out.append("compact_master")
    if block.weights is not None and block.weights.format == "nvfp4":
        out.append("weights")
    if block.monitor is not None:
        out.append("monitor")
    return tuple(out)


@dataclass
class Attached:
    """What ``initialize`` applied to an engine (``engine.fp4offload``)."""

    prepared: Prepared
    activations: Any = None
    weights: Any = None
    monitor: Any = None
    allocator: dict | None = None
    staging_shared_bytes: int = 0  # share_bf16_staging
    master_shared_bytes: int = 0  # a compact master that is the model's own bf16 partition (CPU accelerator)
    bf16_grad_bytes_saved: int = 0  # bf16_gradient_partition
    bf16_grads_at_init: bool = False  # ... allocated in bf16 by DeepSpeed itself (ds_host.bf16_grads_at_init)
    zero3_grads_at_init: bool = False  # ZeRO-3's master gradients allocated unfilled (ds_host.zero3_grads_at_init)
    preflight: Any = None  # the host-memory estimate (planner.host_model.HostEstimate); None when off


def _client_optimizer(prepared: Prepared, optimizer: Any, lr_scheduler: Any, model: Any, model_parameters: Any):
    """FP4AdamW (or a callable building it) in place of what the caller passed."""
    import torch

    where = prepared.states
    if optimizer is None:
        hp = ds_optim.settings_from_ds_section(prepared.ds_config.get("optimizer"))

        def build(params):
            params = list(params)
            return ds_optim.make_optimizer(params, hp, where)

        return build, lr_scheduler
    if isinstance(optimizer, torch.optim.Optimizer):
        new = ds_optim.convert_optimizer(optimizer, where)
        if new is not optimizer:
            ds_optim.rebind_scheduler(lr_scheduler, optimizer, new)
        return new, lr_scheduler
    if callable(optimizer):
        user = optimizer

        def build_from_callable(params):
            return ds_optim.convert_optimizer(user(params), where)

        return build_from_callable, lr_scheduler
    raise ConfigError("optimizer", type(optimizer).__name__, "None, a torch Optimizer, or a callable(params)")


def _attach_activations(model: Any, block: Fp4OffloadConfig) -> Any:
    """Pack the saved activations of the modules the block names, every step (fp4offload.offload.wrap_modules)."""
    try:
        from fp4offload.offload import ActivationPolicy, wrap_modules
    except Exception as exc:
        raise ConfigError("fp4offload.activations", block.to_dict().get("activations"),
                          "a block this build can apply", f"fp4offload.offload does not import ({exc}); "
                          "remove the activations sub-block") from None
    policy = ActivationPolicy.from_config(block.activations)
    return wrap_modules(model, policy)


# ----------------------------------------------------------------------------------------------
# install / uninstall

_ORIGINAL = None


def _patched_initialize(*args, **kwargs):
    return initialize(*args, **kwargs)


def install() -> None:
    """Route ``deepspeed.initialize`` through :func:`initialize` (idempotent).

    After this a plain ``deepspeed.initialize`` (Accelerate's, the HF Trainer's) honours the block;
    configs without the block go to DeepSpeed untouched.
    """
    global _ORIGINAL
    import deepspeed

    if deepspeed.initialize is _patched_initialize:
        return
    _ORIGINAL = deepspeed.initialize  # may be the start-up hook's wrapper: uninstall() puts it back
    deepspeed.initialize = _patched_initialize


def uninstall() -> None:
    """Undo :func:`install`."""
    global _ORIGINAL
    import deepspeed

    if deepspeed.initialize is _patched_initialize and _ORIGINAL is not None:
        deepspeed.initialize = _ORIGINAL
    _ORIGINAL = None


def installed() -> bool:
    """True while a plain ``deepspeed.initialize`` goes through :func:`initialize`: after :func:`install`, or
    once the start-up hook (:func:`auto_status`) has patched an imported deepspeed."""
    import sys

    ds = sys.modules.get("deepspeed")
    fn = getattr(ds, "initialize", None)
    return ds is not None and (fn is _patched_initialize or getattr(fn, "_fp4offload_hook", False))


#: FP4OFFLOAD_AUTO values (the off list is also spelled out in fp4offload-auto.pth, which can import nothing)
AUTO_OFF = ("0", "off", "false", "no")
AUTO_ON = ("1", "on", "true", "yes")


def _odd_auto_value(env: str) -> str:
    """A note for a FP4OFFLOAD_AUTO value that is neither on nor off (the hook then stays on)."""
    if env.strip() and env.strip().lower() not in AUTO_ON + AUTO_OFF:
        return f"; FP4OFFLOAD_AUTO={env!r} is not 0/1/on/off/true/false/yes/no, so it counts as on"
    return ""


def auto_status() -> dict[str, Any]:
    """The zero-code start-up hook (``fp4offload-auto.pth``, module ``_fp4offload_auto``), for doctor.

    ``{"active": bool, "state": str, "why": str}``; state is "waiting" (its finder is in sys.meta_path:
    the first import of deepspeed patches it), "patched", "disabled" (FP4OFFLOAD_AUTO off), "not
    installed" (no fp4offload-auto.pth on sys.path's site directories, or Python started with -S), or
    "inactive" (the .pth is there but nothing of it ran: deepspeed imported without it)."""
    import sys

    hook = sys.modules.get("_fp4offload_auto")
    env = os.environ.get("FP4OFFLOAD_AUTO", "")
    if hook is not None and hook.state == "patched":
        return {"active": True, "state": "patched",
                "why": "deepspeed.initialize goes through fp4offload (configs without the block pass untouched)"
                       + _odd_auto_value(env)}
    note = _odd_auto_value(env)
    if any(getattr(f, "fp4offload_auto", False) for f in sys.meta_path):
        return {"active": True, "state": "waiting",
                "why": "deepspeed.initialize is routed through fp4offload when deepspeed is imported" + note}
    if env.strip().lower() in AUTO_OFF:
        return {"active": False, "state": "disabled", "why": f"FP4OFFLOAD_AUTO={env!r} turns it off"}
    if not any((Path(p) / "fp4offload-auto.pth").is_file() for p in sys.path if p):
        return {"active": False, "state": "not installed",
                "why": "no fp4offload-auto.pth in site-packages (reinstall fp4offload with pip; python -S skips "
                       ".pth files); call fp4offload.deepspeed.install() instead"}
    return {"active": False, "state": "inactive",
            "why": "fp4offload-auto.pth is installed but deepspeed was imported without it; call "
                   "fp4offload.deepspeed.install()"}
