"""Checkpoints of an ``apply``-ed model and its optimizer with ``torch.distributed.checkpoint``.

Files are safetensors (``HuggingFaceStorageWriter(save_distributed=True)``): every rank writes its
own shards, the offsets of each shard sit in the safetensors header (JSON), and the reader rebuilds
DCP's metadata from those headers, so neither saving nor loading unpickles anything.

What is saved (flat keys):

- ``model.<name>``: every parameter as a DTensor over its fp32 master shard (FP4 weights are saved
  as their fp32 masters; the packed copy is derived data), and every persistent buffer.
- ``optim.<name>.<state>``: optimizer state tensors. Those shaped like the local shard (fp32
  ``exp_avg``...) are DTensors with the parameter's placement, so DCP reshards them; 0-d ones
  (``step``) are plain tensors; any other tensor (FP4AdamW's packed states, whose layout follows each
  rank's shard) is saved as one row per rank, ``[world, n]``, with its true length in ``...__numel``.
  Strings (``v_format``) are saved as UTF-8 bytes (``...__str``). FP4AdamW's ``master`` is not saved:
  it equals the parameter shard.
- ``optim.param_groups.<i>.<key>``: hyperparameters (numbers as float64, strings as UTF-8 bytes).
- ``meta.world_size``, ``meta.version``.

Loading on the same number of ranks restores every byte, so a resumed run repeats the losses of an
uninterrupted one. On another number of ranks (1 included) the model and fp32 states are resharded by
DCP; FP4AdamW's packed states are decoded per saved rank, cut along the new shard boundaries and
quantized again once (the only lossy step, and only on a change of world size).
"""

from __future__ import annotations

import logging
import math
import os
import warnings
from pathlib import Path
from typing import Iterator, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from .._dtensor import like_param
from ..errors import ConfigError
from .internals import local_tensor, mesh_all_reduce, shard_layout
from .optim import local_shards_of
from .weight import FP4Weight

log = logging.getLogger("fp4offload.fsdp")

__all__ = ["save", "load"]

VERSION = 1
_SKIP_STATE = ("master",)
_PG = "optim.param_groups."
_STR, _NUMEL = ".__str", ".__numel"  # suffixes: a string as UTF-8 bytes; the true length of a per-rank row


def _dtensor_cls():
    from torch.distributed.tensor import DTensor

    return DTensor


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (fp32 masters for FP4 weights) and persistent buffers, keyed ``model.<name>``."""
    DTensor = _dtensor_cls()
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and isinstance(local_tensor(p), FP4Weight):
            v = DTensor.from_local(local_tensor(p)._master, p.device_mesh, p.placements, run_check=False,
                                   shape=p.shape, stride=p.stride())
        else:
            v = p.detach()
        out[f"model.{name}"] = v
    for mod_name, mod in model.named_modules():
        for bname, b in mod._buffers.items():
            if b is not None and bname not in mod._non_persistent_buffers_set:
                out[f"model.{mod_name + '.' if mod_name else ''}{bname}"] = b
    return out


def _names(model: nn.Module, opt) -> list[tuple[str, nn.Parameter, torch.Tensor]]:
    """(qualified name, model parameter, optimizer proxy) for every parameter the optimizer steps."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    out = []
    for p, proxy in opt.local_shards.pairs:
        if id(p) not in by_id:
            raise ConfigError("optimizer", "a parameter that is not in the model", "an optimizer of this model")
        out.append((by_id[id(p)], p, proxy))
    return out


def _state_key(name: str, key: str) -> str:
    """The flat key of optimizer state ``key`` of parameter ``name``."""
    return f"optim.{name}.{key}"


class _Entry(NamedTuple):
    name: str  # the parameter's qualified name
    p: torch.Tensor  # the model parameter
    proxy: torch.Tensor  # the optimizer's parameter
    st: dict  # the optimizer's state of proxy
    key: str
    v: object  # st[key]
    full: str  # _state_key(name, key)
    kind: str  # _state_kind(v, proxy, key)


def _state_entries(model: nn.Module, opt) -> Iterator[_Entry]:
    """Every optimizer state that save writes and load reads, in the same order on both sides (and on
    every rank): the optimizer's parameters in turn, each one's state keys sorted, ``master`` left out."""
    for name, p, proxy in _names(model, opt):
        st = opt.state.get(proxy, {})
        for key in sorted(st):
            if key not in _SKIP_STATE:
                v = st[key]
                yield _Entry(name, p, proxy, st, key, v, _state_key(name, key), _state_kind(v, proxy, key))


