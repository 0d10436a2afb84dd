"""The way back: a live ``torch.optim.AdamW`` over an FP4AdamW's parameters, its states decoded once.

:func:`to_torch_adamw` is the mirror of :func:`fp4offload._optim.convert.load_param_states` (torch AdamW's states
into an FP4AdamW): it reads each parameter's state from whatever tier holds it (GPU, host RAM, NVMe files),
decodes packed m and sqrt(v) to fp32, and hands them to a new torch AdamW with the same groups and
hyperparameters, one parameter at a time (no state dict of either optimizer is built). torch AdamW then steps
from exactly the moments FP4AdamW would have stepped from.

A master weight is never dropped silently. Where FP4AdamW keeps one beside a bf16 parameter (``master="fp32"``
or ``"split"``, whose bf16 half and 16-bit residual are the fp32 master exactly), the caller chooses:
``fp32_params=True`` makes each such parameter the fp32 master itself (torch AdamW then continues the fp32
run), ``fp32_params=False`` keeps the bf16 parameter and lets the master's low bits go.

Over a sharded model (FSDP2's DTensors) torch's own API already gives torch AdamW's form
(``get_optimizer_state_dict``); that case is refused here with that advice.

:func:`adamw_state_dict` does the same to a saved state dict, without the model (a checkpoint's ``optimizer.pt``):
each entry is verified (checksum, fingerprint) and decoded to fp32 ``exp_avg`` / ``exp_avg_sq`` of the shape its
fingerprint records, and the groups get torch AdamW's keys, so ``torch.optim.AdamW.load_state_dict`` takes it.
``fp4offload export-adamw IN OUT`` runs it on a file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError
from .convert import FINGERPRINT, _master_form, _saved_master, check_entry, saved_entry
from .shards import _as_torch_adamw_group
from .state import entry_moments, step_of

if TYPE_CHECKING:
    from .adamw import FP4AdamW

__all__ = ["to_torch_adamw", "adamw_state_dict"]

#: The hyperparameters torch AdamW shares with FP4AdamW; the others (min_numel, v_format, ...) are FP4AdamW's own.
SHARED = ("lr", "betas", "eps", "weight_decay", "maximize")


def _mastered(opt: FP4AdamW) -> list[torch.Tensor]:
    """The parameters whose fp32 master FP4AdamW keeps apart from them (a bf16 parameter with a master)."""
    if opt.master not in ("fp32", "split"):
        return []
    return [p for g in opt.param_groups for p in g["params"] if p.dtype != torch.float32 and opt.state.get(p)]


def to_torch_adamw(opt: FP4AdamW, *, fp32_params: bool | None = None, **torch_options) -> torch.optim.AdamW:
    """A ``torch.optim.AdamW`` over `opt`'s parameters and groups (lr, betas, eps, weight_decay, maximize), holding
    each parameter's step count and its m and v decoded to the parameter's dtype: stepping it continues the run
    from exactly the moments FP4AdamW holds. `opt` is left as it was; call ``opt.close()`` when done with it
    (that frees its states and removes its NVMe folder).

    ``fp32_params``: needed only when `opt` keeps an fp32 master beside a bf16 parameter (``master="fp32"`` or
    ``"split"``). True: each such parameter becomes its fp32 master (``p.data`` is replaced, its gradient
    cleared; split's is the fp32 run's weight bit for bit). False: the bf16 parameters stay, and the masters' low
    bits are dropped. ``torch_options``: torch AdamW's own keywords (``foreach``, ``fused``, ...).

    Costs 8 B per parameter of fp32 states (for fp32 parameters; 4 for bf16 ones), as torch AdamW does."""
    from .adamw import FP4AdamW

    if not isinstance(opt, FP4AdamW):
        raise ConfigError("to_torch_adamw(opt)", type(opt).__name__, "an fp4offload.FP4AdamW")
    if opt.local_shards is not None:
        raise ConfigError("to_torch_adamw(opt)", "an FP4AdamW over a sharded model (DTensor parameters)",
                          "an FP4AdamW over plain tensors", "over FSDP2, torch's get_optimizer_state_dict(model, "
                          "opt) is already torch AdamW's form: set_optimizer_state_dict loads it into torch AdamW")
    clash = sorted(set(torch_options) & {*SHARED, "params", "amsgrad"})
    if clash:
        raise ConfigError("to_torch_adamw(**torch_options)", clash, "torch AdamW's own options (foreach, fused, ...)",
                          "the shared hyperparameters come from the FP4AdamW's groups: change them there")
    mastered = _mastered(opt)
    if mastered and fp32_params is None:
        raise ConfigError("to_torch_adamw(fp32_params)", None, "True or False",
                          f"this FP4AdamW keeps an fp32 master (master={opt.master!r}) beside {len(mastered)} "
                          f"{mastered[0].dtype} parameter(s): fp32_params=True makes each parameter its fp32 "
                          "master (the run continues as in fp32), fp32_params=False keeps the bf16 parameters and "
                          "drops the masters' low bits")
    opt.placement.sync()  # the NVMe tier's pending writes
    groups = [{"params": list(g["params"]), **{k: g[k] for k in SHARED}} for g in opt.param_groups]
    moments: dict[int, tuple] = {}
    with torch.no_grad():
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) in moments:
                    continue
                entry = saved_entry(opt, p)
                if entry is None:  # never stepped: torch AdamW starts it fresh too
                    moments[id(p)] = None
                    continue
                master = _saved_master(p, entry) if fp32_params and p.dtype != torch.float32 else None
                m, v = entry_moments(entry, p.numel())
                moments[id(p)] = (step_of(entry["step"]), m, v, master)
        for _, p, _ in opt.numbered_params():  # every state read: only now does a parameter become its master
            got = moments.get(id(p))
            if got is not None and got[3] is not None:
                p.data = got[3].view(p.shape).to(p.device)
                p.grad = None
    new = torch.optim.AdamW(groups, amsgrad=False, **torch_options)
    for g in new.param_groups:
        for p in g["params"]:
            got = moments.get(id(p))
            if got is None:
                continue
            step, m, v, _ = got
            new.state[p] = {"step": torch.tensor(float(step), dtype=torch.float32),
                            "exp_avg": m.view(p.shape).to(p.device, p.dtype),
                            "exp_avg_sq": v.view(p.shape).to(p.device, p.dtype)}
    return new


def adamw_state_dict(state_dict: dict, *, drop_masters: bool = False) -> dict:
    """torch AdamW's state dict from FP4AdamW's (``opt.state_dict()`` as saved, any tier and ``v_format``), without
    the model: per parameter ``step`` and fp32 ``exp_avg`` / ``exp_avg_sq`` shaped as its fingerprint records, the
    groups with torch AdamW's keys (FP4AdamW's own options dropped). Every entry is checked first (CorruptionError
    for a changed byte). An entry holding a master weight (``master="fp32"`` or ``"split"`` beside bf16
    parameters) is a ConfigError unless ``drop_masters=True``: the master lives outside torch AdamW's state, and
    split's needs the model's bf16 weights; :func:`to_torch_adamw` over the live model keeps it."""
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) \
            or not isinstance(state_dict.get("param_groups"), list):
        raise ConfigError("state_dict", type(state_dict).__name__, "an optimizer state dict (state, param_groups)",
                          "pass what FP4AdamW.state_dict() returned (a Trainer checkpoint's optimizer.pt)")
    state: dict = {}
    for key, entry in state_dict["state"].items():
        if not isinstance(entry, dict):  # optimizer.state's keys that are not parameters: carried as they are
            state[key] = entry
            continue
        where = f"state_dict['state'][{key!r}]"
        fp = entry.get(FINGERPRINT)
        if "exp_avg" in entry:
            shape = tuple(entry["exp_avg"].shape)
        elif isinstance(fp, dict) and "shape" in fp:
            shape = tuple(int(d) for d in fp["shape"])
        else:
            raise ConfigError(where, "packed states without a fingerprint (saved before fingerprints existed)",
                              "an entry that records its parameter's shape",
                              "load it into an FP4AdamW over the model and call fp4offload.to_torch_adamw(opt)")
        check_entry(entry, key, torch.empty(shape, device="meta"))
        if _master_form(entry) != "none" and not drop_masters:
            raise ConfigError(f"{where} ({_master_form(entry)} master)", "a master weight beside the parameter",
                              "drop_masters=True (torch AdamW keeps none: the bf16 parameters go on alone)",
                              "or fp4offload.to_torch_adamw(opt, fp32_params=True) over the live model keeps it")
        m, v = entry_moments(entry, int(torch.Size(shape).numel()))
        state[key] = {"step": torch.tensor(float(step_of(entry["step"])), dtype=torch.float32),
                      "exp_avg": m.reshape(shape).clone(), "exp_avg_sq": v.reshape(shape).clone()}
    return {"state": state, "param_groups": [_as_torch_adamw_group(g) for g in state_dict["param_groups"]]}
