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
4. builds FP4AdamW from the client optimizer or the config's ``optimizer`` section;

then calls the real ``deepspeed.initialize`` and attaches what needs the engine: packed ZeRO-3 weight
shards (``ds_weights``), saved-activation packing, and the metrics writer (``ds_monitor``).

With ``optimizer_states`` set it also keeps the memory each step frees from staying resident
(:func:`control_host_allocator`): the offloaded fp32 master, gradient partition and packed states live in host
RAM, and glibc's default (a threshold that rises to 32 MiB after the first large free) keeps the memory freed
during each backward in its heap, ~5 B/param of host RSS that the packed states would otherwise save. It fixes
glibc's mmap threshold (``FP4OFFLOAD_MMAP_THRESHOLD``: bytes, or ``off``) and serves torch's large CPU blocks
from a bounded cache that reuses them within the step instead of faulting them in again
(:mod:`fp4offload.host_allocator`; ``FP4OFFLOAD_HOST_CACHE``: a fraction, or ``off``). On the CPU accelerator
it also lets ZeRO-1/2 offload write the updated weights straight into the bf16 partition, dropping DeepSpeed's
second bf16 copy of it (:func:`share_bf16_staging`, 2 B/param; ``FP4OFFLOAD_SHARE_STAGING=0`` keeps it). With
one micro-batch per step the host gradient partition is kept in bf16 (:func:`bf16_gradient_partition`, 2
B/param; ``FP4OFFLOAD_BF16_GRADS=0`` keeps fp32).

``install()`` makes a plain ``deepspeed.initialize`` (the call inside Accelerate and the HF Trainer)
go through here; a config without the block is passed through untouched.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from fp4offload.config import Fp4OffloadConfig, parse_block, validate_deepspeed_config
from fp4offload.errors import ConfigError
from fp4offload.host_allocator import OFF_VALUES as _OFF

from . import ds_optim

log = logging.getLogger("fp4offload.deepspeed")

__all__ = ["initialize", "install", "uninstall", "installed", "prepare_config", "Prepared", "read_config",
           "SUPPORTED_DEEPSPEED", "control_host_allocator", "release_free_host_memory", "share_bf16_staging",
           "bf16_gradient_partition"]

SUPPORTED_DEEPSPEED = (">=0.19.8", "<0.20")
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
    """

    ds_config: dict
    block: Fp4OffloadConfig
    states: ds_optim.StatePlacement | None
    rewrites: tuple[str, ...] = field(default=())


def read_config(config: str | os.PathLike | Mapping[str, Any]) -> dict:
    """A deep copy of a DeepSpeed config given as a dict or a path to a JSON file."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, os.PathLike)):
        p = Path(config)
        try:
            doc = json.loads(p.read_text())
        except OSError as exc:
            raise ConfigError("config", str(config), "a readable DeepSpeed JSON file or a dict", str(exc)) from None
        except json.JSONDecodeError as exc:
            raise ConfigError("config", str(config), "valid JSON", f"line {exc.lineno} column {exc.colno}: {exc.msg}") \
                from None
        if not isinstance(doc, dict):
            raise ConfigError("config", str(config), "a JSON object at the top level")
        return doc
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
            if device == "same":
                device, nvme_path = "nvme", nvme_path or ds_path
            if device == "nvme" and not nvme_path:
                raise ConfigError("zero_optimization.offload_optimizer.nvme_path", ds_path,
                                  "a directory on an NVMe drive when the optimizer is offloaded to 'nvme'",
                                  "set it, or fp4offload.optimizer_states.nvme_path")
            new_off = {k: v for k, v in off.items() if k in ("pin_memory", "ratio")}
            new_off["device"] = "cpu"
            zero["offload_optimizer"] = new_off
            notes.append(f"zero_optimization.offload_optimizer.device: 'nvme' -> 'cpu' (fp32 master in host RAM); "
                         f"packed states on {device!r}" + (f" under {nvme_path}" if device == "nvme" else ""))
        if device == "nvme" and nvme_path:
            nvme_path = str(Path(nvme_path) / "optimizer_states")
        if ds.get("optimizer") is not None:
            ds_optim.settings_from_ds_section(ds["optimizer"])  # Adam/AdamW only; raises before anything is built
        states = ds_optim.StatePlacement(format=st.format, device=device, nvme_path=nvme_path, rounding=st.rounding,
                                         min_numel=st.min_numel)
    if world_size is None and os.environ.get("WORLD_SIZE", "").isdigit():
        world_size = int(os.environ["WORLD_SIZE"])
    validate_deepspeed_config(ds, world_size=world_size, check_with_deepspeed=True)
    _check_combinations(ds, block)
    return Prepared(ds_config=ds, block=block, states=states, rewrites=tuple(notes))


