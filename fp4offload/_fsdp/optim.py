"""The optimizer over an FSDP2 model's local shards: FP4AdamW (or torch AdamW) on plain fp32 tensors.

FSDP2 parameters are DTensors; with NVFP4 weights their local tensor is an ``FP4Weight`` wrapper.
Compiled optimizers need plain, contiguous fp32 tensors, so the optimizer built here steps over
one *proxy* per parameter: a plain tensor that shares the storage of the local fp32 shard (FSDP may
swap the local tensor object, e.g. when it re-pads a shard after ``load_state_dict``; the proxy is
re-pointed before every step) and whose ``.grad`` is the local shard of the DTensor gradient.

The returned object is an instance of the inner optimizer's class (``isinstance(opt, FP4AdamW)``
and ``isinstance(opt, torch.optim.Optimizer)`` hold, so LR schedulers work). Its ``param_groups`` hold the
model's DTensor parameters, as any optimizer of a sharded model does; the proxies take their place only while the
inner optimizer runs (``step``, and its own state dict). So ``torch.distributed.checkpoint.state_dict``'s
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` work on it: ``state_dict()`` gives torch AdamW's form
(``step``, fp32 ``exp_avg`` and ``exp_avg_sq`` as DTensors with each parameter's placement, packed states
decoded), which DCP saves and reshards to any number of ranks, and ``load_state_dict`` quantizes it once.
``packed_state_dict()`` / ``load_packed_state_dict`` are the inner optimizer's own form (what
``fp4offload.fsdp.save`` writes: the packed bytes, exact on the same number of ranks). ``step`` and
``zero_grad`` are extended: ``step`` binds the proxies, skips the step on every rank when any rank's gradients are
non-finite (FP4AdamW's ``skip_nonfinite``, made global), steps, and marks the packed weight copies stale;
``zero_grad`` also clears the DTensor gradients FSDP accumulates into.
"""

from __future__ import annotations

import logging
import collections
import contextlib
from typing import Any, Iterable

import torch
import torch.nn as nn

from ..errors import ConfigError
from .internals import local_tensor, mesh_all_reduce, shard_layout
from .policy import Policy
from .weight import FP4Weight

log = logging.getLogger("fp4offload.fsdp")

__all__ = ["optimizer", "over_shards", "ShardedOptimizerMixin", "inner_optimizer_class"]


def _local(p: torch.Tensor) -> torch.Tensor:
    """The plain fp32 tensor holding a parameter's local values."""
    local = local_tensor(p, p)
    return local._master if isinstance(local, FP4Weight) else local


class _SharedState(collections.defaultdict):
    """``optimizer.state``: keyed by the proxies (what the inner optimizer uses), and readable by the model's
    parameters too (what ``param_groups`` show)."""

    def __init__(self, alias: dict, items=()):
        super().__init__(dict, items)
        self._alias = alias

    def _key(self, k):
        return self._alias.get(id(k), k)

    def __getitem__(self, k):
        return super().__getitem__(self._key(k))

    def __setitem__(self, k, v):
        super().__setitem__(self._key(k), v)

    def __delitem__(self, k):
        super().__delitem__(self._key(k))

    def __contains__(self, k):
        return super().__contains__(self._key(k))

    def get(self, k, default=None):
        return super().get(self._key(k), default)

    def pop(self, k, *default):
        return super().pop(self._key(k), *default)

    def __reduce__(self):  # copies and pickles are plain defaultdicts
        return collections.defaultdict, (dict,), None, None, iter(self.items())


