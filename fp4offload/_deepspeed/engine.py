"""``initialize``: the ``"fp4offload"`` block of a DeepSpeed config applied, and ``install``.

``initialize`` takes the arguments of ``deepspeed.initialize`` and returns what it returns. When the
config carries the block it, in this order, before DeepSpeed builds anything:

1. reads the config (dict or JSON path, from ``config``, ``config_params`` or ``args.deepspeed_config``);
2. rewrites what the block implies and validates the result (:func:`fp4offload._deepspeed.config.prepare_config`:
   ``zero_force_ds_cpu_optimizer: false``, ``zero_allow_untested_optimizer: true``, an ``offload_optimizer``
   on NVMe becomes ``cpu`` for DeepSpeed while FP4AdamW keeps its packed states on NVMe itself), raising
   ConfigError with the key path, the value and what is allowed, and checks its NVMe folders;
3. checks the private DeepSpeed names the features turned on need (:mod:`fp4offload._deepspeed.internals`);
4. checks that the host RAM the config needs fits (:mod:`fp4offload._deepspeed.preflight`; CapacityError,
   ``host.preflight``);
5. builds FP4AdamW from the client optimizer or the config's ``optimizer`` section
   (:mod:`fp4offload._deepspeed.optim`);

then calls the real ``deepspeed.initialize`` and attaches what needs the engine: packed ZeRO-3 weight
shards (:mod:`fp4offload._deepspeed.weights`), saved-activation packing, and the metrics writer
(:mod:`fp4offload._deepspeed.monitor`).

With ``optimizer_states`` set it also applies the ``host`` settings: glibc's mmap threshold and the host
allocator cache (:mod:`fp4offload._deepspeed.host`), the bf16 host gradient partition and, on the CPU
accelerator, the shared bf16 staging buffers (:mod:`fp4offload._deepspeed.zero12`,
:mod:`fp4offload._deepspeed.zero3`).

A plain ``deepspeed.initialize`` (the user's own, Accelerate's, the HF Trainer's) comes here with no code
change: the start-up hook ``_fp4offload_auto`` (``fp4offload-auto.pth`` in site-packages) wraps it when
deepspeed is first imported; ``FP4OFFLOAD_AUTO=0`` turns that off, and ``install()`` does the same by
hand. A config without the block is passed through untouched.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from fp4offload import _switches as switches
from fp4offload._announce import announce
from fp4offload._config import Fp4OffloadConfig
from fp4offload._config.block import MonitorConfig
from fp4offload.errors import ConfigError

from . import optim as ds_optim

from . import internals as dsi
from . import auto, preflight
from .auto import is_auto
from .at_init import compact_master_at_init
from .config import BLOCK_KEY, Prepared, _zero, features, prepare_config, read_config
from .host import control_host_allocator, release_free_host_memory
from .zero3 import fp32_clip, zero3_gradient_partition, zero3_grads_at_init
from .zero12 import (bf16_gradient_partition, bf16_grads_at_init, master_is_device_partition, share_bf16_staging,
                     staging_is_master)

log = logging.getLogger("fp4offload.deepspeed")

__all__ = ["initialize", "install", "uninstall", "installed", "prepare_config", "Prepared", "read_config",
           "features", "auto_status", "Attached", "BLOCK_KEY"]

_TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

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


def _block_of(config: Any) -> Any:
    return (config if isinstance(config, Mapping) else read_config(config)).get(BLOCK_KEY)


def _init_distributed_for_auto(port: int, required: bool | None) -> None:
    """Start the process group as deepspeed.initialize would, so rank 0's choice can reach every rank."""
    import torch.distributed as dist

    ws = os.environ.get("WORLD_SIZE", "1")
    if required is False or dist.is_initialized() or not (ws.isdigit() and int(ws) > 1):
        return
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name(), distributed_port=port)


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

    decision = None
    if is_auto(_block_of(source)):  # choose the block from the live readings and the model (rank 0 decides)
        auto.auto_options(_block_of(source))  # its form and keys, before the process group or the model
        if model is None or not hasattr(model, "parameters"):
            raise ConfigError(BLOCK_KEY, "auto", "a model passed to initialize",
                              "auto sizes the block by the model's parameters; pass model=..., or write the block")
        _init_distributed_for_auto(distributed_port, dist_init_required)
        source, decision = auto.decide(read_config(source), model)
        announce(decision.line())
    prepared = prepare_config(source).checked_paths()  # its folders too, before anything is built
    for note in prepared.rewrites:
        announce(f"config: {note}")
    dsi.check(features(prepared))  # DeepSpeed's private names: fail before anything is built
    estimate = preflight.check(prepared, model)  # host RAM: fail before DeepSpeed allocates
    block, host, states = prepared.block, prepared.host, prepared.block.optimizer_states is not None
    if states:
        kwargs["optimizer"], kwargs["lr_scheduler"] = _client_optimizer(prepared, optimizer, lr_scheduler, model,
                                                                        model_parameters)
    allocator = control_host_allocator(host) if states else None
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
        with bf16_grads_at_init(states, host) as at_init, compact_master_at_init(compact), \
                zero3_grads_at_init(states and stage3) as at_init3:
            result = _original_initialize()(config=prepared.ds_config, **kwargs)
    finally:
        for name, v in saved.items():
            setattr(args, name, v)
    engine = result[0]
    master_shared = 0
    if compact:
        shared = staging_is_master(engine)
        master_shared = master_is_device_partition(engine)
        fp32_clip(engine)
    else:
        shared = share_bf16_staging(engine, host) if states else 0
    bf16_grads = bf16_gradient_partition(engine, host) if states else 0
    if states:
        fused = block.weights is not None and block.weights.format == "nvfp4"
        shared3 = zero3_gradient_partition(engine, host, fused_weights=fused)
        if at_init3.applied and not shared3:
            at_init3.zero_fill(engine)  # kept as DeepSpeed's own: zero-filled, as DeepSpeed leaves them
        bf16_grads += shared3
    if states:
        _norm_source(engine)
        _close_on_destroy(engine)
    if allocator is not None and allocator.get("mmap_threshold") and release_free_host_memory():
        # the model's own tensors, freed when DeepSpeed flattened them
        announce("process: glibc malloc_trim(0) after initialize (free heap pages back to the OS)")
    attached = Attached(prepared=prepared, activations=acts, allocator=allocator, staging_shared_bytes=shared,
                        master_shared_bytes=master_shared,
                        bf16_grad_bytes_saved=bf16_grads, bf16_grads_at_init=at_init.applied > 0,
                        zero3_grads_at_init=at_init3.applied > 0,
                        preflight=estimate, auto=decision, block=copy.deepcopy(_block_of(source)))
    if block.weights is not None and block.weights.format == "nvfp4":
        from . import weights

        attached.weights = weights.attach(engine, block.weights)
    ds_monitor = getattr(engine, "monitor", None)
    if block.monitor is not None or getattr(ds_monitor, "enabled", False):
        from . import monitor

        # a DeepSpeed monitor in the JSON (csv_monitor, tensorboard, wandb, comet) is enough: the block writes to
        # it every monitor.every steps (default MonitorConfig().every) without a key of its own
        attached.monitor = monitor.attach(engine, block.monitor or MonitorConfig(), attached)
    engine.fp4offload = attached
    return result