def _mesh_world(p) -> int:
    """Ranks p's dim 0 is sharded over (the shard dimension of an HSDP mesh)."""
    layout = shard_layout(p)
    return 1 if layout is None else layout.world


def _rows(v: torch.Tensor, p, length: int):
    """A per-rank tensor as row `rank` of a [world, length] DTensor (zero-padded; replicated like p on an HSDP
    mesh's replicate dimension)."""
    DTensor = _dtensor_cls()

    flat = v.detach().reshape(-1)
    row = flat.new_zeros((1, length))
    row[0, : flat.numel()] = flat
    if isinstance(p, DTensor):
        return DTensor.from_local(row, p.device_mesh, p.placements, run_check=False, shape=(_mesh_world(p), length),
                                  stride=(length, 1))
    return row


def _rows_and_numel(v: torch.Tensor, p, length: int):
    """``v`` as a row of [world, length] (:func:`_rows`) and its true length as a row of [world, 1]."""
    return _rows(v, p, length), _rows(torch.tensor([v.numel()], dtype=torch.int64, device=v.device), p, 1)


def _max_over_ranks(n: int, p) -> int:
    DTensor = _dtensor_cls()
    if not isinstance(p, DTensor) or _mesh_world(p) == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64, device=p.device_mesh.device_type)
    return int(mesh_all_reduce(t, p.device_mesh, dist.ReduceOp.MAX).item())


def _str_tensor(s: str) -> torch.Tensor:
    return torch.tensor(list(s.encode("utf-8")), dtype=torch.uint8)


def _tensor_str(t: torch.Tensor) -> str:
    return bytes(t.to(torch.uint8).tolist()).decode("utf-8")


def _state_kind(v, proxy, key: str = "") -> str:
    if isinstance(v, str):
        return "str"
    if isinstance(v, bool) or isinstance(v, (int, float)):
        return "number"
    if not torch.is_tensor(v):
        return "other"
    if v.dim() == 0:
        return "replicated"
    if key not in _packed_keys() and tuple(v.shape) == tuple(proxy.shape):
        return "like_param"
    return "rows"


def _hyper(opt) -> dict[str, torch.Tensor]:
    out = {}
    for i, g in enumerate(opt.param_groups):
        for k, v in g.items():
            key = f"{_PG}{i}.{k}"
            if k == "params":
                continue
            if isinstance(v, str):
                out[key + _STR] = _str_tensor(v)
            elif isinstance(v, (bool, int, float)) or (torch.is_tensor(v) and v.numel() == 1):
                out[key] = torch.tensor([float(v)], dtype=torch.float64)
            elif isinstance(v, (tuple, list)) and v and all(isinstance(x, (int, float)) for x in v):
                out[key] = torch.tensor([float(x) for x in v], dtype=torch.float64)
    return out


def _restore_hyper(opt, sd: dict, keys: list[str]) -> None:
    for k in keys:
        is_str = k.endswith(_STR)
        i, key = k[len(_PG):].removesuffix(_STR).split(".", 1)
        g = opt.param_groups[int(i)]
        old = g.get(key)
        if is_str:
            g[key] = _tensor_str(sd[k])
            continue
        vals = sd[k].tolist()
        if isinstance(old, (tuple, list)):
            g[key] = type(old)(type(o)(x) for o, x in zip(old, vals))
        elif torch.is_tensor(old):
            old.fill_(vals[0])
        elif isinstance(old, bool):
            g[key] = bool(vals[0])
        elif isinstance(old, int):
            g[key] = int(vals[0])
        else:
            g[key] = float(vals[0])


