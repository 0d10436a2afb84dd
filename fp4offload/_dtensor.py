"""DTensor parameters as FSDP2 and HSDP shard them: the local shard, the layout, the mesh-wide reduce.

The layer below the optimizer and the FSDP2 policies: FP4AdamW steps a sharded model's local shards with these,
and ``fp4offload._fsdp`` builds on them (its ``internals`` lists every private torch name the package reads, this
module's ``DTensor._local_tensor`` among them).
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

from .errors import ConfigError

__all__ = ["is_dtensor", "local_tensor", "ShardLayout", "shard_layout", "mesh_all_reduce", "all_reduce",
           "settle_gloo_at_exit", "like_param"]


def is_dtensor(p: Any) -> bool:
    """Whether p is a DTensor (by its class name, or its mesh and placements: no torch.distributed import)."""
    return type(p).__name__ == "DTensor" or (hasattr(p, "device_mesh") and hasattr(p, "placements"))


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


# The tensors of the last few all-reduces, kept alive from Python. Gloo's worker thread drops its reference to a
# finished all-reduce just after the caller's wait() returns. If Python no longer holds the tensor by then, that
# drop frees its Python object and needs the GIL; at interpreter exit (a program that ends right after an optimizer
# step) the thread cannot take it and the process aborts with "terminate called without an active exception".
_RECENT: deque = deque(maxlen=4)


def all_reduce(t: Any, op: Any, group: Any = None) -> Any:
    """``torch.distributed.all_reduce(t, op, group)``, in place, with ``t`` kept alive past the collective (see
    ``_RECENT``): a program may exit right after it without racing gloo's worker thread."""
    import torch.distributed as dist

    settle_gloo_at_exit()
    dist.all_reduce(t, op=op, group=group)
    _RECENT.append(t)
    return t


#: how long the interpreter's exit waits for gloo's worker threads, seconds
GLOO_EXIT_GRACE_S = 0.2
_settling: list[bool] = []


def settle_gloo_at_exit() -> None:
    """Once per process, when a gloo process group exists: at interpreter exit (atexit, while threads can still
    take the GIL) wait :data:`GLOO_EXIT_GRACE_S`, so that gloo's worker threads drop the collectives they finished.
    torch's own collectives (a checkpoint's gathers, the Trainer's) race the same way as ``_RECENT`` describes, and
    a program that ends right after one aborts with "terminate called without an active exception"."""
    import torch.distributed as dist

    if _settling or not (dist.is_available() and dist.is_initialized()) or "gloo" not in str(dist.get_backend()):
        return
    import atexit
    import time

    atexit.register(time.sleep, GLOO_EXIT_GRACE_S)
    _settling.append(True)


def mesh_all_reduce(t: Any, mesh: Any, op: Any) -> Any:
    """All-reduce ``t`` in place over every rank of ``mesh`` (each dimension in turn; MIN/MAX/SUM compose)."""
    for d in range(mesh.ndim):
        if mesh.size(d) > 1:
            all_reduce(t, op, mesh.get_group(d) if mesh.ndim > 1 else mesh.get_group())
    return t


def like_param(v: Any, p: Any) -> Any:
    """``v`` (shaped like p's local shard) as a DTensor with p's placement, sharing v's storage; v for a plain p."""
    if not is_dtensor(p):
        return v
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
