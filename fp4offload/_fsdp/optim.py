"""The optimizer over an FSDP2 model's local shards: FP4AdamW, or torch AdamW for fp32 states.

Both step each rank's local shards through proxies (fp4offload/_optim/shards.py): FP4AdamW does so by itself over
DTensor parameters; :class:`ShardedAdamW` is torch AdamW doing the same, for a policy whose states stay fp32 (the
local shard of an NVFP4 weight is an FP4Weight, which torch AdamW cannot step). Either way ``param_groups`` hold the
model's DTensor parameters, ``state_dict()`` is torch AdamW's form (``step``, fp32 ``exp_avg`` and ``exp_avg_sq``
as DTensors with each parameter's placement, packed states decoded), so ``torch.distributed.checkpoint``'s
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` work on it and DCP reshards it, and
``packed_state_dict()`` / ``load_packed_state_dict`` are the optimizer's own form (what ``fp4offload.fsdp.save``
writes: the packed bytes, exact on the same number of ranks).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
import torch.nn as nn

from .._optim.shards import STATE, LocalShards, ShardedEntryPoints
from ..errors import ConfigError
from .policy import Policy

log = logging.getLogger("fp4offload.fsdp")

__all__ = ["optimizer", "ShardedAdamW", "inner_optimizer_class", "local_shards_of"]


class ShardedAdamW(ShardedEntryPoints, torch.optim.AdamW):
    """torch.optim.AdamW over the local shards of a sharded model's parameters (fp32 states beside the shards)."""

    state = STATE
    _packed_fp4 = False

    def __init__(self, params: Iterable[Any], **kwargs: Any):
        groups, shards = LocalShards.of(params, always=True)
        super().__init__(groups, **kwargs)
        self.local_shards = shards
        shards.attach(self)

    def step(self, closure=None):
        return self.local_shards.step(self, closure, super().step)

    def init_state(self) -> None:
        """Create every state without changing a parameter (one step with zero gradients and lr 0)."""
        self.local_shards.init_state(self, super().step)

    def packed_state_dict(self) -> dict:
        """torch AdamW's own state dict over the local shards (positional)."""
        with self.local_shards.in_groups(self):
            return torch.optim.AdamW.state_dict(self)  # not super(): ShardedEntryPoints.state_dict comes first

    def load_packed_state_dict(self, state_dict: dict) -> None:
        with self.local_shards.in_groups(self):
            torch.optim.AdamW.load_state_dict(self, state_dict)


def local_shards_of(optimizer, depth: int = 4):
    """The optimizer stepping a sharded model's local shards inside the wrappers the Trainer and Accelerate put
    around it (``AcceleratedOptimizer.optimizer``, a few levels at most), or None."""
    for _ in range(depth + 1):
        if getattr(optimizer, "local_shards", None) is not None:
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        if optimizer is None:
            return None
    return None


def inner_optimizer_class(policy: Policy) -> tuple[type, dict, str]:
    """(optimizer class, extra constructor kwargs, name) the policy's ``optimizer_states`` asks for.

    ``optimizer_states`` None, or ``format: fp32``: torch AdamW (fp32 states beside the shards).
    ``format: nvfp4``: FP4AdamW with ``device`` -> ``state_device``, ``nvme_path``, ``master``, ``rounding`` ->
    ``state_format.m_rounding``, ``v_rounding``, ``v_format`` and ``min_numel`` into its ``state_format``,
    ``master_device`` into its ``nvme`` options; while FP4AdamW does not import, torch AdamW with a warning (the
    returned name says which).
    """
    st = policy.optimizer_states
    if st is None or st.format == "fp32":
        return ShardedAdamW, {}, "torch.optim.AdamW"
    try:
        from .._optim import FP4AdamW
    except ImportError as e:
        log.warning("fp4offload.fsdp: FP4AdamW is not available (%s); using torch.optim.AdamW with fp32 states", e)
        return ShardedAdamW, {}, "torch.optim.AdamW (FP4AdamW unavailable)"
    from .._optim.options import fp4adamw_kwargs

    return FP4AdamW, fp4adamw_kwargs(st), "fp4offload.FP4AdamW"


def optimizer(model: nn.Module, policy: Policy | None = None, *, params: Iterable[Any] | None = None,
              lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
              weight_decay: float = 1e-2, **kwargs: Any) -> torch.optim.Optimizer:
    """The optimizer of an ``apply``-ed model: FP4AdamW (or torch AdamW) over its local shards.

    Args:
        model: the model ``apply`` returned.
        policy: its policy (default: the one ``apply`` used). ``optimizer_states`` picks the class
            and where states live.
        params: parameters or param-group dicts of ``model`` (default ``model.parameters()``), as for
            any torch optimizer; per-group options are kept.
        lr, betas, eps, weight_decay, kwargs: the optimizer's hyperparameters (defaults as torch AdamW:
            1e-3, (0.9, 0.999), 1e-8, 1e-2).
    """
    if policy is None:
        policy = getattr(model, "_fp4offload_policy", None) or Policy()
    if not isinstance(policy, Policy):
        raise ConfigError("policy", type(policy).__name__, "an fp4offload.fsdp.Policy")
    cls, extra, name = inner_optimizer_class(policy)
    opt = cls(list(model.parameters()) if params is None else params, lr=lr, betas=betas, eps=eps,
              weight_decay=weight_decay, **extra, **kwargs)
    if opt.local_shards is None:  # FP4AdamW over plain parameters: the model was not sharded
        raise ConfigError("model", type(model).__name__, "a model fp4offload.fsdp.apply sharded",
                          "build the optimizer after apply (ff.optimizer(ff.apply(model, policy), policy))")
    every = policy.monitor.every if policy.monitor is not None else 0
    if every:
        opt.register_step_post_hook(_monitor(every))
    log.debug("fp4offload.fsdp: optimizer %s", name)
    return opt


def _monitor(every: int):
    """A step post-hook that logs the fsdp.* counters every `every` steps."""
    count = [0]

    def hook(opt, args, kwargs) -> None:
        count[0] += 1
        if count[0] % every == 0:
            from .. import _metrics as metrics

            log.info("fp4offload.fsdp step %d: %s", count[0], metrics.snapshot("fsdp."))

    return hook
