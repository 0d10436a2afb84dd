"""Packed NVFP4 (16x16) weight shards under ZeRO-3 with ``offload_param``.

Which hook, and why (DeepSpeed 0.19.8):

- ZeRO++'s quantized-weight path (``zero_quantized_weights``) quantizes each partition on the device,
  after the bf16 partition has already crossed from the host, into int8 with its own kernel (no CPU
  kernel): it saves all-gather bytes, not host->device bytes, and it cannot carry NVFP4. Its place in
  the code shows where a partition becomes what is gathered: ``all_gather_coalesced`` / ``all_gather``,
  bound on every parameter by ``Init._convert_to_deepspeed_param``, which the coordinator's
  ``fetch_sub_module`` calls with the host partition ``param.ds_tensor``.
- So the hook is those per-parameter functions: for a packed parameter the fetch copies the packed host
  bytes (codes + E4M3 scales, 0.5625 B/element) to the device, all-gathers uint8 across the partition
  group, and decodes to the compute dtype on the device. ``partition`` is wrapped so a partition that
  was updated in place (``GatheredParameters(modifier_rank=...)``) is packed again.
- The packed copy is written inside FP4AdamW's fused step over the sub-group's flat fp32 master: each
  partition is a region of that flat tensor (``FP4AdamW.hooks.weight_regions``), encoded band by band
  as the step updates it. The tensor scale comes from the weight's amax, max-reduced across the
  partition group (so every rank's shard shares it and the gathered codes decode as one tensor,
  docs/design.md 3.8) and rounded up to a power of two (``FP4AdamW.copy_amax``); the step uses the previous step's
  value. Right where stage3.py writes the master back into the partitions
  (``_reassign_or_swap_out_partitioned_parameters``, per sub-group after the step), one all-reduce of
  the new amaxes checks it still holds; the weights whose rounded amax moved (and the first step,
  checkpoint loads, an optimizer other than FP4AdamW, states on NVMe) are packed from the master by a codec
  pass. Either way the copy is the master's NVFP4 image with that amax: it never lags the master, and
  a resumed run rebuilds the same copies.

What is packed: trainable parameters with at least two dimensions whose partition is a whole number of
16-row bands of the 2-D view (``ds_numel`` divisible by world x 16 x columns), minus ``keep_bf16``
(name substrings and ``first:N`` / ``last:N`` transformer blocks). Everything else is fetched by
DeepSpeed unchanged.

Limits of this version: DeepSpeed's bf16 partition is still kept in host RAM beside the packed copy
(DeepSpeed's own checkpointing and ``GatheredParameters`` read it), so this saves host->device bytes,
not host memory; ``offload_param`` on NVMe is not supported.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fp4offload.errors import ConfigError
from fp4offload._optim.adamw import FP4AdamW

from fp4offload import _keep_bf16 as keep_bf16
from fp4offload._dtensor import all_reduce

from . import internals as dsi

log = logging.getLogger("fp4offload.deepspeed")

__all__ = ["attach", "PackedWeights", "select"]


def select(model: Any, keep: tuple[str, ...], world: int) -> tuple[list, dict]:
    """(packed [(name, param)], kept {name: reason}) for the ZeRO-3 parameters of ``model``.

    ``keep`` is ``weights.keep_bf16`` (fp4offload._keep_bf16: the same rules as under FSDP2)."""
    kept_ids = keep_bf16.kept_parameters(model, keep, keep_bf16.find_blocks(model))
    packed, kept = [], {}
    for name, p in model.named_parameters():
        shape = tuple(dsi.read(p, "ds_shape", p.shape))
        numel = int(dsi.read(p, "ds_numel", p.numel()))
        if not p.requires_grad:
            kept[name] = "frozen"
        elif len(shape) < 2:
            kept[name] = "1-D"
        elif id(p) in kept_ids:
            kept[name] = f"keep_bf16 {kept_ids[id(p)]!r}"
        elif numel % (world * 16 * shape[-1]):
            kept[name] = f"partition is not whole 16-row bands ({shape} over {world} ranks)"
        else:
            packed.append((name, p))
    return packed, kept


# ----------------------------------------------------------------------------------------------
# the hook


@dataclass
class _Shard:
    """One parameter's packed host partition."""

    name: str
    rows: int  # rows of this rank's band
    cols: int
    data: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor
    amax: float = 0.0  # the amax the tensor scale came from (max-reduced over the partition group)