def _check_combinations(ds: dict, block: Fp4OffloadConfig) -> None:
    """What DeepSpeed would reject (or silently ignore) with the block on, caught before anything is built."""
    zero = _zero(ds)
    stage = zero.get("stage", 0)
    if block.optimizer_states is not None:
        off = zero.get("offload_optimizer")
        if isinstance(off, dict) and off.get("device") == "cpu" and stage == 0:
            raise ConfigError("zero_optimization.stage", 0, "1, 2 or 3 when offload_optimizer is set",
                              "DeepSpeed offloads the optimizer only under ZeRO")
        if ds.get("fp16", {}).get("enabled") and stage == 0:
            raise ConfigError("fp16.enabled", True, "false without ZeRO when fp4offload.optimizer_states is set",
                              "DeepSpeed's fp16 optimizer wrapper flattens states itself; use ZeRO 1-3 or bf16")
    if block.weights is not None and block.weights.format == "nvfp4":
        if zero.get("zero_quantized_weights") or zero.get("zero_quantized_nontrainable_weights"):
            raise ConfigError("zero_optimization.zero_quantized_weights", True, "false with fp4offload.weights",
                              "both replace how partitions are stored and fetched; keep one")
        if zero.get("zero_hpz_partition_size", 1) not in (1, None):
            raise ConfigError("zero_optimization.zero_hpz_partition_size", zero.get("zero_hpz_partition_size"),
                              "1 with fp4offload.weights", "hierarchical partitions keep a second bf16 copy")
        if block.weights.device != "cpu":
            raise ConfigError("fp4offload.weights.device", block.weights.device, "'cpu' (this version)",
                              "packed weight shards on NVMe are not implemented yet; use offload_param cpu")


# ----------------------------------------------------------------------------------------------
# initialize


def _original_initialize():
    import deepspeed

    return _ORIGINAL or deepspeed.initialize


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

    prepared = prepare_config(source)
    for note in prepared.rewrites:
        log.info("fp4offload: %s", note)
    block = prepared.block
    if block.weights is not None and block.weights.format == "nvfp4":
        from . import ds_weights

        ds_weights.check_deepspeed()  # private names: fail before anything is built
    if block.optimizer_states is not None:
        kwargs["optimizer"], kwargs["lr_scheduler"] = _client_optimizer(prepared, optimizer, lr_scheduler, model,
                                                                        model_parameters)
    allocator = control_host_allocator() if block.optimizer_states is not None else None
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
        with _bf16_grads_at_init(block.optimizer_states is not None) as at_init:
            result = _original_initialize()(config=prepared.ds_config, **kwargs)
    finally:
        for name, v in saved.items():
            setattr(args, name, v)
    engine = result[0]
    shared = share_bf16_staging(engine) if block.optimizer_states is not None else 0
    bf16_grads = bf16_gradient_partition(engine) if block.optimizer_states is not None else 0
    if allocator is not None and allocator.get("mmap_threshold"):
        release_free_host_memory()  # the model's own tensors, freed when DeepSpeed flattened them
    attached = Attached(prepared=prepared, activations=acts, allocator=allocator, staging_shared_bytes=shared,
                        bf16_grad_bytes_saved=bf16_grads, bf16_grads_at_init=at_init.applied > 0)
    if block.weights is not None and block.weights.format == "nvfp4":
        from . import ds_weights

        attached.weights = ds_weights.attach(engine, block.weights)
    if block.monitor is not None:
        from . import ds_monitor

        attached.monitor = ds_monitor.attach(engine, block.monitor, attached)
    engine.fp4offload = attached
    return result


