"""``initialize``: the ``"fp4offload"`` block of a DeepSpeed config applied, and ``install``.

``initialize`` takes the arguments of ``deepspeed.initialize`` and returns what it returns. When the
config carries the block it, in this order, before DeepSpeed builds anything:

1. reads the config (dict or JSON path, from ``config``, ``config_params`` or ``args.deepspeed_config``);
2. rewrites what the block implies and validates the result (:func:`fp4offload._deepspeed.config.prepare_config`:
   ``zero_force_ds_cpu_optimizer: false``, ``zero_allow_untested_optimizer: true``, an ``offload_optimizer``
   on NVMe becomes ``cpu`` for DeepSpeed while FP4AdamW keeps its packed states on NVMe itself), raising
   ConfigError with the key path, the value and what is allowed, and checks its NVMe folders;
3. checks the private DeepSpeed names the surgeries it turns on need (:mod:`fp4offload._deepspeed.internals`);
4. checks that the host RAM the config needs fits (:mod:`fp4offload._deepspeed.preflight`; CapacityError,
   ``host.preflight``);
5. applies what each surgery it turns on does before DeepSpeed builds anything, in the order of
   :data:`fp4offload._deepspeed.surgeries.SURGERIES`: FP4AdamW built from the client optimizer or the config's
   ``optimizer`` section (:mod:`fp4offload._deepspeed.optim`), the host allocator settings, saved-activation
   packing, and the DeepSpeed methods replaced while ``deepspeed.initialize`` runs;

then calls the real ``deepspeed.initialize`` and runs, in the same order, each surgery's step on the engine:
the bf16 host gradient partition and, on the CPU accelerator, the shared bf16 staging buffers
(:mod:`fp4offload._deepspeed.zero12`, :mod:`fp4offload._deepspeed.zero3`), packed ZeRO-3 weight shards
(:mod:`fp4offload._deepspeed.weights`) and the metrics writer (:mod:`fp4offload._deepspeed.monitor`).

A plain ``deepspeed.initialize`` (the user's own, Accelerate's, the HF Trainer's) comes here with no code
change: the start-up hook ``_fp4offload_auto`` (``fp4offload-auto.pth`` in site-packages) wraps it when
deepspeed is first imported; ``FP4OFFLOAD_AUTO=0`` turns that off, and ``install()`` does the same by
hand. A config without the block is passed through untouched.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from pathlib import Path
from typing import Any, Mapping

from fp4offload import _switches as switches
from fp4offload._announce import announce
from fp4offload._dtensor import settle_gloo_at_exit
from fp4offload.errors import ConfigError

from . import internals as dsi
from . import auto, preflight
from .auto import is_auto
from .config import BLOCK_KEY, Prepared, prepare_config, read_config
from .surgeries import SURGERIES, Attached, Run, features
from .surgeries import close_on_destroy as _close_on_destroy  # noqa: F401

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
    room = preflight.limits()
    estimate = preflight.check(prepared, model, lim=room)  # host RAM: fail before DeepSpeed allocates
    attached = Attached(prepared=prepared, preflight=estimate, preflight_free=room.free, auto=decision,
                        block=copy.deepcopy(_block_of(source)))
    run = Run(prepared=prepared, kwargs=kwargs, attached=attached)
    surgeries = [s for s in SURGERIES if s.applies(prepared)]
    with contextlib.ExitStack() as at_init:
        for s in surgeries:
            if s.before is not None:
                run.started(s, s.before(run))
            if s.at_init is not None:
                run.started(s, at_init.enter_context(s.at_init(run)))
        with _without_config_path(args):
            result = _original_initialize()(config=prepared.ds_config, **kwargs)
    engine = result[0]
    settle_gloo_at_exit()  # DeepSpeed's CPU ranks talk over gloo
    for s in SURGERIES:
        if s.after is not None and (s in surgeries or (s.on_engine is not None and s.on_engine(engine))):
            run.finished(s, s.after(run, engine))
    engine.fp4offload = attached
    return result


@contextlib.contextmanager
def _without_config_path(args: Any):
    """Hand DeepSpeed the rewritten dict; args.deepspeed_config would conflict with it."""
    saved = {}
    if args is not None:
        for name in ("deepspeed_config", "deepscale_config"):
            if getattr(args, name, None) is not None:
                saved[name] = getattr(args, name)
                setattr(args, name, None)
    try:
        yield
    finally:
        for name, v in saved.items():
            setattr(args, name, v)


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
