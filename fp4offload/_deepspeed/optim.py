"""The optimizer the DeepSpeed block hands to ZeRO: FP4AdamW, built from what the user asked for.

The user's request can arrive three ways, and each is turned into the same hyperparameters:

- the DeepSpeed config's ``"optimizer"`` section (``{"type": "AdamW", "params": {...}}``), when
  ``deepspeed.initialize`` gets no client optimizer (what the Hugging Face Trainer does when the
  config names one);
- an optimizer instance (``torch.optim.AdamW``/``Adam``, DeepSpeed's ``DeepSpeedCPUAdam`` or
  ``FusedAdam``, which Accelerate substitutes under ZeRO-Offload): its param groups and defaults
  are carried over, so per-group learning rates and weight-decay exclusions survive;
- a callable ``f(params) -> Optimizer``: called, then converted as above.

The optimizer states block (``fp4offload.optimizer_states``) decides where FP4AdamW keeps m and v.
Nothing here imports deepspeed at module import time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from fp4offload._announce import announce
from fp4offload._config import OptimizerStatesConfig, check_adam_hyperparameters
from fp4offload.errors import ConfigError

from . import internals as dsi

log = logging.getLogger("fp4offload.deepspeed")

ADAM_TYPES = ("adam", "adamw")
_HYPER = ("lr", "betas", "eps", "weight_decay")


@dataclass(frozen=True)
class AdamSettings:
    """Adam hyperparameters as the user asked for them.

    Attributes:
        lr: learning rate. Default 1e-3.
        betas: (beta1, beta2). Default (0.9, 0.999).
        eps: added to sqrt(v). Default 1e-8.
        weight_decay: decoupled (AdamW) weight decay. Default 0.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "betas": tuple(self.betas), "eps": self.eps, "weight_decay": self.weight_decay}


#: where FP4AdamW keeps its packed states: the block's ``optimizer_states`` as prepare_config resolved it (the
#: device and folder DeepSpeed's own offload settles), checked as the block is
StatePlacement = OptimizerStatesConfig


# ----------------------------------------------------------------------------------------------
# Which class builds the optimizer. FP4AdamW by default; tests of the plumbing may swap in a
# reference optimizer while FP4AdamW is not importable (set_optimizer_factory).

OptimizerFactory = Callable[[Any, AdamSettings, StatePlacement], torch.optim.Optimizer]
_factory: OptimizerFactory | None = None


def set_optimizer_factory(factory: OptimizerFactory | None) -> None:
    """Replace the function that builds the optimizer (None restores FP4AdamW). For tests and ablations."""
    global _factory
    _factory = factory


def fp4adamw_available() -> bool:
    """True when ``fp4offload.FP4AdamW`` imports."""
    try:
        from fp4offload._optim import FP4AdamW  # noqa: F401
    except Exception:
        return False
    return True


def _fp4adamw(params: Any, hp: AdamSettings, where: StatePlacement) -> torch.optim.Optimizer:
    if where.format == "fp32":  # the ablation: unpacked states, DeepSpeed's usual layout
        return torch.optim.AdamW(params, **hp.as_dict())
    try:
        from fp4offload._optim import FP4AdamW, StepOptions
        from fp4offload._optim.options import fp4adamw_kwargs
    except Exception as exc:  # pragma: no cover - depends on the tree's state
        raise ImportError(f"fp4offload.FP4AdamW does not import ({exc}); the optimizer_states block needs it") from exc
    return FP4AdamW(params, **hp.as_dict(), **fp4adamw_kwargs(where),
                    step_options=StepOptions(tensor_key=ds_tensor_key), _defer_master_check=where.master != "fp32")


def ds_tensor_key(t: Any) -> str | None:
    """FP4AdamW's ``tensor_key`` under DeepSpeed: ``ds<ds_id>``, or None (FP4AdamW falls back to positions).
    It names the tensor's NVMe state files and picks its stochastic-rounding stream.

    ZeRO-3 hands FP4AdamW one fp32 flat partition per sub-group, each alone in its param group for its step,
    and names it ``"<first ds_id>_<last ds_id>"`` of the parameters it holds (stage3's
    ``fp32_partitioned_groups_flat[i].ds_id``): unique per sub-group, and the same when DeepSpeed builds
    the partition again, whatever the order of the sub-groups. ZeRO-1/2 partitions carry no ds_id and never
    leave their param group, so FP4AdamW's own numbering is stable for them.
    """
    ds_id = dsi.read(t, "ds_id")
    return None if ds_id is None else f"ds{ds_id}"


