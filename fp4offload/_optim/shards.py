"""An optimizer over a sharded model's DTensor parameters (FSDP2, HSDP): each rank steps its local shards.

The step works on plain tensors, so each parameter steps as a *proxy*: a plain tensor sharing the storage of its
local shard (re-pointed before every step: FSDP may swap the local tensor, e.g. when it re-pads a shard after
``load_state_dict``) whose ``.grad`` is the local shard of the DTensor gradient. ``param_groups`` show the model's
parameters, as for any optimizer of a sharded model; the proxies take their place only while the step (and the
optimizer's own state dict) runs, and ``optimizer.state`` answers to both.

What sharding asks of a step, and :class:`LocalShards` gives:

- one verdict on non-finite gradients for all ranks (after the reduce-scatter a NaN may sit in one rank's shard
  only, and ranks that decided differently would hold weights from different steps);
- the packed-or-fp32 choice from the padded shard size, which every rank shares (FSDP's last ranks hold shorter or
  empty shards, and ranks that chose differently would save different keys);
- torch AdamW's state-dict form (``step``, fp32 ``exp_avg`` / ``exp_avg_sq`` DTensors with each parameter's
  placement), which ``torch.distributed.checkpoint`` reshards to any number of ranks; the optimizer's own form
  (packed bytes, by position) is ``packed_state_dict``.

A local tensor that wraps its values (fp4offload.fsdp's NVFP4 weight shards) gives them as ``fp4offload_values``
and is told of each step through ``fp4offload_stepped()``. FP4AdamW builds a LocalShards when its parameters are
DTensors; fp4offload.fsdp's ``ShardedAdamW`` (fp32 states) always does.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from typing import Any, Callable, Iterable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._dtensor import is_dtensor, like_param, local_tensor, mesh_all_reduce, shard_layout
from ..errors import ConfigError

log = logging.getLogger("fp4offload.fsdp")

__all__ = ["LocalShards", "STATE", "offer_residual", "zero_lr_step"]

#: sharded parameter -> split's starting residual ``(lo, odd)`` of its local shard, until an optimizer takes it
_RESIDUALS = WeakIdKeyDictionary()


def offer_residual(p, lo: torch.Tensor, odd: torch.Tensor) -> None:
    """Leave split's starting residual of the local shard of `p` (a sharded parameter cast from fp32) for the
    FP4AdamW built over it (``master="split"``), which starts the master from the fp32 values exactly."""
    _RESIDUALS[p] = (lo, odd)


def local_values(p) -> torch.Tensor:
    """The plain tensor holding a parameter's local values."""
    local = local_tensor(p, p)
    values = getattr(local, "fp4offload_values", None)
    return local if values is None else values


class _SharedState(collections.defaultdict):
    """``optimizer.state``: keyed by the proxies (what the step uses), and readable by the model's parameters too
    (what ``param_groups`` show)."""

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


def _get_state(opt):
    st = opt.__dict__.get("state")
    shards = opt.__dict__.get("local_shards")
    if st is not None and shards is not None and not isinstance(st, _SharedState):
        st = opt.__dict__["state"] = _SharedState(shards.alias, st)  # also after torch's load_state_dict
    return st


def _set_state(opt, value) -> None:
    opt.__dict__["state"] = value


#: ``optimizer.state`` of an optimizer that may hold a LocalShards (a class attribute: ``state = STATE``)
STATE = property(_get_state, _set_state)


