"""Conversions of one parameter's FP4AdamW state to and from its saved forms.

Owns: the optimizer's state dict (:func:`state_dict_of`, :func:`load_state_dict_into`: the groups, the ids and
the checks of torch's form, around the entries; the state-dict hooks are the optimizer's), the state-dict entry
of a parameter (:func:`saved_entry`, the tier-independent form of state.py), loading
an entry (:func:`load_entry`: FP4AdamW's from any tier and v format, or torch AdamW's ``exp_avg`` /
``exp_avg_sq``, quantized once), the change of a group's ``v_format`` (:func:`change_v_format`), and
:func:`load_param_states`, which takes the per-parameter states of a live torch AdamW (or any Adam keeping
``step``, ``exp_avg``, ``exp_avg_sq``: DeepSpeedCPUAdam, FusedAdam) into an FP4AdamW over the same tensors,
one parameter at a time, without building a state dict of either optimizer.

Saved entries are sealed (:func:`seal_entry`): each carries a ``fingerprint`` (the parameter's position in the
state dict, its shape, numel and master form) and a ``checksum`` (CRC-32 over every value, in a form that a cast
of the byte tensors to a floating dtype does not change). :func:`check_entry` verifies both before anything is
loaded: a changed byte is a CorruptionError, an entry under another parameter's key (swapped, re-keyed) or of
another shape a ConfigError. Entries without them (torch AdamW's, or saved before they existed) load unverified.
"""

from __future__ import annotations

import copy
import json
import zlib
from collections import defaultdict
from typing import TYPE_CHECKING, Mapping

import torch

from .._config.grids import LEGACY_V_FORMAT
from ..errors import ConfigError, CorruptionError
from . import master as MW
from . import reference_step as R
from .checks import UNSUPPORTED
from .state import PACKED_KEYS, as_u8, decode_state, encode_state, entry_moments, packed_from_entry, step_of

if TYPE_CHECKING:
    from .adamw import FP4AdamW


def saved_entry(opt: FP4AdamW, p) -> dict | None:
    """p's state-dict entry: packed states as uint8 CPU tensors, fp32 ones as fp32 (None: p has no state).
    Call ``opt.placement.sync()`` first on the NVMe tier."""
    st = opt.state.get(p)
    if not st or "step" not in st:
        return None
    e = {"step": torch.tensor(float(step_of(st["step"])))}
    if "master" in st:
        e["master"] = st["master"].detach().cpu().clone()
    packed = "exp_avg" not in st
    m, v, res = opt.placement.states_and_residual(st, p) if packed else (None, None, None)
    if res is None and "master_lo" in st:
        res = st["master_lo"], st["master_odd"]
    if res is not None:  # split: the residual and odd positions as bytes (a cast to a float dtype loses nothing)
        e["master_lo"] = res[0].detach().cpu().contiguous().view(torch.uint8).clone()
        e["master_odd"] = res[1].detach().cpu().contiguous().view(torch.uint8).clone()
    if not packed:
        e["exp_avg"] = st["exp_avg"].detach().cpu().clone()
        e["exp_avg_sq"] = st["exp_avg_sq"].detach().cpu().clone()
    else:
        e["v_format"] = st["v_format"]
        for k, t in zip(PACKED_KEYS, (*m, *v)):
            e[k] = t.detach().cpu().clone()
    return e


CHECKSUM, FINGERPRINT = "checksum", "fingerprint"
_BYTE_KEYS = (*PACKED_KEYS, "master_lo", "master_odd")  # whole bytes (a cast to a float dtype keeps them)


def _master_form(entry: Mapping) -> str:
    return "fp32" if "master" in entry else "split" if "master_lo" in entry else "none"