def make_optimizer(params: Any, hp: AdamSettings, where: StatePlacement) -> torch.optim.Optimizer:
    """Build the optimizer for ``params`` (a list of tensors or of param-group dicts)."""
    return (_factory or _fp4adamw)(params, hp, where)


def is_fp4_optimizer(opt: Any) -> bool:
    """True for an FP4AdamW instance (already what the block wants)."""
    try:
        from fp4offload._optim import FP4AdamW
    except Exception:
        return False
    return isinstance(opt, FP4AdamW)


# ----------------------------------------------------------------------------------------------
# Reading the user's request


def settings_from_ds_section(section: Mapping[str, Any] | None) -> AdamSettings:
    """Adam settings from a DeepSpeed ``"optimizer"`` section; ConfigError for anything but Adam/AdamW."""
    if section is None:
        raise ConfigError("optimizer", None,
                          "an {\"type\": \"AdamW\", \"params\": {...}} section, or a client optimizer "
                          "passed to initialize",
                          "fp4offload.optimizer_states replaces Adam's states; it needs an Adam")
    if not isinstance(section, Mapping):
        raise ConfigError("optimizer", section, "a JSON object with 'type' and 'params'")
    typ = section.get("type")
    if not isinstance(typ, str) or typ.lower() not in ADAM_TYPES:
        raise ConfigError("optimizer.type", typ, "'Adam' or 'AdamW' when fp4offload.optimizer_states is set",
                          "FP4AdamW stores Adam's m and v in 4 bits; other optimizers keep their own states, so "
                          "remove fp4offload.optimizer_states or switch to AdamW")
    if section.get("params") is not None and not isinstance(section.get("params"), Mapping):
        raise ConfigError("optimizer.params", section.get("params"), "a JSON object of Adam's hyperparameters",
                          "e.g. {\"lr\": 1e-4, \"betas\": [0.9, 0.999], \"eps\": 1e-8, \"weight_decay\": 0.01}")
    params = dict(section.get("params") or {})
    # every number checked here, before anything is built: finite, in range, a pair of betas (ConfigError)
    checked = check_adam_hyperparameters("optimizer.params.", **{k: params[k] for k in _HYPER if k in params})
    # DeepSpeed's Adam is AdamW unless adam_w_mode is false (decoupled weight decay by default).
    adam_w = params.pop("adam_w_mode", True)
    if typ.lower() == "adam" and adam_w is False and checked.get("weight_decay", 0.0) != 0.0:
        raise ConfigError("optimizer.params.adam_w_mode", False, "true (decoupled weight decay)",
                          "FP4AdamW implements AdamW; L2-style weight decay would change the training run")
    out: dict[str, Any] = {}
    for k, v in params.items():
        if k in _HYPER:
            out[k] = checked[k]
        elif k in ("torch_adam", "fp32_optimizer_states", "bias_correction", "amsgrad", "foreach", "fused"):
            if k == "amsgrad" and v:
                raise ConfigError("optimizer.params.amsgrad", v, "false", "FP4AdamW has no AMSGrad variant")
            if k == "bias_correction" and v is False:
                raise ConfigError("optimizer.params.bias_correction", v, "true", "FP4AdamW always corrects bias")
        else:
            raise ConfigError(f"optimizer.params.{k}", v, "lr, betas, eps, weight_decay, adam_w_mode",
                              "FP4AdamW takes Adam's usual hyperparameters only")
    return AdamSettings(**out)