class ShardedOptimizerMixin:
    """Steps the inner optimizer over proxies of the local shards (see the module docstring)."""

    _fsdp_pairs: list[tuple[nn.Parameter, torch.Tensor]]

    @property
    def state(self):
        st = self.__dict__.get("state")
        alias = self.__dict__.get("_fsdp_alias")
        if st is not None and alias is not None and not isinstance(st, _SharedState):
            st = self.__dict__["state"] = _SharedState(alias, st)  # also after torch's load_state_dict
        return st

    @state.setter
    def state(self, value) -> None:
        self.__dict__["state"] = value

    def _fsdp_bind(self) -> None:
        with torch.no_grad():
            for p, proxy in self._fsdp_pairs:
                m = _local(p)
                if (proxy.data_ptr() != m.data_ptr() or proxy.shape != m.shape or proxy.stride() != m.stride()
                        or proxy.device != m.device):
                    proxy.set_(m)
                g = p.grad
                if g is not None:
                    g = local_tensor(g, g)
                proxy.grad = g

    def _fsdp_grads_finite_everywhere(self) -> bool:
        """True when every rank's gradient shards are finite (one all-reduce of a flag).

        FP4AdamW skips a step with non-finite gradients, but it only sees this rank's shards: after the
        reduce-scatter a NaN may sit in one rank's shard only, and ranks that decided differently would
        hold weights from different steps. So the decision is made for all ranks together here.
        """
        import torch.distributed as dist

        grads = [proxy.grad for _, proxy in self._fsdp_pairs if proxy.grad is not None]
        ok = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True)
        mesh = next((p.device_mesh for p, _ in self._fsdp_pairs if hasattr(p, "device_mesh")), None)
        if mesh is None or mesh.size() == 1:
            return bool(ok)
        flag = ok.to(torch.int32).reshape(1).to(mesh.device_type)
        return bool(mesh_all_reduce(flag, mesh, dist.ReduceOp.MIN).item())

    def _fsdp_after_step(self) -> None:
        for p, _ in self._fsdp_pairs:
            local = local_tensor(p)
            if isinstance(local, FP4Weight):
                local._slot.mark_dirty()

    # ---- what torch sees (the model's DTensors) and what the inner optimizer steps (their proxies) ----------

    @contextlib.contextmanager
    def _proxies_in_groups(self):
        """Within: ``param_groups`` hold the proxies the inner optimizer keys its state by (re-entrant)."""
        self._fsdp_depth = getattr(self, "_fsdp_depth", 0) + 1
        if self._fsdp_depth == 1:
            self._fsdp_shown = [g["params"] for g in self.param_groups]  # the model's parameters, as a rule
            for g, inner in zip(self.param_groups, self._fsdp_inner):
                g["params"] = inner
        try:
            yield
        finally:
            self._fsdp_depth -= 1
            if self._fsdp_depth == 0:  # (torch's load_state_dict makes new group dicts: set them again)
                for g, shown in zip(self.param_groups, self._fsdp_shown):
                    g["params"] = shown

    def packed_state_dict(self) -> dict:
        """The inner optimizer's own state dict (positional; FP4AdamW's packed bytes as they are)."""
        with self._proxies_in_groups():
            return super().state_dict()

    def load_packed_state_dict(self, state_dict: dict) -> None:
        with self._proxies_in_groups():
            super().load_state_dict(state_dict)

    @contextlib.contextmanager
    def packed_form(self):
        """Within: ``state_dict`` / ``load_state_dict`` are the packed ones (for a caller that round-trips the
        state dict of an optimizer it does not know, as Accelerate's prepare does)."""
        self._fsdp_packed_form = True
        try:
            yield self
        finally:
            self._fsdp_packed_form = False

    def state_dict(self) -> dict:
        """torch AdamW's form over the model's DTensors: ``step``, ``exp_avg`` and ``exp_avg_sq`` (fp32, each a
        DTensor with its parameter's placement; FP4AdamW's packed m and v decoded). What
        ``get_optimizer_state_dict`` maps to parameter names and DCP reshards."""
        from .checkpoint import like_param

        inner = self.packed_state_dict()
        if getattr(self, "_fsdp_packed_form", False):
            return inner
        state = {}
        for i, (p, proxy) in enumerate(self._fsdp_pairs):
            entry = inner["state"].get(i)
            if entry is None:
                continue
            m, v = _fp32_moments(entry, proxy)
            state[i] = {"step": entry["step"], "exp_avg": like_param(m.view(proxy.shape), p),
                        "exp_avg_sq": like_param(v.view(proxy.shape), p)}
        return {"state": state, "param_groups": [_as_torch_adamw_group(g) for g in inner["param_groups"]]
                if self._fsdp_fp4 else inner["param_groups"]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch AdamW's form (this optimizer's ``state_dict()``, or torch AdamW's, from any number of ranks
        once DCP has resharded it): each rank takes its shard; FP4AdamW quantizes m and v once."""
        from torch.distributed.tensor import DTensor

        if getattr(self, "_fsdp_packed_form", False):
            return self.load_packed_state_dict(state_dict)
        groups = state_dict["param_groups"]
        saved = [k for g in groups for k in g["params"]]
        if len(saved) != len(self._fsdp_pairs) or len(groups) != len(self.param_groups):
            raise ConfigError("optimizer state_dict", f"{len(saved)} parameters in {len(groups)} groups",
                              f"{len(self._fsdp_pairs)} parameters in {len(self.param_groups)} groups, as this "
                              "optimizer has", "load the state of an optimizer over the same model")
        state = {}
        for i, key in enumerate(saved):
            entry = state_dict["state"].get(key)
            if entry is None:
                continue
            state[i] = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in entry.items()}
        inner_groups = []
        start = 0
        for g, mine in zip(groups, self.param_groups):
            n = len(g["params"])
            if self._fsdp_fp4:  # torch AdamW's keys: FP4AdamW's own options stay as this optimizer was built
                g = _from_torch_adamw_group(g, mine)
            inner_groups.append({**g, "params": list(range(start, start + n))})
            start += n
        self.load_packed_state_dict({"state": state, "param_groups": inner_groups})

    def step(self, closure=None):
        with self._proxies_in_groups():
            try:
                return self._sharded_step(closure)
            finally:  # bound again at the next step: holding them would keep the gradients alive past zero_grad
                for _, proxy in self._fsdp_pairs:
                    proxy.grad = None

    def _sharded_step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._fsdp_bind()
        if getattr(self, "skip_nonfinite", False) and not self._fsdp_grads_finite_everywhere():
            self.skipped_steps = getattr(self, "skipped_steps", 0) + 1
            log.warning("fp4offload.fsdp: non-finite gradients on some rank: step skipped on every rank (%d so far)",
                        self.skipped_steps)
            return loss
        super().step()
        self._fsdp_after_step()
        self._fsdp_steps = getattr(self, "_fsdp_steps", 0) + 1
        every = getattr(self, "_fsdp_monitor_every", 0)
        if every and self._fsdp_steps % every == 0:
            from .. import _metrics as metrics

            log.info("fp4offload.fsdp step %d: %s", self._fsdp_steps, metrics.snapshot("fsdp."))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, _ in self._fsdp_pairs:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()
        with self._proxies_in_groups():
            super().zero_grad(set_to_none)

    def is_packed(self, group, p) -> bool:
        """FP4AdamW's packed-or-fp32 choice, made the same on every rank.

        FP4AdamW compares the local numel with ``min_numel``; FSDP's last ranks hold shorter (or empty)
        shards, so ranks could disagree and their checkpoints would hold different keys. The choice
        here uses the padded shard size, which every rank shares.
        """
        n = self._fsdp_padded_numel.get(id(p))
        if n is None:
            return super().is_packed(group, p)
        return n >= group["min_numel"]

    def init_state(self) -> None:
        """Create every state tensor without changing any parameter (a step with zero grads, lr 0)."""
        if len(self.state) >= len(self._fsdp_pairs):
            return
        saved = [p.grad for p, _ in self._fsdp_pairs]
        lrs = [g["lr"] for g in self.param_groups]
        with self._proxies_in_groups():
            try:
                self._fsdp_bind()
                for _, proxy in self._fsdp_pairs:
                    proxy.grad = torch.zeros_like(proxy)
                for g in self.param_groups:
                    g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
                super().step()
            finally:
                for g, lr in zip(self.param_groups, lrs):
                    g["lr"] = lr
                for (p, proxy), g in zip(self._fsdp_pairs, saved):
                    p.grad = g
                    proxy.grad = None


def _torch_adamw_defaults() -> dict:
    return {k: v for k, v in torch.optim.AdamW([torch.zeros(1)]).defaults.items()}


def _as_torch_adamw_group(group: dict) -> dict:
    """An FP4AdamW param group with torch AdamW's keys exactly (its defaults where FP4AdamW has no such option), so
    torch AdamW's checkpoints and FP4AdamW's hold the same entries and DCP moves a run between the two."""
    return {**{k: group.get(k, v) for k, v in _torch_adamw_defaults().items()}, "params": group["params"]}


def _from_torch_adamw_group(saved: dict, mine: dict) -> dict:
    """The group FP4AdamW loads from torch AdamW's form: the shared hyperparameters from ``saved``, FP4AdamW's own
    options from ``mine``; a torch-only option away from its default (``amsgrad=True``...) is a ConfigError."""
    defaults = _torch_adamw_defaults()
    for k, v in saved.items():
        if k != "params" and k not in mine and k in defaults and v != defaults[k]:
            raise ConfigError(f"optimizer state_dict param_groups {k}", v, f"{defaults[k]!r} (FP4AdamW has no {k})",
                              "continue with torch.optim.AdamW, or save the run without that option")
    out = {k: v for k, v in mine.items() if k != "params"}
    out.update({k: (tuple(v) if isinstance(mine.get(k), tuple) else v) for k, v in saved.items()
                if k in mine and k != "params"})
    return out


def _fp32_moments(entry: dict, proxy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, v) of one parameter's inner state-dict entry as flat fp32 tensors on the proxy's device (FP4AdamW's
    packed states decoded; fp32 ones as they are)."""
    if "exp_avg" in entry:
        return entry["exp_avg"].reshape(-1).float(), entry["exp_avg_sq"].reshape(-1).float()
    from .._optim.state import decode_state, packed_from_entry

    n = proxy.numel()
    m, v = decode_state(*packed_from_entry(entry, n), n, entry.get("v_format", "ufp4"))
    return m.to(proxy.device), v.to(proxy.device)


