"""What the block does to DeepSpeed around ``deepspeed.initialize``: one :class:`Surgery` per change, in
:data:`SURGERIES`, in the order ``initialize`` applies them.

Each record names the block feature that turns it on (its ``feature``: the rows of
:data:`fp4offload._deepspeed.internals.TABLE` tagged with it are the private DeepSpeed names it needs), when a
prepared config turns it on (``applies``), what it does before ``deepspeed.initialize`` (``before``) or while it
runs (``at_init``, a context manager), what it does once the engine exists (``after``), and the attribute of
:class:`Attached` its result goes to (``field``). From the table come the features :func:`features` hands to
:func:`fp4offload._deepspeed.internals.check`, the steps ``initialize`` runs, and ``engine.fp4offload``: what
each surgery returned, and the names of those that ran (``Attached.surgeries``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

from fp4offload._announce import announce
from fp4offload._config import Fp4OffloadConfig
from fp4offload._config.block import MonitorConfig
from fp4offload.errors import ConfigError

from . import internals as dsi
from . import optim as ds_optim
from .at_init import compact_master_at_init
from .config import Prepared, _zero
from .host import control_host_allocator, release_free_host_memory
from .zero3 import fp32_clip, zero3_gradient_partition, zero3_grads_at_init
from .zero12 import (bf16_gradient_partition, bf16_grads_at_init, master_is_device_partition, share_bf16_staging,
                     staging_is_master)

__all__ = ["Surgery", "SURGERIES", "Run", "Attached", "features", "client_optimizer", "attach_activations",
           "norm_source", "close_on_destroy"]


@dataclass(frozen=True)
class Surgery:
    """One change the block makes to DeepSpeed around ``deepspeed.initialize``.

    Attributes:
        name: what ``engine.fp4offload.surgeries`` calls it once it ran.
        feature: the block feature that turns it on. The rows of internals.TABLE tagged with it (:attr:`needs`)
            are checked before anything is built, and their ConfigError names ``fp4offload.<feature>``.
        applies: whether a prepared config turns it on.
        before: ``before(run)`` before ``deepspeed.initialize``; returns its result.
        at_init: ``at_init(run)``, a context manager held open while ``deepspeed.initialize`` runs; what it
            enters is its result.
        after: ``after(run, engine)`` once the engine exists; returns its result (in place of the one before).
        field: the :class:`Attached` attribute its result goes to. Byte counts of records naming the same
            attribute add up.
        on_engine: ``on_engine(engine)`` true also runs ``after`` where the config does not turn it on.
    """

    name: str
    feature: str
    applies: Callable[[Prepared], bool]
    before: Callable[["Run"], Any] | None = None
    at_init: Callable[["Run"], ContextManager] | None = None
    after: Callable[["Run", Any], Any] | None = None
    field: str | None = None
    on_engine: Callable[[Any], bool] | None = None

    @property
    def needs(self) -> tuple[dsi.Internal, ...]:
        """The private DeepSpeed names its feature needs (rows of internals.TABLE)."""
        return tuple(row for row in dsi.TABLE if self.feature in row.features)


@dataclass
class Attached:
    """What ``initialize`` applied to an engine (``engine.fp4offload``)."""

    prepared: Prepared
    activations: Any = None
    weights: Any = None
    monitor: Any = None
    allocator: dict | None = None
    staging_shared_bytes: int = 0  # share_bf16_staging, or staging_is_master with a compact master
    master_shared_bytes: int = 0  # a compact master that is the model's own bf16 partition (CPU accelerator)
    bf16_grad_bytes_saved: int = 0  # bf16_gradient_partition and zero3_gradient_partition
    bf16_grads_at_init: bool = False  # ... allocated in bf16 by DeepSpeed itself (zero12.bf16_grads_at_init)
    zero3_grads_at_init: bool = False  # ZeRO-3's master gradients allocated unfilled (zero3.zero3_grads_at_init)
    preflight: Any = None  # the host-memory estimate (fp4offload._memory.host_model.HostEstimate); None when off
    preflight_free: int | None = None  # what the process could still take when the preflight read its limits
    auto: Any = None  # with "fp4offload": {"auto": true}, what it chose and why (_deepspeed.auto.Decision)
    block: Any = None  # the block that ran, as JSON (auto's choice in place of "auto")
    surgeries: tuple[str, ...] = ()  # the names of the SURGERIES that ran, in order

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
        lines.append("  details: .prepared, .block, .preflight, .auto, .monitor.last, .activations, .weights, "
                     ".surgeries")
        return "\n".join(lines)


@dataclass
class Run:
    """One ``initialize``: its prepared config, the arguments going to ``deepspeed.initialize`` (which
    ``client_optimizer`` rewrites), the :class:`Attached` it fills, and what each surgery's ``before`` or
    ``at_init`` gave, by name."""

    prepared: Prepared
    kwargs: dict
    attached: Attached
    entered: dict[str, Any] = field(default_factory=dict)

    def started(self, surgery: Surgery, result: Any) -> None:
        """What ``before`` returned or ``at_init`` entered; it is the result unless an ``after`` follows."""
        self.entered[surgery.name] = result
        self._ran(surgery)
        if surgery.after is None:
            self._keep(surgery, result)

    def finished(self, surgery: Surgery, result: Any) -> None:
        """What ``after`` returned."""
        self._ran(surgery)
        self._keep(surgery, result)

    def _ran(self, surgery: Surgery) -> None:
        if surgery.name not in self.attached.surgeries:
            self.attached.surgeries += (surgery.name,)

    def _keep(self, surgery: Surgery, result: Any) -> None:
        if surgery.field is None:
            return
        held = getattr(self.attached, surgery.field)
        adds = isinstance(held, int) and not isinstance(held, bool)
        setattr(self.attached, surgery.field, held + result if adds else result)


# ----------------------------------------------------------------------------------------------
# when each applies


def _stage(p: Prepared) -> int:
    return _zero(p.ds_config).get("stage", 0)


def _states(p: Prepared) -> bool:
    return p.block.optimizer_states is not None


def _compact(p: Prepared) -> bool:
    return p.states is not None and p.states.master != "fp32"


def _bf16_grads(p: Prepared) -> bool:
    """ZeRO-1/2's host gradient partition in bf16 (``host.bf16_gradient_partition``)."""
    return _states(p) and _stage(p) in (1, 2) and bool(p.host.bf16_gradient_partition.value)


