"""FSDP2 (``fully_shard``) policies: NVFP4 weight all-gathers, FP4 optimizer states, activation offload.

``apply(model, policy, mesh=None)`` is :func:`~fp4offload._fsdp.convert.convert` (every trainable weight the
policy packs wrapped in an :class:`~fp4offload._fsdp.weight.FP4Weight`: fp32 master, NVFP4 all-gather) plus the
default sharding: ``fully_shard`` per block (module class names or a callable, like an auto-wrap policy) and
at the root. Users who shard the model themselves call ``convert`` and then their own ``fully_shard``.
``optimizer(model, policy)`` builds FP4AdamW (or torch AdamW) over the local shards; ``save`` and
``load`` write and read ``torch.distributed.checkpoint`` checkpoints in safetensors files (no pickle).

Order of work in :func:`apply`, so that a bad policy fails before any collective: validate the
policy and the mesh, find the blocks and the parameters to pack (ConfigError on anything wrong),
and only then call ``fully_shard``.

Fallbacks (each logged once per model):
- one rank (a mesh of size 1) without CPU offload: nothing is gathered or copied, so nothing is
  packed (with CPU offload the host-to-device copy is packed, also on one GPU);
- parameters named by ``weights.keep_bf16``, frozen ones, integer ones and 0-d ones: FSDP's plain
  gather in ``param_dtype``;
- weights whose padded local shard has fewer than 16 rows (or a row count that is not a multiple
  of 16), and 1-D ones: 1x16 blocks over the flattened local shard instead of 16x16 tiles (same
  bytes per element, same global tensor scale).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn

from .._announce import announce
from .._dtensor import settle_gloo_at_exit
from ..errors import ConfigError
from .convert import activation_policy, as_policy, packable, unwrap_value, wrap
from .._optim.shards import offer_residual
from .internals import AllGatherBase, local_tensor, shard_layout
from .. import _keep_bf16 as keep_bf16
from .policy import Policy, policy_from_yaml
from .weight import STATS, CollectiveError, FP4Weight, Slot

log = logging.getLogger("fp4offload.fsdp")

__all__ = ["apply", "Policy", "policy_from_yaml", "optimizer", "save", "load", "refresh", "stats", "reset_stats",
           "count_all_gathers", "AllGatherCounter", "fp4_parameters", "state_dict"]


# --------------------------------------------------------------------------------------------------
# what to shard and what to pack


def _blocks(model: nn.Module, block_classes) -> list[tuple[str, nn.Module]]:
    """The modules to shard one by one (keep_bf16.find_blocks); ConfigError when the policy names none."""
    if keep_bf16.block_predicate(model, block_classes) is None:
        raise ConfigError("block_classes", (), "class names of the model's repeated blocks, or a callable",
                          f"{type(model).__name__} declares no _no_split_modules; pass e.g. "
                          "Policy(block_classes=['TransformerBlock'])")
    if not callable(block_classes) or isinstance(block_classes, type):
        given = (block_classes,) if isinstance(block_classes, (str, type)) else tuple(block_classes)
        names = {c if isinstance(c, str) else c.__name__ for c in given} or set(model._no_split_modules)
        found = {type(m).__name__ for m in model.modules()}
        if not names & found:
            sample = ", ".join(sorted(found)[:10])
            raise ConfigError("block_classes", sorted(names), f"class names of modules in this model (it has {sample})")
    blocks = keep_bf16.find_blocks(model, block_classes)
    if not blocks:
        raise ConfigError("block_classes", "<callable>" if callable(block_classes) else list(block_classes),
                          "something that matches at least one submodule (the root is always sharded anyway)")
    return blocks


def _mesh_world(mesh) -> int:
    """The number of ranks weights are sharded over; ConfigError for a mesh this module cannot use."""
    if mesh is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("mesh", None, "a DeviceMesh, or an initialized default process group",
                              "call torch.distributed.init_process_group(...) before fp4offload.fsdp.apply")
        return dist.get_world_size()
    if getattr(mesh, "ndim", None) not in (1, 2):
        raise ConfigError("mesh", mesh, "a 1-D DeviceMesh (FSDP) or a 2-D (replicate, shard) one (HSDP)",
                          "tensor-parallel dimensions are not supported by fp4offload.fsdp: shard with FSDP/HSDP "
                          "only")
    return mesh.size(mesh.ndim - 1)  # fully_shard shards over a 2-D mesh's last dimension, replicates the first


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() and dist.get_backend() != "gloo" else "cpu"


def _default_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(_default_device_type(), (dist.get_world_size(),))


# --------------------------------------------------------------------------------------------------
# all-gather byte counter (a custom FSDP2 all-gather that counts what it delivers)


class AllGatherCounter(AllGatherBase):
    """An FSDP2 all-gather that counts the bytes it delivers to this rank (all parameters of a unit).

    Attributes:
        bytes: bytes received (output size) since the last reset. calls: collectives issued.
    """

    def __init__(self):
        self.bytes = 0
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.bytes += output_tensor.numel() * output_tensor.element_size()
        self.calls += 1
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        try:
            return gather(output_tensor, input_tensor, group=group, async_op=async_op)
        except Exception as e:
            raise CollectiveError(f"an FSDP all-gather of {output_tensor.numel() * output_tensor.element_size()} "
                                  "bytes", e) from e

    def reset(self) -> None:
        self.bytes = 0
        self.calls = 0


def count_all_gathers(model: nn.Module) -> AllGatherCounter:
    """Install one :class:`AllGatherCounter` on every FSDP2 unit of ``model`` (any FSDP2 model)."""
    from torch.distributed.fsdp import FSDPModule

    counter = AllGatherCounter()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            try:
                m.set_custom_all_gather(counter)
            except ValueError as e:  # several param groups on one unit (per-parameter meshes)
                log.info("fp4offload.fsdp: all-gathers of %s not counted: %s", type(m).__name__, e)
    return counter


# --------------------------------------------------------------------------------------------------
# state dicts: the fp32 masters, as DTensors, never the wrapper


def state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every FP4 shard as a DTensor over its fp32 master (no copies)."""
    sd = model.state_dict()
    return {k: unwrap_value(v) for k, v in sd.items()}