@dataclass
class PackedWeights:
    """The packed shards of an engine (``engine.fp4offload.weights``) and their counters.

    Counters (bytes, summed over fetches on this rank): ``h2d_bytes`` what crossed host->device for the
    packed parameters, ``h2d_bf16_bytes`` what DeepSpeed's bf16 offload moves for the same fetches;
    ``h2d_all_bytes`` / ``h2d_all_bf16_bytes`` the same over every parameter fetched (the kept ones cross
    as bf16 in both); ``fetches``, ``encodes``; ``packed_params`` / ``kept_params``; ``host_packed_bytes``.
    """

    engine: Any
    shards: dict = field(default_factory=dict)  # id(param) -> _Shard
    offsets: dict = field(default_factory=dict)  # id(param) -> (sub-group, offset, numel) in the flat buffers
    kept: dict = field(default_factory=dict)
    h2d_bytes: int = 0
    h2d_bf16_bytes: int = 0
    kept_h2d_bytes: int = 0
    fetches: int = 0
    fetches_by_entry: dict = field(default_factory=lambda: {"all_gather_coalesced": 0, "all_gather": 0})
    encodes: int = 0
    fused_encodes: int = 0  # of those, written by FP4AdamW's fused step (the rest: a codec pass of their own)
    regions: dict = field(default_factory=dict)  # id(param) -> FP4AdamW WeightRegion of its master slice

    def counters(self) -> dict[str, float]:
        ratio = self.h2d_bf16_bytes / self.h2d_bytes if self.h2d_bytes else 0.0
        all_b, all_bf16 = self.h2d_bytes + self.kept_h2d_bytes, self.h2d_bf16_bytes + self.kept_h2d_bytes
        return {"h2d_bytes": self.h2d_bytes, "h2d_bf16_bytes": self.h2d_bf16_bytes, "h2d_reduction": ratio,
                "h2d_all_bytes": all_b, "h2d_all_bf16_bytes": all_bf16,
                "h2d_all_reduction": all_bf16 / all_b if all_b else 0.0,
                "fetches": self.fetches, **{f"fetches_{k}": v for k, v in self.fetches_by_entry.items()},
                "encodes": self.encodes, "fused_encodes": self.fused_encodes, "packed_params": len(self.shards),
                "kept_params": len(self.kept),
                "host_packed_bytes": sum(s.data.numel() + s.scales.numel() + 4 for s in self.shards.values())}


def _status():
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return ZeroParamStatus


class _DoneHandle:
    """A completed gather: ``wait()`` marks the parameters available (DeepSpeed's handle protocol)."""

    def __init__(self, params: list, inner: Any = None):
        self.params, self.inner = params, inner

    def wait(self, **kwargs) -> None:
        if self.inner is not None:
            self.inner.wait(**kwargs)
            self.inner = None
        st = _status()
        for p in self.params:
            if dsi.require(p, "ds_status") == st.INFLIGHT:
                dsi.write(p, "ds_status", st.AVAILABLE)
        self.params = []


def _group_world(p) -> tuple[Any, int]:
    g = dsi.read(p, "ds_process_group", None)
    return g, int(dsi.read(p, "ds_zero_partition_world_size", 1))


def _fetch(pw: PackedWeights, p) -> None:
    """Packed host shard -> device, all-gather uint8, decode to the parameter dtype; sets p.data."""
    from deepspeed.accelerator import get_accelerator

    from fp4offload.formats.packed import PackedTensor

    sh: _Shard = pw.shards[id(p)]
    dev = get_accelerator().current_device_name()
    data = sh.data.to(dev, non_blocking=True)
    scales = sh.scales.to(dev, non_blocking=True)
    ts = sh.tensor_scale.to(dev, non_blocking=True)
    pw.h2d_bytes += data.numel() + scales.numel() + ts.numel() * 4
    part = dsi.require(p, "ds_tensor")
    pw.h2d_bf16_bytes += part.numel() * part.element_size()
    pw.fetches += 1
    group, world = _group_world(p)
    if world > 1:
        datas = [torch.empty_like(data) for _ in range(world)]
        scls = [torch.empty_like(scales) for _ in range(world)]
        torch.distributed.all_gather(datas, data, group=group)
        torch.distributed.all_gather(scls, scales, group=group)
        data, scales = torch.cat(datas), torch.cat(scls)
    shape = torch.Size(dsi.require(p, "ds_shape"))
    packed = PackedTensor(data, scales, ts, shape, torch.float32, "nvfp4", "16x16", 0)
    p.data = packed.dequantize(p.dtype)


