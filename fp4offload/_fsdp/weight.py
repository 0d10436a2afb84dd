"""NVFP4 all-gathers for FSDP2: a tensor subclass around each fp32 weight shard.

``fully_shard`` lets the local tensor of a sharded parameter transform itself before and after the
all-gather (docs/design.md section 5). :class:`FP4Weight` wraps the fp32 master shard and:

- before the all-gather, all-reduces the per-tensor amax over the shard group (one collective per
  FSDP unit and gather, for all of its FP4 weights together), packs its zero-padded local shard to
  NVFP4 with that global amax, and hands FSDP the packed codes and block scales (uint8);
- after the all-gather, decodes the gathered bytes to the compute dtype (FSDP's ``param_dtype``)
  and trims the padding rows. Gradients flow to the fp32 master unchanged (straight-through).

Layouts. FSDP shards dim 0 in chunks of ``ceil(d0 / world)`` rows (the last ranks padded with
zeros). When the padded local shard's 2-D view (``prod(shape[:-1])`` rows) has a multiple of 16
rows, 16x16 tiles never straddle ranks and the gathered bytes are exactly the NVFP4 16x16 encoding
of the whole (zero-padded) tensor. Otherwise (1-D parameters, or shards of a few rows) the local
shard is packed in 1x16 blocks of its flattened padded form; each rank's chunk decodes on its own.
Both use one fp32 tensor scale from the global amax, so no scale crosses ranks.

The packed copy is cached and reused while the master and the global amax are unchanged (forward
and backward gather the same bytes). With ``CPUOffloadPolicy`` the host shard is what FSDP copies
to the device before the all-gather: that copy (``.to(device)`` from the host) transfers only the
packed bytes, so the host-to-device traffic shrinks by the same factor as the all-gather.

Every operation other than the all-gather hooks unwraps to the fp32 master: optimizers, gradient
clipping and ``load_state_dict`` act on fp32 values. In-place operations mark the packed copy stale.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map_only

from .. import _metrics as metrics
from ..errors import NonFiniteError
from .._dtensor import all_reduce
from .internals import local_tensor

aten = torch.ops.aten

__all__ = ["CollectiveError", "FP4Weight", "WeightSpec", "Slot", "GatherGroup", "GatherStats", "STATS",
           "encode_with_amax", "decode_gathered"]


# --------------------------------------------------------------------------------------------------
# counters


@dataclass
class GatherStats:
    """Bytes the FP4 hooks moved, in this process (reset with :meth:`reset`).

    The same totals also go to ``fp4offload._metrics`` as ``fsdp.weights.allgather_bytes``,
    ``allgather_bf16_bytes``, ``packs``, ``amax_allreduces``, ``h2d_bytes`` and ``h2d_fp32_bytes``.

    Attributes:
        gathers: parameter all-gathers that went through the NVFP4 hooks.
        packed_bytes: bytes those all-gathers delivered to this rank (input bytes x world size).
        bf16_bytes: what the same all-gathers would have delivered in bf16 (padded shard x 2 x world).
        packs: times a shard was (re)encoded; a cached pack is reused while nothing changed.
        amax_allreduces: amax all-reduces issued (one per FSDP unit and gather).
        h2d_packed_bytes: bytes copied host to device by the CPU-offload path (packed).
        h2d_fp32_bytes: what plain CPU offload would have copied for the same shards (fp32).
        per_param: parameter name -> bytes one all-gather of it delivers (packed).
    """

    gathers: int = 0
    packed_bytes: int = 0
    bf16_bytes: int = 0
    packs: int = 0
    amax_allreduces: int = 0
    h2d_packed_bytes: int = 0
    h2d_fp32_bytes: int = 0
    per_param: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def reset(self) -> None:
        with self._lock:
            self.gathers = self.packed_bytes = self.bf16_bytes = self.packs = self.amax_allreduces = 0
            self.h2d_packed_bytes = self.h2d_fp32_bytes = 0
            self.per_param = {}

    def snapshot(self) -> dict:
        with self._lock:
            return {"gathers": self.gathers, "packed_bytes": self.packed_bytes, "bf16_bytes": self.bf16_bytes,
                    "packs": self.packs, "amax_allreduces": self.amax_allreduces,
                    "h2d_packed_bytes": self.h2d_packed_bytes, "h2d_fp32_bytes": self.h2d_fp32_bytes,
                    "per_param": dict(self.per_param)}


#: the process-wide counters of the FP4 all-gather hooks
STATS = GatherStats()


class CollectiveError(RuntimeError):
    """A collective of the FSDP integration failed or timed out (usually: another rank failed first)."""

    def __init__(self, what: str, cause: BaseException):
        super().__init__(
            f"fp4offload.fsdp: {what} failed on rank {dist.get_rank() if dist.is_initialized() else '?'} "
            f"({type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}). "
            "Another rank most likely failed or stopped first: look for the first error in the other ranks' "
            "logs. The wait is bounded by the process group's timeout "
            "(torch.distributed.init_process_group(timeout=...)).")


# --------------------------------------------------------------------------------------------------
# layout of one sharded weight


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class WeightSpec:
    """Where one weight's shard sits in the whole tensor, and how it is packed.

    Attributes:
        name: the parameter's qualified name (for messages and counters).
        shape: the whole (unsharded) shape.
        world: ranks the parameter is sharded over (dim 0, FSDP's chunking).
    """

    name: str
    shape: tuple[int, ...]
    world: int

    @property
    def rows0(self) -> int:
        """Rows of dim 0 per rank after FSDP's padding: ceil(d0 / world)."""
        return _ceil_div(self.shape[0], self.world)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """Shape of the padded local shard (every rank's all-gather input has this size)."""
        return (self.rows0, *self.shape[1:])

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def cols(self) -> int:
        return self.shape[-1]

    @property
    def local_rows(self) -> int:
        """Rows of the padded local shard's 2-D view (prod(shape[:-1]))."""
        return self.local_numel // self.cols if self.cols else 0

    @property
    def tile(self) -> int:
        """16 when 16x16 tiles stay inside one rank's shard, else 1 (1x16 blocks of the flat shard)."""
        return 16 if len(self.shape) >= 2 and self.local_rows % 16 == 0 and self.local_rows > 0 else 1

    def packed_sizes(self) -> tuple[int, int]:
        """(code bytes, scale bytes) of one rank's all-gather input."""
        if self.tile == 16:
            cp = _ceil_div(self.cols, 16) * 16
            return self.local_rows * cp // 2, (self.local_rows // 16) * (cp // 16)
        nb = _ceil_div(self.local_numel, 16)
        return nb * 8, nb


# --------------------------------------------------------------------------------------------------
# encoding with a given amax


def encode_with_amax(x: torch.Tensor, amax: torch.Tensor, tile: int):
    """NVFP4-encode ``x`` (2-D for tile 16, 1-D for tile 1) with the tensor scale of ``amax``.

    Returns ``(data, scales, tensor_scale)``: for a shard of a weight whose global amax is ``amax``,
    every rank encodes with the same tensor scale, so the gathered bytes decode as one tensor.
    """
    from .._codec import quantize

    p = quantize(x, "nvfp4", block="16x16" if tile == 16 else "1x16", amax=amax)
    return p.data, p.scales, p.tensor_scale


def decode_gathered(spec: WeightSpec, gathered: torch.Tensor, tensor_scale: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """The whole tensor (``spec.shape``, ``dtype``) from the all-gathered bytes.

    ``gathered`` holds ``spec.world`` rows of ``[codes | scales]`` (one per rank, in rank order), as
    the all-gather of :meth:`FP4Weight.fsdp_pre_all_gather`'s single uint8 input delivers them.
    """
    from .._codec import dequantize
    from ..formats.packed import PackedTensor

    world = spec.world
    nd, ns = spec.packed_sizes()
    g = gathered.reshape(world, nd + ns)
    data, scales = g[:, :nd], g[:, nd:]
    if world > 1:  # rank-ordered codes (and scales) of the whole tensor
        data, scales = data.contiguous(), scales.contiguous()
    if spec.tile == 16:
        rows = world * spec.local_rows
        p = PackedTensor(data.reshape(-1), scales.reshape(-1), tensor_scale, torch.Size((rows, spec.cols)),
                         torch.float32, "nvfp4", "16x16")
        full = dequantize(p, dtype).reshape(world * spec.rows0, *spec.shape[1:])
    else:
        nb = _ceil_div(spec.local_numel, 16)
        p = PackedTensor(data.reshape(-1), scales.reshape(-1), tensor_scale, torch.Size((world * nb * 16,)),
                         torch.float32, "nvfp4", "1x16")
        full = dequantize(p, dtype).view(world, nb * 16)[:, : spec.local_numel]
        full = full.reshape(world * spec.rows0, *spec.shape[1:])
    return full[: spec.shape[0]]


# --------------------------------------------------------------------------------------------------
# per-parameter state shared by every wrapper derived from it


class Slot:
    """What one FP4 parameter keeps across FSDP's re-wrappings: its spec, group, owner, packed cache."""

    def __init__(self, spec: WeightSpec):
        self.spec = spec
        self.group: GatherGroup | None = None
        self.conversion = None  # the convert.Conversion that binds this slot once its parameter is sharded
        self.owner: tuple | None = None  # (module, attribute name) holding the sharded DTensor parameter
        self.offload = False  # CPU offload: a host-to-device copy carries the packed bytes only
        self.gen = 0  # bumped by in-place changes of the master (local knowledge only)
        self.global_amax: float | None = None  # set by the group each gather
        self.cache: tuple | None = None  # (key, [codes | scales] uint8, tensor_scale)
        self.local_amax_cache: tuple | None = None  # (key, amax)

    def mark_dirty(self) -> None:
        self.gen += 1

    def ensure_bound(self) -> bool:
        """True once this slot knows its shard layout and gather group. A slot of a converted model binds
        (with every other slot of the model) the first time it is needed after the user's ``fully_shard``."""
        if self.group is None and self.conversion is not None and self.owner_is_sharded():
            self.conversion.bind()
        return self.group is not None

    def owner_is_sharded(self) -> bool:
        if self.owner is None:
            return False
        module, name = self.owner
        return local_tensor(module._parameters.get(name)) is not None

    def current_master(self) -> torch.Tensor | None:
        """The fp32 master of the local shard FSDP has registered for this parameter right now."""
        if self.owner is None:
            return None
        module, name = self.owner
        p = module._parameters.get(name)
        local = local_tensor(p)
        return local._master if isinstance(local, FP4Weight) else None

    def _key(self, master: torch.Tensor) -> tuple:
        return (self.gen, master._version, master.data_ptr(), tuple(master.shape), master.device)

    def local_amax(self, master: torch.Tensor) -> torch.Tensor:
        """max |x| over the local shard (fp32 scalar on the master's device), cached while unchanged."""
        key = self._key(master)
        if self.local_amax_cache is not None and self.local_amax_cache[0] == key:
            return self.local_amax_cache[1]
        if master.numel():  # NaN counts as +inf, so a non-finite shard gives an inf amax on every rank
            a = torch.nan_to_num(master.detach().abs().float(), nan=math.inf).amax()
        else:
            a = torch.zeros((), dtype=torch.float32, device=master.device)
        self.local_amax_cache = (key, a)
        return a

    def packed(self, master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``[codes | scales]`` uint8, tensor scale) of the padded local shard with the current global amax."""
        amax = self.global_amax
        if amax is None:
            raise RuntimeError(f"fp4offload: {self.spec.name}: packed before its amax was all-reduced")
        key = (self._key(master), amax)
        if self.cache is not None and self.cache[0] == key:
            return self.cache[1], self.cache[2]
        spec = self.spec
        buf = master.detach()
        if tuple(buf.shape) != spec.local_shape:  # pad dim 0 to FSDP's chunk size with zeros
            padded = buf.new_zeros(spec.local_shape, dtype=torch.float32)
            if buf.numel():
                padded[: buf.shape[0]].copy_(buf)
            buf = padded
        buf = buf.float().reshape(spec.local_rows, spec.cols) if spec.tile == 16 else buf.float().reshape(-1)
        data, scales, ts = encode_with_amax(buf, torch.tensor(amax, dtype=torch.float32), spec.tile)
        nd, ns = spec.packed_sizes()
        assert data.numel() == nd and scales.numel() == ns, (spec, data.numel(), scales.numel())
        out = torch.empty(nd + ns, dtype=torch.uint8, device=data.device)
        out[:nd].copy_(data.reshape(-1))
        out[nd:].copy_(scales.reshape(-1))
        with STATS._lock:
            STATS.packs += 1
        metrics.counter("fsdp.weights.packs").add(1)
        self.cache = (key, out, ts)
        return out, ts


class GatherGroup:
    """The FP4 weights that FSDP all-gathers together (one ``fully_shard`` unit).

    The first of them to be prepared in a gather all-reduces every member's local amax in one
    collective (MAX over the shard group); the others reuse the result. Every rank gathers every
    member of a unit in each unshard, so the ranks issue the same collectives in the same order.
    """

    def __init__(self, slots: list[Slot], group: dist.ProcessGroup | None, device_type: str):
        self.slots = slots
        self.pg = group
        self.device_type = device_type
        self._seen = 0
        for s in slots:
            s.group = self

    def prepare(self, slot: Slot, master: torch.Tensor) -> None:
        """Called once per member and gather; the first call of a gather does the all-reduce."""
        if self._seen % len(self.slots) == 0:
            self._allreduce(slot, master)
        self._seen += 1

    def _allreduce(self, first: Slot, first_master: torch.Tensor) -> None:
        local = []
        for s in self.slots:
            m = first_master if s is first else s.current_master()
            if m is None:
                raise RuntimeError(f"fp4offload: cannot find the local shard of {s.spec.name}")
            local.append(s.local_amax(m).reshape(1).to(first_master.device))
        amax = torch.cat(local)
        if self.pg is not None and dist.get_world_size(self.pg) > 1:
            t = amax if amax.device.type == self.device_type else amax.to(self.device_type)
            try:
                all_reduce(t, dist.ReduceOp.MAX, self.pg)
            except Exception as e:
                raise CollectiveError("the amax all-reduce of " + first.spec.name, e) from e
            amax = t
        values = amax.tolist()  # one host sync per unit and gather
        with STATS._lock:
            STATS.amax_allreduces += 1
        metrics.counter("fsdp.weights.amax_allreduces").add(1)
        bad = [s.spec.name for s, a in zip(self.slots, values) if not math.isfinite(a)]
        if bad:  # every rank sees the same values, so every rank raises here together (no hang)
            raise NonFiniteError("FSDP weight shard(s) " + ", ".join(bad), len(bad), len(self.slots))
        for s, a in zip(self.slots, values):
            s.global_amax = a


# --------------------------------------------------------------------------------------------------
# the tensor subclass


_PRESERVE = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default, aten.slice.Tensor,
    aten.split.Tensor, aten.split_with_sizes.default, aten.new_zeros.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.clone.default, aten._to_copy.default, aten._pin_memory.default,
    aten.as_strided.default, aten.empty_like.default,
}


class FP4Weight(torch.Tensor):
    """An fp32 weight shard whose FSDP2 all-gather moves NVFP4 bytes.

    ``_master`` is the fp32 tensor holding the values (``None`` on the packed-only device copy that
    CPU offload makes); ``_slot`` is shared with every wrapper derived from the same parameter.
    """

    _master: torch.Tensor | None
    _slot: Slot
    _packed: tuple | None

    @staticmethod
    def __new__(cls, master: torch.Tensor | None, slot: Slot, *, packed: tuple | None = None,
                shape=None, device=None, dtype=None):
        if master is not None:
            shape, stride, device, dtype = master.shape, master.stride(), master.device, master.dtype
        else:
            stride = None
        t = torch.Tensor._make_wrapper_subclass(cls, shape, strides=stride, dtype=dtype, device=device,
                                                requires_grad=False)
        t._master = master
        t._slot = slot
        t._packed = packed
        return t

    def __init__(self, *args, **kwargs):
        pass

    @property
    def fp4offload_values(self) -> torch.Tensor | None:
        """The fp32 tensor an optimizer over the local shards steps (shards.local_values)."""
        return self._master

    def fp4offload_stepped(self) -> None:
        """An optimizer stepped the values: the packed copy is stale."""
        self._slot.mark_dirty()

    def __repr__(self) -> str:
        kind = "packed-only" if self._master is None else "fp32 master"
        return f"FP4Weight({self._slot.spec.name}, shape={tuple(self.shape)}, {kind}, device={self.device})"

    def __tensor_flatten__(self):
        return ["_master"], {"slot": self._slot}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return FP4Weight(inner["_master"], meta["slot"])

    # ---- everything but the all-gather: act on the fp32 master ---------------------------------

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        mine = [a for a in flat if isinstance(a, FP4Weight)]
        src = mine[0]
        for w in mine:
            if w._master is None:
                raise RuntimeError(f"fp4offload: {w!r} holds only packed bytes for the all-gather; "
                                   f"{func} needs the fp32 master (use the host shard)")
        if func is aten._to_copy.default and _is_offload_fetch(src, kwargs):
            return src._fetch_packed(torch.device(kwargs["device"]), kwargs.get("non_blocking", False))
        uargs, ukwargs = tree_map_only(FP4Weight, lambda w: w._master, (args, kwargs))
        out = func(*uargs, **ukwargs)
        if func._schema.is_mutable:
            for w in mine:  # conservative: any in-place op touching a wrapper invalidates its pack
                w._slot.mark_dirty()
            by_id = {id(w._master): w for w in mine}
            return tree_map_only(torch.Tensor, lambda t: by_id.get(id(t), t), out)
        if func in _PRESERVE:
            return tree_map_only(torch.Tensor,
                                 lambda t: FP4Weight(t, src._slot) if t.dtype == src.dtype and t.is_floating_point()
                                 else t, out)
        return out

    # ---- the FSDP2 all-gather extension ----------------------------------------------------------

    def _prepare_and_pack(self) -> tuple[torch.Tensor, torch.Tensor]:
        slot = self._slot
        if not slot.ensure_bound():
            raise RuntimeError(f"fp4offload: {slot.spec.name} was not registered with a gather group; "
                               "prepare models with fp4offload.fsdp.convert (or apply)")
        slot.group.prepare(slot, self._master)
        return slot.packed(self._master)

    def _fetch_packed(self, device: torch.device, non_blocking: bool) -> "FP4Weight":
        """The CPU-offload copy: packed bytes only, on `device`."""
        buf, ts = self._prepare_and_pack()
        moved = (buf.to(device, non_blocking=non_blocking), ts.to(device, non_blocking=non_blocking))
        with STATS._lock:
            STATS.h2d_packed_bytes += buf.numel() + ts.numel() * 4
            STATS.h2d_fp32_bytes += self._slot.spec.local_numel * 4
        metrics.counter("fsdp.weights.h2d_bytes").add(buf.numel() + ts.numel() * 4)
        metrics.counter("fsdp.weights.h2d_fp32_bytes").add(self._slot.spec.local_numel * 4)
        return FP4Weight(None, self._slot, packed=moved, shape=self.shape, device=device, dtype=self.dtype)

    def fsdp_pre_all_gather(self, mesh):
        """FSDP2 hook: the all-gather input (one uint8 tensor: NVFP4 codes, then E4M3 block scales).

        One input (not two) so that FSDP's one-rank path, which copies ``all_gather_inputs[0]`` instead
        of gathering, works too (CPU offload on a single GPU). The tensor scale travels as local
        metadata: every rank computed the same one from the all-reduced amax.
        """
        slot = self._slot
        if self._master is not None and slot.ensure_bound() and slot.spec.world == 1 and not slot.offload:
            # one rank and no host copy: FSDP copies the input instead of gathering, so nothing would be saved
            return (self._master.detach().reshape(-1),), (slot.spec, None)
        buf, ts = self._packed if self._master is None else self._prepare_and_pack()
        spec = slot.spec
        with STATS._lock:
            STATS.gathers += 1
            STATS.packed_bytes += buf.numel() * spec.world
            STATS.bf16_bytes += spec.local_numel * 2 * spec.world
            STATS.per_param[spec.name] = buf.numel() * spec.world
        metrics.counter("fsdp.weights.allgather_bytes").add(buf.numel() * spec.world)
        metrics.counter("fsdp.weights.allgather_bf16_bytes").add(spec.local_numel * 2 * spec.world)
        return (buf,), (spec, ts)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """FSDP2 hook: decode the gathered bytes to ``param_dtype`` in the whole shape."""
        spec, ts = metadata
        (gathered,) = all_gather_outputs
        if ts is None:  # one rank: the fp32 shard itself (see fsdp_pre_all_gather)
            full = gathered.view(spec.shape).to(param_dtype)
        else:
            full = decode_gathered(spec, gathered, ts.to(gathered.device), param_dtype)
        if out is not None:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(full)
            return None
        t = torch.empty(spec.shape, dtype=param_dtype, device=gathered.device)
        t.copy_(full)
        return t, (t,)


def _is_offload_fetch(src: FP4Weight, kwargs: dict) -> bool:
    """True for FSDP's CPU-offload copy of a host shard to the accelerator (same dtype)."""
    dev = kwargs.get("device")
    if dev is None:
        return False
    dev = torch.device(dev)
    dtype = kwargs.get("dtype")
    return (src.device.type == "cpu" and dev.type not in ("cpu", "meta") and dtype in (None, src.dtype)
            and src._slot.ensure_bound() and src._slot.offload)
