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
``DTensor._local_tensor``                  ``distributed/tensor/_api``       the local shard itself (an FP4Weight)
=========================================  ==============================  =====================================

Each has a fallback, so a torch that moves one of them runs slower, never wrong: no AllGather base (duck
typing is enough), no param groups (one all-reduce per weight instead of one per unit; :func:`check` says
so, and ``apply`` logs it once). torch 2.11 has one optional ``FSDPState._fsdp_param_group`` where 2.13 has the
list ``_fsdp_param_groups`` (and the singular as a property): both are read, and the check's key covers both.
Verified on torch 2.11.0, 2.13.0 and 2.14.1 (benchmarks/torch_matrix.sh).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch.nn as nn

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


def local_tensor(p: Any, default: Any = None) -> Any:
    """The local tensor of a DTensor parameter (the object FSDP2 all-gathers from), else ``default``."""
    return getattr(p, "_local_tensor", default)


class ShardLayout(NamedTuple):
    """How FSDP shards one DTensor parameter: dim 0 split over one mesh dimension, replicated over the rest."""

    mesh: Any  # the parameter's DeviceMesh (1-D for FSDP, 2-D (replicate, shard) for HSDP)
    dim: int  # the mesh dimension dim 0 is sharded over
    world: int  # ranks along it
    rank: int  # this rank's coordinate along it

    def group(self):
        """The process group of the shard dimension (where the NVFP4 all-gather runs)."""
        return self.mesh.get_group(self.dim) if self.mesh.ndim > 1 else self.mesh.get_group()


def shard_layout(p: Any, name: str = "parameter") -> ShardLayout | None:
    """The layout of a DTensor parameter sharded as FSDP/HSDP shards (None for a plain tensor).

    Raises ConfigError for any other placement: a tensor-parallel dimension (``Shard`` of another dim, or
    ``Shard(0)`` on two mesh dimensions) or a partial placement.
    """
    from torch.distributed.tensor import Replicate, Shard

    from ..errors import ConfigError

    mesh, placements = getattr(p, "device_mesh", None), getattr(p, "placements", None)
    if mesh is None or placements is None:
        return None
    shard = [i for i, pl in enumerate(placements) if isinstance(pl, Shard)]
    other = [pl for pl in placements if not isinstance(pl, (Shard, Replicate))]
    if len(shard) != 1 or placements[shard[0]].dim != 0 or other:
        raise ConfigError(f"{name} placements", tuple(placements), "Shard(0) on one mesh dimension (FSDP), with "
                          "Replicate on the others (HSDP)",
                          "NVFP4 all-gathers and the FP4 optimizer's shard bookkeeping follow FSDP's dim-0 "
                          "sharding; tensor-parallel dimensions are not supported: keep TP parameters out of the "
                          "policy (weights: null) or shard them with FSDP/HSDP only")
    d = shard[0]
    coord = mesh.get_coordinate()
    return ShardLayout(mesh, d, mesh.size(d), coord[d] if coord is not None else 0)


def mesh_all_reduce(t: Any, mesh: Any, op: Any) -> Any:
    """All-reduce ``t`` in place over every rank of ``mesh`` (each dimension in turn; MIN/MAX/SUM compose)."""
    import torch.distributed as dist

    for d in range(mesh.ndim):
        if mesh.size(d) > 1:
            dist.all_reduce(t, op=op, group=mesh.get_group(d) if mesh.ndim > 1 else mesh.get_group())
    return t


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