def _settings_from_group(group: Mapping[str, Any], defaults: AdamSettings, *, decoupled: bool, where: str) -> dict:
    hp = defaults.as_dict()
    for k in _HYPER:
        if k in group:
            v = group[k]
            if isinstance(v, torch.Tensor):
                v = v.item()
            hp[k] = tuple(float(b) for b in v) if k == "betas" else float(v)
    if not decoupled and hp["weight_decay"] != 0.0:
        raise ConfigError(f"{where}.weight_decay", hp["weight_decay"], "0 for torch.optim.Adam (L2 decay)",
                          "FP4AdamW implements decoupled weight decay: pass torch.optim.AdamW instead")
    if group.get("amsgrad"):
        raise ConfigError(f"{where}.amsgrad", True, "false", "FP4AdamW has no AMSGrad variant")
    return hp


def _is_decoupled(opt: torch.optim.Optimizer) -> bool:
    if isinstance(opt, torch.optim.AdamW):
        return True
    if type(opt) is torch.optim.Adam:
        return bool(opt.defaults.get("decoupled_weight_decay", False))
    # DeepSpeedCPUAdam / FusedAdam carry adamw_mode (or adam_w_mode)
    for name in ("adamw_mode", "adam_w_mode"):
        if hasattr(opt, name):
            return bool(getattr(opt, name))
    return True


def _is_adam_like(opt: torch.optim.Optimizer) -> bool:
    name = type(opt).__name__.lower()
    return isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) or name in (
        "deepspeedcpuadam", "fusedadam", "zenflowcpuadam")


def convert_optimizer(opt: torch.optim.Optimizer, where: StatePlacement) -> torch.optim.Optimizer:
    """An optimizer of the block's kind over ``opt``'s param groups and hyperparameters.

    ``opt`` must be an Adam (torch's Adam/AdamW, DeepSpeedCPUAdam, FusedAdam) that has not stepped yet;
    anything else raises ConfigError, since its states cannot become FP4AdamW's.
    """
    if is_fp4_optimizer(opt):
        return opt
    if not _is_adam_like(opt):
        raise ConfigError("optimizer", type(opt).__name__, "an Adam or AdamW (torch, DeepSpeedCPUAdam, FusedAdam) or "
                          "FP4AdamW", "fp4offload.optimizer_states replaces Adam's m and v; remove the block to use "
                          "another optimizer")
    if any(len(s) for s in opt.state.values()):
        raise ConfigError("optimizer", type(opt).__name__, "an optimizer that has not stepped yet",
                          "its states cannot be carried over; call initialize before training")
    decoupled = _is_decoupled(opt)
    defaults = AdamSettings(**_settings_from_group(opt.defaults, AdamSettings(), decoupled=decoupled,
                                                   where="optimizer.defaults"))
    groups = []
    for i, g in enumerate(opt.param_groups):
        hp = _settings_from_group(g, defaults, decoupled=decoupled, where=f"optimizer.param_groups[{i}]")
        extra = {k: v for k, v in g.items() if k in ("name",)}
        groups.append({"params": list(g["params"]), **hp, **extra})
    new = make_optimizer(groups, defaults, where)
    announce(f"replaced the client {type(opt).__name__} with {type(new).__name__} over {len(groups)} param "
             f"group(s): {describe_states(where)}")
    return new


def describe_states(where: StatePlacement) -> str:
    """What the block keeps of Adam's states, where, and at what cost, in one phrase."""
    from fp4offload._memory.sizes import STATE_BYTES as _STATE_BYTES, state_bytes  # the byte sizes' one home

    if where.format != "nvfp4":
        return f"fp32 m and v ({_STATE_BYTES['fp32']:.0f} B/param)"
    place = {"same": "beside ZeRO's partition", "cpu": "in host RAM",
             "nvme": f"in NVMe files under {where.nvme_path}"}.get(where.device, where.device)
    master = "" if where.master == "fp32" else f", master {where.master}"
    cost = state_bytes("nvfp4", where.v_format)
    return (f"m in NVFP4, sqrt(v) on {where.v_format}, {place} ({cost:.2f} B/param instead of "
            f"{_STATE_BYTES['fp32']:.0f}){master}")


def rebind_scheduler(scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Point an LR scheduler built on ``old`` at ``new`` (same group order, so base_lrs still apply)."""
    if scheduler is None or callable(scheduler) and not hasattr(scheduler, "optimizer"):
        return
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
        for g_old, g_new in zip(old.param_groups, new.param_groups):
            for k in ("initial_lr", "lr"):
                if k in g_old:
                    g_new[k] = g_old[k]