@dataclass
class Attached:
    """What ``initialize`` applied to an engine (``engine.fp4offload``)."""

    prepared: Prepared
    activations: Any = None
    weights: Any = None
    monitor: Any = None
    allocator: dict | None = None
    staging_shared_bytes: int = 0  # share_bf16_staging
    bf16_grad_bytes_saved: int = 0  # bf16_gradient_partition
    bf16_grads_at_init: bool = False  # ... allocated in bf16 by DeepSpeed itself (_bf16_grads_at_init)


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
    a = block.activations
    policy = ActivationPolicy(format=a.format, device=a.device, nvme_path=a.nvme_path, min_numel=max(1, a.min_numel),
                              modules=tuple(a.modules), exclude=tuple(a.exclude))
    return wrap_modules(model, policy)


# ----------------------------------------------------------------------------------------------
# host allocator

MMAP_THRESHOLD_ENV = "FP4OFFLOAD_MMAP_THRESHOLD"
DEFAULT_MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value, kept fixed
_M_MMAP_THRESHOLD = -3  # mallopt parameter number (malloc.h)
_allocator_state: dict | None = None


def _libc():
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - both must exist
    except (OSError, AttributeError):
        return None
    return libc


def control_host_allocator(threshold: int | str | None = None) -> dict:
    """Keep the memory a training step frees from staying resident: glibc's mmap threshold fixed, and a
    bounded cache for torch's large CPU blocks (process-wide, once).

    glibc serves blocks below its mmap threshold from its heap. The threshold starts at 128 KiB and, each
    time an mmapped block is freed, rises to that block's size (up to 32 MiB); after the first backward every
    gradient, bucket slice and activation below 32 MiB comes from the heap, which then holds the backward's
    transient memory after it is freed (measured: ~0.8 GB of a 155M-parameter ZeRO-2 offload run, ~5 B/param,
    in the RSS peak and, once a long-lived block lands on top of the heap, between steps too). Setting the
    threshold turns that adjustment off: blocks at or above it are mmapped and unmapped on free. Alone, that
    costs page faults when the same sizes are allocated again in the next layer (measured on a 103M-parameter
    run: 289 thousand per step, 0.87 s against 0.55 s). So torch's blocks of 128 KiB and more go to
    :mod:`fp4offload.host_allocator` instead, which keeps freed blocks for reuse up to 1/8 of the bytes in use
    and unmaps the rest (the same run: about 1,600 page faults per step; see benchmarks/RESULTS.md).

    Args:
        threshold: bytes; None reads ``FP4OFFLOAD_MMAP_THRESHOLD`` (default 128 KiB); ``"off"`` or 0 leaves
            glibc alone. The cache has its own switch, ``FP4OFFLOAD_HOST_CACHE`` (a fraction, or ``off``).

    Returns ``{"mmap_threshold": bytes or None, "reason": str, "host_cache": host_allocator.install()'s
    dict}``. The glibc part does nothing when the user already tuned glibc (``MALLOC_MMAP_THRESHOLD_`` or a
    ``glibc.malloc`` tunable) or off glibc. Called again, returns what the first call did.
    """
    global _allocator_state
    if _allocator_state is not None:
        return dict(_allocator_state)
    from fp4offload import host_allocator

    state = _fix_mmap_threshold(threshold)
    state["host_cache"] = host_allocator.install()
    _allocator_state = state
    return dict(state)


