"""The argument checks of FP4AdamW's constructor (and of its NVMe store's I/O engine).

Each bad value raises ConfigError naming the argument, the value and what is allowed. The allowed values
are the project's vocabulary in fp4offload._config (OPTIMIZER_DEVICES, ROUNDINGS, V_FORMATS, STEP_BACKENDS,
WORKING_COPIES, NVME_IO_ENGINES, MASTER_FORMS), and each error's text is built from those tuples, so it always lists
exactly what the constructor accepts.
"""

from __future__ import annotations

from typing import Any

import torch

from .._config import (MASTER_FORMS, OPTIMIZER_DEVICES, ROUNDINGS, V_FORMATS, check_adam_hyperparameters,
                      prepare_path)
from .._config.checks import check_bool, check_choice, check_int
from .._dtensor import is_dtensor
from ..errors import ConfigError
from . import fused


#: more I/O threads than this only queue on the disk (and each holds a staging buffer)
NVME_THREADS_MAX = 256


def _scalar(key: str, value: Any) -> Any:
    """A one-element tensor's number (torch optimizers take a tensor lr); other values as they are."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise ConfigError(key, f"tensor(shape={tuple(value.shape)}, dtype={value.dtype})",
                              "a number, or a real tensor of one element", "one value for the whole group")
        return value.item()
    return value


def check_hyperparameters(prefix: str = "", defaults: dict | None = None, **hp: Any) -> None:
    """The per-group options (GROUP_OPTIONS) present in ``hp``: Adam's numbers by
    fp4offload._config.check_adam_hyperparameters (finite, in range, betas a pair; lr may be a one-element tensor),
    maximize a bool, m_rounding, v_rounding and v_format choices, min_numel an integer >= 1, seed an integer >= 0.
    Errors name ``prefix + key`` (``lr``, ``param_groups[1].betas[0]``)."""
    adam = {k: _scalar(prefix + k, hp[k]) for k in ("lr", "betas", "eps", "weight_decay") if k in hp}
    check_adam_hyperparameters(prefix, **adam, defaults=defaults)
    if "maximize" in hp:
        check_bool(prefix + "maximize", hp["maximize"])
    if "m_rounding" in hp:
        check_choice(prefix + "m_rounding", hp["m_rounding"], ROUNDINGS)
    if "v_rounding" in hp:
        check_choice(prefix + "v_rounding", hp["v_rounding"], ROUNDINGS)
    if "v_format" in hp:
        check_choice(prefix + "v_format", hp["v_format"], V_FORMATS)
    if "min_numel" in hp:
        check_int(prefix + "min_numel", hp["min_numel"], minimum=1)
    if "seed" in hp:
        check_int(prefix + "seed", hp["seed"], minimum=0)


#: the options a param group may set (FP4AdamW's docstring, "Per-group options"; seed is a default too)
GROUP_OPTIONS = ("lr", "betas", "eps", "weight_decay", "maximize", "m_rounding", "v_rounding", "v_format", "min_numel",
                 "seed")


def check_param_group(group: Any, index: int, defaults: dict | None = None) -> None:
    """A param group's own options (those it sets, before torch fills in the defaults), checked before the group
    is added: ConfigError naming ``param_groups[index].key``, and the optimizer keeps its groups as they were."""
    if isinstance(group, dict):
        check_hyperparameters(f"param_groups[{index}].", defaults,
                              **{k: group[k] for k in GROUP_OPTIONS if k in group})


def check_not_sharded(group: Any) -> None:
    """DTensor parameters added to an optimizer over plain ones (``add_param_group``): refused with the way that
    works, rather than failing at the first step on the sharded wrapper's storage. (``FP4AdamW(params)`` over
    DTensors at construction steps their local shards.)"""
    params = group.get("params") if isinstance(group, dict) else None
    if params is not None and not isinstance(params, (torch.Tensor, list, tuple)):
        params = group["params"] = list(params)  # a generator is read once: keep what was read for torch
    params = [params] if isinstance(params, torch.Tensor) else list(params or ())
    for i, p in enumerate(params):
        if is_dtensor(p):
            raise ConfigError(f"params[{i}]", f"a DTensor of shape {tuple(p.shape)}", "plain tensors",
                              "an optimizer over plain tensors cannot take a sharded model's parameters: build "
                              "FP4AdamW(model.parameters(), ...) over all of them at once, which steps each rank's "
                              "local shards (or fp4offload.fsdp.optimizer(model, policy))")


def check_arguments(*, lr, betas, eps, weight_decay, maximize, master, state_device, nvme_path, state_format, nvme,
                    step_options):
    """FP4AdamW's hyperparameters and options (see its docstring); raises ConfigError for the first bad one.

    Every number is checked where it enters: finite, in range, of the right type (bools are not numbers) and
    arity (betas a pair); the option groups' fields were checked when they were made (options.py), here their
    types and the rules that join them. The NVMe folder is checked last, by fp4offload._config.prepare_path
    (expanded, resolved, created only under an existing parent). Returns ``nvme_path``: the resolved folder for
    ``state_device="nvme"``, else as given (unused)."""
    from .options import NvmeOptions, StateFormat, StepOptions

    check_hyperparameters("", lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize)
    for key, value, cls in (("state_format", state_format, StateFormat), ("nvme", nvme, NvmeOptions),
                            ("step_options", step_options, StepOptions)):
        if not isinstance(value, cls):
            raise ConfigError(key, value, f"a fp4offload.{cls.__name__}", f"e.g. {key}={cls.__name__}()")
    check_choice("state_device", state_device, OPTIMIZER_DEVICES)
    if state_device == "nvme" and nvme_path is None:
        raise ConfigError("nvme_path", None, "a folder on a local disk for state_device='nvme'")
    check_choice("master", master, MASTER_FORMS)
    if nvme.master_device == "nvme" and (master, state_device) != ("split", "nvme"):
        raise ConfigError("nvme.master_device", nvme.master_device, f"'same' with master={master!r} and "
                          f"state_device={state_device!r}", "only split's residual goes to the NVMe files, beside "
                          "the states: use master='split' and state_device='nvme', or master_device='same'")
    if master != "fp32" and step_options.working_copy is not None:
        raise ConfigError("step_options.working_copy", step_options.working_copy, f"None with master={master!r}",
                          "the bf16 parameter is the working copy; use master='fp32' for an NVFP4 copy")
    if step_options.backend == "fused" and fused.cpu_extension() is None and not torch.cuda.is_available():
        why = "; ".join(v for k, v in fused.failures().items() if k.startswith("cpu"))
        raise ConfigError("step_options.backend", step_options.backend, "'auto' or 'reference' on this machine",
                          f"the fused CPU step does not build: {why}")
    if state_device == "nvme":
        return prepare_path("nvme_path", nvme_path)
    return nvme_path


def check_master(master: str, state_device: str, p, compute_device) -> None:
    """A compact master (``master`` "split" or "bf16") needs a bf16 parameter, contiguous, stepped where it
    lives (`compute_device`: where the step of `p` runs); ConfigError otherwise."""
    if master == "fp32":
        return
    why = None
    if p.dtype != torch.bfloat16:
        why = (f"a {p.dtype} parameter", "cast the model to bf16 first (model.to(torch.bfloat16)), or use "
               "master='fp32'")
    elif not p.is_contiguous():
        why = ("a non-contiguous parameter", "make it contiguous, or use master='fp32'")
    elif compute_device != p.device:
        why = (f"a {p.device.type} parameter with state_device={state_device!r}",
               "keep the states beside the parameter (state_device='same'), or use master='fp32'")
    if why is not None:
        raise ConfigError("master", master, "bf16 parameters the step can update where they live", why[1]
                          + f" (got {why[0]} of shape {tuple(p.shape)})")


#: FP4AdamW's option groups: group keyword -> (its class, {flat keyword the constructor once took: field})
_GROUPS = {"state_format": ("StateFormat", {k: k for k in ("m_rounding", "v_rounding", "v_format", "min_numel",
                                                            "seed")}),
           "nvme": ("NvmeOptions", {"nvme_threads": "threads", "nvme_reserve_bytes": "reserve_bytes",
                                    "nvme_io": "io", "nvme_keep": "keep", "master_device": "master_device"}),
           "step_options": ("StepOptions", {k: k for k in ("backend", "working_copy", "skip_nonfinite",
                                                            "metrics_every", "tensor_key")})}
#: FP4AdamW's keywords that live in an option group: keyword -> (group keyword, its class, the field)
GROUPED = {flat: (group, cls, field) for group, (cls, fields) in _GROUPS.items() for flat, field in fields.items()}


def check_extra_keywords(extra: dict) -> None:
    """The keywords FP4AdamW's constructor takes beyond its own: torch AdamW's options (UNSUPPORTED, through
    check_unsupported); an option of a group, given alone, is a ConfigError naming the group to put it in;
    any other is Python's TypeError for an unexpected keyword."""
    for key, value in extra.items():
        if key in GROUPED:
            group, cls, field = GROUPED[key]
            raise ConfigError(key, value, f"{group}={cls}({field}=...)", f"FP4AdamW takes {key} inside its "
                              f"{group} group (fp4offload.{cls})")
        if key not in UNSUPPORTED:
            raise TypeError(f"FP4AdamW.__init__() got an unexpected keyword argument {key!r}")
    check_unsupported(extra)


#: torch.optim.AdamW options FP4AdamW does not have, and why (the value each may take: off)
UNSUPPORTED = {
    "amsgrad": "AMSGrad keeps max(v) as an extra full-size fp32 state, which FP4AdamW does not store",
    "foreach": "FP4AdamW has one implementation per device (backend= picks the fused or the reference step)",
    "fused": "FP4AdamW's own fused C++/CUDA step is chosen with backend='fused' (or 'auto', the default)",
    "capturable": "the step reads its scalars on the host and cannot be captured in a CUDA graph",
    "differentiable": "the 4-bit states are not differentiable through the step",
}


def check_unsupported(flags: dict) -> None:
    """torch AdamW's options FP4AdamW lacks (UNSUPPORTED): accepted when off (False, or None for foreach and
    fused), ConfigError naming the option and the reason when on. Used for constructor arguments, param groups
    and loaded state dicts' groups."""
    for key, value in flags.items():
        if key in UNSUPPORTED and value not in (False, None, 0):
            raise ConfigError(key, value, "False (FP4AdamW has no such option)", UNSUPPORTED[key])