def _zero3(p: Prepared) -> bool:
    """ZeRO-3 shares its gradient partition whenever the dtypes agree (zero3.zero3_gradient_partition), whatever
    ``host.bf16_gradient_partition`` says."""
    return _states(p) and _stage(p) == 3


def _share_staging(p: Prepared) -> bool:
    """ZeRO-1/2's staging buffers shared with the bf16 partitions; a compact master makes them the master instead
    (staging_is_master)."""
    return (_states(p) and not _compact(p) and _stage(p) in (1, 2)
            and bool(p.host.share_bf16_staging.value))


def _nvfp4_weights(p: Prepared) -> bool:
    return p.block.weights is not None and p.block.weights.format == "nvfp4"


def _ds_monitor(engine: Any) -> bool:
    """A DeepSpeed monitor in the JSON (csv_monitor, tensorboard, wandb, comet): the block writes to it every
    monitor.every steps (default MonitorConfig().every) without a key of its own."""
    return bool(getattr(getattr(engine, "monitor", None), "enabled", False))


# ----------------------------------------------------------------------------------------------
# what each does


def client_optimizer(prepared: Prepared, optimizer: Any, lr_scheduler: Any, model: Any, model_parameters: Any):
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


def attach_activations(model: Any, block: Fp4OffloadConfig) -> Any:
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


def norm_source(engine: Any) -> bool:
    """ZeRO-1/2 computes the global gradient norm before the optimizer steps (for clipping, and always under
    offload): FP4AdamW's non-finite check reads it instead of every gradient (``hooks.grad_norm_source``)."""
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


def close_on_destroy(engine: Any) -> bool:
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


def _replace_client_optimizer(run: Run) -> None:
    kw = run.kwargs
    kw["optimizer"], kw["lr_scheduler"] = client_optimizer(run.prepared, kw["optimizer"], kw["lr_scheduler"],
                                                           kw["model"], kw["model_parameters"])