def _fix_mmap_threshold(threshold: int | str | None) -> dict:
    raw = threshold if threshold is not None else os.environ.get(MMAP_THRESHOLD_ENV, "")
    raw = str(raw).strip().lower()
    if raw in _OFF:
        return {"mmap_threshold": None, "reason": f"{MMAP_THRESHOLD_ENV}=off"}
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return {"mmap_threshold": None, "reason": "glibc malloc already tuned by the environment"}
    try:
        value = int(raw) if raw else DEFAULT_MMAP_THRESHOLD
    except ValueError:
        raise ConfigError(MMAP_THRESHOLD_ENV, raw, "a size in bytes, or 'off'") from None
    libc = _libc()
    if libc is None:
        return {"mmap_threshold": None, "reason": "not glibc"}
    if libc.mallopt(_M_MMAP_THRESHOLD, int(value)) != 1:
        return {"mmap_threshold": None, "reason": f"mallopt(M_MMAP_THRESHOLD, {value}) refused"}
    log.info("fp4offload: glibc mmap threshold fixed at %d bytes (%s=off to keep glibc's default)", value,
             MMAP_THRESHOLD_ENV)
    return {"mmap_threshold": int(value), "reason": "set"}


SHARE_STAGING_ENV = "FP4OFFLOAD_SHARE_STAGING"


def share_bf16_staging(engine: Any) -> int:
    """On the CPU accelerator, let ZeRO-1/2 offload write the updated weights straight into the bf16
    partition instead of through a second bf16 copy of it. Returns the bytes no longer held.

    After its CPU optimizer step ZeRO-1/2 offload casts the fp32 master into a staging buffer
    (``param_buffer_of_bit16_for_cpu_offload_groups``, 2 B/param) and copies that into the bf16 partition:
    the buffer is where the weights wait to cross to a GPU. When the bf16 partition is itself in host RAM
    (the CPU accelerator) the buffer is a second copy of it: each one is replaced by the partition, so the
    cast lands in place (same rounding, same bits) and the copy after it is a copy onto itself. Skipped for
    a buffer DeepSpeed's native pinned-memory backend owns, and when ``FP4OFFLOAD_SHARE_STAGING=0``.
    """
    if os.environ.get(SHARE_STAGING_ENV, "1").strip().lower() in _OFF:
        return 0
    opt = getattr(engine, "optimizer", None)
    bufs = getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", None)
    parts = getattr(opt, "parallel_partitioned_bit16_groups", None)
    if not bufs or not parts:
        return 0
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    freed = 0
    for i, buf in enumerate(bufs):
        target = parts[i][dist.get_rank(group=opt.real_dp_process_group[i])]
        if (target.device.type != "cpu" or buf.device.type != "cpu" or target.dtype != buf.dtype
                or target.numel() != buf.numel() or target.data_ptr() == buf.data_ptr()
                or get_accelerator().is_pinned(buf)):
            continue
        bufs[i] = target.view(buf.shape)
        freed += buf.numel() * buf.element_size()
    if freed:
        log.info("fp4offload: %d bytes of bf16 staging buffers shared with the bf16 partitions (%s=0 keeps them)",
                 freed, SHARE_STAGING_ENV)
    return freed


BF16_GRADS_ENV = "FP4OFFLOAD_BF16_GRADS"


def bf16_gradient_partition(engine: Any) -> int:
    """Bytes the block saves by keeping ZeRO-1/2 offload's host gradient partition in bf16 instead of fp32.

    Under ``offload_optimizer`` DeepSpeed keeps an fp32 copy of each rank's gradient partition in host RAM
    (``single_partition_of_fp32_groups[i].grad``, 4 B/param, on a GPU machine too) and copies the bf16
    gradients into it. With one micro-batch per step (no accumulation into it) every value it holds is a
    bf16 value, and FP4AdamW's step reads bf16 gradients directly, so a bf16 partition holds the same
    numbers in half the bytes. The one operation DeepSpeed applies to it in place is gradient clipping's
    scale, which then rounds to bf16 (relative 2^-9, far below the 4-bit states' own rounding); without
    clipping, or below the clip norm, training is the same bits. Applied when the inner optimizer is
    FP4AdamW, the parameters are bf16, gradient_accumulation_steps is 1, and ``FP4OFFLOAD_BF16_GRADS`` is
    not ``0``.

    ``initialize`` has DeepSpeed allocate the partition in bf16 to begin with (:class:`_bf16_grads_at_init`):
    an fp32 one, zero-filled while DeepSpeed builds its buffers, would set the process's peak RSS for large
    models even if it were replaced right after. This counts what that saved.
    """
    import torch

    opt = getattr(engine, "optimizer", None)
    if not _wants_bf16_grads(opt):
        return 0
    saved = sum(m.grad.numel() * 2 for m in opt.single_partition_of_fp32_groups
                if m.grad is not None and m.grad.dtype == torch.bfloat16)
    if saved:
        log.info("fp4offload: host gradient partitions kept in bf16, %d bytes less (%s=0 keeps fp32)", saved,
                 BF16_GRADS_ENV)
    return saved


