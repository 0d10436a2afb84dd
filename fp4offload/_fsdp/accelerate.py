"""Hugging Face Accelerate on FSDP2: ``fp4offload.fsdp.prepare(accelerator, model, policy, lr=...)``.

One call in place of ``accelerator.prepare(model, optimizer)``::

    accelerator = Accelerator()                 # launched with an Accelerate config: distributed_type FSDP,
                                                # fsdp_config: {fsdp_version: 2, ...}
    model, opt = ff.prepare(accelerator, model, "policy.yaml", lr=3e-4)
    loader, sched = accelerator.prepare(loader, sched)   # everything else as usual

It shards the model with :func:`~fp4offload._fsdp.apply.apply`, builds the optimizer of
:func:`~fp4offload._fsdp.optim.optimizer` (FP4AdamW over the local shards) and registers both
with the accelerator through ``accelerator.prepare``. Why not ``ff.apply``, ``ff.optimizer`` and then a
plain ``accelerator.prepare(model, opt)`` (what Accelerate 1.15 does, read in ``Accelerator._prepare_fsdp2``
and ``utils/fsdp_utils.py``):

- ``fsdp2_prepare_model`` returns a model that is already an ``FSDPModule`` untouched;
- but the optimizer's parameters are swapped for the model's: Accelerate replaces each entry of
  ``param_groups`` by a placeholder that remembers the ``data_ptr`` of the parameter's local shard and then
  maps it to the model parameter whose local tensor has that ``data_ptr``. The FP4 optimizer steps over
  plain *proxies* of the local shards (fsdp_optim.py), and an NVFP4 shard's local tensor is an
  ``FP4Weight`` wrapper with no storage (``data_ptr()`` is 0), so the mapping fails with Accelerate's
  KeyError ("A parameter in the optimizer couldn't be switched to its sharded version"); without packed
  weights it would succeed and leave the optimizer stepping over DTensors instead of its proxies.
- with ``fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP``, Accelerate looks the layer classes up by name in
  the model, and ``fully_shard`` has renamed them (``FSDPLlamaDecoderLayer``), so it raises ValueError.

So :func:`prepare` resolves the plugin's auto-wrap policy on the unsharded model first (the plugin's own
``set_auto_wrap_policy``, which Accelerate's later call then leaves alone), and hands the optimizer to
``accelerator.prepare`` with its parameter lists emptied (nothing to swap), putting the proxies back
afterwards. The optimizer is wrapped in Accelerate's ``AcceleratedOptimizer`` and both objects are
registered with the accelerator as usual (``accelerator.backward``, ``accelerator.clip_grad_norm_`` and LR
schedulers prepared with ``accelerator.prepare`` work on them). ``accelerator.save_state`` is not supported
(Accelerate 1.15's FSDP2 optimizer checkpoint raised KeyError mapping the optimizer's parameters while they were
proxies; it is not tested with the parameters the optimizer shows now); checkpoint with
``fp4offload.fsdp.save(path, model, optimizer.optimizer)`` and ``load``, or torch's ``get_optimizer_state_dict``
over ``optimizer.optimizer``.

Where the Accelerate config and the policy overlap, the Accelerate config decides, and the policy may
only agree with it: ``mixed_precision`` (or the plugin's ``mixed_precision_policy``) gives ``param_dtype``
and ``reduce_dtype``, ``fsdp_offload_params`` gives ``cpu_offload``, ``fsdp_reshard_after_forward``
gives ``reshard_after_forward`` and ``fsdp_transformer_layer_cls_to_wrap`` gives ``block_classes``. A
policy field left at its default takes Accelerate's value; one set to something else that disagrees is a
ConfigError naming both settings. Everything FP4 (weights, optimizer_states, activations, monitor) comes
from the policy.

Refused with a ConfigError before anything is sharded: an Accelerator that is not on FSDP2 (FSDP1, no FSDP,
or a CPU-only machine, where Accelerate 1.15 never turns FSDP on), ``mixed_precision`` fp16 (Accelerate's
GradScaler reads the gradients of the optimizer's parameters, which the FP4 optimizer binds only inside
``step``) or fp8, Accelerate's activation checkpointing, torch.compile through Accelerate,
``fsdp_cpu_ram_efficient_loading``, ``fsdp_ignored_modules``, size-based or custom auto-wrap policies,
device meshes with more than the data-parallel shard dimension, and an already sharded model.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from ..errors import ConfigError
from .apply import apply
from .optim import optimizer as build_optimizer
from .policy import Policy, policy_from_yaml

log = logging.getLogger("fp4offload.fsdp")

__all__ = ["prepare"]

_ACC_KEYS = {"param_dtype": "mixed_precision", "reduce_dtype": "mixed_precision",
             "cpu_offload": "fsdp_offload_params", "reshard_after_forward": "fsdp_reshard_after_forward"}
_FIX_FSDP2 = ("launch with an Accelerate config holding distributed_type: FSDP and fsdp_config: {fsdp_version: 2} "
              "(or build Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)))")


# --------------------------------------------------------------------------------------------------
# what the accelerator is set up for


def _fsdp2_plugin(accelerator):
    """The accelerator's FullyShardedDataParallelPlugin; ConfigError unless it is on FSDP2."""
    state = getattr(accelerator, "state", None)
    if state is None or not callable(getattr(accelerator, "prepare", None)):
        raise ConfigError("accelerator", type(accelerator).__name__, "an accelerate.Accelerator")
    kind = getattr(state, "distributed_type", None)
    name = getattr(kind, "value", kind)
    if str(name) != "FSDP":
        hint = _FIX_FSDP2
        if str(name) in ("MULTI_CPU", "NO"):
            hint += ("; Accelerate turns FSDP on only on accelerator devices (GPU, XPU, NPU, HPU...), so on a "
                     "CPU-only machine it runs as MULTI_CPU or NO: there, call fp4offload.fsdp.apply and "
                     "fp4offload.fsdp.optimizer under torch.distributed without Accelerate")
        raise ConfigError("accelerator.distributed_type", str(name), "FSDP (with fsdp_version 2)", hint)
    plugin = getattr(state, "fsdp_plugin", None)
    version = getattr(plugin, "fsdp_version", None)
    if version != 2:
        raise ConfigError("fsdp_config.fsdp_version", version, "2 (FSDP2, torch's fully_shard)",
                          "fp4offload's all-gather and optimizer hooks are FSDP2 only: set fsdp_version: 2 in the "
                          "Accelerate config (FullyShardedDataParallelPlugin(fsdp_version=2))")
    return plugin