def entry_checksum(entry: Mapping) -> int:
    """CRC-32 of a state-dict entry: every key but ``checksum`` in sorted order with its value (byte tensors as
    uint8, other tensors as fp32, ``step`` as its integer, the fingerprint as sorted JSON)."""
    crc = 0
    for k in sorted((k for k in entry if k != CHECKSUM), key=str):
        v = entry[k]
        crc = zlib.crc32(str(k).encode(), crc)
        if torch.is_tensor(v) and k in _BYTE_KEYS:
            data = as_u8(v, str(k), v.numel()).numpy()
        elif k == "step":
            data = str(step_of(v)).encode()
        elif torch.is_tensor(v):
            data = v.detach().reshape(-1).cpu().to(torch.float32).contiguous().view(torch.uint8).numpy()
        elif isinstance(v, (dict, list, tuple)):
            data = json.dumps(v, sort_keys=True, default=str).encode()
        else:
            data = repr(v).encode()
        crc = zlib.crc32(data, crc)
    return crc


def seal_entry(entry: dict, index: int, p) -> dict:
    """Add the fingerprint of `p` (saved as state-dict key `index`) and the checksum to a saved entry."""
    entry[FINGERPRINT] = {"index": int(index), "shape": [int(d) for d in p.shape], "numel": int(p.numel()),
                          "master": _master_form(entry)}
    entry[CHECKSUM] = entry_checksum(entry)
    return entry


def _sizes_ok(entry: Mapping, p, where: str) -> None:
    n = p.numel()
    c, s, t = R.packed_sizes(n)
    v_format = entry.get("v_format", LEGACY_V_FORMAT)
    cv = R.packed_sizes(n, R.v_bits(v_format))[0] if v_format in R.V_GRID else c
    want = dict(zip(PACKED_KEYS, (c, s, t, cv, s, t)), exp_avg=n, exp_avg_sq=n, master=n, master_lo=2 * n)
    if "m_codes" not in entry and "exp_avg" not in entry:
        raise ConfigError(where, f"an entry with keys {sorted(map(str, entry))}",
                          "FP4AdamW's packed states (m_codes, ...) or Adam's step, exp_avg and exp_avg_sq")
    for k, size in want.items():
        v = entry.get(k)
        if k in PACKED_KEYS and "m_codes" in entry and not torch.is_tensor(v):
            raise ConfigError(f"{where}[{k!r}]", type(v).__name__, "a tensor", "the state dict is damaged")
        if torch.is_tensor(v) and v.numel() != size:
            raise ConfigError(f"{where}[{k!r}]", f"a tensor of {v.numel()} elements",
                              f"{size} elements for a parameter of shape {tuple(p.shape)}",
                              "the state dict belongs to another model or chunk size")


def check_entry(entry, key, p) -> None:
    """Verify a saved entry before it is loaded into `p` (the parameter its key `key` maps to): the checksum
    (CorruptionError), the fingerprint (ConfigError naming the key) and the sizes. Changes nothing."""
    where = f"state_dict['state'][{key!r}]"
    if not isinstance(entry, Mapping):
        raise ConfigError(where, type(entry).__name__, "a dict of the parameter's states")
    if CHECKSUM in entry:
        want = entry[CHECKSUM]
        try:
            got = entry_checksum(entry)
        except (ConfigError, TypeError, ValueError, RuntimeError):
            got = None
        if not isinstance(want, int) or isinstance(want, bool) or got != want:
            raise CorruptionError(where, "checksum mismatch of the saved optimizer state",
                                  expected=f"{want:#010x}" if isinstance(want, int) else repr(want),
                                  found="unreadable values" if got is None else f"{got:#010x}")
    fp = entry.get(FINGERPRINT)
    if fp is not None:
        if not isinstance(fp, Mapping) or not {"index", "shape", "numel"} <= set(fp):
            raise ConfigError(f"{where}['fingerprint']", fp, "a dict with index, shape, numel and master",
                              "the state dict is damaged")
        if fp["index"] != int(key):
            raise ConfigError(where, f"the entry saved for parameter {fp['index']} (shape {tuple(fp['shape'])})",
                              f"the entry of parameter {int(key)} (shape {tuple(p.shape)})",
                              "entries were swapped or re-keyed: load the state dict as it was saved")
        if list(fp["shape"]) != list(p.shape) or fp["numel"] != p.numel():
            raise ConfigError(where, f"an entry for a parameter of shape {tuple(fp['shape'])}",
                              f"one for shape {tuple(p.shape)}", "the state dict belongs to another model")
        if fp.get("master", _master_form(entry)) != _master_form(entry):
            raise ConfigError(where, f"an entry holding master form {_master_form(entry)!r}",
                              f"the form its fingerprint records ({fp.get('master')!r})", "the state dict is damaged")
    _sizes_ok(entry, p, where)


