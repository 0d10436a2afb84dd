"""``convert(model, policy)``: NVFP4 all-gathers under the user's own ``fully_shard``.

``convert`` shards nothing. It wraps every weight the policy packs in an
:class:`~fp4offload._fsdp.weight.FP4Weight` (the fp32 values, unchanged) and installs the activation hooks the
policy asks for; the user then calls torch's ``fully_shard`` per block and at the root, with their own mesh (1-D,
or 2-D ``(replicate, shard)`` for HSDP), ``MixedPrecisionPolicy``, ``CPUOffloadPolicy`` and
``reshard_after_forward``, as they would without fp4offload::

    model = ff.convert(model, ff.Policy(weights=ff.WeightsConfig()))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    fully_shard(model, mesh=mesh, mp_policy=...)
    opt = fp4offload.FP4AdamW(model.parameters(), lr=3e-4)

``fully_shard`` cuts each wrapper into shards as it cuts any tensor (the wrapper survives ``chunk``,
``new_zeros`` and ``copy_``), so each local shard is a wrapper whose ``fsdp_pre_all_gather`` packs it. What the
wrapper needs from the sharding (ranks along the shard dimension, that dimension's process group, whether FSDP
keeps the shard on the host) is read from the sharded DTensor parameters the first time any wrapper is gathered
or copied to the device: :class:`Conversion` then *binds* every wrapper of the model at once, one gather group
(one amax all-reduce per gather) per ``fully_shard`` unit, in ``model.modules()`` order, the same on every rank.

On one rank without CPU offload FSDP copies instead of gathering: the wrapper then hands FSDP its fp32 shard and
nothing is rounded. ``apply`` is ``convert`` plus the default sharding.
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.nn as nn

from .. import _keep_bf16 as keep_bf16
from .._announce import announce
from ..errors import ConfigError
from .internals import local_tensor, shard_layout, unit_parameters
from .policy import Policy
from .weight import FP4Weight, GatherGroup, Slot, WeightSpec

log = logging.getLogger("fp4offload.fsdp")

__all__ = ["convert", "Conversion", "as_policy", "packable", "activation_policy", "wrap", "unwrap_value"]


def as_policy(policy) -> Policy:
    """A checked :class:`Policy` from a Policy, an ``FsdpPolicyConfig`` or None (the default: NVFP4 states only)."""
    from .._config import FsdpPolicyConfig

    if policy is None:
        policy = Policy()
    elif isinstance(policy, FsdpPolicyConfig):
        policy = Policy.from_config(policy)
    elif not isinstance(policy, Policy):
        raise ConfigError("policy", type(policy).__name__, "an fp4offload.fsdp.Policy or FsdpPolicyConfig")
    return policy.checked_paths()  # the NVMe folders: expanded, resolved, created under an existing parent


def packable(model: nn.Module, policy: Policy, blocks) -> tuple[list[tuple[str, nn.Parameter]], dict]:
    """(parameters whose all-gather the policy packs, counts of why the others are not); changes nothing.

    ConfigError for DTensor parameters (a model already sharded or tensor-parallel). Parameters on the meta device
    are wrapped as they are: ``to_empty`` after sharding gives each shard's wrapper real (empty) storage, and the
    user's initialization writes into it.
    """
    from torch.distributed.tensor import DTensor

    why = {"keep_bf16": 0, "frozen": 0, "not floating": 0, "0-d": 0}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            raise ConfigError(f"parameter {name}", "a DTensor", "plain parameters (a model not sharded yet)",
                              "convert (or apply) before fully_shard; tensor-parallel models are not supported")
    if not policy.packs_weights:
        return [], why
    kept = keep_bf16.kept_parameters(model, policy.weights.keep_bf16, blocks)
    out = []
    for name, p in model.named_parameters():
        if id(p) in kept:
            why["keep_bf16"] += 1
        elif not p.requires_grad:
            why["frozen"] += 1
        elif not p.is_floating_point():
            why["not floating"] += 1
        elif p.dim() == 0:
            why["0-d"] += 1
        else:
            out.append((name, p))
    return out, why


def activation_policy(acts):
    """The ActivationPolicy for ``wrap_modules`` from a policy's ``activations`` (None: off)."""
    if acts is None:
        return None
    from .._offload import ActivationPolicy

    if isinstance(acts, ActivationPolicy):
        return acts
    return ActivationPolicy.from_config(acts)