def _count_kept(pw: PackedWeights, params: list) -> None:
    st = _status()
    for q in params:
        part = dsi.require(q, "ds_tensor") if dsi.require(q, "ds_status") == st.NOT_AVAILABLE else None
        if part is not None:
            pw.kept_h2d_bytes += part.numel() * part.element_size()


def _wrap_param(pw: PackedWeights, p) -> None:
    orig_coalesced, orig_all_gather, orig_partition = (dsi.require(p, n) for n in ("all_gather_coalesced", "all_gather",
                                                                                   "partition"))
    st = _status()

    def all_gather_coalesced(params, safe_mode: bool = False, quantize: bool = False):
        params = list(params)
        mine = [q for q in params if id(q) in pw.shards]
        if not mine:
            _count_kept(pw, params)
            return orig_coalesced(params, safe_mode=safe_mode, quantize=quantize)
        others = [q for q in params if id(q) not in pw.shards]
        _count_kept(pw, others)
        inner = orig_coalesced(others, safe_mode=safe_mode, quantize=quantize) if others else None
        for q in sorted(mine, key=lambda q: dsi.require(q, "ds_id")):  # same order on every rank
            if dsi.require(q, "ds_status") != st.NOT_AVAILABLE:
                raise RuntimeError(dsi.require(q, "ds_summary")())
            dsi.write(q, "ds_status", st.INFLIGHT)
            _fetch(pw, q)
            pw.fetches_by_entry["all_gather_coalesced"] += 1
        return _DoneHandle(mine, inner)

    def all_gather(param_list=None, async_op: bool = False, hierarchy: int = 0):
        param_list = [p] if param_list is None else list(param_list)
        mine = [q for q in param_list if id(q) in pw.shards and dsi.require(q, "ds_status") == st.NOT_AVAILABLE]
        others = [q for q in param_list if id(q) not in pw.shards]
        _count_kept(pw, others)
        out = orig_all_gather(others, async_op=async_op, hierarchy=hierarchy) if others else ([] if async_op else None)
        for q in sorted(mine, key=lambda q: dsi.require(q, "ds_id")):
            dsi.write(q, "ds_status", st.INFLIGHT)
            _fetch(pw, q)
            pw.fetches_by_entry["all_gather"] += 1
            dsi.write(q, "ds_status", st.INFLIGHT if async_op else st.AVAILABLE)
        if async_op:
            return list(out or []) + [_DoneHandle(mine)]
        return out

    def partition(param_list=None, hierarchy: int = 0, has_been_updated: bool = False, free_data: bool = True):
        param_list = [p] if param_list is None else list(param_list)
        orig_partition(param_list, hierarchy=hierarchy, has_been_updated=has_been_updated, free_data=free_data)
        if has_been_updated:
            for q in param_list:
                if id(q) in pw.shards:
                    _encode_from(pw, [q], [dsi.require(q, "ds_tensor").detach().float().reshape(-1)])

    dsi.write(p, "all_gather_coalesced", all_gather_coalesced)
    dsi.write(p, "all_gather", all_gather)
    dsi.write(p, "partition", partition)