class LocalShards:
    """The proxies of one optimizer's parameters and what sharding asks of its step (see the module docstring).

    Build it with :meth:`of` before the optimizer's ``__init__`` (which is given the proxy groups), then
    :meth:`attach` it once the optimizer exists."""

    def __init__(self, groups: list[dict]):
        self.pairs: list[tuple[Any, torch.Tensor]] = []
        self.groups = groups  # the groups as given (the model's parameters)
        self.proxy_groups = []
        seen: set[int] = set()
        for g in groups:
            proxies = []
            for p in g["params"]:
                if id(p) in seen:
                    raise ConfigError("params", "a parameter listed twice", "each parameter in one group once")
                seen.add(id(p))
                values = local_values(p)
                proxy = torch.empty(0, dtype=values.dtype, device=values.device)
                with torch.no_grad():
                    proxy.set_(values)
                proxy.requires_grad_(p.requires_grad)
                self.pairs.append((p, proxy))
                proxies.append(proxy)
            self.proxy_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": proxies})
        self.alias = {id(p): proxy for p, proxy in self.pairs}
        self.padded = {id(proxy): _padded_local_numel(p) for p, proxy in self.pairs}
        self.inner: list[list[torch.Tensor]] = []  # each group's proxies, once attached
        self.packed = False  # within packed_form(): state_dict is the optimizer's own
        self.voted = False  # within the step's run: every rank found its gradients fit to step (the vote)
        self._depth = 0
        self._shown: list = []

    @classmethod
    def of(cls, params: Iterable[Any], always: bool = False) -> tuple[Any, "LocalShards | None"]:
        """(what to give the optimizer's ``__init__``, the LocalShards or None): proxies when a parameter is a
        DTensor (or `always`), else `params` as read (a generator is read once)."""
        if params is None or isinstance(params, torch.Tensor):
            return params, None
        groups = [dict(g, params=[g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"]))
                  if isinstance(g, dict) else g for g in params]
        flat = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
        if not (always or any(is_dtensor(p) for p in flat)):
            return groups, None
        if not groups:
            raise ConfigError("params", "[]", "at least one parameter")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        shards = cls(groups)
        return shards.proxy_groups, shards

    def attach(self, opt) -> None:
        """Show the model's parameters in ``opt.param_groups`` (the proxies stay in :attr:`inner`), and start
        split's masters from the residuals left for these parameters."""
        self.inner = [g["params"] for g in opt.param_groups]
        for g, outer in zip(opt.param_groups, self.groups):
            g["params"] = list(outer["params"])
        if getattr(opt, "master", None) != "split":
            return
        for p, proxy in self.pairs:
            res = _RESIDUALS.get(p)
            if res is not None and res[0].numel() == proxy.numel():
                with self.in_groups(opt):
                    opt.hooks.start_master(proxy, res[0].to(proxy.device), res[1])
                del _RESIDUALS[p]  # held by the optimizer now

    # ---- what torch sees (the model's parameters) and what the step uses (their proxies) --------------------

    @contextlib.contextmanager
    def in_groups(self, opt):
        """Within: ``opt.param_groups`` hold the proxies the step keys its states by (re-entrant)."""
        self._depth += 1
        if self._depth == 1:
            self._shown = [g["params"] for g in opt.param_groups]
            for g, inner in zip(opt.param_groups, self.inner):
                g["params"] = inner
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:  # (torch's load_state_dict makes new group dicts: set them again)
                for g, shown in zip(opt.param_groups, self._shown):
                    g["params"] = shown

    def bind(self) -> None:
        """Point every proxy at its local shard and its gradient at the local shard of the gradient."""
        with torch.no_grad():
            for p, proxy in self.pairs:
                m = local_values(p)
                if (proxy.data_ptr() != m.data_ptr() or proxy.shape != m.shape or proxy.stride() != m.stride()
                        or proxy.device != m.device):
                    proxy.set_(m)
                g = p.grad
                proxy.grad = None if g is None else local_tensor(g, g)

    def finite_everywhere(self, local_ok: Callable[[list], bool] | None = None) -> bool:
        """True when every rank's gradient shards are fit to step (one all-reduce of a flag over the mesh):
        `local_ok` (the optimizer's own test of its gradients: FP4AdamW's also bounds their magnitude), else finite."""
        import torch.distributed as dist

        grads = [proxy.grad for _, proxy in self.pairs if proxy.grad is not None]
        if local_ok is not None:
            ok = torch.tensor(bool(local_ok(grads)))
        else:
            ok = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else torch.tensor(True)
        mesh = next((p.device_mesh for p, _ in self.pairs if hasattr(p, "device_mesh")), None)
        if mesh is None or mesh.size() == 1:
            return bool(ok)
        flag = ok.to(torch.int32).reshape(1).to(mesh.device_type)
        return bool(mesh_all_reduce(flag, mesh, dist.ReduceOp.MIN).item())

    def padded_numel(self, proxy) -> int | None:
        """Elements of the padded local shard behind `proxy` (the same on every rank); None for another tensor."""
        return self.padded.get(id(proxy))

    # ---- the optimizer's entry points ------------------------------------------------------------------

    def step(self, opt, closure: Callable | None, run: Callable[[], Any]):
        """``opt.step(closure)``: bind the proxies, skip the step on every rank when any rank's gradients are not
        finite (with ``opt.skip_nonfinite``; the test is ``opt.local_grads_ok`` where it has one), run the step
        (`run`; :attr:`voted` is set meanwhile, so the optimizer need not test the gradients again) and tell wrapped
        local tensors."""
        with self.in_groups(opt):
            try:
                loss = None
                if closure is not None:
                    with torch.enable_grad():
                        loss = closure()
                self.bind()
                vote = getattr(opt, "skip_nonfinite", False)
                if vote and not self.finite_everywhere(getattr(opt, "local_grads_ok", None)):
                    opt.skipped_steps += 1
                    log.warning("fp4offload.fsdp: non-finite gradients on some rank: step skipped on every rank "
                                "(%d so far)", opt.skipped_steps)
                    return loss
                self.voted = vote
                try:
                    run()
                finally:
                    self.voted = False
                for p, _ in self.pairs:
                    stepped = getattr(local_tensor(p, p), "fp4offload_stepped", None)
                    if stepped is not None:
                        stepped()
                return loss
            finally:  # bound again at the next step: holding them would keep the gradients alive past zero_grad
                for _, proxy in self.pairs:
                    proxy.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' gradients (the DTensor gradients FSDP accumulates into)."""
        for p, _ in self.pairs:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_()
                    p.grad.zero_()

    def init_state(self, opt, run: Callable[[], Any]) -> None:
        """Create every state without changing a parameter: one step (`run`) with zero gradients and lr 0."""
        if len(opt.state) >= len(self.pairs):
            return
        with self.in_groups(opt):
            try:
                self.bind()
                zero_lr_step(opt, [proxy for _, proxy in self.pairs], run)
            finally:
                for _, proxy in self.pairs:
                    proxy.grad = None

    @contextlib.contextmanager
    def packed_form(self, opt):
        """Within: ``opt.state_dict`` / ``load_state_dict`` are the optimizer's own (for a caller that round-trips
        the state dict of an optimizer it does not know, as Accelerate's prepare does)."""
        self.packed = True
        try:
            yield opt
        finally:
            self.packed = False

    def torch_form(self, inner: dict, fp4: bool) -> dict:
        """torch AdamW's form of the optimizer's own state dict `inner`: ``step``, ``exp_avg`` and ``exp_avg_sq``
        (fp32, each a DTensor with its parameter's placement; packed m and v decoded); with `fp4` the param groups
        carry torch AdamW's keys exactly."""
        state = {}
        for i, (p, proxy) in enumerate(self.pairs):
            entry = inner["state"].get(i)
            if entry is None:
                continue
            m, v = _fp32_moments(entry, proxy)
            state[i] = {"step": entry["step"], "exp_avg": like_param(m.view(proxy.shape), p),
                        "exp_avg_sq": like_param(v.view(proxy.shape), p)}
        return {"state": state, "param_groups": [_as_torch_adamw_group(g) for g in inner["param_groups"]]
                if fp4 else inner["param_groups"]}

    def from_torch_form(self, opt, state_dict: dict, fp4: bool) -> dict:
        """The optimizer's own state dict from torch AdamW's form (this rank's shards of a state dict DCP
        resharded, or torch AdamW's own); with `fp4` the optimizer's own options stay as it was built."""
        groups = state_dict["param_groups"]
        saved = [k for g in groups for k in g["params"]]
        if len(saved) != len(self.pairs) or len(groups) != len(opt.param_groups):
            raise ConfigError("optimizer state_dict", f"{len(saved)} parameters in {len(groups)} groups",
                              f"{len(self.pairs)} parameters in {len(opt.param_groups)} groups, as this "
                              "optimizer has", "load the state of an optimizer over the same model")
        state = {}
        for i, key in enumerate(saved):
            entry = state_dict["state"].get(key)
            if entry is None:
                continue
            state[i] = {k: (v.to_local() if is_dtensor(v) else v) for k, v in entry.items()}
        inner_groups = []
        start = 0
        for g, mine in zip(groups, opt.param_groups):
            n = len(g["params"])
            if fp4:
                g = _from_torch_adamw_group(g, mine)
            inner_groups.append({**g, "params": list(range(start, start + n))})
            start += n
        return {"state": state, "param_groups": inner_groups}


class ShardedEntryPoints:
    """The state-dict and gradient entry points of an optimizer that may step a sharded model's local shards
    (FP4AdamW, and _fsdp.optim.ShardedAdamW for fp32 states), written once over :class:`LocalShards`.

    Put before the torch optimizer class in the bases. The optimizer has ``local_shards`` (None over a model that is
    not sharded), :meth:`packed_state_dict` / :meth:`load_packed_state_dict` (its own positional form) and
    ``_packed_fp4`` (whether that form holds FP4AdamW's packed states, which torch AdamW's form is converted
    from and to)."""

    local_shards: LocalShards | None
    _packed_fp4: bool

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.local_shards is not None:
            self.local_shards.zero_grad(set_to_none)
        else:
            super().zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """:meth:`packed_state_dict`; over a sharded model torch AdamW's form (LocalShards.torch_form), which
        torch.distributed.checkpoint reshards (not within :meth:`packed_form`)."""
        if self.local_shards is None or self.local_shards.packed:
            return self.packed_state_dict()
        return self.local_shards.torch_form(self.packed_state_dict(), fp4=self._packed_fp4)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict`'s form: the optimizer's own or torch AdamW's (over a sharded model each rank
        takes its shard of it)."""
        if self.local_shards is None or self.local_shards.packed:
            return self.load_packed_state_dict(state_dict)
        with self.local_shards.in_groups(self):  # a state dict keyed by parameter positions, as torch's is
            own = self.local_shards.from_torch_form(self, state_dict, fp4=self._packed_fp4)
        self.load_packed_state_dict(own)

    def packed_form(self):
        """Within (a context manager): ``state_dict`` / ``load_state_dict`` are :meth:`packed_state_dict`'s form
        also over a sharded model (for a caller that round-trips the state dict of an optimizer it does not
        know, as Accelerate's prepare does)."""
        return contextlib.nullcontext(self) if self.local_shards is None else self.local_shards.packed_form(self)


def zero_lr_step(opt, tensors: list[torch.Tensor], run: Callable[[], Any]) -> None:
    """Run one step of `opt` (`run`) with zero gradients on `tensors` and lr 0 in every group: every state is
    created, no parameter changes (gradients and learning rates are put back)."""
    grads = [t.grad for t in tensors]
    lrs = [g["lr"] for g in opt.param_groups]
    try:
        for t in tensors:
            t.grad = torch.zeros_like(t)
        for g in opt.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
        run()
    finally:
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
        for t, grad in zip(tensors, grads):
            t.grad = grad


def _torch_adamw_defaults() -> dict:
    return dict(torch.optim.AdamW([torch.zeros(1)]).defaults)


def _as_torch_adamw_group(group: dict) -> dict:
    """A param group with torch AdamW's keys exactly (its defaults where FP4AdamW has no such option), so torch
    AdamW's checkpoints and FP4AdamW's hold the same entries and DCP moves a run between the two."""
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
    """(m, v) of one state-dict entry as flat fp32 tensors on the proxy's device (packed states decoded)."""
    from .state import entry_moments

    m, v = entry_moments(entry, proxy.numel())
    return m.to(proxy.device), v.to(proxy.device)


def _padded_local_numel(p) -> int:
    """Elements of FSDP's padded local shard (the same on every rank)."""
    layout = shard_layout(p)
    if layout is None or p.dim() == 0:
        return p.numel()
    return -(-p.shape[0] // layout.world) * (p.numel() // p.shape[0] if p.shape[0] else 0)