def _close_on_destroy(engine: Any) -> bool:
    """``engine.destroy()`` also closes FP4AdamW: its NVMe state folder goes (or stays, kept with its manifest,
    under ``FP4OFFLOAD_NVME_KEEP=1``). Normal interpreter exit removes it as well (the tier's atexit)."""
    from fp4offload._optim import FP4AdamW

    zo = getattr(engine, "optimizer", None)
    opt = zo if isinstance(zo, FP4AdamW) else dsi.read(zo, "optimizer")
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
    offload): FP4AdamW's non-finite check reads it instead of every gradient (``hooks.grad_norm_source``)."""
    import weakref

    from fp4offload._optim import FP4AdamW

    zo = getattr(engine, "optimizer", None)
    inner = dsi.read(zo, "optimizer")
    if not (isinstance(inner, FP4AdamW) and dsi.read(zo, "compute_grad_norm", False)
            and dsi.read(zo, "single_partition_of_fp32_groups")):
        return False
    ref = weakref.ref(zo)

    def norm():
        z = ref()
        return None if z is None else dsi.read(z, "_global_grad_norm")

    inner.hooks.grad_norm_source(norm)
    return True


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
    bf16_grads_at_init: bool = False  # ... allocated in bf16 by DeepSpeed itself (zero12.bf16_grads_at_init)
    zero3_grads_at_init: bool = False  # ZeRO-3's master gradients allocated unfilled (zero3.zero3_grads_at_init)
    preflight: Any = None  # the host-memory estimate (fp4offload._memory.host_model.HostEstimate); None when off
    auto: Any = None  # with "fp4offload": {"auto": true}, what it chose and why (_deepspeed.auto.Decision)
    block: Any = None  # the block that ran, as JSON (auto's choice in place of "auto")

    def __repr__(self) -> str:
        """A few lines for a person: what the block does on this engine; the fields hold the details."""
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        states = self.prepared.states
        lines = ["fp4offload block on this engine:",
                 "  optimizer: " + (ds_optim.describe_states(states) if states is not None else "not replaced")]
        policy = getattr(self.activations, "policy", None)
        lines.append("  activations: " + (policy.describe() if policy is not None else
                                          "on" if self.activations is not None else "not compressed"))
        lines.append("  weights: " + ("ZeRO-3 partitions packed as NVFP4" if self.weights is not None
                                      else "DeepSpeed's own"))
        if self.monitor is not None:
            mon = getattr(self.monitor.engine, "monitor", None)
            dest = ("DeepSpeed's monitor" if getattr(mon, "enabled", False)
                    else "the fp4offload.deepspeed logger at INFO (no DeepSpeed monitor in the JSON)")
            lines.append(f"  metrics: every {self.monitor.every} steps to {dest} ({self.monitor.written} written)")
        if self.preflight is not None:
            est = self.preflight
            lines.append(f"  host RAM estimate: {gib(est.per_rank)} per rank, {gib(est.node_total)} per node")
        if self.auto is not None:
            lines.append(f"  auto: {self.auto.line()}")
        lines.append("  details: .prepared, .block, .preflight, .auto, .monitor.last, .activations, .weights")
        return "\n".join(lines)


