"""torch's private FSDP2 and DTensor names: every one the FSDP2 policies read, in one place.

FSDP2's public extension points (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on a sharded parameter's
local tensor, ``FSDPModule.set_custom_all_gather``) carry the NVFP4 all-gather. Three things they do not
expose, and the policies read from torch's internals here:

=========================================  ==============================  =====================================
name                                       defined in                      what the policies do with it
=========================================  ==============================  =====================================
``AllGather``                              ``fsdp/_fully_shard/_fsdp_api``   base class of the counting all-gather
``FSDPModule._get_fsdp_state()``           ``fsdp/_fully_shard/_fully_shard``  a unit's state, for its param groups
``FSDPState._fsdp_param_groups``,          ``fsdp/_fully_shard/_fsdp_state``,  a unit's parameters in FSDP's order
``FSDPParamGroup.fsdp_params``,            ``_fsdp_param_group``,            (one amax all-reduce per unit)
``FSDPParam.sharded_param``                ``_fsdp_param``
``DTensor._local_tensor``                  ``distributed/tensor/_api``       the local shard itself (an FP4Weight;
                                                                            read in fp4offload/_dtensor.py)
=========================================  ==============================  =====================================

Each has a fallback, so a torch that moves one of them runs slower, never wrong: no AllGather base (duck
typing is enough), no param groups (one all-reduce per weight instead of one per unit; :func:`check` says
so, and ``apply`` logs it once). torch 2.11 has one optional ``FSDPState._fsdp_param_group`` where 2.13 has the
list ``_fsdp_param_groups`` (and the singular as a property): both are read, and the check's key covers both.
Verified on torch 2.11.0, 2.13.0 and 2.14.1 (benchmarks/torch_matrix.sh).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

# the DTensor helpers (``DTensor._local_tensor`` among them) live a layer down, where FP4AdamW reads them too
from .._dtensor import ShardLayout, local_tensor, mesh_all_reduce, shard_layout

__all__ = ["AllGatherBase", "unit_parameters", "local_tensor", "check", "ShardLayout", "shard_layout",
           "mesh_all_reduce"]

try:  # the interface FSDP2's set_custom_all_gather expects
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as AllGatherBase
except ImportError:  # pragma: no cover - a torch without it: duck typing is enough
    AllGatherBase = object


def unit_parameters(unit: nn.Module) -> list[Any] | None:
    """The sharded parameters of one fully_shard unit, in FSDP's order; None if torch's internals moved."""
    try:
        state = unit._get_fsdp_state()
        if "_fsdp_param_groups" in vars(state):  # torch >= 2.13: a list
            groups = list(state._fsdp_param_groups)
        else:  # torch 2.11: one optional group, ``_fsdp_param_group``
            group = state._fsdp_param_group
            groups = [] if group is None else [group]
        return [fp.sharded_param for g in groups for fp in g.fsdp_params]
    except (AttributeError, AssertionError, TypeError):
        return None


def check() -> dict[str, bool]:
    """Which of the private names this torch has (False: the policies use the slower fallback)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_state

    from torch.distributed.tensor import DTensor

    state = getattr(_fsdp_state, "FSDPState", None)
    return {"AllGather": AllGatherBase is not object,
            "FSDPState._fsdp_param_groups": state is not None and "_fsdp_param_group" in _init_source(state),
            "DTensor._local_tensor": "_local_tensor" in getattr(DTensor, "__slots__", ()) or
                                     "_local_tensor" in _init_source(DTensor)}


def _init_source(cls: type) -> str:
    import inspect

    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""