def load_entry(opt: FP4AdamW, group: dict, p, entry: Mapping) -> None:
    """Replace p's state by a saved entry: FP4AdamW's (packed in any v format, or fp32) or torch AdamW's
    (``step``, ``exp_avg``, ``exp_avg_sq``), quantized to the group's ``v_format`` when p is packed here."""
    n = p.numel()
    opt.state.pop(p, None)
    packed_saved = "m_codes" in entry
    packed = opt.is_packed(group, p)
    if packed:
        want = group["v_format"]
        if packed_saved:
            m, v = packed_from_entry(entry, n)
            have = entry.get("v_format", LEGACY_V_FORMAT)
            if have != want:
                mf, vf = decode_state(m, v, n, have)
                _, v = encode_state(mf, vf, want)
        else:  # fp32 states (torch AdamW, or a smaller min_numel): quantize once
            m, v = encode_state(_flat_cpu(entry["exp_avg"]), _flat_cpu(entry["exp_avg_sq"]), want)
    else:
        m, v = entry_moments(entry, n)
    # split's residual before the state is made: the NVMe tier writes it into the files with m and v
    res = _split_start(p, entry) if opt.master == "split" else None
    if packed:
        st = opt.fresh_state(group, p, m, v, res)
    else:
        st = opt.fresh_state(group, p, res=res)
        st["exp_avg"].copy_(m.reshape(p.shape))
        st["exp_avg_sq"].copy_(v.reshape(p.shape))
    st["step"] = torch.tensor(float(step_of(entry.get("step", 0))))
    if opt.master != "split":
        _load_master(p, st, entry)


def _saved_master(p, entry: Mapping) -> torch.Tensor | None:
    """The fp32 master a saved entry holds (an fp32 one, or split's rebuilt from p's current bf16 values)."""
    if "master" in entry:
        return entry["master"].detach().reshape(-1).to(torch.float32).cpu()
    if "master_lo" in entry:
        lo, odd = _split_parts(p, entry)
        return MW.join(p.detach().reshape(-1).cpu(), lo, odd)
    return None


def _split_parts(p, entry: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
    n = p.numel()
    lo = as_u8(entry["master_lo"], "master_lo", 2 * n).view(torch.int16)
    raw = entry.get("master_odd", torch.zeros(0, dtype=torch.uint8)).detach().reshape(-1)
    if raw.numel() % 8:
        raise ConfigError("state_dict['state'][...]['master_odd']", f"{raw.numel()} bytes", "8 bytes per position",
                          "the state dict is damaged")
    odd = as_u8(raw, "master_odd", raw.numel()).view(torch.int64)
    if odd.numel() and not (int(odd.min()) >= 0 and int(odd.max()) < n and bool((odd[1:] > odd[:-1]).all())):
        raise ConfigError("state_dict['state'][...]['master_odd']", "positions out of order or outside the parameter",
                          f"increasing positions in [0, {n})", "the state dict belongs to another model")
    return lo, odd


def _split_start(p, entry: Mapping) -> tuple[torch.Tensor, torch.Tensor] | None:
    """split's (lo, odd) for p from a saved entry: its own, or those of the fp32 master it holds (p then takes
    that master's rounding); None (zeros) for torch AdamW's or a bf16 master's: the parameter is the master."""
    if "master_lo" in entry:
        return _split_parts(p, entry)
    saved = _saved_master(p, entry)
    if saved is None:
        return None
    h, lo, odd = MW.split(saved)
    p.data.copy_(h.view(p.shape))
    return lo, odd


def _load_master(p, st: dict, entry: Mapping) -> None:
    """The master of a saved entry into p's fresh state, for an fp32 or bf16 master (split: _split_start)."""
    saved = _saved_master(p, entry)
    if saved is None:  # torch AdamW, or a bf16 master: the parameter is the master
        return
    if "master" in st:
        st["master"].copy_(saved)
    else:  # the saved run kept a master, this one does not: it is the better weight (rounded to nearest)
        p.data.copy_(saved.reshape(p.shape).to(p.dtype))


def _flat_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).cpu()


