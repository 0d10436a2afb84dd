"""Which saved tensors the activation hooks leave alone, and how they hand them back.

A parameter (or a view or cast of it) is already kept by the model; integer and bool tensors, small ones,
outputs of the policy's ``skip_outputs_of`` ops, tables (no autograd history, broadcast over batch and heads:
rotary cos/sin and masks, which every layer saves and multiplies with: 4 bits there would bias every layer),
non-dense or exotic layouts and tensors saved while backward runs (checkpoint recomputation) are taken as
they are. :func:`skip_reason` names the first that applies (the
name the stats count it under); :func:`alias` is what the pack hook returns for them.
"""

from __future__ import annotations

import torch

from .packing import FLOAT_DTYPES, is_dense

__all__ = ["from_parameter", "alias", "unpack_alias", "in_backward", "skip_reason", "KeepAsIs"]

# grad_fn names through which a tensor is still "the parameter" (a view or a dtype cast of it)
_PARAM_PATH = frozenset({"ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
                         "ExpandBackward0", "UnsafeViewBackward0", "AliasBackward0", "ReshapeAliasBackward0",
                         "SliceBackward0", "SelectBackward0", "CloneBackward0"})


def from_parameter(t: torch.Tensor) -> bool:
    """True for parameters, leaves that require grad, and views or casts of them."""
    if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
        return True
    if t._base is not None and (isinstance(t._base, torch.nn.Parameter) or (t._base.is_leaf and t._base.requires_grad)):
        return True
    fn = t.grad_fn
    for _ in range(4):
        if fn is None or type(fn).__name__ not in _PARAM_PATH:
            return False
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
        if type(fn).__name__ == "AccumulateGrad":
            return True
    return False


def alias(t: torch.Tensor) -> torch.Tensor:
    """What a pack hook hands back for a tensor it leaves alone: the same memory, without autograd history.

    Handing back `t` itself would let a node that saved its own output hold that output, whose grad_fn is
    the node: a reference cycle through C++ that no garbage collector sees, so a graph whose backward
    failed half-way would never be freed. Autograd re-attaches the history on unpack, as it does for
    any packed copy.
    """
    return t.detach()


def unpack_alias(t: torch.Tensor) -> torch.Tensor:
    return t


def in_backward() -> bool:
    f = getattr(torch._C, "_current_graph_task_id", None)
    return f is not None and f() != -1


class KeepAsIs(Exception):
    """Raised inside packing when a CPU tensor held Inf/NaN: the pack hook hands it back untouched."""


def skip_reason(t: torch.Tensor, policy) -> str | None:
    """Why the pack hook takes `t` as it is under `policy` (an ActivationPolicy), or None: it is stored."""
    if type(t) is not torch.Tensor:
        return "parameter" if isinstance(t, torch.nn.Parameter) else "subclass"
    if from_parameter(t):
        return "parameter"
    if t.dtype not in FLOAT_DTYPES:
        return "dtype"
    if t.numel() < policy.min_numel:
        return "small"
    if t.grad_fn is not None and type(t.grad_fn).__name__ in policy.skip_outputs_of:
        return "kept_op"
    if t.grad_fn is None and not t.requires_grad and t.dim() >= 3 and t.shape[0] == t.shape[1] == 1:
        return "table"  # broadcast over batch and heads, no history: rotary cos/sin, masks, saved by every layer
    if t.device.type not in ("cpu", "cuda") or t.layout != torch.strided or not is_dense(t):
        return "layout"
    if in_backward():
        return "backward"
    return None
