"""``offload_activations``: the context manager users call (docs/design.md section 5, "Activations")."""

from __future__ import annotations

import torch

from .hooks import ActivationOffloader
from .pinned_pool import HostSlabPool
from .policy import ActivationPolicy


class offload_activations:
    """Context manager: tensors autograd saves inside it are compressed and moved per `policy`.

    ::

        with fp4offload.offload_activations(ActivationPolicy(format="nvfp4", device="cpu")) as off:
            loss = model(batch)
        loss.backward()            # stored copies come back (prefetched) and are freed as backward goes
        print(off.snapshot())      # bytes before/after, bytes moved, seconds, sampled error

    With module patterns in the policy (``modules``, ``exclude``, ``module_formats``) pass `model`:
    only the forward of matched modules is offloaded (see ``wrap_modules``). Backward may run after
    the block; the stored copies outlive it until autograd lets go of them. If the block raises,
    everything stored is released at once (and the files removed). Contexts nest: the innermost wins.
    Normalization layers get ``policy.norm_format`` (bf16 by default): they are found through `model`
    if given, else through torch's global module hooks while the block runs.

    Args:
        policy: ActivationPolicy (default: NVFP4 to host RAM).
        model: the module whose qualified names the policy's patterns refer to.
        pool: a HostSlabPool to use instead of the process-wide one.
    """

    def __init__(self, policy: ActivationPolicy | None = None, model: torch.nn.Module | None = None, *,
                 pool: HostSlabPool | None = None):
        from ..errors import ConfigError

        if isinstance(policy, torch.nn.Module) and (model is None or isinstance(model, ActivationPolicy)):
            policy, model = model, policy  # offload_activations(model, policy) reads the same
        self.policy = policy or ActivationPolicy()
        if not isinstance(self.policy, ActivationPolicy):
            raise ConfigError("policy", type(policy).__name__, "an fp4offload.ActivationPolicy")
        if self.policy.scoped and model is None:
            raise ConfigError("model", None, "the model whose modules the policy's modules/exclude patterns name",
                              "call offload_activations(policy, model=model)")
        self.model, self._pool = model, pool
        self.offloader: ActivationOffloader | None = None
        self._ctx = None
        self._wrapped = None
        self._shield = None

    def __enter__(self) -> ActivationOffloader:
        from .modules import NormShield, wrap_modules

        off = self.offloader = ActivationOffloader(self.policy, pool=self._pool)
        pol = self.policy
        try:
            if pol.modules or pol.module_formats:
                self._wrapped = wrap_modules(self.model, pol, offloader=off)
            else:
                if self.model is not None and (pol.exclude or pol.norm_fmt):
                    self._wrapped = wrap_modules(self.model, pol, offloader=off, root=False)
                elif pol.norm_fmt:  # no model to look into: find norm layers as they run
                    self._shield = NormShield(off, pol.norm_classes, pol.norm_fmt)
                self._ctx = off.hooks()
                self._ctx.__enter__()
        except BaseException:
            self._unwrap()
            off.close("the offload context failed to start")
            raise
        return off

    def _unwrap(self) -> None:
        if self._wrapped is not None:
            self._wrapped.remove()
        if self._shield is not None:
            self._shield.remove()

    def __exit__(self, exc_type, exc, tb) -> None:
        off = self.offloader
        try:
            if self._ctx is not None:
                self._ctx.__exit__(exc_type, exc, tb)
        finally:
            self._unwrap()
            if exc_type is not None:
                off.close(f"the offload context was left by an exception ({exc_type.__name__})")
            else:
                off.seal()
                off.prefetch_tail()