def change_v_format(opt: FP4AdamW, group: dict, p) -> None:
    """Re-encode p's packed states in the group's (changed) ``v_format``, once."""
    opt.placement.sync()
    load_entry(opt, group, p, saved_entry(opt, p))


def load_param_states(opt: FP4AdamW, states: Mapping) -> int:
    """Load per-parameter states into `opt`, one parameter at a time; returns how many were loaded.

    `states` maps a parameter tensor of `opt` to its state: torch AdamW's (``torch_adamw.state``: ``step``,
    ``exp_avg``, ``exp_avg_sq``; DeepSpeedCPUAdam and FusedAdam keep the same keys), quantized once, or an
    FP4AdamW state-dict entry. Tensors without state (empty dicts) are skipped; a tensor `opt` does not
    step raises ConfigError. Neither optimizer's state dict is built.
    """
    group_of = {id(p): group for group, p, _ in opt.numbered_params()}
    loaded = 0
    with torch.no_grad():
        for t, entry in states.items():
            if not entry:
                continue
            if id(t) not in group_of:
                raise ConfigError("states", f"a state for a tensor of shape {tuple(t.shape)}",
                                  "states of tensors in this optimizer's param_groups")
            if "m_codes" not in entry and "exp_avg" not in entry:
                raise ConfigError("states", f"an entry with keys {sorted(entry)}",
                                  "Adam states (step, exp_avg, exp_avg_sq) or an FP4AdamW state-dict entry")
            load_entry(opt, group_of[id(t)], t, entry)
            loaded += 1
    return loaded


# ---- the whole state dict -----------------------------------------------------------------------------------


def state_dict_of(opt: FP4AdamW) -> dict:
    """`opt`'s state dict, without its hooks (FP4AdamW.state_dict runs them): ``param_groups`` with parameter ids
    numbered as torch numbers them, ``state`` mapping an id to its sealed entry, and the keys of
    ``optimizer.state`` that are not tensors carried over as they are."""
    ids: dict[int, int] = {}
    start, groups = 0, []
    for g in opt.param_groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        ids.update({id(p): i for i, p in enumerate(g["params"], start) if id(p) not in ids})
        packed["params"] = [ids[id(p)] for p in g["params"]]
        start += len(packed["params"])
        groups.append(packed)
    opt.placement.sync()
    state, seen = {}, set()
    for g in opt.param_groups:
        for p in g["params"]:
            if id(p) in seen:
                continue
            seen.add(id(p))
            e = saved_entry(opt, p)
            if e is not None:
                state[ids[id(p)]] = seal_entry(e, ids[id(p)], p)
    state.update({k: v for k, v in opt.state.items() if not torch.is_tensor(k)})
    return {"state": state, "param_groups": groups}