def _zero3_gradient_partition(run: Run, engine: Any) -> int:
    shared = zero3_gradient_partition(engine, run.prepared.host, fused_weights=_nvfp4_weights(run.prepared))
    at_init = run.entered["zero3_grads_at_init"]
    if at_init.applied and not shared:
        at_init.zero_fill(engine)  # kept as DeepSpeed's own: zero-filled, as DeepSpeed leaves them
    return shared


def _release_host_memory(run: Run, engine: Any) -> bool:
    allocator = run.attached.allocator
    if allocator is not None and allocator.get("mmap_threshold") and release_free_host_memory():
        # the model's own tensors, freed when DeepSpeed flattened them
        announce("process: glibc malloc_trim(0) after initialize (free heap pages back to the OS)")
        return True
    return False


def _attach_weights(run: Run, engine: Any) -> Any:
    from . import weights

    return weights.attach(engine, run.prepared.block.weights)


def _attach_monitor(run: Run, engine: Any) -> Any:
    from . import monitor

    return monitor.attach(engine, run.prepared.block.monitor or MonitorConfig(), run.attached)


# ----------------------------------------------------------------------------------------------
# the table

#: Every surgery, in the order ``initialize`` applies it: ``before`` and ``at_init`` in this order ahead of
#: ``deepspeed.initialize``, then ``after`` in this order once the engine exists.
SURGERIES: tuple[Surgery, ...] = (
    Surgery("client_optimizer", "optimizer_states", _states, before=_replace_client_optimizer),
    Surgery("host_allocator", "optimizer_states", _states, field="allocator",
            before=lambda run: control_host_allocator(run.prepared.host)),
    Surgery("activations", "activations", lambda p: p.block.activations is not None, field="activations",
            before=lambda run: attach_activations(run.kwargs["model"], run.prepared.block)),
    Surgery("bf16_grads_at_init", "bf16_gradient_partition", _bf16_grads, field="bf16_grads_at_init",
            at_init=lambda run: bf16_grads_at_init(True, run.prepared.host),
            after=lambda run, engine: run.entered["bf16_grads_at_init"].applied > 0),
    Surgery("zero3_grads_at_init", "bf16_gradient_partition", _zero3, field="zero3_grads_at_init",
            at_init=lambda run: zero3_grads_at_init(True),
            after=lambda run, engine: run.entered["zero3_grads_at_init"].applied > 0),
    Surgery("compact_master_at_init", "compact_master", _compact, at_init=lambda run: compact_master_at_init(True)),
    Surgery("staging_is_master", "compact_master", _compact, field="staging_shared_bytes",
            after=lambda run, engine: staging_is_master(engine)),
    Surgery("master_is_device_partition", "compact_master", _compact, field="master_shared_bytes",
            after=lambda run, engine: master_is_device_partition(engine)),
    Surgery("fp32_clip", "compact_master", _compact, after=lambda run, engine: fp32_clip(engine)),
    Surgery("share_bf16_staging", "share_bf16_staging", _share_staging, field="staging_shared_bytes",
            after=lambda run, engine: share_bf16_staging(engine, run.prepared.host)),
    Surgery("bf16_gradient_partition", "bf16_gradient_partition", _bf16_grads, field="bf16_grad_bytes_saved",
            after=lambda run, engine: bf16_gradient_partition(engine, run.prepared.host)),
    Surgery("zero3_gradient_partition", "bf16_gradient_partition", _zero3, field="bf16_grad_bytes_saved",
            after=_zero3_gradient_partition),
    Surgery("norm_source", "optimizer_states", _states, after=lambda run, engine: norm_source(engine)),
    Surgery("close_on_destroy", "optimizer_states", _states, after=lambda run, engine: close_on_destroy(engine)),
    Surgery("release_host_memory", "optimizer_states", _states, after=_release_host_memory),
    Surgery("weights", "weights", _nvfp4_weights, field="weights", after=_attach_weights),
    Surgery("monitor", "monitor", lambda p: p.block.monitor is not None, field="monitor", after=_attach_monitor,
            on_engine=_ds_monitor),
)


def features(prepared: Prepared) -> tuple[str, ...]:
    """The block features (internals.FEATURES) whose surgeries a prepared config turns on, for internals.check."""
    out: list[str] = []
    for s in SURGERIES:
        if s.feature in dsi.FEATURES and s.feature not in out and s.applies(prepared):
            out.append(s.feature)
    return tuple(out)