def _encode_from(pw: PackedWeights, params: list, sources: list[torch.Tensor],
                 known: list[float] | None = None) -> None:
    """Pack each parameter's partition from ``sources`` (fp32 flat, this rank's elements) with a shared amax:
    ``known`` (already max-reduced over the partition group), else measured and max-reduced here."""
    from fp4offload._codec import quantize

    if not params:
        return
    if known is None:
        amax = torch.stack([s.abs().max() if s.numel() else torch.zeros(()) for s in sources]).float()
        group, world = _group_world(params[0])
        if world > 1:
            all_reduce(amax, torch.distributed.ReduceOp.MAX, group)
        known = amax.tolist()
    amax = torch.tensor([FP4AdamW.copy_amax(a) for a in known], dtype=torch.float32)  # as the fused step encodes
    for i, (p, src) in enumerate(zip(params, sources)):
        sh = pw.shards.get(id(p))
        cols = int(dsi.require(p, "ds_shape")[-1])
        rows = src.numel() // cols
        pk = quantize(src.reshape(rows, cols), "nvfp4", block="16x16", amax=amax[i], name=getattr(sh, "name", None))
        region = pw.regions.get(id(p))
        if region is not None:  # the next step's fused encode starts from this amax
            region.amax = float(amax[i])
        if sh is None:
            continue
        sh.data, sh.scales, sh.tensor_scale, sh.rows, sh.cols = pk.data, pk.scales, pk.tensor_scale, rows, cols
        sh.amax = float(amax[i])
        pw.encodes += 1


def _after_step(pw: PackedWeights, params: list, sources: list[torch.Tensor]) -> None:
    """After a sub-group's step: take the copies FP4AdamW's fused step wrote where the new amax, max-reduced
    over the ranks and rounded up to a power of two, is the amax they were encoded with (the same on every
    rank), and pack the rest from the master as _encode_from does. One all-reduce of the new amaxes."""
    if not params:
        return
    regions = [pw.regions.get(id(p)) for p in params]
    new = torch.tensor([r.new_amax if r is not None and r.packed is not None and math.isfinite(r.new_amax)
                        else math.inf for r in regions], dtype=torch.float64)
    group, world = _group_world(params[0])
    if world > 1:
        all_reduce(new, torch.distributed.ReduceOp.MAX, group)
    rest, measured = ([], [], []), ([], [])  # rest: amax known (max-reduced above) / measured: not written
    for p, src, r, g in zip(params, sources, regions, new.tolist()):
        sh = pw.shards.get(id(p))
        if not math.isfinite(g):
            measured[0].append(p)
            measured[1].append(src)
            continue
        if r is None or sh is None or FP4AdamW.copy_amax(g) != r.amax:  # its rounded amax moved
            for lst, x in zip(rest, (p, src, g)):
                lst.append(x)
            continue
        pk = r.packed
        sh.data, sh.scales, sh.tensor_scale, sh.rows, sh.cols, sh.amax = (pk.data, pk.scales, pk.tensor_scale,
                                                                          r.rows, r.cols, r.amax)
        pw.encodes += 1
        pw.fused_encodes += 1
    _encode_from(pw, *rest)
    _encode_from(pw, *measured)