def _wants_bf16_grads(zero_opt: Any) -> bool:
    """Whether a ZeRO-1/2 optimizer's host gradient partition may be bf16 (bf16_gradient_partition)."""
    if os.environ.get(BF16_GRADS_ENV, "1").strip().lower() in _OFF:
        return False
    import torch

    from fp4offload.optim import FP4AdamW

    return (bool(getattr(zero_opt, "single_partition_of_fp32_groups", None))
            and bool(getattr(zero_opt, "cpu_offload", False))
            and getattr(zero_opt, "gradient_accumulation_steps", None) == 1
            and isinstance(getattr(zero_opt, "optimizer", None), FP4AdamW)
            and all(p.dtype == torch.bfloat16 for g in getattr(zero_opt, "bit16_groups", []) for p in g))


def _set_grad(master, grad) -> None:
    """``master.grad = grad`` for a gradient of another dtype than the tensor's (torch >= 2.9 checks it)."""
    master.grad = None
    if hasattr(master, "grad_dtype"):
        master.grad_dtype = grad.dtype
    master.grad = grad


class _bf16_grads_at_init:
    """While ``deepspeed.initialize`` runs, ZeRO-1/2 allocates its host gradient partition in bf16 when
    :func:`_wants_bf16_grads` says it may (``DeepSpeedZeroOptimizer.initialize_optimizer_states``, which under
    offload does nothing else for FP4AdamW; the method is restored on exit). ``applied`` counts the
    optimizers it served; the tests require it for ZeRO-1/2 with FP4AdamW, so a DeepSpeed that stops calling
    the method fails them instead of silently keeping fp32."""

    def __init__(self, enabled: bool):
        self.enabled, self.applied, self._cls, self._orig = enabled, 0, None, None

    def __enter__(self):
        if not self.enabled:
            return self
        try:
            from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
        except ImportError:
            return self
        orig = getattr(DeepSpeedZeroOptimizer, "initialize_optimizer_states", None)
        if orig is None:
            return self
        outer = self

        def initialize_optimizer_states(zo):
            if not _wants_bf16_grads(zo):
                return orig(zo)
            import torch
            from deepspeed.accelerator import get_accelerator

            for i, _ in enumerate(zo.bit16_groups):
                grad = torch.zeros(int(zo.partition_size[i]), dtype=torch.bfloat16, device=zo.device)
                _set_grad(zo.single_partition_of_fp32_groups[i],
                          get_accelerator().pin_memory(grad) if zo.cpu_offload_pin_memory else grad)
            outer.applied += 1

        self._cls, self._orig = DeepSpeedZeroOptimizer, orig
        DeepSpeedZeroOptimizer.initialize_optimizer_states = initialize_optimizer_states
        return self

    def __exit__(self, *exc):
        if self._cls is not None:
            self._cls.initialize_optimizer_states = self._orig
        return False


def release_free_host_memory() -> bool:
    """``malloc_trim(0)``: hand the free pages of glibc's heaps back to the OS. False off glibc."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


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
    _ORIGINAL = deepspeed.initialize
    deepspeed.initialize = _patched_initialize


def uninstall() -> None:
    """Undo :func:`install`."""
    global _ORIGINAL
    import deepspeed

    if deepspeed.initialize is _patched_initialize and _ORIGINAL is not None:
        deepspeed.initialize = _ORIGINAL
    _ORIGINAL = None


def installed() -> bool:
    """True while :func:`install` is in effect."""
    import sys

    ds = sys.modules.get("deepspeed")
    return ds is not None and ds.initialize is _patched_initialize