def load_state_dict_into(opt: FP4AdamW, state_dict: Mapping) -> None:
    """Load a state dict of FP4AdamW (any tier) or of torch.optim.AdamW into `opt` (after its load pre-hooks).

    As torch's: group sizes must match, parameters are matched through the saved groups' ids, and keys that are
    not parameter ids (strings that are not integers) are kept in ``optimizer.state`` as they are. Every entry is
    checked before anything changes: a key that is no saved parameter id (``-1``, an id past the end) or an
    entry whose fingerprint names another parameter or shape is a ConfigError naming the key, a checksum
    mismatch a CorruptionError (check_entry). Survives a caller that cast the state tensors to a floating dtype
    (packed states are whole bytes). torch AdamW groups with ``amsgrad=True`` are refused (their max_exp_avg_sq
    would be lost); its implementation flags (foreach, fused, capturable, differentiable) are dropped."""
    if "param_groups" not in state_dict:
        raise ConfigError("state_dict", f"a dict with keys {sorted(map(str, state_dict))}",
                          "an optimizer state dict ('state' and 'param_groups')")
    saved_groups = copy.deepcopy(list(state_dict["param_groups"]))
    if len(saved_groups) != len(opt.param_groups):
        raise ConfigError("state_dict['param_groups']", f"{len(saved_groups)} groups",
                          f"{len(opt.param_groups)}, as this optimizer has", "the state dict belongs to another "
                          "model (loaded state dict has a different number of parameter groups)")
    for i, (g, sg) in enumerate(zip(opt.param_groups, saved_groups)):
        if not isinstance(sg, dict) or not isinstance(sg.get("params"), (list, tuple)):
            raise ConfigError(f"state_dict['param_groups'][{i}]", type(sg).__name__ if not isinstance(sg, dict)
                              else f"a group with keys {sorted(map(str, sg))}", "a dict with a 'params' list")
        if len(sg["params"]) != len(g["params"]):
            raise ConfigError(f"state_dict['param_groups'][{i}]['params']", f"{len(sg['params'])} parameters",
                              f"{len(g['params'])}, as this optimizer's group has", "the state dict belongs to "
                              "another model (a parameter group doesn't match the size of optimizer's group)")
        if sg.get("amsgrad"):
            raise ConfigError(f"state_dict['param_groups'][{i}]['amsgrad']", sg["amsgrad"], "False",
                              UNSUPPORTED["amsgrad"] + "; its saved max_exp_avg_sq would be lost")
    id_map = {}
    for sg, g in zip(saved_groups, opt.param_groups):
        id_map.update(zip(sg["params"], g["params"]))
    plan, extra, seen = [], {}, set()
    for key, entry in state_dict.get("state", {}).items():
        pid = _param_id(key)
        if pid is None:
            extra[key] = entry
            continue
        if pid not in id_map or pid in seen:
            ids = sorted(k for k in id_map if isinstance(k, int))
            raise ConfigError(f"state_dict['state'][{key!r}]", "an entry for " + (
                "a parameter already loaded under another key" if pid in seen else
                "no parameter id of the saved param_groups"),
                f"one entry per id in {ids[0]}..{ids[-1]}" if ids else "no entries (no parameters)",
                "the state dict belongs to another model, or its keys were changed")
        seen.add(pid)
        check_entry(entry, pid, id_map[pid])
        plan.append((id_map[pid], entry))
    groups = []
    for g, sg in zip(opt.param_groups, saved_groups):
        sg["params"] = g["params"]
        if "param_names" in g and "param_names" not in sg:
            sg["param_names"] = g["param_names"]
        for k in UNSUPPORTED:
            sg.pop(k, None)
        sg.pop("decoupled_weight_decay", None)
        for k, val in opt.defaults.items():  # a torch AdamW state dict lacks our per-group options
            sg.setdefault(k, val)
        sg["betas"] = tuple(sg["betas"])
        groups.append(sg)
    opt.param_groups = groups
    opt.state = defaultdict(dict)
    group_of: dict[int, dict] = {}
    for g in groups:
        for p in g["params"]:
            group_of.setdefault(id(p), g)
    for p, entry in plan:
        load_entry(opt, group_of[id(p)], p, entry)
    opt.state.update(extra)


def _param_id(key) -> int | None:
    """The parameter id a state-dict key stands for (an int, or a string of one); None for other keys."""
    if isinstance(key, bool):
        raise ConfigError("state_dict['state']", f"the key {key!r}", "integer parameter ids")
    if isinstance(key, int):
        return key
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            return None
    return None