def _client_optimizer(prepared: Prepared, optimizer: Any, lr_scheduler: Any, model: Any, model_parameters: Any):
    """FP4AdamW (or a callable building it) in place of what the caller passed."""
    import torch

    where = prepared.states
    if optimizer is None:
        hp = ds_optim.settings_from_ds_section(prepared.ds_config.get("optimizer"))

        kind = str((prepared.ds_config.get("optimizer") or {}).get("type", "Adam"))

        def build(params):
            params = list(params)
            new = ds_optim.make_optimizer(params, hp, where)
            announce(f"replaced DeepSpeed's {kind} (the config's optimizer section) with {type(new).__name__}: "
                     f"{ds_optim.describe_states(where)}")
            return new

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
    """Pack the saved activations of the modules the block names, every step (fp4offload._offload.wrap_modules)."""
    try:
        from fp4offload._offload import ActivationPolicy, wrap_modules
    except Exception as exc:
        raise ConfigError("fp4offload.activations", block.to_dict().get("activations"),
                          "a block this build can apply", f"fp4offload._offload does not import ({exc}); "
                          "remove the activations sub-block") from None
    policy = ActivationPolicy.from_config(block.activations)
    wrapped = wrap_modules(model, policy)
    announce(policy.describe())
    return wrapped


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


def auto_status() -> dict[str, Any]:
    """The zero-code start-up hook (``fp4offload-auto.pth``, module ``_fp4offload_auto``), for doctor.

    ``{"active": bool, "state": str, "why": str}``; state is "waiting" (its finder is in sys.meta_path:
    the first import of deepspeed patches it), "patched", "disabled" (FP4OFFLOAD_AUTO off), "not
    installed" (no fp4offload-auto.pth on sys.path's site directories, or Python started with -S), or
    "inactive" (the .pth is there but nothing of it ran: deepspeed imported without it)."""
    import sys

    hook = sys.modules.get("_fp4offload_auto")
    auto = switches.setting("FP4OFFLOAD_AUTO")  # a word that is neither on nor off is a ConfigError
    if hook is not None and hook.state == "patched":
        return {"active": True, "state": "patched",
                "why": "deepspeed.initialize goes through fp4offload (configs without the block pass untouched)"}
    if any(getattr(f, "fp4offload_auto", False) for f in sys.meta_path):
        return {"active": True, "state": "waiting",
                "why": "deepspeed.initialize is routed through fp4offload when deepspeed is imported"}
    if not auto.value:
        return {"active": False, "state": "disabled",
                "why": f"FP4OFFLOAD_AUTO={os.environ.get('FP4OFFLOAD_AUTO')!r} turns it off"}
    if not any((Path(p) / "fp4offload-auto.pth").is_file() for p in sys.path if p):
        return {"active": False, "state": "not installed",
                "why": "no fp4offload-auto.pth in site-packages (reinstall fp4offload with pip; python -S skips "
                       ".pth files); call fp4offload.deepspeed.install() instead"}
    return {"active": False, "state": "inactive",
            "why": "fp4offload-auto.pth is installed but deepspeed was imported without it; call "
                   "fp4offload.deepspeed.install()"}
