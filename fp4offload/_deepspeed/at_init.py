"""DeepSpeed methods replaced while ``deepspeed.initialize`` runs, and a master gradient of another dtype.

:class:`WhileInitializing` replaces one method of DeepSpeed's ZeRO optimizer classes for the duration of
``deepspeed.initialize`` (through :func:`fp4offload._deepspeed.internals.patch_class`) and restores it on exit;
:class:`fp4offload._deepspeed.zero12.bf16_grads_at_init` and :class:`fp4offload._deepspeed.zero3.zero3_grads_at_init`
build on it, and :class:`compact_master_at_init`, which both stages need, is here. :func:`set_grad` gives a
master partition a gradient of another dtype than its own, which both stages do.
"""

from __future__ import annotations

import contextlib

from . import internals as dsi

__all__ = ["WhileInitializing", "compact_master_at_init", "set_grad"]


def set_grad(master, grad) -> None:
    """``master.grad = grad`` for a gradient of another dtype than the tensor's (torch >= 2.9 checks it)."""
    master.grad = None
    if hasattr(master, "grad_dtype"):
        master.grad_dtype = grad.dtype
    master.grad = grad


class WhileInitializing:
    """A DeepSpeed method (``METHOD`` of each class in ``OWNERS``) replaced by ``self._make(original)`` while
    ``deepspeed.initialize`` runs, when ``enabled``; restored on exit. ``applied`` counts what it served."""

    OWNERS: tuple[str, ...] = ()
    METHOD = ""

    def __init__(self, enabled: bool):
        self.enabled, self.applied = enabled, 0
        self._stack = None

    def _make(self, orig):
        raise NotImplementedError

    def __enter__(self):
        if self.enabled:
            self._stack = contextlib.ExitStack()
            for owner in self.OWNERS:
                self._stack.enter_context(dsi.patch_class(owner, self.METHOD, self._make))
        return self

    def __exit__(self, *exc):
        if self._stack is not None:
            self._stack.close()
            self._stack = None
        return False


class compact_master_at_init(WhileInitializing):
    """While ``deepspeed.initialize`` runs with a compact master (``optimizer_states.master`` "split" or
    "bf16"), DeepSpeed's bf16 master mode accepts FP4AdamW: its ``_configure_master_weights`` checks that the
    optimizer is DeepSpeedCPUAdam, which is how that mode gets an optimizer able to step bf16 partitions;
    FP4AdamW with a compact master is one too. The rest of the mode is DeepSpeed's own (bf16 master and gradient
    partitions, their reduction and clipping). ``applied`` counts the optimizers it served."""

    OWNERS = (dsi.ZERO12, dsi.ZERO3)
    METHOD = "_configure_master_weights"

    def _make(self, orig):
        outer = self

        def _configure_master_weights(zo, *args, **kwargs):
            from fp4offload._optim import FP4AdamW

            inner = dsi.read(zo, "optimizer", None)
            compact = isinstance(inner, FP4AdamW) and inner.master != "fp32"
            if compact and kwargs.get("bf16_master_weights_and_gradients"):
                kwargs["bf16_offload_validator"] = None
                outer.applied += 1
            return orig(zo, *args, **kwargs)

        return _configure_master_weights