def _refuse_unsupported(accelerator, plugin) -> None:
    mp = str(getattr(accelerator, "mixed_precision", "no"))
    if mp in ("fp16", "fp8"):
        raise ConfigError("mixed_precision", mp, "'bf16' or 'no'",
                          "fp16 needs Accelerate's GradScaler, which reads the gradients of the optimizer's "
                          "parameters, and fp8 converts the linear layers: set mixed_precision: bf16 "
                          "(weights are gathered as NVFP4 and decoded to bf16 anyway)")
    if getattr(plugin, "activation_checkpointing", False):
        raise ConfigError("fsdp_config.fsdp_activation_checkpointing", True, "false",
                          "Accelerate would wrap the blocks after fp4offload has sharded them; set it to false and "
                          "use the policy's activations block to shrink what backward keeps")
    dynamo = getattr(getattr(accelerator.state, "dynamo_plugin", None), "backend", None)
    if dynamo is not None and str(getattr(dynamo, "value", dynamo)).lower() != "no":
        raise ConfigError("dynamo_config.dynamo_backend", str(getattr(dynamo, "value", dynamo)), "'no'",
                          "torch.compile through Accelerate is not supported with fp4offload's NVFP4 weights")
    if getattr(plugin, "cpu_ram_efficient_loading", False):
        raise ConfigError("fsdp_config.fsdp_cpu_ram_efficient_loading", True, "false",
                          "every rank must hold the full weights when fp4offload shards them (Accelerate's "
                          "broadcast from rank 0 happens only for models it shards itself)")
    if getattr(plugin, "ignored_modules", None) is not None:
        raise ConfigError("fsdp_config.fsdp_ignored_modules", plugin.ignored_modules, "none",
                          "fp4offload.fsdp shards every module; freeze parameters (requires_grad=False) to keep "
                          "them out of the optimizer instead")


