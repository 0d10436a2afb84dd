"""``Policy``: what ``fp4offload.fsdp.apply`` does to a model under FSDP2, and its YAML form.

The sub-blocks are the dataclasses of :mod:`fp4offload._config` (the same keys as the DeepSpeed
block and the FSDP policy YAML), so a policy read from YAML and one written in Python are the same
object and are validated by the same code. Runtime-only fields (dtypes, a callable block matcher)
exist only on :class:`Policy`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .._config import (ActivationsConfig, FsdpPolicyConfig, MonitorConfig, OptimizerStatesConfig, WeightsConfig,
                      prepare_path, check_fsdp_states, load_fsdp_policy_yaml)
from ..errors import ConfigError

__all__ = ["Policy", "policy_from_yaml"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SUB = {"weights": WeightsConfig, "optimizer_states": OptimizerStatesConfig, "activations": ActivationsConfig,
        "monitor": MonitorConfig}


def _sub(key: str, value: Any, cls: type) -> Any:
    """A sub-block given as a dataclass, a mapping (its keys) or None."""
    if value is None or isinstance(value, cls):
        return value
    if key == "activations" and type(value).__name__ == "ActivationPolicy":
        return value  # fp4offload._offload.ActivationPolicy: used as is
    if isinstance(value, Mapping):
        names = {f.name for f in fields(cls)}
        unknown = [k for k in value if k not in names]
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}", value[unknown[0]], "one of the keys " + ", ".join(sorted(names)))
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in value.items()})
    allowed = f"a {cls.__name__}, a mapping of its keys, or None"
    if key == "activations":
        allowed = "an fp4offload.ActivationPolicy, an ActivationsConfig, a mapping of its keys, or None"
    raise ConfigError(key, value, allowed)


def _dtype(key: str, value: Any) -> torch.dtype:
    if isinstance(value, str) and value.replace("torch.", "") in _DTYPES:
        return _DTYPES[value.replace("torch.", "")]
    if value in (torch.bfloat16, torch.float16, torch.float32):
        return value
    raise ConfigError(key, value, "torch.bfloat16, torch.float16 or torch.float32")


@dataclass(frozen=True)
class Policy:
    """How :func:`fp4offload.fsdp.apply` shards a model with ``fully_shard`` and what it packs.

    Modelled on torch's ``MixedPrecisionPolicy``: a frozen value object, checked when built
    (:class:`~fp4offload.errors.ConfigError` names the key, the value and what is allowed), so a bad
    policy fails before any process group or collective is touched.

    Attributes:
        weights: the weight working copies. ``format="nvfp4"`` (default): each trainable weight shard
            keeps its fp32 master and is all-gathered as NVFP4 16x16 blocks (0.504 B/element instead of
            2), decoded to ``param_dtype`` after the gather; ``keep_bf16`` names the parameters that
            are gathered plainly in ``param_dtype`` instead (name substrings such as ``"embed"``,
            ``"lm_head"``, ``"norm"``, ``"bias"``, and ``"first:N"`` / ``"last:N"`` for the first and
            last N blocks). ``format="bf16"`` or ``None``: plain FSDP gathers. ``device`` must be
            ``"cpu"`` (with ``cpu_offload`` the host shard is packed; NVMe weights are DeepSpeed-only).
            Default None: plain gathers (NVFP4 weights change the forward pass's numbers, so they are opted into,
            ``weights=WeightsConfig()``: embeddings, head, norms, biases, first and last block kept in bf16).
        optimizer_states: Adam's m and v for :func:`fp4offload.fsdp.optimizer`: ``format`` ``"nvfp4"``
            (FP4AdamW) or ``"fp32"``; ``device`` ``"same"`` (next to the shard: the GPU, or host RAM
            with ``cpu_offload``), ``"cpu"`` or ``"nvme"``; ``rounding`` of m, ``v_rounding`` and ``v_format``
            of sqrt(v); ``min_numel`` (elements) under which states stay fp32; ``master`` ``"split"`` or ``"bf16"``
            (docs/numerics.md "Master weights"): ``apply`` makes the parameters bf16, so each shard is 2 B/param,
            and FP4AdamW keeps
            the 16-bit residual that makes it the fp32 master exactly (split, 2 + 2 B/param) or rounds it
            stochastically (bf16); needs ``weights=None``. ``None``: torch AdamW. Default
            ``OptimizerStatesConfig()``.
        activations: tensors saved for backward, compressed and moved: an
            ``fp4offload.ActivationPolicy`` or its YAML keys (``ActivationsConfig``). Default None (off).
        monitor: every ``every`` optimizer steps, the optimizer from :func:`fp4offload.fsdp.optimizer` logs
            the ``fsdp.*`` counters of ``fp4offload._metrics`` (logger ``fp4offload.fsdp``, INFO). Default None.
        cpu_offload: keep parameter shards, gradients and optimizer states in host RAM
            (``CPUOffloadPolicy(pin_memory=True)``); the optimizer steps on the CPU. Default False.
        reshard_after_forward: free gathered weights after forward and gather again for backward
            (True, ZeRO-3 like, default) or keep them until backward (False). Booleans only: FSDP's
            resharding to a smaller world size cannot carry packed shards.
        block_classes: the modules given their own ``fully_shard`` (one all-gather each): module classes
            or their names (``(LlamaDecoderLayer,)`` or ``("LlamaDecoderLayer",)``, mixed if you like) or a
            callable ``module -> bool``, the way auto-wrap policies are written. Empty (default): the
            model's ``_no_split_modules`` (Hugging Face models), or a ConfigError if it has none. The
            root module is always sharded as well.
        param_dtype: dtype forward and backward compute in (what gathered weights are decoded to).
            Default torch.bfloat16.
        reduce_dtype: dtype gradients are reduce-scattered in. Default torch.float32.
        automatic: :meth:`auto`'s mark: ``apply`` chooses ``optimizer_states.master`` and ``.device``. Default
            False.
    """

    weights: WeightsConfig | None = None
    optimizer_states: OptimizerStatesConfig | None = field(default_factory=OptimizerStatesConfig)
    activations: Any = None
    monitor: MonitorConfig | None = None
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    block_classes: tuple[str | type, ...] | Callable[[torch.nn.Module], bool] = ()
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    automatic: bool = False

    @classmethod
    def auto(cls, **fields: Any) -> "Policy":
        """A policy whose optimizer master form and state placement ``apply`` chooses from the model, the mesh
        and the live readings (:mod:`fp4offload._fsdp.auto`; YAML ``auto: true``); ``fields`` set the rest
        (``block_classes``, ``cpu_offload``, ``activations``, the states' rounding, ...)."""
        return cls(automatic=True, **fields)

    def __post_init__(self) -> None:
        for key, cls in _SUB.items():
            object.__setattr__(self, key, _sub(key, getattr(self, key), cls))
        if self.weights is not None and self.weights.device != "cpu":
            raise ConfigError("weights.device", self.weights.device, "'cpu' under FSDP2",
                              "FSDP2 offloads to host RAM only; NVMe weights need DeepSpeed ZeRO-3 offload_param")
        for key in ("cpu_offload", "reshard_after_forward", "automatic"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(key, getattr(self, key), "True or False")
        check_fsdp_states(self.optimizer_states, self.cpu_offload)
        bc = self.block_classes
        if isinstance(bc, (str, type)):
            bc = (bc,)
        if not callable(bc):
            if isinstance(bc, (list, tuple)) and all(_is_block_class(c) for c in bc):
                bc = tuple(bc)
            else:
                raise ConfigError("block_classes", bc, "module classes or their names, or a callable module -> bool",
                                  "e.g. ['LlamaDecoderLayer'] or (LlamaDecoderLayer,)")
        object.__setattr__(self, "block_classes", bc)
        object.__setattr__(self, "param_dtype", _dtype("param_dtype", self.param_dtype))
        object.__setattr__(self, "reduce_dtype", _dtype("reduce_dtype", self.reduce_dtype))
        master = self.compact_master
        if master is not None:
            if self.packs_weights:
                raise ConfigError("optimizer_states.master", master, "'fp32' with weights.format 'nvfp4'",
                                  "NVFP4 gathers are encoded from an fp32 master shard; set weights to None (YAML: "
                                  "weights: null) for a compact master")
            if self.param_dtype != torch.bfloat16:
                raise ConfigError("param_dtype", self.param_dtype, f"torch.bfloat16 with optimizer_states.master="
                                  f"{master!r}", "the bf16 shards are the master's upper half")
        st = self.optimizer_states
        if st is not None and st.master_device == "nvme" and st.device != "nvme":
            raise ConfigError("optimizer_states.master_device", "nvme", f"'same' with device {st.device!r}",
                              "the residual goes into the NVMe state files: set optimizer_states.device 'nvme', or "
                              "master_device 'same'")

    def checked_paths(self) -> "Policy":
        """This policy with its NVMe folders (``optimizer_states.nvme_path``, ``activations.nvme_path``) checked on
        this machine and resolved: ``~`` and ``$VARS`` expanded, made absolute, created (one level, under an
        existing parent) when missing, refused with ConfigError when they are a file, a device, in /proc or /sys,
        unwritable, or under a missing parent (fp4offload._config.prepare_path). :func:`fp4offload.fsdp.apply`
        calls it before anything is sharded; building a Policy (or reading its YAML) does not look at the disk,
        since a policy may be written on one machine for another."""
        changes = {}
        for key in ("optimizer_states", "activations"):
            sub = getattr(self, key)
            path = getattr(sub, "nvme_path", None)
            if path is not None and getattr(sub, "device", None) == "nvme":
                resolved = str(prepare_path(f"{key}.nvme_path", path))
                if resolved != path:
                    changes[key] = dataclasses.replace(sub, nvme_path=resolved)
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def compact_master(self) -> str | None:
        """``"split"`` or ``"bf16"`` when the optimizer holds a compact master (the shards are then bf16)."""
        st = self.optimizer_states
        return st.master if st is not None and st.master != "fp32" else None

    @property
    def packs_weights(self) -> bool:
        """True when weight shards are all-gathered as NVFP4."""
        return self.weights is not None and self.weights.format == "nvfp4"

    @classmethod
    def from_config(cls, cfg: FsdpPolicyConfig, **runtime: Any) -> "Policy":
        """The policy of a parsed YAML document (``fp4offload._config.FsdpPolicyConfig``).

        ``runtime`` sets the fields YAML does not carry (``param_dtype``, ``reduce_dtype``, or a
        callable ``block_classes``).
        """
        if not isinstance(cfg, FsdpPolicyConfig):
            raise ConfigError("cfg", type(cfg).__name__, "an fp4offload._config.FsdpPolicyConfig")
        kw = {k: getattr(cfg, k) for k in ("weights", "optimizer_states", "activations", "monitor", "cpu_offload",
                                           "reshard_after_forward", "block_classes")}
        kw["automatic"] = cfg.auto
        kw.update(runtime)
        return cls(**kw)

    def to_config(self) -> FsdpPolicyConfig:
        """The YAML-able part of this policy (classes are written by name; a callable ``block_classes`` is a
        ConfigError)."""
        if callable(self.block_classes):
            raise ConfigError("block_classes", self.block_classes, "class names to be written as YAML")
        names = tuple(c if isinstance(c, str) else c.__name__ for c in self.block_classes)
        acts = self.activations
        if acts is not None and not isinstance(acts, ActivationsConfig):
            acts = ActivationsConfig(format=acts.format, device=acts.device, nvme_path=acts.nvme_path,
                                     min_numel=acts.min_numel, modules=acts.modules, exclude=acts.exclude)
        return FsdpPolicyConfig(weights=self.weights, optimizer_states=self.optimizer_states, activations=acts,
                                monitor=self.monitor, cpu_offload=self.cpu_offload,
                                reshard_after_forward=self.reshard_after_forward, block_classes=names,
                                auto=self.automatic)


def _is_block_class(c: Any) -> bool:
    return (isinstance(c, str) and bool(c)) or (isinstance(c, type) and issubclass(c, torch.nn.Module))


def policy_from_yaml(path: str | Path, **runtime: Any) -> Policy:
    """Read an FSDP policy YAML (the schema of ``fp4offload._config``) into a :class:`Policy`.

    Keys: ``weights``, ``optimizer_states``, ``activations``, ``monitor`` (sub-blocks; absent means
    off), ``cpu_offload``, ``reshard_after_forward``, ``block_classes``. ``runtime`` sets fields YAML
    does not carry (``param_dtype=torch.float32``, a callable ``block_classes``). Any bad value raises
    ConfigError naming its key path.
    """
    return Policy.from_config(load_fsdp_policy_yaml(path), **runtime)