def _register_regions(pw: PackedWeights, opt) -> None:
    """Ask FP4AdamW (when it is the inner optimizer) to write each packed partition's NVFP4 copy inside its
    fused step over the sub-group's flat fp32 master."""
    inner = dsi.read(opt, "optimizer")
    if not hasattr(getattr(inner, "hooks", None), "weight_regions"):
        return
    from fp4offload._optim import WeightRegion

    for sg, params in enumerate(dsi.require(opt, "fp16_groups")):
        flat32 = dsi.require(opt, "fp32_partitioned_groups_flat")[sg]
        if flat32 is None or flat32.device.type != "cpu":
            continue
        regs = []
        for p in params:
            where = pw.offsets.get(id(p))
            if where is None:
                continue
            _, off, n = where
            cols = int(dsi.require(p, "ds_shape")[-1])
            pw.regions[id(p)] = WeightRegion(off, n // cols, cols)
            regs.append(pw.regions[id(p)])
        if regs:
            inner.hooks.weight_regions(flat32, regs)


def _offsets(opt, pw: PackedWeights) -> dict[int, tuple[int, int, int]]:
    """id(param) -> (sub-group, offset, numel) of its partition inside the flat fp16/fp32 buffers.

    Taken once, while ``ds_tensor`` still views the flat fp16 buffer (checkpoint loading re-points it).
    """
    out = {}
    for sg, params in enumerate(dsi.require(opt, "fp16_groups")):
        flat16 = dsi.require(opt, "fp16_partitioned_groups_flat")[sg]
        if flat16 is None:
            continue
        base, esz, end = flat16.data_ptr(), flat16.element_size(), flat16.numel()
        for p in params:
            if id(p) not in pw.shards:
                continue
            part = dsi.require(p, "ds_tensor")
            off = (part.data_ptr() - base) // esz
            n = part.numel()
            if not 0 <= off <= end - n:
                raise RuntimeError(f"fp4offload: the partition of {pw.shards[id(p)].name} is not inside its "
                                   "sub-group's flat buffer; DeepSpeed's ZeRO-3 layout changed")
            out[id(p)] = (sg, off, n)
    return out


def _sub_group_masters(opt, sub_group_id: int, pw: PackedWeights) -> tuple[list, list]:
    """Packed params of a sub-group and their fp32 master slices."""
    flat32 = dsi.require(opt, "fp32_partitioned_groups_flat")[sub_group_id]
    params, sources = [], []
    if flat32 is None or flat32.numel() == 0:
        return params, sources
    for p in dsi.require(opt, "fp16_groups")[sub_group_id]:
        where = pw.offsets.get(id(p))
        if where is None:
            continue
        _, off, n = where
        params.append(p)
        sources.append(flat32.data.narrow(0, off, n))
    return params, sources


def refresh(pw: PackedWeights) -> None:
    """Pack every selected partition again from the fp32 masters (after a checkpoint load)."""
    opt = pw.engine.optimizer
    for sg in range(len(dsi.require(opt, "fp16_groups"))):
        params, sources = _sub_group_masters(opt, sg, pw)
        _encode_from(pw, params, sources)


def attach(engine: Any, weights_cfg: Any) -> PackedWeights:
    """Pack the selected ZeRO-3 partitions of ``engine`` and hook their fetch and write-back."""
    opt = engine.optimizer
    if dsi.read(opt, "fp32_partitioned_groups_flat") is None:
        raise ConfigError("zero_optimization.stage", engine.zero_optimization_stage(), "3 with fp4offload.weights")
    if any(f is None for f in dsi.require(opt, "fp16_partitioned_groups_flat")):
        raise ConfigError("zero_optimization.offload_param.device", "nvme", "'cpu' with fp4offload.weights",
                          "packed weight shards on NVMe are not implemented")
    named = list(engine.module.named_parameters())
    world = int(dsi.read(named[0][1], "ds_zero_partition_world_size", 1)) if named else 1
    chosen, kept = select(engine.module, tuple(weights_cfg.keep_bf16), world)
    pw = PackedWeights(engine=engine, kept=kept)
    for name, p in chosen:
        pw.shards[id(p)] = _Shard(name, 0, int(dsi.require(p, "ds_shape")[-1]), torch.empty(0, dtype=torch.uint8),
                                  torch.empty(0, dtype=torch.uint8), torch.zeros(1))
    pw.offsets = _offsets(opt, pw)
    _register_regions(pw, opt)
    refresh(pw)
    missing = [pw.shards[k].name for k in pw.shards if pw.shards[k].data.numel() == 0]
    if missing:
        raise RuntimeError(f"fp4offload: no fp32 master found for {missing}; DeepSpeed's ZeRO-3 layout changed")
    for _, p in named:  # every parameter: any of them may lead a coalesced fetch that holds packed ones
        _wrap_param(pw, p)
    def after_write_back(orig):
        def reassign(sub_group_id):
            out = orig(sub_group_id)
            params, sources = _sub_group_masters(opt, sub_group_id, pw)
            _after_step(pw, params, sources)
            return out

        return reassign

    dsi.wrap_instance(opt, "_reassign_or_swap_out_partitioned_parameters", after_write_back)
    # Loading restores the fp32 masters and copies them into the bf16 partitions without passing through
    # the write-back above: pack again afterwards (both entry points, either may be called alone).
    def then_refresh(fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            refresh(pw)
            return out

        return wrapped

    opt.load_state_dict = then_refresh(opt.load_state_dict)
    engine.load_checkpoint = then_refresh(engine.load_checkpoint)
    log.info("fp4offload: %d weight partitions packed NVFP4 16x16, %d kept", len(pw.shards), len(kept))
    return pw