def _padded_local_numel(p: torch.Tensor) -> int:
    """Elements of FSDP's padded local shard (the same on every rank)."""
    layout = shard_layout(p)
    if layout is None or p.dim() == 0:
        return p.numel()
    world = layout.world
    return -(-p.shape[0] // world) * (p.numel() // p.shape[0] if p.shape[0] else 0)


_CLASSES: dict[type, type] = {}


def _sharded_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedOptimizerMixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


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
        return torch.optim.AdamW, {}, "torch.optim.AdamW"
    try:
        from .._optim import FP4AdamW
    except ImportError as e:
        log.warning("fp4offload.fsdp: FP4AdamW is not available (%s); using torch.optim.AdamW with fp32 states", e)
        return torch.optim.AdamW, {}, "torch.optim.AdamW (FP4AdamW unavailable)"
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
    opt = over_shards(cls, model.parameters() if params is None else params, lr=lr, betas=betas, eps=eps,
                      weight_decay=weight_decay, **extra, **kwargs)
    opt._fsdp_monitor_every = policy.monitor.every if policy.monitor is not None else 0
    opt.fp4offload_inner = name
    return opt


def over_shards(cls: type, params: Iterable[Any], **kwargs: Any) -> torch.optim.Optimizer:
    """An optimizer of class ``cls`` stepping proxies of the local shards of ``params`` (DTensors of a model
    sharded by ``apply`` or by the user's own ``fully_shard``; parameters or param-group dicts), built with
    ``kwargs``. ``FP4AdamW(model.parameters())`` over DTensors comes here."""
    groups = list(params)
    if not groups:
        raise ConfigError("params", "[]", "at least one parameter")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    pairs: list[tuple[nn.Parameter, torch.Tensor]] = []
    seen: set[int] = set()
    proxy_groups = []
    for g in groups:
        ps = list(g["params"])
        proxies = []
        for p in ps:
            if id(p) in seen:
                raise ConfigError("params", "a parameter listed twice", "each parameter in one group once")
            seen.add(id(p))
            proxy = torch.empty(0, dtype=_local(p).dtype, device=_local(p).device)
            with torch.no_grad():
                proxy.set_(_local(p))
            proxy.requires_grad_(p.requires_grad)
            pairs.append((p, proxy))
            proxies.append(proxy)
        proxy_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": proxies})
    opt = _sharded_class(cls)(proxy_groups, **kwargs)
    opt._fsdp_pairs = pairs
    opt._fsdp_alias = {id(p): proxy for p, proxy in pairs}
    opt._fsdp_fp4 = any(c.__name__ == "FP4AdamW" for c in cls.__mro__)
    opt._fsdp_inner = [g["params"] for g in opt.param_groups]
    for g, outer in zip(opt.param_groups, groups):  # torch sees the model's parameters
        g["params"] = list(outer["params"])
    opt._fsdp_monitor_every = 0
    opt._fsdp_padded_numel = {id(proxy): _padded_local_numel(p) for p, proxy in pairs}
    opt.fp4offload_inner = cls.__name__
    for p, proxy in pairs:  # a compact master starts from the fp32 values apply cast to bf16
        res = getattr(p, "_fp4offload_residual", None)
        if res is not None and getattr(opt, "master", "fp32") == "split" and res[0].numel() == proxy.numel():
            with opt._proxies_in_groups():
                opt.hooks.start_master(proxy, res[0].to(proxy.device), res[1])
            p._fp4offload_residual = None  # held by the optimizer now
    return opt
