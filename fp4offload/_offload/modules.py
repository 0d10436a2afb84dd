"""Offload only chosen modules: "MLP inputs yes, attention no".

``wrap_modules(model, policy)`` matches the policy's fnmatch patterns against qualified module names
(``model.named_modules()``) and registers a forward pre-hook and an always-called forward hook on
each matched module. The pre-hook enters the offloader's saved-tensor hooks (in the module's format),
the post-hook leaves them, so exactly the tensors saved inside that module's forward are offloaded.
Excluded modules get hooks that pass tensors through, which shields them inside an offloaded parent
(the innermost saved-tensor hooks win). Inside a region ``torch.utils.checkpoint`` manages, its own
hooks are left in charge, so only what checkpointing still saves is compressed.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch

from ..errors import ConfigError
from .hooks import ActivationOffloader
from .policy import ActivationPolicy


def _checkpoint_in_charge() -> bool:
    """True when the innermost saved-tensor hooks belong to torch.utils.checkpoint."""
    top_fn = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top_fn is None:
        return False
    top = top_fn(False)
    return top is not None and getattr(top[0], "__module__", "") == "torch.utils.checkpoint"


def _match(name: str, patterns) -> bool:
    return any(fnmatchcase(name, p) for p in patterns)


def plan(model: torch.nn.Module, policy: ActivationPolicy, *, root: bool = True) -> dict[str, str]:
    """Qualified module name -> format to offload in, ``"exclude"``, or ``"norm"`` (a norm layer left alone).

    Exclusion wins over inclusion and covers the module's children; an offloaded module's format covers
    its children too, unless a ``module_formats`` pattern names a child. The root module's name is ""
    (matched by "*"). Without include patterns the whole model (its root module, when `root`; else the
    caller's context) is offloaded in the policy's format. Normalization layers inside the offloaded
    part (``policy.norm_classes``) get ``policy.norm_format``.
    """
    mods = dict(model.named_modules())
    names = list(mods)
    excluded = [n for n in names if n and _match(n, policy.exclude)]
    out = {n: "exclude" for n in excluded if not any(n.startswith(x + ".") for x in excluded if x != n)}

    def under_excluded(n: str) -> bool:
        return any(n == x or n.startswith(x + ".") for x in excluded)

    def nearest_included(n: str) -> str | None:
        parts = n.split(".")
        for i in range(len(parts) - 1, -1, -1):
            a = ".".join(parts[:i])
            if a in out and out[a] not in ("exclude", "norm"):
                return out[a]
        return None

    scoped = bool(policy.modules or policy.module_formats)
    if scoped:
        for n in names:  # parents come before their children
            if n and under_excluded(n):
                continue
            fmt = next((f for p, f in policy.module_formats if fnmatchcase(n, p)), None)
            if fmt is not None:  # an explicit format: needs hooks unless its parent already gives it
                if not n or nearest_included(n) != fmt:
                    out[n] = fmt
            elif _match(n, policy.modules) and (not n or nearest_included(n) is None):
                out[n] = policy.format  # a parent's hooks (and its format) cover its whole subtree
        if all(v == "exclude" for v in out.values()):
            sample = ", ".join(names[1:8]) + (", ..." if len(names) > 8 else "")
            raise ConfigError("ActivationPolicy.modules", policy.modules + tuple(p for p, _ in policy.module_formats),
                              f"patterns that match qualified module names such as {sample}",
                              "use fnmatch syntax, e.g. '*.mlp' or 'model.layers.*.mlp'")
    elif root:
        out[""] = policy.format
    norm_fmt = policy.norm_fmt
    if norm_fmt is not None:
        for n in names:
            if not n or under_excluded(n) or not _match(type(mods[n]).__name__, policy.norm_classes):
                continue
            if scoped and n not in out and nearest_included(n) is None:
                continue  # outside what the policy offloads
            out[n] = "norm" if norm_fmt == "keep" else norm_fmt
    return out


class _ContextPerCall:
    """Hooks that enter a context in a module's forward pre-hook and leave it in its forward hook, a stack
    per module (a module can run inside itself: recursion, or a checkpointed block's recompute)."""

    def __init__(self):
        self._handles: list = []
        self._stacks: dict[int, list] = {}

    def _enter(self, mod, ctx) -> None:
        if ctx is not None:
            ctx.__enter__()
        self._stacks.setdefault(id(mod), []).append(ctx)

    def _leave(self, mod) -> None:
        stack = self._stacks.get(id(mod))
        if stack:
            ctx = stack.pop()
            if ctx is not None:
                ctx.__exit__(None, None, None)

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class ModuleOffload(_ContextPerCall):
    """Hooks installed on a model's modules by ``wrap_modules``; ``remove()`` takes them off.

    Attributes:
        offloader: the ActivationOffloader the hooks feed (its ``snapshot()`` has the counters).
        plan: qualified module name -> format, or "exclude".
    """

    def __init__(self, model: torch.nn.Module, policy: ActivationPolicy, offloader: ActivationOffloader | None,
                 root: bool = True):
        super().__init__()
        self.policy = policy
        self._own = offloader is None
        self.offloader = offloader or ActivationOffloader(policy)
        self.plan = plan(model, policy, root=root)
        mods = dict(model.named_modules())
        for name, what in self.plan.items():
            mod = mods[name]
            self._handles.append(mod.register_forward_pre_hook(self._pre(what)))
            self._handles.append(mod.register_forward_hook(self._post, always_call=True))

    def _pre(self, what: str):
        def pre(mod, args):
            if _checkpoint_in_charge():
                ctx = None
            elif what in ("exclude", "norm"):
                ctx = self.offloader.shield_hooks("excluded" if what == "exclude" else "norm")
            else:
                ctx = self.offloader.hooks(what)
            self._enter(mod, ctx)

        return pre

    def _post(self, mod, args, output):
        self._leave(mod)

    def remove(self) -> None:
        """Take the hooks off (and, if this object made its offloader, seal it)."""
        self._remove_hooks()
        if self._own:
            self.offloader.seal()

    def __enter__(self) -> "ModuleOffload":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.remove()
        if exc_type is not None and self._own:
            self.offloader.close(f"the wrapped model's block was left by an exception ({exc_type.__name__})")


def wrap_modules(model: torch.nn.Module, policy: ActivationPolicy, *, offloader: ActivationOffloader | None = None,
                 root: bool = True) -> ModuleOffload:
    """Offload the activations saved inside the forward of the modules `policy` names.

    The hooks stay until ``remove()`` (or the end of a ``with`` block over the returned object), so
    every training step's forward is offloaded. ``ActivationPolicy(modules=("*.mlp",),
    exclude=("*.self_attn",))`` offloads MLP activations and leaves attention's alone.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError("model", type(model).__name__, "a torch.nn.Module")
    if not isinstance(policy, ActivationPolicy):
        raise ConfigError("policy", type(policy).__name__, "an fp4offload.ActivationPolicy")
    return ModuleOffload(model, policy, offloader, root=root)


class NormShield(_ContextPerCall):
    """While installed, the forward of every module whose class name matches `patterns` stores its saved
    tensors in `fmt` (or leaves them alone for ``"keep"``): ``offload_activations`` without a model.

    Uses torch's global module hooks, so it finds norm layers of any model as they run; modules of
    other classes cost one dictionary lookup per forward call.
    """

    def __init__(self, offloader: ActivationOffloader, patterns: tuple[str, ...], fmt: str):
        super().__init__()
        self.offloader, self.patterns, self.fmt = offloader, patterns, fmt
        self._is_norm: dict[type, bool] = {}
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._handles = [register_module_forward_pre_hook(self._pre),
                         register_module_forward_hook(self._post, always_call=True)]

    def _norm(self, mod) -> bool:
        cls = type(mod)
        r = self._is_norm.get(cls)
        if r is None:
            r = self._is_norm[cls] = _match(cls.__name__, self.patterns)
        return r

    def _pre(self, mod, args):
        if self._norm(mod):
            if _checkpoint_in_charge():
                ctx = None
            elif self.fmt == "keep":
                ctx = self.offloader.shield_hooks("norm")
            else:
                ctx = self.offloader.hooks(self.fmt)
            self._enter(mod, ctx)

    def _post(self, mod, args, output):
        if self._norm(mod):
            self._leave(mod)

    def remove(self) -> None:
        self._remove_hooks()