def _mesh(accelerator):
    """The 1-D mesh to shard over: Accelerate's FSDP dimension when it built a device mesh, else None."""
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is None:
        return None
    for dim in ("tp", "cp", "sp", "dp_replicate"):
        if getattr(pc, f"{dim}_enabled", False):
            raise ConfigError(f"parallelism_config.{dim}_size", getattr(pc, f"{dim}_size", None), "1",
                              "fp4offload.fsdp shards over one data-parallel dimension only (no HSDP, TP or CP yet)")
    try:
        mesh = accelerator.torch_device_mesh
    except AttributeError:
        return None
    if mesh is None:
        return None
    sub = mesh[tuple(pc.fsdp_dim_names)]
    if sub.ndim != 1:
        raise ConfigError("parallelism_config", pc, "a data-parallel shard dimension only")
    return sub


# --------------------------------------------------------------------------------------------------
# the policy, as the Accelerate config completes it


def _as_policy(policy) -> Policy:
    from .._config import FsdpPolicyConfig

    if policy is None:
        return Policy()
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, FsdpPolicyConfig):
        return Policy.from_config(policy)
    if isinstance(policy, (str, Path)):
        return policy_from_yaml(policy)
    raise ConfigError("policy", type(policy).__name__,
                      "an fp4offload.fsdp.Policy, an FsdpPolicyConfig, the path of a policy YAML file, or None")


def _accelerate_blocks(plugin, model: nn.Module) -> tuple[tuple, bool]:
    """(block classes of Accelerate's transformer auto-wrap, whether the config named them).

    Resolves the plugin's auto-wrap policy on the unsharded model (the plugin's own method; Accelerate's
    second call inside ``prepare`` leaves a resolved policy alone, which it must, since ``fully_shard``
    renames the classes).
    """
    import functools

    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    awp = plugin.auto_wrap_policy
    if awp is None:
        return (), False
    base = awp.func if isinstance(awp, functools.partial) else awp
    if base is size_based_auto_wrap_policy:
        raise ConfigError("fsdp_config.fsdp_auto_wrap_policy", "SIZE_BASED_WRAP", "TRANSFORMER_BASED_WRAP or NO_WRAP",
                          "fp4offload shards one unit per block class: name the class with "
                          "fsdp_transformer_layer_cls_to_wrap (or the policy's block_classes)")
    if base is not transformer_auto_wrap_policy:
        raise ConfigError("fsdp_config.fsdp_auto_wrap_policy", awp, "TRANSFORMER_BASED_WRAP or NO_WRAP",
                          "for a custom choice of blocks pass a callable as the policy's block_classes")
    named = plugin.transformer_cls_names_to_wrap is not None
    if not isinstance(awp, functools.partial):
        try:
            plugin.set_auto_wrap_policy(model)
        except ValueError as e:  # a class name the model does not have
            raise ConfigError("fsdp_config.fsdp_transformer_layer_cls_to_wrap", plugin.transformer_cls_names_to_wrap,
                              "class names of modules in this model", str(e)) from None
        awp = plugin.auto_wrap_policy
    classes = tuple(sorted(awp.keywords.get("transformer_layer_cls", ()), key=lambda c: c.__name__))
    return classes, named


def _names(classes) -> set[str]:
    return {c if isinstance(c, str) else c.__name__ for c in classes}


def _accelerate_values(accelerator, plugin) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    mpp = plugin.mixed_precision_policy
    if isinstance(mpp, MixedPrecisionPolicy):
        param = mpp.param_dtype or torch.float32
        reduce = mpp.reduce_dtype or mpp.param_dtype or torch.float32
    else:  # mixed_precision "no": FSDP2 computes in the parameters' dtype (fp32) and reduces in it
        param = reduce = torch.float32
    return {"param_dtype": param, "reduce_dtype": reduce,
            "cpu_offload": isinstance(plugin.cpu_offload, CPUOffloadPolicy),
            "reshard_after_forward": bool(plugin.reshard_after_forward)}


def _merged(policy: Policy, accelerator, plugin, model: nn.Module) -> Policy:
    """``policy`` with the fields the Accelerate config decides; ConfigError where they disagree."""
    default = Policy()
    changes: dict[str, Any] = {}
    for key, acc_value in _accelerate_values(accelerator, plugin).items():
        mine = getattr(policy, key)
        if mine == acc_value:
            continue
        if mine != getattr(default, key):
            raise ConfigError(f"policy.{key}", mine, f"{acc_value}, what the Accelerate config's {_ACC_KEYS[key]} "
                              "gives", f"the Accelerate config decides {key}: change {_ACC_KEYS[key]} there, or "
                              f"leave {key} at its default in the policy")
        changes[key] = acc_value
    classes, named = _accelerate_blocks(plugin, model)
    mine = policy.block_classes
    if not mine and classes:
        changes["block_classes"] = classes
    elif mine and named and (callable(mine) or _names(mine) != _names(classes)):
        raise ConfigError("policy.block_classes", mine if callable(mine) else sorted(_names(mine)),
                          f"{sorted(_names(classes))} (the Accelerate config's fsdp_transformer_layer_cls_to_wrap)",
                          "name the block classes in one place: drop fsdp_transformer_layer_cls_to_wrap or the "
                          "policy's block_classes")
    if changes:
        log.info("fp4offload.fsdp.prepare: from the Accelerate config: %s",
                 ", ".join(f"{k}={v}" for k, v in changes.items()))
    return dataclasses.replace(policy, **changes) if changes else policy