def unwrap_value(v):
    """A state-dict value with every FP4 wrapper replaced by its fp32 master (a DTensor stays a DTensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor) and isinstance(local_tensor(v), FP4Weight):
        return DTensor.from_local(local_tensor(v)._master, v.device_mesh, v.placements, run_check=False,
                                  shape=v.shape, stride=v.stride())
    if isinstance(v, FP4Weight):
        return v._master
    return v


def _state_dict_hook(module, state_dict, prefix, local_metadata) -> None:
    for k in list(state_dict.keys()):
        state_dict[k] = unwrap_value(state_dict[k])


def _owners(model: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    out: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((mod, name))
    return out


class Conversion:
    """The FP4 weights of one converted model, and their binding to the sharding the user chose."""

    def __init__(self, model: nn.Module, slots: list[Slot]):
        self._model = weakref.ref(model)
        self.slots = slots
        for s in slots:
            s.conversion = self

    def bind(self) -> None:
        """Give every sharded FP4 weight its layout (ranks along the shard dimension), host-offload flag and
        gather group: one group per ``fully_shard`` unit. Deterministic in ``model.modules()`` order, so every
        rank builds the same groups. Weights not sharded yet stay unbound (a later call binds them)."""
        from torch.distributed.fsdp import FSDPModule

        model = self._model()
        if model is None:
            return
        mine = {id(s) for s in self.slots if s.group is None}
        claimed: set[int] = set()
        hidden = False
        for unit in model.modules():
            if not isinstance(unit, FSDPModule):
                continue
            params = unit_parameters(unit)
            if params is None:
                hidden = True
                break
            members: dict[int, tuple] = {}  # id(process group) -> (group, device type, slots)
            for p in params:
                local = local_tensor(p)
                if not isinstance(local, FP4Weight) or id(local._slot) not in mine or id(local._slot) in claimed:
                    continue
                pg, device_type = self._bind_slot(local._slot, p, local)
                members.setdefault(id(pg), (pg, device_type, []))[2].append(local._slot)
                claimed.add(id(local._slot))
            for pg, device_type, slots in members.values():
                GatherGroup(slots, pg, device_type)
        if hidden:
            log.info("fp4offload.fsdp: this torch hides FSDP's parameter groups (fsdp_internals.check()); "
                     "one amax all-reduce per weight instead of one per unit")
        for s in self.slots:  # sharded outside any unit this torch shows us: one group each (still correct)
            if id(s) in mine and id(s) not in claimed and s.owner_is_sharded():
                p = s.owner[0]._parameters[s.owner[1]]
                pg, device_type = self._bind_slot(s, p, local_tensor(p))
                GatherGroup([s], pg, device_type)

    @staticmethod
    def _bind_slot(slot: Slot, p, local) -> tuple:
        layout = shard_layout(p, f"parameter {slot.spec.name}")
        slot.spec = WeightSpec(slot.spec.name, tuple(p.shape), layout.world)
        # FSDP keeps the shard on the host and copies it to the device before each gather (apply also sets it
        # for CPUOffloadPolicy on a CPU mesh, where the copy is FSDP's one-rank path)
        slot.offload = slot.offload or (local.device.type == "cpu" and layout.mesh.device_type != "cpu")
        return layout.group(), layout.mesh.device_type


def wrap(model: nn.Module, params: list[tuple[str, nn.Parameter]], *, world: int = 0,
         device: torch.device | None = None, offload: bool = False) -> Conversion:
    """Replace each of ``params`` (in every module that holds it) by a parameter over an FP4Weight of its values.

    ``world``, ``device`` and ``offload`` are known when ``apply`` shards; under ``convert`` the binding reads them
    from the sharded parameters later.
    """
    owners = _owners(model)
    slots = []
    for name, p in params:
        slot = Slot(WeightSpec(name, tuple(p.shape), world))
        master = p.detach()
        if device is not None and master.device != device and master.device.type != "meta":
            master = master.to(device)
        slot.offload = offload
        newp = nn.Parameter(FP4Weight(master, slot), requires_grad=p.requires_grad)
        for mod, attr in owners[id(p)]:
            mod._parameters[attr] = newp
        slot.owner = owners[id(p)][0]
        slots.append(slot)
    model.register_state_dict_post_hook(_state_dict_hook)  # state dicts hold the fp32 values, never the wrapper
    return Conversion(model, slots)


def convert(model: nn.Module, policy: Policy | None = None) -> nn.Module:
    """Prepare ``model`` for the user's own ``fully_shard``: NVFP4 all-gathers for the weights ``policy`` packs
    (``weights``), and its activation hooks (``activations``). Shards nothing; returns ``model``.

    Raises:
        ConfigError: a bad policy, a model already sharded (DTensor parameters), a model converted before, a
            policy that needs the sharding itself (``auto``, a compact master: use
            :func:`~fp4offload._fsdp.apply.apply`), activation patterns that match nothing. Raised before anything
            changes.

    The optimizer states are the optimizer's business: ``fp4offload.FP4AdamW(model.parameters())`` after
    ``fully_shard`` steps over the local shards.
    """
    policy = as_policy(policy)
    if not isinstance(model, nn.Module):
        raise ConfigError("model", type(model).__name__, "a torch.nn.Module")
    if getattr(model, "_fp4offload_conversion", None) is not None:
        raise ConfigError("model", "converted already", "a model converted once")
    if policy.automatic:
        raise ConfigError("policy.auto", True, "False under your own fully_shard",
                          "auto chooses the sharding's memory use from the readings: use fp4offload.fsdp.apply")
    if policy.compact_master is not None:
        raise ConfigError("optimizer_states.master", policy.compact_master, "'fp32' under your own fully_shard",
                          "a compact master is cut from the initial fp32 values along the shards apply makes: use "
                          "fp4offload.fsdp.apply, or FP4AdamW's own master option")
    pred = keep_bf16.block_predicate(model, policy.block_classes)
    blocks = keep_bf16.find_blocks(model, policy.block_classes) if pred is not None else []
    to_pack, why = packable(model, policy, blocks)
    act = activation_policy(policy.activations)
    if act is not None:
        from .._offload.modules import plan as activation_plan

        activation_plan(model, act)  # ConfigError now if its module patterns match nothing
    # ---- from here on the model changes ----
    model._fp4offload_conversion = wrap(model, to_pack)
    model._fp4offload_policy = policy
    if act is not None:
        from .._offload import wrap_modules

        model._fp4offload_activations = wrap_modules(model, act)
        announce(act.describe())
    log.info("fp4offload.fsdp: %d weights converted for NVFP4 all-gathers; plain gathers: %s", len(to_pack),
             ", ".join(f"{v} {k}" for k, v in why.items() if v) or "none")
    return model