def fp4_parameters(model: nn.Module) -> list[tuple[str, Slot]]:
    """(name, slot) of every parameter whose all-gather is NVFP4."""
    out = []
    for name, p in model.named_parameters():
        local = local_tensor(p, p)
        if isinstance(local, FP4Weight):
            out.append((name, local._slot))
    return out


def refresh(model: nn.Module) -> None:
    """Re-encode every packed shard at its next all-gather.

    Needed only after changing weights behind fp4offload's back (writing into ``p._local_tensor``
    storage directly); optimizers from :func:`optimizer`, ``load`` and in-place ops on the parameters
    already do it.
    """
    for _, slot in fp4_parameters(model):
        slot.mark_dirty()


def stats() -> dict:
    """Counters of the NVFP4 all-gather hooks in this process (see ``GatherStats``)."""
    return STATS.snapshot()


def reset_stats() -> None:
    STATS.reset()


# --------------------------------------------------------------------------------------------------
# apply


def _to_bf16(model: nn.Module, master: str | None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """With a compact master, the parameters become bf16 (the master's upper half; buffers stay). Under
    split, returns each cast parameter's residual (master.split of its fp32 values), so the optimizer starts
    from the fp32 values themselves."""
    from .._optim import master as MW

    out = {}
    if master is None:
        return out
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if prm.is_floating_point() and prm.dtype != torch.bfloat16:
                h, lo, odd = MW.split(prm.data.float().reshape(-1))
                prm.data = h.view(prm.shape)
                if master == "split" and (lo.any() or odd.numel()):
                    out[name] = (lo.view(prm.shape), odd)
    return out


def _keep_local_residuals(model: nn.Module, residuals: dict) -> None:
    """Each rank leaves its shard's part of the residuals (FSDP2 shards dim 0 as torch.chunk does) for the
    FP4AdamW built over the sharded parameter to start its split master from (shards.offer_residual)."""
    if not residuals:
        return
    for name, prm in model.named_parameters():
        if name not in residuals:
            continue
        layout = shard_layout(prm, f"parameter {name}")
        rank, world = layout.rank, layout.world
        lo, odd = residuals[name]
        parts = lo.chunk(world, dim=0)
        local = parts[rank] if rank < len(parts) else lo[:0]
        start = sum(p.numel() for p in parts[:rank])
        keep = (odd >= start) & (odd < start + local.numel())
        offer_residual(prm, local.reshape(-1).clone(), odd[keep] - start)


def _torch_policies(policy: Policy, mp_policy, offload_policy) -> tuple:
    """torch's MixedPrecisionPolicy and OffloadPolicy for ``fully_shard``: the ones given, else the policy's
    ``param_dtype``, ``reduce_dtype`` and ``cpu_offload``. A policy field set away from its default that disagrees
    with a torch policy object is a ConfigError naming both."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    default = Policy()
    if mp_policy is None:
        mp_policy = MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)
    elif not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ConfigError("mp_policy", type(mp_policy).__name__, "a torch.distributed.fsdp.MixedPrecisionPolicy")
    else:
        for key in ("param_dtype", "reduce_dtype"):
            mine = getattr(policy, key)
            if mine != getattr(default, key) and mine != getattr(mp_policy, key):
                raise ConfigError(f"policy.{key}", mine, f"{getattr(mp_policy, key)} (mp_policy.{key}) or left "
                                  "at its default", "set the dtype in one place: the MixedPrecisionPolicy")
    if offload_policy is None:
        offload_policy = (CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if policy.cpu_offload
                          else OffloadPolicy())
    elif not isinstance(offload_policy, OffloadPolicy):
        raise ConfigError("offload_policy", type(offload_policy).__name__,
                          "a torch.distributed.fsdp.OffloadPolicy or CPUOffloadPolicy")
    elif policy.cpu_offload and not isinstance(offload_policy, CPUOffloadPolicy):
        raise ConfigError("policy.cpu_offload", True, "False (or left out) with offload_policy=OffloadPolicy()",
                          "say where shards live in one place: the offload policy")
    return mp_policy, offload_policy


def apply(model: nn.Module, policy: Policy | None = None, *, mesh=None, mp_policy=None,
          offload_policy=None) -> nn.Module:
    """:func:`~fp4offload._fsdp.convert.convert` plus the default sharding: ``fully_shard`` per block and at the
    root, as ``policy`` says; returns the model.

    Args:
        model: the module, with materialized parameters (on the mesh's device, or on the CPU: they
            are moved).
        policy: a :class:`Policy` (or an ``fp4offload._config.FsdpPolicyConfig``). Default ``Policy()``.
        mesh: a 1-D DeviceMesh (FSDP) or a 2-D ``(replicate, shard)`` one (HSDP: NVFP4 all-gathers within the
            shard dimension, gradients all-reduced across replicas); default: one over the default process group
            ("cuda" when CUDA is present and the backend is not gloo, else "cpu").
        mp_policy: torch's ``MixedPrecisionPolicy`` (default: the policy's ``param_dtype`` and ``reduce_dtype``).
        offload_policy: torch's ``OffloadPolicy`` / ``CPUOffloadPolicy`` (default: the policy's ``cpu_offload``).

    Raises:
        ConfigError: a bad policy or mesh, block classes that match nothing, meta parameters with a compact
            master. Raised before ``fully_shard`` is called, so no collective has started.

    A model built under ``torch.device("meta")`` is sharded as it is (NVFP4 weights included; a compact master
    needs the initial values and refuses it); then ``model.to_empty(device=...)`` and initialize it, shard by
    shard, before :func:`optimizer`.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    policy = as_policy(policy)
    if not isinstance(model, nn.Module):
        raise ConfigError("model", type(model).__name__, "a torch.nn.Module")
    blocks = _blocks(model, policy.block_classes)
    world = _mesh_world(mesh)
    settle_gloo_at_exit()
    decision = None
    if policy.automatic:  # the master form and the states' place, from the model and the readings (rank 0's)
        from .auto import decide

        on_gpu = (mesh.device_type if mesh is not None else _default_device_type()) == "cuda"
        policy, decision = decide(model, policy, blocks, world, on_gpu)
        announce(decision.line())
    mp, offload = _torch_policies(policy, mp_policy, offload_policy)
    host_shards = isinstance(offload, CPUOffloadPolicy)
    to_pack, why = packable(model, policy, blocks)
    if world < 2 and not host_shards:  # one rank, nothing gathered or copied: nothing to pack
        to_pack = []
    if policy.compact_master is not None:
        meta = next((n for n, p in model.named_parameters() if p.device.type == "meta"), None)
        if meta is not None:
            raise ConfigError(f"parameter {meta}", "on the meta device", f"materialized parameters with "
                              f"optimizer_states.master={policy.compact_master!r}",
                              "a compact master is split from the initial fp32 values when apply casts the shards "
                              "to bf16: initialize the model first, or shard it from meta with master 'fp32'")
    act = activation_policy(policy.activations)  # validated before anything changes
    if act is not None:
        from .._offload.modules import plan as activation_plan

        activation_plan(model, act)  # ConfigError now if its module patterns match nothing

    # ---- from here on the model changes and collectives may run ----
    mesh = _default_mesh() if mesh is None else mesh
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" \
        else torch.device(mesh.device_type)
    residuals = _to_bf16(model, policy.compact_master)
    conversion = wrap(model, to_pack, world=world, device=device, offload=host_shards)
    kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload)
    for _, block in reversed(blocks):  # innermost first
        fully_shard(block, reshard_after_forward=policy.reshard_after_forward, **kw)
    # the root: FSDP's default keeps its weights from forward to backward (they are needed at once)
    fully_shard(model, reshard_after_forward=None if policy.reshard_after_forward else False, **kw)
    conversion.bind()
    _keep_local_residuals(model, residuals)
    model._fp4offload_conversion = conversion
    model._fp4offload_policy = policy
    model._fp4offload_auto = decision
    model._fp4offload_all_gather = count_all_gathers(model)
    if act is not None:
        from .._offload import wrap_modules

        model._fp4offload_activations = wrap_modules(model, act)
        announce(act.describe())
    slots = conversion.slots
    if world < 2 and policy.packs_weights and not host_shards:
        log.info("fp4offload.fsdp: one rank without CPU offload: nothing is gathered or copied, weights are not "
                 "packed")
    else:
        log.info("fp4offload.fsdp: %d weights all-gathered as NVFP4 over %d ranks, %d blocks; plain gathers: %s",
                 len(slots), world, len(blocks), ", ".join(f"{v} {k}" for k, v in why.items() if v) or "none")
    tiles = [s.spec.name for s in slots if s.spec.tile != 16]
    if tiles:
        log.info("fp4offload.fsdp: %d weights use 1x16 blocks (local shard rows not a multiple of 16), e.g. %s",
                 len(tiles), tiles[0])
    return model


from .checkpoint import load, save  # noqa: E402
from .convert import convert  # noqa: E402,F401
from .optim import optimizer  # noqa: E402