def _optim_save_tensors(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    entries: dict[str, torch.Tensor] = {}
    for e in _state_entries(model, opt):
        if e.kind == "str":
            entries[e.full + _STR] = _str_tensor(e.v)
        elif e.kind == "number":
            entries[e.full] = torch.tensor([float(e.v)], dtype=torch.float64)
        elif e.kind == "replicated":
            entries[e.full] = e.v
        elif e.kind == "like_param":
            entries[e.full] = like_param(e.v, e.p)
        elif e.kind == "rows":
            entries[e.full], entries[e.full + _NUMEL] = _rows_and_numel(e.v, e.p, _max_over_ranks(e.v.numel(), e.p))
    entries.update(_hyper(opt))
    return entries


def save(path: str | os.PathLike, model: nn.Module, optimizer=None) -> None:
    """Write ``model`` (and ``optimizer``) to the folder ``path``; a collective: call it on every rank."""
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    sd = _model_tensors(model)
    if optimizer is not None:
        optimizer = _check_opt(optimizer)
        if len(optimizer.state) < len(optimizer.local_shards.pairs):
            raise ConfigError("optimizer", f"{len(optimizer.state)} of {len(optimizer.local_shards.pairs)} states",
                              "an optimizer that has stepped", "the packed states exist from the first opt.step() "
                              "on: save after it, or save the model alone (ff.save(path, model))")
        sd.update(_optim_save_tensors(model, optimizer))
    sd["meta.world_size"] = torch.tensor([_world()], dtype=torch.int64)
    sd["meta.version"] = torch.tensor([VERSION], dtype=torch.int64)
    Path(path).mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_save(sd, storage_writer=HuggingFaceStorageWriter(str(path), save_distributed=True),
                 no_dist=not dist.is_initialized())


def _check_opt(optimizer):
    inner = local_shards_of(optimizer)
    if inner is None:
        raise ConfigError("optimizer", type(optimizer).__name__, "the optimizer fp4offload.fsdp.optimizer built "
                          "(or a wrapper of it, as trainer.optimizer)",
                          "pass the optimizer fp4offload.fsdp.optimizer(model, policy), ff.prepare or "
                          "FP4FSDPTrainer built; for torch's own optimizers use torch.distributed.checkpoint")
    return inner


# --------------------------------------------------------------------------------------------------- load


def _shard_rows(d0: int, world: int, rank: int) -> tuple[int, int]:
    """[start, stop) of dim 0 that FSDP gives `rank` of `world`."""
    rows0 = -(-d0 // world)
    start = min(rank * rows0, d0)
    return start, min(start + rows0, d0)


class _Resharder:
    """FP4AdamW packed states saved on another number of ranks: decode, re-cut, re-quantize once."""

    def __init__(self, opt, saved_world: int):
        self.opt, self.saved_world = opt, saved_world
        self.rows: dict[str, torch.Tensor] = {}  # full [saved_world, L] targets, read by every rank
        self.params: dict[str, tuple] = {}  # name -> (param, proxy)

    def targets(self, name: str, p, proxy, full: str, size: tuple[int, ...]) -> dict[str, torch.Tensor]:
        self.params[name] = (p, proxy)
        t = torch.zeros(size, dtype=torch.uint8)
        n = torch.zeros((size[0], 1), dtype=torch.int64)
        self.rows[full], self.rows[full + _NUMEL] = t, n
        return {full: t, full + _NUMEL: n}

    def finish(self) -> None:
        from .._config.grids import LEGACY_V_FORMAT
        from .._optim.state import PACKED_KEYS, decode_state, packed_from_entry

        sd = self.opt.packed_state_dict()
        pid_of = {id(proxy): i for i, (_, proxy) in enumerate(self.opt.local_shards.pairs)}
        new_state = dict(sd["state"])
        group_of = {id(q): g for g, ps in zip(self.opt.param_groups, self.opt.local_shards.inner) for q in ps}
        for name, (p, proxy) in self.params.items():
            shape = tuple(p.shape)
            d0, inner = shape[0], math.prod(shape[1:])
            st = self.opt.state[proxy]
            # fp32 here: the group's
            v_format = st.get("v_format") or group_of[id(proxy)].get("v_format", LEGACY_V_FORMAT)
            ms, vs = [], []
            for r in range(self.saved_world):
                a, b = _shard_rows(d0, self.saved_world, r)
                n = (b - a) * inner
                if n == 0:
                    continue
                entry = {}
                for k in PACKED_KEYS:
                    full = _state_key(name, k)
                    ln = int(self.rows[full + _NUMEL][r, 0])
                    entry[k] = self.rows[full][r, :ln]
                m, v = decode_state(*packed_from_entry(entry, n, v_format), n, v_format)
                ms.append(m)
                vs.append(v)
            layout = shard_layout(p)
            rank = 0 if layout is None else layout.rank
            a, b = _shard_rows(d0, _mesh_world(p), rank)
            m_all, v_all = torch.cat(ms), torch.cat(vs)
            pid = pid_of[id(proxy)]
            e = {"step": new_state[pid]["step"], "exp_avg": m_all[a * inner: b * inner].clone(),
                 "exp_avg_sq": v_all[a * inner: b * inner].clone()}
            new_state[pid] = e
        self.opt.load_packed_state_dict({"state": new_state, "param_groups": sd["param_groups"]})


def load(path: str | os.PathLike, model: nn.Module, optimizer=None) -> None:
    """Read a checkpoint written by :func:`save` into ``model`` (and ``optimizer``), in place.

    Works on any number of ranks (a collective when a process group exists). Packed weight copies
    are re-encoded at the next all-gather. Raises ConfigError when the folder is not such a
    checkpoint or lacks an entry this model or optimizer needs.
    """
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    if not Path(path).is_dir():
        raise ConfigError("path", str(path), "a folder written by fp4offload.fsdp.save")
    meta = HuggingFaceStorageReader(str(path)).read_metadata().state_dict_metadata
    if "meta.version" not in meta:
        raise ConfigError("path", str(path), "a folder written by fp4offload.fsdp.save (no meta.version in it)")
    sd = _model_tensors(model)
    sd["meta.world_size"] = torch.zeros(1, dtype=torch.int64)
    after: list = []
    hyper: list[str] = []
    resharder = None
    if optimizer is not None:
        optimizer = _check_opt(optimizer)
        optimizer.init_state()
        sizes = {k: tuple(m.size) for k, m in meta.items() if hasattr(m, "size")}
        hyper = [k for k in list(meta) if k.startswith(_PG)]
        for k in hyper:
            sd[k] = torch.zeros(sizes[k], dtype=torch.uint8 if k.endswith(_STR) else torch.float64)
        for e in _state_entries(model, optimizer):
            full = e.full
            if e.kind == "str":
                continue  # re-derived from the (restored) param group
            if e.kind == "number":
                t = torch.zeros(1, dtype=torch.float64)
                sd[full] = t
                typ = type(e.v)  # bound now, like the other defaults: the loop moves on before the call
                after.append(lambda st=e.st, key=e.key, t=t, typ=typ: st.__setitem__(key, typ(t.item())))
            elif e.kind == "replicated":
                sd[full] = e.v
            elif e.kind == "like_param" and full not in sizes and _state_key(e.name, "m_codes") in sizes:
                # packed when saved, fp32 here (the shards of more ranks fall under min_numel): decode and re-cut
                if e.key == "exp_avg":
                    size = sizes[_state_key(e.name, "m_codes")]
                    resharder = resharder or _Resharder(optimizer, size[0])
                    for k in _packed_keys():
                        sd.update(resharder.targets(e.name, e.p, e.proxy, _state_key(e.name, k),
                                                    sizes[_state_key(e.name, k)]))
            elif e.kind == "like_param":
                sd[full] = like_param(e.v, e.p)
            elif e.kind == "rows":
                if full not in sizes:
                    raise ConfigError(full, "missing", "a state saved by fp4offload.fsdp.save",
                                      "was the checkpoint written with another optimizer_states format?")
                size = sizes[full]
                if size[0] == _mesh_world(e.p):
                    row, n = _rows_and_numel(e.v, e.p, size[1])
                    sd[full], sd[full + _NUMEL] = row, n
                    after.append(lambda v=e.v, row=row, n=n, full=full: _copy_row_back(v, row, n, full))
                else:
                    if e.key not in _packed_keys():
                        raise ConfigError(full, f"saved on {size[0]} ranks", f"{_mesh_world(e.p)} ranks",
                                          "this optimizer's per-shard state cannot be resharded")
                    resharder = resharder or _Resharder(optimizer, size[0])
                    sd.update(resharder.targets(e.name, e.p, e.proxy, full, size))
    missing = [k for k in sd if k not in meta]
    if missing:
        raise ConfigError("path", str(path), f"a checkpoint holding {missing[0]!r}",
                          f"{len(missing)} entries of this model/optimizer are not in it (another model or "
                          "optimizer?)")
    with warnings.catch_warnings():  # without a process group DCP warns that it loads in one process: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(sd, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=not dist.is_initialized())
    for fn in after:
        fn()
    if optimizer is not None:
        _restore_hyper(optimizer, sd, hyper)
        if resharder is not None:
            log.info("fp4offload.fsdp: packed optimizer states saved on %d ranks re-cut for %d", resharder.saved_world,
                     _world())
            resharder.finish()
    for _, p in model.named_parameters():
        local = local_tensor(p)
        if isinstance(local, FP4Weight):
            local._slot.mark_dirty()


def _packed_keys() -> tuple[str, ...]:
    try:
        from .._optim.state import PACKED_KEYS
    except ImportError:  # pragma: no cover
        return ()
    return PACKED_KEYS


def _copy_row_back(v: torch.Tensor, row, n, full: str) -> None:
    local_row = local_tensor(row, row).reshape(-1)
    local_n = int(local_tensor(n, n).reshape(-1)[0])
    if local_n != v.numel():
        raise ConfigError(full, f"{local_n} elements in the checkpoint", f"{v.numel()} (this rank's state)",
                          "the checkpoint was written with another shard layout")
    with torch.no_grad():
        v.view(-1).copy_(local_row[:local_n])
