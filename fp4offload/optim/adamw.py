"""FP4AdamW: AdamW whose moments are stored in 4 bits (DESIGN.md 3.7), on the GPU, in host RAM or on NVMe."""

from __future__ import annotations

import math
import re
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from .. import metrics
from ..config import STATE_MIN_NUMEL
from ..errors import ConfigError
from ..ops import backend_for
from . import fused
from . import reference_step as R
from .checks import check_arguments
from .state import PACKED_KEYS, decode_state, encode_state, packed_from_entry, step_of

KEYED_STREAM0 = 1 << 15  # stochastic-rounding stream ids of tensors named by tensor_key start here


def _pinned(n: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(n, dtype=dtype, pin_memory=pin)


@dataclass(eq=False)
class WeightRegion:
    """A (rows, cols) matrix at element `offset` of a flat parameter whose NVFP4 16x16 copy the fused CPU
    step writes (FP4AdamW.register_weight_regions).

    Set before a step: ``amax``, the amax the tensor scale comes from (None: the step leaves the region
    alone). Set by the step: ``packed`` (a PackedTensor of shape (rows, cols), equal to
    ``quantize(values, "nvfp4", block="16x16", amax=amax)``; None when the step did not write it) and
    ``new_amax`` (the finite amax of the region's new values; NaN when one is not finite or nothing was
    written). When ``new_amax > amax`` the largest tiles saturated: encode again with the right amax.
    """

    offset: int
    rows: int
    cols: int
    amax: float | None = None
    packed: Any = None
    new_amax: float = float("nan")
    _data: Any = field(default=None, repr=False)
    _scales: Any = field(default=None, repr=False)


class FP4AdamW(Optimizer):
    """AdamW (decoupled weight decay, bias correction) with m in NVFP4 and sqrt(v) in ufp4.

    Args:
        params: parameters or param groups, as for any torch optimizer.
        lr, betas, eps, weight_decay, maximize: as torch.optim.AdamW (weight_decay default 1e-2).
        m_rounding: ``"stochastic"`` (default) or ``"nearest"`` (benchmarks/RESULTS.md, "Accuracy", compares
            them with fp32 AdamW).
        v_format: ``"ufp4"`` (default: u = sqrt(v) in the zero-free unsigned code) or ``"nvfp4"`` (v itself in
            NVFP4, the ablation's baseline; it flushes small v to zero).
        min_numel: parameters with fewer elements keep fp32 states (default 4096).
        state_device: ``"same"`` (states beside the parameters), ``"cpu"`` (host RAM, pinned when CUDA is
            present; for GPU parameters the CPU runs the step segment by segment, overlapped with the
            copies) or ``"nvme"`` (packed states in files under `nvme_path`, read ahead and written behind).
        nvme_path: folder for ``state_device="nvme"`` (a private subfolder is created in it).
        nvme_threads: I/O threads of the NVMe tier (default 4).
        nvme_reserve_bytes: free space the NVMe tier leaves untouched on its disk (default 0).
        nvme_io: I/O engine of the NVMe tier: ``"auto"`` (default: DeepSpeed's async_io handle when it loads and
            works in `nvme_path`, else the thread pool, with one warning), ``"aio"`` (require it) or ``"threads"``.
            :attr:`nvme_io` tells which one runs (see fp4offload/optim/nvme.py).
        tensor_key: ``f(tensor) -> str | None``, a name for a tensor that does not depend on where it sits in
            ``param_groups``. It names the tensor's NVMe files (without it, or when it returns None: ``t<n>``,
            numbered in order of first step) and picks its stochastic-rounding stream (numbered by name in order
            of first step, in place of the position; see reference_step). A tensor keeps its NVMe key while it lives; two tensors holding
            states may not share one (ConfigError). The DeepSpeed block passes DeepSpeed's ``ds_id``, so ZeRO-3
            sub-groups (stepped one at a time, each alone in its group) keep their own files and their own
            random streams, also across a re-created tensor.
        backend: ``"auto"`` (the fused C++/CUDA step when it builds, else the torch reference step),
            ``"fused"`` (require it) or ``"reference"`` (the torch-op step; same bits, slower).
        working_copy: also produce the new weight as ``"bf16"``, ``"nvfp4"`` (16x16, per-tensor scale),
            ``"both"`` or ``None`` (default); read it with :meth:`working_copy`. The fused CPU step writes
            both inside its pass. The NVFP4 copy is ``quantize(w, "nvfp4", block="16x16",
            amax=FP4AdamW.copy_amax(amax(w)))`` (recorded in ``copy.meta["amax"]``): the amax rounded up to a
            power of two, known before the step except when it crosses one, when the copy is encoded in a
            pass of its own (``optim.wcopy_reencodes`` counts those, and first steps).
        seed: base seed of stochastic rounding (see reference_step's docstring for the streams).
        skip_nonfinite: skip the whole step when any gradient holds Inf/NaN (default True); states and
            weights stay untouched and ``optim.skipped_steps`` counts it.
        metrics_every: every this many steps, sample the relative quantization error of m and v on the
            first chunk of the first packed parameter (0: never; default 100).

    Per-group options: lr, betas, eps, weight_decay, maximize, m_rounding, v_format, min_numel.

    Metrics (fp4offload.metrics): ``optim.steps``, ``optim.skipped_steps``, timers ``optim.time.step`` /
    ``.compute`` / ``.nvme_read_wait`` / ``.nvme_write_wait`` / ``.d2h_wait``, counters ``optim.nvme.bytes_read``
    / ``bytes_written``, ``optim.bytes_d2h`` / ``bytes_h2d``, gauges ``optim.state_bytes.{host,device,nvme}`` and
    ``optim.qerr.{m,v}`` (relative L2 error of the stored m and v against the exact fp32 values of that step).

    NVMe tier and damaged files: a segment is checked when it is read, just before it is used; a damaged file
    raises CorruptionError naming the file and the segment and is left as it is. Segments (and parameters)
    stepped before it in the same step keep their new values, so restore the optimizer from a checkpoint.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, maximize: bool = False,
                 m_rounding: str = "stochastic", v_format: str = "ufp4", min_numel: int = STATE_MIN_NUMEL,
                 state_device: str = "same", nvme_path=None, nvme_threads: int = 4, nvme_reserve_bytes: int = 0,
                 nvme_io: str = "auto", tensor_key: Callable[[torch.Tensor], str | None] | None = None,
                 backend: str = "auto", working_copy: str | None = None, seed: int = 0,
                 skip_nonfinite: bool = True, metrics_every: int = 100):
        check_arguments(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, m_rounding=m_rounding,
                        v_format=v_format, min_numel=min_numel, state_device=state_device, nvme_path=nvme_path,
                        nvme_io=nvme_io, tensor_key=tensor_key, backend=backend, working_copy=working_copy)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, maximize=maximize,
                        m_rounding=m_rounding, v_format=v_format, min_numel=int(min_numel), seed=int(seed))
        super().__init__(params, defaults)
        self.state_device = state_device
        self.backend = backend
        self.working_copy_format = working_copy
        self.skip_nonfinite = skip_nonfinite
        self.metrics_every = int(metrics_every)
        self.skipped_steps = 0
        self._steps_taken = 0
        self._working: dict[int, dict] = {}
        self._regions = WeakIdKeyDictionary()  # tensor -> its list[WeightRegion] (register_weight_regions)
        self._copy_stream = None
        self._nvme = None
        self.nvme_io = None
        self._tensor_key_fn = tensor_key
        self._stream_numbers: dict[str, int] = {}  # tensor_key name -> its stochastic-rounding stream number
        self._nvme_keys = WeakIdKeyDictionary()  # tensor -> key of its NVMe files
        self._nvme_key_owner: dict[str, weakref.ref] = {}
        self._nvme_counter = 0
        if state_device == "nvme":
            from .nvme import NvmeStore

            self._nvme = NvmeStore(nvme_path, threads=nvme_threads, reserve_bytes=nvme_reserve_bytes, io=nvme_io)
            self.nvme_io = self._nvme.io

    # ---- helpers ----------------------------------------------------------------------------------------

    def _params(self):
        pid = 0
        for group in self.param_groups:
            for p in group["params"]:
                yield group, p, pid
                pid += 1

    def _packed(self, group, p) -> bool:
        return p.numel() >= group["min_numel"]

    def _compute_device(self, p) -> torch.device:
        return p.device if self.state_device == "same" else torch.device("cpu")

    def _pin(self, p) -> bool:
        return p.is_cuda and self.state_device != "same"

    def _cpu_ext(self):
        return None if self.backend == "reference" else fused.cpu_extension()

    def _cuda_ext(self):
        return None if self.backend == "reference" else fused.cuda_extension()

    def _init_state(self, group, p, pid) -> dict:
        st = self.state[p]
        n = p.numel()
        dev = self._compute_device(p)
        pin = self._pin(p) and torch.cuda.is_available()
        st["step"] = torch.tensor(0.0)
        if p.dtype != torch.float32 or not p.is_contiguous() or dev != p.device:
            master = _pinned(n, torch.float32, pin)
            master.copy_(p.detach().reshape(-1))
            st["master"] = master
        if not self._packed(group, p):
            st["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=dev)
            st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=dev)
        else:
            st["v_format"] = group["v_format"]
            if self._nvme is not None:
                self._nvme_create(self._nvme_key(p), n, group["v_format"])
            else:
                m, v = R.empty_packed(n, dev), R.empty_packed(n, dev)
                if pin:
                    m, v = (R.Packed(*(t.pin_memory() for t in m)), R.Packed(*(t.pin_memory() for t in v)))
                for k, t in zip(PACKED_KEYS, (*m, *v)):
                    st[k] = t
        return st

    def _stream_id(self, p, pid: int) -> int:
        """The stochastic-rounding stream id of p: its position, or for a tensor named by ``tensor_key``
        ``KEYED_STREAM0`` + the number of names stepped before its name first was. The order of first steps
        repeats in a resumed process even where the names do not (DeepSpeed's ds_ids count every parameter
        the process has made), so a resumed run draws the same bits."""
        raw = self._tensor_key_fn(p) if self._tensor_key_fn is not None else None
        if raw is None:
            return pid
        return KEYED_STREAM0 + self._stream_numbers.setdefault(str(raw), len(self._stream_numbers))

    def _nvme_key(self, p) -> str:
        """The key of p's NVMe files: given once, kept while p lives (see ``tensor_key``)."""
        key = self._nvme_keys.get(p)
        if key is not None:
            return key
        raw = self._tensor_key_fn(p) if self._tensor_key_fn is not None else None
        if raw is None:
            while True:
                key = f"t{self._nvme_counter:05d}"
                self._nvme_counter += 1
                holder = self._nvme_key_owner.get(key)
                if holder is None or holder() is None:
                    break
        else:
            raw = str(raw)
            safe = re.sub(r"[^A-Za-z0-9_-]", "-", raw)[:100]
            key = "k" + safe + ("" if safe == raw else f"-{zlib.crc32(raw.encode()):08x}")
            holder = self._nvme_key_owner.get(key)
            other = holder() if holder is not None else None
            if other is not None and other is not p:
                if "step" in self.state.get(other, {}):
                    raise ConfigError("tensor_key", raw, "a key no other tensor with states in this optimizer has",
                                      f"two tensors ({tuple(other.shape)} and {tuple(p.shape)}) would share NVMe "
                                      "files")
                self._nvme_keys.pop(other, None)  # a tensor without states hands its key over (re-created tensor)
        self._nvme_keys[p] = key
        self._nvme_key_owner[key] = weakref.ref(p)
        return key

    def _nvme_create(self, key: str, n: int, v_format: str, m: R.Packed | None = None, v: R.Packed | None = None):
        from .nvme import segment_file_bytes

        nseg = -(-n // R.SEGMENT)
        self._nvme.check_space(sum(segment_file_bytes(min(R.SEGMENT, n - s * R.SEGMENT)) for s in range(nseg)),
                               f"tensor {key}")
        for s in range(nseg):
            s0, s1 = s * R.SEGMENT, min(n, (s + 1) * R.SEGMENT)
            if m is None:
                ms, vs = R.empty_packed(s1 - s0, "cpu"), R.empty_packed(s1 - s0, "cpu")
            else:
                ms, vs = R.segment_view(m, s0, s1), R.segment_view(v, s0, s1)
            self._nvme.write(key, s, s1 - s0, v_format, ms, vs)
        self._nvme.remove(key, first_segment=nseg)  # a dead tensor's key reused for a smaller one

    def _states(self, st) -> tuple[R.Packed, R.Packed]:
        m = R.Packed(*(st[k] for k in PACKED_KEYS[:3]))
        v = R.Packed(*(st[k] for k in PACKED_KEYS[3:]))
        return m, v

    # ---- the step ---------------------------------------------------------------------------------------

    def _grads_finite(self, grads: list[torch.Tensor]) -> bool:
        ext = fused.cpu_extension() if any(not g.is_cuda for g in grads) else None
        flags = []
        for g in grads:
            if not g.is_cuda and ext is not None:
                if not ext.all_finite(g):
                    return False
            else:
                flags.append(torch.isfinite(g).all())
        return bool(torch.stack([f.cpu() for f in flags]).all()) if flags else True

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One AdamW step over every parameter with a gradient; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [(g, p, pid) for g, p, pid in self._params() if p.grad is not None]
        for _, p, _ in todo:
            if p.grad.is_sparse:
                raise ConfigError("grad", "a sparse gradient", "dense gradients", "FP4AdamW has no sparse path")
        for _, p, _ in todo:  # region results are per step: unset until this step writes them
            for r in self._regions.get(p, ()):
                r.packed, r.new_amax = None, float("nan")
        with metrics.timer("optim.time.step"):
            if self.skip_nonfinite and todo and not self._grads_finite([p.grad for _, p, _ in todo]):
                self.skipped_steps += 1
                metrics.counter("optim.skipped_steps").add(1)
                return loss
            self._steps_taken += 1
            sample = self.metrics_every > 0 and self._steps_taken % self.metrics_every == 0
            for group, p, pid in todo:
                sample = self._step_param(group, p, pid, sample) and sample
            if self._nvme is not None:
                with metrics.timer("optim.time.nvme_write_wait"):
                    self._nvme.wait_writes()
            metrics.counter("optim.steps").add(1)
        if self.metrics_every > 0 and self._steps_taken % self.metrics_every == 0:
            self.state_bytes()  # refreshes the optim.state_bytes.* gauges
        return loss

    def _scalars(self, group, step: int) -> R.StepScalars:
        b1, b2 = group["betas"]
        return R.StepScalars.make(lr=float(group["lr"]), beta1=b1, beta2=b2, eps=group["eps"],
                                  weight_decay=group["weight_decay"], step=step)

    def _step_param(self, group, p, pid, sample: bool) -> bool:
        """Steps one parameter; returns True while the quantization-error sample is still to be taken."""
        st = self.state[p]
        if "step" not in st:
            st = self._init_state(group, p, pid)
        elif "v_format" in st and st["v_format"] != group["v_format"]:  # the group's v_format changed: convert once
            self._convert_v(p, pid)
            st = self.state[p]
        t = step_of(st["step"]) + 1
        st["step"] = torch.tensor(float(t))
        sc = self._scalars(group, t)
        wc = self._want_copies(p)
        master = st.get("master")
        w = master if master is not None else p.data.view(-1)
        if not self._packed(group, p):
            g = p.grad.reshape(-1).to(w.device)
            bf = torch.empty(w.numel(), dtype=torch.bfloat16, device=w.device) if "bf16" in wc else None
            R.fp32_step(w, g, st["exp_avg"], st["exp_avg_sq"], sc, maximize=group["maximize"], bf16_out=bf)
            self._finish(p, w, master, bf, wc)
            return sample
        seed = R.sr_seed(group["seed"], t)
        stochastic = group["m_rounding"] == "stochastic"
        v_format = st["v_format"]
        args = dict(sc=sc, maximize=group["maximize"], v_format=v_format, stochastic=stochastic, seed=seed)
        n = p.numel()
        bf = None
        if "bf16" in wc or (p.is_cuda and w.device.type == "cpu" and p.dtype == torch.bfloat16):
            bf = self._working.setdefault(id(p), {}).get("bf16")
            if bf is None or bf.numel() != n:
                bf = _pinned(n, torch.bfloat16, self._pin(p) and torch.cuda.is_available()) if w.device.type == "cpu" \
                    else torch.empty(n, dtype=torch.bfloat16, device=w.device)
        if self._nvme is None and not (p.is_cuda and w.device.type == "cpu"):
            m, v = self._states(st)
            check = self._sampler(w, p.grad.reshape(-1), m, v, args) if sample else None
            regions, own = self._fused_regions(p, w, "nvfp4" in wc) if w.device.type == "cpu" else ([], None)
            with metrics.timer("optim.time.compute"):
                res = self._compute(w, p.grad.reshape(-1), m, v, args, R.sr_stream(self._stream_id(p, pid), 0), bf,
                                    regions)
            if check is not None:
                check(m, v)
                sample = False
            self._finish(p, w, master, bf, wc, *self._region_results(p, w, regions, res, own))
        else:
            sample = self._segment_loop(p, pid, w, m_v=None if self._nvme is not None else self._states(st),
                                        args=args, bf=bf, sample=sample, v_format=v_format)
            self._finish(p, w, master, bf, wc, uploaded=p.is_cuda and w.device.type == "cpu")
        return sample

    def _compute(self, w, g, m: R.Packed, v: R.Packed, args: dict, stream0: int, bf, regions=()):
        """The step over w (a whole flat parameter or a run of whole segments starting at one).

        `regions` (CPU fused step only, from _fused_regions): NVFP4 copies the step writes as it goes, into
        buffers made here (``region._data``, ``._scales``); returns the kernel's (new amax, s_dec) per region.
        """
        sc = args["sc"]
        ext = self._cpu_ext() if w.device.type == "cpu" else self._cuda_ext() if w.is_cuda else None
        if ext is not None:  # the fused step (C++ on the CPU, CUDA kernel on the GPU): same signature, same bits
            if g.dtype not in (torch.float32, torch.bfloat16):
                g = g.float()
            extra = {}
            if regions:
                for r in regions:
                    rp, cp = -(-r.rows // 16) * 16, -(-r.cols // 16) * 16
                    r._data = torch.empty(rp * cp // 2, dtype=torch.uint8)
                    r._scales = torch.empty(rp // 16 * (cp // 16), dtype=torch.uint8)
                extra = dict(w_data=[r._data for r in regions], w_scales=[r._scales for r in regions],
                             w_offsets=[r.offset for r in regions], w_rows=[r.rows for r in regions],
                             w_cols=[r.cols for r in regions], w_amax=[R.f32(r.amax) for r in regions])
            return ext.fused_step(w, g.contiguous(), *m, *v, sc.b1, sc.omb1, sc.b2, sc.omb2, sc.eps, sc.decay,
                                  sc.step_size, sc.rsbc2, sc.weight_decay, args["maximize"],
                                  args["v_format"] == "nvfp4", args["stochastic"], args["seed"], stream0, bf, **extra)
        kern = backend_for(w.device)
        n = w.numel()
        for k, s0 in enumerate(range(0, n, R.SEGMENT)):
            s1 = min(n, s0 + R.SEGMENT)
            R.packed_step(w[s0:s1], g[s0:s1], R.segment_view(m, s0, s1), R.segment_view(v, s0, s1), sc,
                          v_format=args["v_format"], m_stochastic=args["stochastic"], seed=args["seed"],
                          stream=stream0 + k, maximize=args["maximize"], kern=kern,
                          bf16_out=None if bf is None else bf[s0:s1])

    def _segment_loop(self, p, pid, w, m_v, args, bf, sample, v_format) -> bool:
        """Segment by segment on the CPU: states from RAM (m_v) or NVMe, gradient from p (maybe on the GPU).

        NVMe: segment s+1 is read while s is updated, s is written while s+1 is updated. GPU parameter:
        the gradient of s+1 comes down and the weights of s go up on a side stream while s is updated.
        """
        n = p.numel()
        nseg = -(-n // R.SEGMENT)
        gpu = p.is_cuda
        g_all = p.grad.reshape(-1)
        if gpu:
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(device=p.device)
            cs = self._copy_stream
            cs.wait_stream(torch.cuda.current_stream(p.device))
            gdt = g_all.dtype if g_all.dtype in (torch.float32, torch.bfloat16) else torch.float32
            if gdt != g_all.dtype:
                g_all = g_all.to(gdt)
            gbuf = [_pinned(min(n, R.SEGMENT), gdt, True) for _ in range(min(2, nseg))]

            def fetch(s):
                s0, s1 = s * R.SEGMENT, min(n, (s + 1) * R.SEGMENT)
                with torch.cuda.stream(cs):
                    gbuf[s % 2][: s1 - s0].copy_(g_all[s0:s1], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(cs)
                return ev

            pending_g = fetch(0)
        reads = None
        if self._nvme is not None:
            key = self._nvme_key(p)

            def read(s):
                s0, s1 = s * R.SEGMENT, min(n, (s + 1) * R.SEGMENT)
                return self._nvme.read_async(key, s, s1 - s0, v_format)

            reads = read(0)
        for s in range(nseg):
            s0, s1 = s * R.SEGMENT, min(n, (s + 1) * R.SEGMENT)
            if gpu:
                nxt_g = fetch(s + 1) if s + 1 < nseg else None
                with metrics.timer("optim.time.d2h_wait"):
                    pending_g.synchronize()
                g = gbuf[s % 2][: s1 - s0]
                metrics.counter("optim.bytes_d2h").add(g.numel() * g.element_size())
            else:
                g = g_all[s0:s1]
            if reads is not None:
                nxt_r = read(s + 1) if s + 1 < nseg else None
                with metrics.timer("optim.time.nvme_read_wait"):
                    m, v = reads.result()
            else:
                m, v = R.segment_view(m_v[0], s0, s1), R.segment_view(m_v[1], s0, s1)
            check = self._sampler(w[s0:s1], g, m, v, args) if (sample and s == 0) else None
            with metrics.timer("optim.time.compute"):
                self._compute(w[s0:s1], g, m, v, args, R.sr_stream(self._stream_id(p, pid), s), None if bf is None else bf[s0:s1])
            if check is not None:
                check(m, v)
                sample = False
            if reads is not None:
                self._nvme.write_async(key, s, s1 - s0, v_format, m, v)
                reads = nxt_r
            if gpu:
                src = bf[s0:s1] if p.dtype == torch.bfloat16 else w[s0:s1]
                with torch.cuda.stream(cs):
                    p.data.view(-1)[s0:s1].copy_(src, non_blocking=True)
                metrics.counter("optim.bytes_h2d").add(src.numel() * src.element_size())
                pending_g = nxt_g
        if gpu:
            torch.cuda.current_stream(p.device).wait_stream(cs)
        return sample

    def _sampler(self, w, g, m: R.Packed, v: R.Packed, args):
        """Snapshot chunk 0 before the step; the returned function measures the stored states' error after it."""
        k = min(w.numel(), R.CHUNK)
        kern = backend_for(w.device)
        m0, v0 = decode_state(R.segment_view(m, 0, k), R.segment_view(v, 0, k), k, args["v_format"], kern)
        _, m_new, v_new, _ = R.adamw_math(w[:k].float().clone(), g[:k].float().to(w.device), m0, v0, args["sc"],
                                          args["maximize"])

        def check(m_after: R.Packed, v_after: R.Packed) -> None:
            md, vd = decode_state(R.segment_view(m_after, 0, k), R.segment_view(v_after, 0, k), k, args["v_format"],
                                  kern)
            for name, exact, got in (("m", m_new, md), ("v", v_new, vd)):
                den = float(exact.double().norm())
                err = float((got.double() - exact.double()).norm()) / den if den > 0 else 0.0
                metrics.gauge(f"optim.qerr.{name}").set(err)

        return check

    # ---- working copies ---------------------------------------------------------------------------------

    def _want_copies(self, p) -> tuple[str, ...]:
        f = self.working_copy_format
        return () if f is None else (("bf16", "nvfp4") if f == "both" else (f,))

    # NVFP4 copies inside the fused CPU step (the working copy, and regions an integration registered). The
    # tensor scale must be known before the step, but the amax of the new weight is known only after it. So
    # a copy's tensor scale comes from copy_amax(amax), the amax rounded up to a power of two: the step
    # encodes with the value the last step found, and keeps the result when the new weight's rounded amax
    # is the same, which is every step but those where the amax crosses a power of two (else the copy is
    # encoded again in a pass of its own). The copy is therefore always quantize(w, "nvfp4", block="16x16",
    # amax=copy_amax(amax(w))): a function of the weight alone, so a resumed run makes the same copies. The
    # rounding costs nothing measurable: block scales land in (224, 448] instead of at 448, and E4M3 is a
    # floating format.

    @staticmethod
    def copy_amax(amax: float) -> float:
        """The amax an NVFP4 copy's tensor scale comes from: `amax` rounded up to a power of two (0 stays 0)."""
        if not math.isfinite(amax):
            return amax
        if not amax > 0:
            return 0.0
        m, e = math.frexp(amax)
        return amax if m == 0.5 else math.ldexp(1.0, e)

    def register_weight_regions(self, tensor: torch.Tensor, regions: list[WeightRegion]) -> None:
        """Ask the fused CPU step to write an NVFP4 16x16 copy of each region of `tensor` (a parameter this
        optimizer steps, held in host RAM) as it updates it. Before each step set ``region.amax``; after it,
        ``region.packed`` and ``region.new_amax`` hold the result (see WeightRegion). Replaces earlier regions
        of the tensor; an empty list removes them."""
        end = 0
        for r in sorted(regions, key=lambda r: r.offset):
            if r.rows <= 0 or r.cols <= 0 or r.offset < end or r.offset + r.rows * r.cols > tensor.numel():
                raise ConfigError("regions", f"offset {r.offset}, {r.rows} x {r.cols}",
                                  f"non-overlapping matrices inside the tensor's {tensor.numel()} elements")
            end = r.offset + r.rows * r.cols
        if regions:
            self._regions[tensor] = sorted(regions, key=lambda r: r.offset)
        else:
            self._regions.pop(tensor, None)

    def _own_region(self, p, w) -> WeightRegion | None:
        """p's NVFP4 working copy as a region of the fused step, once an amax is known; else None."""
        from ..codec import _rows_cols

        slot = self._working.get(id(p), {})
        amax = slot.get("nvfp4_amax")
        if amax is None or w.device.type != "cpu" or p.is_cuda or self._cpu_ext() is None:
            return None
        rows, cols = _rows_cols(p.shape)
        # one band of 16 rows is one thread's work: with too few bands a large copy would be encoded serially
        if not rows or not cols or (p.numel() >= 1 << 20 and -(-rows // 16) < 4 * torch.get_num_threads()):
            return None
        return WeightRegion(0, rows, cols, amax=amax)

    def _fused_regions(self, p, w, want_copy: bool) -> tuple[list[WeightRegion], WeightRegion | None]:
        """The regions the fused step over p writes this step (registered ones with an amax, and the working
        copy's), and the working copy's among them."""
        out = [r for r in self._regions.get(p, ()) if r.amax is not None]
        own = self._own_region(p, w) if want_copy else None
        if own is not None:
            if out:  # an integration's regions and a working copy of the same tensor: the copy goes separately
                own = None
            else:
                out = [own]
        return out, own

    def _region_results(self, p, w, regions: list[WeightRegion], res, own: WeightRegion | None):
        """Stores what the step wrote in each region; returns (the working copy's PackedTensor, or None when
        _finish must encode it, and the new weight's amax when the step measured it, else None)."""
        from ..formats.packed import PackedTensor

        for i, r in enumerate(regions):
            r.new_amax = float(res[2 * i])
            r.packed = PackedTensor(r._data, r._scales, torch.tensor([res[2 * i + 1]], dtype=torch.float32),
                                    torch.Size((r.rows, r.cols)), w.dtype, "nvfp4", "16x16", 0,
                                    meta={"amax": R.f32(r.amax)})  # the value the kernel scaled by
            r._data = r._scales = None
        if own is None:
            return None, None
        if not (math.isfinite(own.new_amax) and self.copy_amax(own.new_amax) == own.amax):
            return None, own.new_amax  # the amax crossed a power of two (or a value is not finite): _finish encodes
        pk = own.packed
        return (PackedTensor(pk.data, pk.scales, pk.tensor_scale, p.shape, w.dtype, "nvfp4", "16x16", 0,
                             meta=pk.meta), own.new_amax)

    def _finish(self, p, w, master, bf, wc, nvfp4=None, amax: float | None = None, uploaded: bool = False) -> None:
        """Write the fp32 master back into the parameter and produce the working copies (`nvfp4`: made by the
        fused step already; `amax`: the new weight's amax when the step measured it)."""
        if master is not None and not uploaded:
            if p.dtype == torch.bfloat16 and bf is not None and bf.device == p.device:
                p.data.copy_(bf.view(p.shape))
            else:
                p.data.copy_(master.view(p.shape))
        if not wc:
            return
        slot = self._working.setdefault(id(p), {})
        if "bf16" in wc:
            slot["bf16"] = bf if bf is not None else w.to(torch.bfloat16)
        if "nvfp4" in wc:
            if nvfp4 is None:
                from ..codec import quantize

                # the amax the fused step would have used (a pass to measure it unless the step did), the encode
                if amax is None:
                    amax = float(w.abs().amax()) if w.numel() else 0.0
                amax = self.copy_amax(amax)
                nvfp4 = quantize(w.view(p.shape), "nvfp4", block="16x16", amax=amax if math.isfinite(amax) else None)
                nvfp4.meta["amax"] = amax
                slot["nvfp4_amax"] = amax  # the next step's fused encode starts from it
                metrics.counter("optim.wcopy_reencodes").add(1)
            slot["nvfp4"] = nvfp4

    def working_copy(self, p) -> dict:
        """The working copies of `p` made by the last step: ``{"bf16": Tensor (flat), "nvfp4": PackedTensor}``."""
        return {k: v for k, v in self._working.get(id(p), {}).items() if k in ("bf16", "nvfp4")}

    # ---- introspection ----------------------------------------------------------------------------------

    def state_bytes(self) -> dict[str, int]:
        """Bytes of m and v held, by place: ``{"host": ..., "device": ..., "nvme": ...}`` (masters not counted)."""
        out = {"host": 0, "device": 0, "nvme": 0}
        for _, p, _ in self._params():
            st = self.state.get(p, {})
            for k in (*PACKED_KEYS, "exp_avg", "exp_avg_sq"):
                t = st.get(k)
                if torch.is_tensor(t):
                    out["device" if t.is_cuda else "host"] += t.numel() * t.element_size()
        if self._nvme is not None:
            out["nvme"] = self._nvme.bytes_on_disk()
        for k, val in out.items():
            metrics.gauge(f"optim.state_bytes.{k}").set(val)
        return out

    def close(self) -> None:
        """Release the NVMe tier's files and threads (also done when the optimizer is collected)."""
        if self._nvme is not None:
            self._nvme.close()
            self._nvme = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- state dict -------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """A tier-independent state dict: packed states as uint8 CPU tensors, fp32 ones as fp32 (see state.py)."""
        groups = super().state_dict()["param_groups"]
        if self._nvme is not None:
            self._nvme.wait_writes()
        state = {}
        for group, p, pid in self._params():
            st = self.state.get(p)
            if not st or "step" not in st:
                continue
            e = {"step": torch.tensor(float(step_of(st["step"])))}
            if "master" in st:
                e["master"] = st["master"].detach().cpu().clone()
            if "exp_avg" in st:
                e["exp_avg"] = st["exp_avg"].detach().cpu().clone()
                e["exp_avg_sq"] = st["exp_avg_sq"].detach().cpu().clone()
            else:
                e["v_format"] = st["v_format"]
                if self._nvme is not None:
                    m, v = self._nvme_read_all(self._nvme_key(p), p.numel(), st["v_format"])
                else:
                    m, v = self._states(st)
                for k, t in zip(PACKED_KEYS, (*m, *v)):
                    e[k] = t.detach().cpu().clone()
            state[pid] = e
        return {"state": state, "param_groups": groups}

    def _nvme_read_all(self, key, n, v_format):
        parts = [self._nvme.read(key, s, min(R.SEGMENT, n - s * R.SEGMENT), v_format)
                 for s in range(-(-n // R.SEGMENT))]
        m = R.Packed(*(torch.cat([pt[0][i] for pt in parts]) for i in range(3)))
        v = R.Packed(*(torch.cat([pt[1][i] for pt in parts]) for i in range(3)))
        return m, v

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of FP4AdamW (any tier) or of torch.optim.AdamW (quantized once).

        Survives a caller that cast the state tensors to a floating dtype (packed states are whole bytes).
        """
        saved_state = state_dict.get("state", {})
        groups = state_dict["param_groups"]
        super().load_state_dict({"state": {}, "param_groups": groups})
        for g in self.param_groups:  # a torch AdamW state dict lacks our per-group options
            for k, val in self.defaults.items():
                g.setdefault(k, val)
            g["betas"] = tuple(g["betas"])
        params = list(self._params())
        for key, entry in saved_state.items():
            idx = int(key)
            if idx >= len(params):
                raise ConfigError("state_dict['state']", f"an entry for parameter {idx}",
                                  f"indices below {len(params)}", "the state dict belongs to another model")
            group, p, pid = params[idx]
            self._load_entry(group, p, pid, entry)

    def _load_entry(self, group, p, pid, entry: dict) -> None:
        n = p.numel()
        self.state.pop(p, None)
        st = self._init_state(group, p, pid)  # allocates the tier's storage (zeros), then overwrite
        st["step"] = torch.tensor(float(step_of(entry.get("step", 0))))
        if "master" in entry and "master" in st:
            st["master"].copy_(entry["master"].reshape(-1).to(torch.float32))
        elif "master" in entry:  # the saved run kept a master, this one does not: it is the better weight
            p.data.copy_(entry["master"].reshape(p.shape).to(p.dtype))
        packed_saved = "m_codes" in entry
        if not self._packed(group, p):
            if packed_saved:
                m, v = decode_state(*packed_from_entry(entry, n), n, entry.get("v_format", "ufp4"))
            else:
                m, v = entry["exp_avg"].float(), entry["exp_avg_sq"].float()
            st["exp_avg"].copy_(m.reshape(p.shape))
            st["exp_avg_sq"].copy_(v.reshape(p.shape))
            return
        want = group["v_format"]
        if packed_saved:
            m, v = packed_from_entry(entry, n)
            have = entry.get("v_format", "ufp4")
            if have != want:
                mf, vf = decode_state(m, v, n, have)
                _, v = encode_state(mf, vf, want)
        else:  # fp32 states (torch AdamW, or a smaller min_numel): quantize once
            m, v = encode_state(entry["exp_avg"].reshape(-1), entry["exp_avg_sq"].reshape(-1), want)
        st["v_format"] = want
        if self._nvme is not None:
            self._nvme_create(self._nvme_key(p), n, want, m, v)
        else:
            for k, t in zip(PACKED_KEYS, (*m, *v)):
                st[k].copy_(t)

    def _convert_v(self, p, pid) -> None:
        entry = self.state_dict()["state"][pid]
        group = next(g for g, q, i in self._params() if i == pid)
        self._load_entry(group, p, pid, entry)


__all__ = ["FP4AdamW", "WeightRegion"]
