"""Host-memory preflight of the DeepSpeed block: does this config fit in the RAM this process may use?

``initialize`` calls :func:`check` after the config is validated and before DeepSpeed allocates anything.
It estimates the host RAM this rank will hold (:mod:`fp4offload._memory.host_model`, fed with the model's
parameter count, the ZeRO stage, the offload targets, the block and the accelerator) and the node's total
across its local ranks, and compares what initialize and training will add with what the process may still
take (:func:`fp4offload._machine.limits`): the smaller of the machine's available memory and, inside a memory
cgroup (v1 or v2, the tightest limit on the way up the hierarchy), the limit less the cgroup's usage without
its reclaimable page cache. When it does not fit, ``host.preflight``
decides: ``error`` (default) raises CapacityError naming the estimate, the limit, the three largest
consumers and the changes that would fit (computed by the same model), ``warn`` logs that and goes on,
``off`` skips the check.

What the process holds before initialize (Python, torch, DeepSpeed, the data, the model as built) is
measured, not modelled: its RSS. DeepSpeed's flattening replaces the model's parameters, so their bytes are
taken out of it; activations, which depend on the batch, are not in the estimate.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fp4offload.errors import CapacityError
from fp4offload._memory import host_model
from fp4offload._machine import Limits, cgroup_limit, launcher_ranks, limits

from . import internals as dsi

log = logging.getLogger("fp4offload.deepspeed")

__all__ = ["Limits", "limits", "cgroup_limit", "model_bytes", "estimate", "fits", "check", "render", "accelerator_kind"]

GiB = float(1 << 30)


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / (1 << 20):.0f} MiB"


def model_bytes(model: Any) -> tuple[int, int]:
    """(parameters, bytes of them in host RAM now) of a torch module; ZeRO-3 ``zero.Init`` parameters count
    their full size (``ds_numel``) and the bytes of their local partition."""
    params = host = 0
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        t = dsi.read(p, "ds_tensor", None)
        params += int(dsi.read(p, "ds_numel", p.numel()))
        local = t if t is not None else p
        if local.device.type == "cpu":
            host += local.numel() * local.element_size()
    return params, host


def accelerator_kind() -> str:
    """"cpu" on DeepSpeed's CPU accelerator (device buffers are host RAM), else "gpu"."""
    try:
        from deepspeed.accelerator import get_accelerator

        return "cpu" if get_accelerator().device_name() == "cpu" else "gpu"
    except Exception:
        return "cpu" if os.environ.get("DS_ACCELERATOR") == "cpu" else "gpu"


def estimate(ds_config: dict, model: Any, host_settings: Any = None, *, rss: int | None = None,
             world: int | None = None, local_ranks: int | None = None,
             accelerator: str | None = None, states: Any = None) -> host_model.HostEstimate:
    """This rank's estimate for ``ds_config`` (as prepare_config returns it, or a plain DeepSpeed config).
    ``model``: a torch module, or its ``(parameters, bytes in host RAM)`` from :func:`model_bytes`.
    ``states``: prepare_config's StatePlacement (where the block put the states and split's residual: its
    rewritten ``offload_optimizer`` says "cpu" even when they went to NVMe)."""
    import psutil

    params, held = model if isinstance(model, tuple) else model_bytes(model)
    w, local, _ = launcher_ranks()
    rss = psutil.Process().memory_info().rss if rss is None else rss
    x = host_model.inputs_from_config(ds_config, params, world=world or w, local_ranks=local_ranks or local,
                                      accelerator=accelerator or accelerator_kind(), host=host_settings,
                                      states=states, free_bytes=limits().free)
    return host_model.estimate_host(x, runtime_bytes=max(0, rss - held), built_bytes=held)


def fits(est: host_model.HostEstimate, lim: Limits, held_now: int) -> bool:
    """Every local rank adds est.added less what DeepSpeed frees of the model as built (held_now)."""
    return max(0, est.added - held_now) * est.local_ranks <= lim.free


def render(est: host_model.HostEstimate, lim: Limits | None = None, held_now: int = 0, *,
           node_ram: int | None = None) -> str:
    """The estimate as lines: per consumer, the rank's total, the node's total and the limit (``node_ram``: a
    named node's RAM, which the node's total must fit, instead of what this process may still use)."""
    rows = [f"  {k:36s} {v / GiB:8.2f} GiB" for k, v in sorted(est.consumers.items(), key=lambda kv: -kv[1])]
    label = "process before initialize (measured)" if node_ram is None else "process before initialize (assumed)"
    rows.append(f"  {label:36s} {est.runtime / GiB:8.2f} GiB")
    rows.append(f"  {'this rank':36s} {est.per_rank / GiB:8.2f} GiB")
    rows.append(f"  {f'node ({est.local_ranks} local ranks)':36s} {est.node_total / GiB:8.2f} GiB")
    for k, v in est.nvme.items():
        rows.append(f"  {'NVMe: ' + k:36s} {v / GiB:8.2f} GiB")
    if node_ram is not None:
        rows.append(f"  {'node RAM':36s} {node_ram / GiB:8.2f} GiB")
    elif lim is not None:
        need = max(0, est.added - held_now) * est.local_ranks
        rows.append(f"  {'to allocate on this node':36s} {need / GiB:8.2f} GiB; may use {lim.describe()}")
    return "\n".join(rows)


def check(prepared: Any, model: Any, *, lim: Limits | None = None) -> host_model.HostEstimate | None:
    """The preflight of ``initialize`` (see the module docstring). Returns the estimate, or None when off."""
    mode = prepared.host.preflight.value
    if mode == "off" or model is None or not hasattr(model, "parameters"):
        return None
    params, held = model_bytes(model)
    est = estimate(prepared.ds_config, (params, held), prepared.host, states=getattr(prepared, "states", None))
    lim = limits() if lim is None else lim
    if fits(est, lim, held):
        log.info("fp4offload: host-memory preflight: %.2f GiB per rank fits\n%s", est.per_rank / GiB,
                 render(est, lim, held))
        return est
    fixes = []
    for what, alt in host_model.alternatives(est.inputs):
        alt_est = host_model.estimate_host(alt, est.runtime, held)
        if fits(alt_est, lim, held):
            fixes.append(f"{what}: {_size(alt_est.per_rank)} per rank")
    top = ", ".join(f"{k} {_size(v)}" for k, v in est.largest(3))
    need = max(0, est.added - held) * est.local_ranks
    src = prepared.host.preflight.source
    hint = (f"this rank would hold {_size(est.per_rank)} ({_size(est.node_total)} for the node's "
            f"{est.local_ranks} local rank(s)); largest: {top}; the process may use {lim.describe()}. "
            + ("Changes that fit: " + "; ".join(fixes) + ". " if fixes else
               "No single change of the block or ZeRO keys fits: more nodes, a smaller model or more RAM. ")
            + f'fp4offload.host.preflight "warn" goes ahead anyway, "off" skips this check (now {mode!r}, '
              f"from {src})")
    err = CapacityError(f"host RAM for {params / 1e6:.1f}M parameters under this DeepSpeed config", need, lim.free,
                        hint)
    if mode == "warn":
        log.warning("fp4offload: host-memory preflight: %s", err)
        return est
    raise err