def _upcast(model: nn.Module, accelerator) -> None:
    """fp32 masters for trainable low-precision parameters under mixed precision, as Accelerate's FSDP2 does."""
    if str(getattr(accelerator, "mixed_precision", "no")) == "no":
        return
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.to(torch.float32)


# --------------------------------------------------------------------------------------------------
# prepare


def prepare(accelerator, model: nn.Module, policy: Policy | str | Path | None = None, *,
            params: Callable[[nn.Module], Any] | None = None, **optimizer_kwargs: Any):
    """Shard ``model`` with the FSDP2 ``policy``, build FP4AdamW over its shards, and prepare both with Accelerate.

    The one step for Accelerate on FSDP2, in place of ``accelerator.prepare(model, optimizer)``; prepare data
    loaders and LR schedulers (built over the returned optimizer) with ``accelerator.prepare`` as usual.

    Args:
        accelerator: an ``accelerate.Accelerator`` on FSDP2 (``distributed_type: FSDP``, ``fsdp_version: 2``).
        model: the unsharded model, weights materialized on every rank.
        policy: a :class:`Policy`, an ``FsdpPolicyConfig``, the path of a policy YAML file, or None (``Policy()``).
            ``param_dtype``, ``reduce_dtype``, ``cpu_offload``, ``reshard_after_forward`` and ``block_classes``
            come from the Accelerate config where the policy leaves them at their defaults (see the module
            docstring).
        params: a callable ``sharded_model -> parameters or param-group dicts`` (the sharded parameters
            exist only once ``prepare`` has sharded the model); default all parameters, one group.
        optimizer_kwargs: ``lr``, ``betas``, ``eps``, ``weight_decay`` and the optimizer's other options,
            as for :func:`fp4offload.fsdp.optimizer`.

    Returns:
        ``(model, optimizer)``: the sharded model (``model._fp4offload_policy`` is the policy applied) and
        Accelerate's ``AcceleratedOptimizer`` around the FP4 optimizer (``optimizer.optimizer``).

    Raises:
        ConfigError: the accelerator is not on FSDP2, a setting fp4offload cannot honour (named, with its fix),
            the policy and the Accelerate config disagree, or the model is already sharded. Raised before the
            model changes.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    plugin = _fsdp2_plugin(accelerator)
    _refuse_unsupported(accelerator, plugin)
    if not isinstance(model, nn.Module):
        raise ConfigError("model", type(model).__name__, "a torch.nn.Module")
    if isinstance(model, FSDPModule) or any(isinstance(p, DTensor) for p in model.parameters()):
        raise ConfigError("model", type(model).__name__, "an unsharded model",
                          "pass the model before fully_shard / fp4offload.fsdp.apply: prepare shards it")
    if params is not None and not callable(params):
        raise ConfigError("params", type(params).__name__, "a callable sharded_model -> parameters or param groups",
                          "the sharded parameters exist only after prepare has sharded the model")
    policy = _merged(_as_policy(policy), accelerator, plugin, model)
    mesh = _mesh(accelerator)

    # ---- from here on the model changes and collectives may run ----
    _upcast(model, accelerator)
    model = apply(model, policy, mesh=mesh)
    opt = build_optimizer(model, policy, params=None if params is None else params(model), **optimizer_kwargs)
    saved = [g["params"] for g in opt.param_groups]
    for g in opt.param_groups:  # nothing for Accelerate's parameter swap to map (see the module docstring)
        g["params"] = []
    try:
        with opt.packed_form():
            model, wrapped = accelerator.prepare(model, opt)
    finally:
        # AcceleratedOptimizer's device placement round-trips the state dict, which replaces the group dicts
        for g, ps in zip(opt.param_groups, saved):
            g["params"] = ps
    return model, wrapped
