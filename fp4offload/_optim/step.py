"""The per-parameter step of FP4AdamW: one parameter's state (packed m and sqrt(v), or fp32 states, and its
master form) stepped with one gradient.

Owns: a parameter's fresh state (:meth:`ParamStep.init_state`), the choice and call of the kernel (the fused
C++/CUDA step or the torch reference of reference_step.py, same bits), the compact masters' step
(``master="split"`` / ``"bf16"``, master.py), the stochastic-rounding stream of each parameter, the working
copies the step writes (working_copy.py), the quantization-error sample, and the non-finite check of the
gradients. Where the states live and how they come and go segment by segment is the tier's (tiers.py), which
:class:`ParamStep` is given; which parameters step, and the step as a whole, are the optimizer's (adamw.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from .. import _metrics as metrics
from .._ops import backend_for
from . import fused
from . import master as MW
from . import reference_step as R
from .state import decode_state, step_of
from .working_copy import WorkingCopies, region_kernel_args

_NO_ODD = torch.zeros(0, dtype=torch.int64)
KEYED_STREAM0 = 1 << 15  # stochastic-rounding stream ids of tensors named by tensor_key start here
#: a gradient element this large or larger skips the step like Inf/NaN: its square overflows fp32 in the v update
GRAD_LIMIT = 2.0 ** 64


def scaled(g: torch.Tensor, scale) -> torch.Tensor:
    """`g` multiplied by an engine's gradient factor (hooks.scale_grad) in fp32, as a new tensor; `g` if none."""
    return g if scale is None else g.to(torch.float32, copy=True).mul_(scale)


def scalars(group: dict, step: int) -> R.StepScalars:
    """The fp32 scalars of step `step` of a parameter of `group`."""
    b1, b2 = group["betas"]
    return R.StepScalars.make(lr=float(group["lr"]), beta1=b1, beta2=b2, eps=group["eps"],
                              weight_decay=group["weight_decay"], step=step)


class ParamStep:
    """Steps one parameter at a time on `tier` (tiers.py), with the master form `master` (``"fp32"``, ``"split"``
    or ``"bf16"``) and the kernels of `backend`; `working_copy`, `tensor_key`: FP4AdamW's (StepOptions);
    `residual_in_files`: split's residual of a packed parameter lives in the tier's files
    (``master_device="nvme"``). `stream_numbers`: tensor_key name -> its stream number, in order of first step
    (carried by copies and pickles, put back when a step is undone)."""

    def __init__(self, tier, master: str, backend: str, working_copy: str | None,
                 tensor_key: Callable[[torch.Tensor], str | None] | None, residual_in_files: bool,
                 stream_numbers: dict[str, int] | None = None):
        self.tier, self.master, self.backend = tier, master, backend
        self.copies = WorkingCopies(working_copy)
        self.tensor_key = tensor_key
        self.residual_in_files = residual_in_files
        self.stream_numbers: dict[str, int] = {} if stream_numbers is None else dict(stream_numbers)

    def cpu_ext(self):
        return None if self.backend == "reference" else fused.cpu_extension()

    def cuda_ext(self):
        return None if self.backend == "reference" else fused.cuda_extension()

    # ---- a parameter's state ----------------------------------------------------------------------------

    def init_state(self, st: dict, group: dict, p, packed: bool, m: R.Packed | None = None,
                   v: R.Packed | None = None, res=None) -> dict:
        """Make `st` p's fresh state: step 0, a master when p is not fp32, contiguous and on the compute device,
        and zero states (or the packed (m, v) given, which the tier stores); `packed`: p holds packed states;
        `res`: split's residual ``(lo, odd)`` to start from (None: zeros), in RAM or, with the residual in the
        files, in the tier's files."""
        dev = self.tier.compute_device(p)
        st["step"] = torch.tensor(0.0)
        in_files = self.residual_in_files and packed
        if self.master == "split" and not in_files:  # the bf16 parameter is the master's upper half: residual 0
            st["master_lo"] = torch.zeros(p.numel(), dtype=torch.int16, device=dev)
            st["master_odd"] = torch.zeros(0, dtype=torch.int64, device=dev)
            if res is not None:
                st["master_lo"].copy_(res[0].reshape(-1))
                st["master_odd"] = res[1].to(dev)
        elif self.master in ("split", "bf16"):  # split: the tier's files keep it; bf16: the parameter is the master
            pass
        elif p.dtype != torch.float32 or not p.is_contiguous() or dev != p.device:
            master = torch.empty(p.numel(), dtype=torch.float32, device=dev, pin_memory=self.tier.pinned(p))
            master.copy_(p.detach().reshape(-1))
            st["master"] = master
        if not packed:
            st["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=dev)
            st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=dev)
        else:
            st["v_format"] = group["v_format"]
            self.tier.put(st, p, m, v, res if in_files else None)
        return st

    def stream_id(self, p, pid: int) -> int:
        """The stochastic-rounding stream id of p: its position, or for a tensor named by ``tensor_key``
        ``KEYED_STREAM0`` + the number of names stepped before its name first was. The order of first steps
        repeats in a resumed process even where the names do not (DeepSpeed's ds_ids count every parameter
        the process has made), so a resumed run draws the same bits."""
        raw = self.tensor_key(p) if self.tensor_key is not None else None
        if raw is None:
            return pid
        return KEYED_STREAM0 + self.stream_numbers.setdefault(str(raw), len(self.stream_numbers))

    def grads_finite(self, grads: list[torch.Tensor]) -> bool:
        """Whether every gradient is finite and below GRAD_LIMIT in magnitude (one min/max pass per gradient,
        one host read per device). A larger one would overflow g*g in fp32 (docs/numerics.md)."""
        flags: dict[torch.device, list[torch.Tensor]] = {}
        ext = self.cpu_ext() if any(g.device.type == "cpu" for g in grads) else None
        for g in grads:
            if g.numel() == 0:
                continue
            if ext is not None and g.device.type == "cpu" and g.dtype in (torch.float32, torch.bfloat16, torch.float16):
                # one integer compare per element on the pattern, at memory speed (csrc/cpu/adam_cpu.cpp)
                if not ext.grads_ok(g.detach()):
                    return False
                continue
            lo, hi = torch.aminmax(g.detach())
            flags.setdefault(g.device, []).append(((hi < GRAD_LIMIT) & (lo > -GRAD_LIMIT)).reshape(1))
        return all(bool(torch.cat(f).all()) for f in flags.values())

    # ---- the step ---------------------------------------------------------------------------------------

    def step(self, group: dict, p, st: dict, pid: int, packed: bool, fresh: bool, sample: bool, scale=None) -> bool:
        """Steps p (its state `st`, in the group's v format; `fresh`: made for this step, dropped and not saved
        if the step is undone; `scale`: the engine's gradient factor, or None); returns True while the
        quantization-error sample is still to be taken."""
        t = step_of(st["step"]) + 1
        st["step"] = torch.tensor(float(t))
        sc = scalars(group, t)
        undo = self.tier.undo  # a transactional tier's log of what changes in place (None on the RAM tiers)
        if self.master != "fp32":
            self._step_compact(group, p, pid, st, sc, t, packed, undo, fresh, scale)
            return sample
        master = st.get("master")
        w = master if master is not None else p.data.view(-1)
        # the gradient scale: inside the fused CPU step, as each gradient is read; else an fp32 gradient is scaled
        # in place (exact) and a bf16 one in fp32, segment by segment as it is read
        fused_scale = scale is not None and packed and w.device.type == "cpu" \
            and self.cpu_ext() is not None and p.grad.dtype in (torch.float32, torch.bfloat16)
        seg_scale = scale if scale is not None and not fused_scale and p.grad.dtype != torch.float32 else None
        if scale is not None and not fused_scale and seg_scale is None:
            p.grad.mul_(scale)
        if undo is not None and (not self.tier.segmented(p) or not packed):  # whole, up front
            for kept in (p.data, *(() if fresh else (st[k] for k in ("master", "exp_avg", "exp_avg_sq") if k in st))):
                undo.save(kept)
        if not packed:
            g = p.grad.reshape(-1).to(w.device)
            g = scaled(g, seg_scale)
            bf = torch.empty(w.numel(), dtype=torch.bfloat16, device=w.device) if "bf16" in self.copies.wanted \
                else None
            R.fp32_step(w, g, st["exp_avg"], st["exp_avg_sq"], sc, maximize=group["maximize"], bf16_out=bf)
            self._write_back(p, master, bf)
            self.copies.finish(p, w, bf)
            return sample
        args = dict(sc=sc, maximize=group["maximize"], v_format=st["v_format"],
                    stochastic=group["m_rounding"] == "stochastic", v_stochastic=group["v_rounding"] == "stochastic",
                    seed=R.sr_seed(group["seed"], t), grad_scale=float(scale) if fused_scale else None)
        bf = self.copies.bf16_out(p, w, p.is_cuda and w.device.type == "cpu" and p.dtype == torch.bfloat16,
                                  self.tier.pinned(p))
        stream = self.stream_id(p, pid)
        if not self.tier.segmented(p) and seg_scale is None:
            m, v = self.tier.states(st, p)
            check = self._sampler(w, scaled(p.grad.reshape(-1)[:R.CHUNK], scale if fused_scale else None), m, v,
                                  args) if sample else None
            regions, own = self.copies.fused_regions(p, w, self.cpu_ext() is not None)
            with metrics.timer("optim.time.compute"):
                res = self._compute(w, p.grad.reshape(-1), m, v, args, R.sr_stream(stream, 0), bf, regions)
            if check is not None:
                check(m, v)
                sample = False
            self._write_back(p, master, bf)
            self.copies.finish(p, w, bf, *self.copies.region_results(p, w, regions, res, own))
            return sample

        p_seg = master is not None and p.data.is_contiguous()  # p changes segment by segment (or in one copy)
        if undo is not None and master is not None and not p_seg:
            undo.save(p.data)

        def segment(s0, s1, g, m, v, res=None):
            nonlocal sample
            g = scaled(g, seg_scale)
            if undo is not None:  # what this segment changes in place, just before it changes
                if master is None or not fresh:
                    undo.save(w, s0, s1)
                if p_seg:
                    undo.save(p.data, s0, s1)
            check = self._sampler(w[s0:s1], scaled(g[:R.CHUNK], scale if fused_scale else None), m, v, args) \
                if (sample and s0 == 0) else None
            with metrics.timer("optim.time.compute"):
                self._compute(w[s0:s1], g, m, v, args, R.sr_stream(stream, s0 // R.SEGMENT),
                              None if bf is None else bf[s0:s1])
            if check is not None:
                check(m, v)
                sample = False

        if self.tier.segmented(p):
            self.tier.step_segments(st, p, segment, bf if p.dtype == torch.bfloat16 else w)
        else:  # states in RAM, a scaled bf16 gradient: the segments one after another, as a segmented tier's
            self.tier.step_in_place(st, p, segment)
        if not p.is_cuda:  # a GPU parameter got its segments as they were computed
            self._write_back(p, master, bf)
        self.copies.finish(p, w, bf)
        return sample

    def _step_compact(self, group, p, pid, st, sc: R.StepScalars, t: int, packed: bool, undo=None,
                      fresh: bool = False, scale=None) -> None:
        """The step of a bf16 parameter with a compact master (``master="split"`` or ``"bf16"``); `undo`: the
        transactional tier's log, given what changes in place (the parameter, the residual in RAM unless `fresh`;
        a residual in the NVMe files goes to the step's generation like the states); `scale`: the engine's
        gradient factor, applied to each segment in fp32."""
        h = p.data.view(-1)
        split = self.master == "split"
        stream = self.stream_id(p, pid)
        seed = R.sr_seed(group["seed"], t)
        lo_ram = st.get("master_lo")  # None under split: the residual comes with each segment from its file
        if not packed:  # fp32 states: the torch step on the rebuilt master
            if undo is not None:
                for kept in (h, *(() if fresh else (st[k] for k in ("master_lo", "exp_avg", "exp_avg_sq") if k in st))):
                    undo.save(kept)
            x = MW.join(h, lo_ram, st["master_odd"]) if split else h.float()
            R.fp32_step(x, scaled(p.grad.reshape(-1), scale), st["exp_avg"], st["exp_avg_sq"], sc,
                        maximize=group["maximize"])
            odd = self._store_compact(h, x, lo_ram, seed, R.sr_stream(stream, 0))
            if split:
                st["master_odd"] = odd
            return
        args = dict(sc=sc, maximize=group["maximize"], v_format=st["v_format"],
                    stochastic=group["m_rounding"] == "stochastic", v_stochastic=group["v_rounding"] == "stochastic",
                    seed=seed)
        # the fused step (C++ on the CPU, the CUDA kernel on the GPU: same signature, same bits) or the reference
        ext = self.cpu_ext() if h.device.type == "cpu" else self.cuda_ext() if h.is_cuda else None
        odd_parts: list[torch.Tensor] = []

        def segment(s0, s1, g, m, v, res=None):
            s = s0 // R.SEGMENT
            if undo is not None:
                undo.save(h, s0, s1)
                if lo_ram is not None and not fresh:
                    undo.save(lo_ram, s0, s1)
            if res is not None:  # the segment's residual, read with its states (updated in place, written with them)
                lo, odd = res.lo, res.odd()
            else:
                lo = lo_ram[s0:s1] if split else None
                odd = MW.odd_in(st["master_odd"], s0, s1) if split else _NO_ODD
            g = scaled(g, scale)
            with metrics.timer("optim.time.compute"):
                if ext is not None:
                    if g.dtype not in (torch.float32, torch.bfloat16):
                        g = g.float()
                    new = ext.fused_step_master(
                        h[s0:s1], lo, odd.to(h.device), g.contiguous(), *m, *v,
                        sc.b1, sc.omb1, sc.b2, sc.omb2, sc.eps, sc.decay, sc.step_size, sc.rsbc2, sc.weight_decay,
                        args["maximize"], R.V_KIND[args["v_format"]], args["stochastic"], seed,
                        R.sr_stream(stream, s), 1 if split else 2, v_stochastic=args["v_stochastic"])
                else:  # the reference step (torch ops) on the rebuilt fp32 master of this segment
                    x = MW.join(h[s0:s1], lo, odd) if split else h[s0:s1].float()
                    self._compute(x, g, m, v, args, R.sr_stream(stream, s), h[s0:s1] if split else None)
                    new = self._store_compact(h[s0:s1], x, lo, seed, R.sr_stream(stream, s))
            if res is not None:
                res.set_odd(new)
            elif split:
                odd_parts.append(new.to(st["master_odd"].device) + s0)

        if self.tier.segmented(p):
            self.tier.step_segments(st, p, segment, None)
        else:  # the CUDA kernel takes every segment in one launch (its streams are stream0 + segment), one sync
            self.tier.step_in_place(st, p, segment, [(0, p.numel())] if ext is not None and h.is_cuda else None)
        if split and lo_ram is not None:
            st["master_odd"] = torch.cat(odd_parts) if odd_parts else st["master_odd"][:0]

    def _store_compact(self, h, x, lo, seed: int, stream: int) -> torch.Tensor:
        """Write the new master x of h (a segment, or a whole parameter) back in the compact form, the residual
        into `lo` (split); returns the odd positions (split), relative to h. Under split, h must hold rne(x)
        already when a step wrote it; it is written here as well, which is the same bits."""
        if self.master == "split":
            hh, r, odd = MW.split(x)
            h.copy_(hh)
            lo.copy_(r)
            return odd
        h.copy_(MW.stochastic_bf16(x, seed, stream))
        return _NO_ODD

    @staticmethod
    def _write_back(p, master, bf) -> None:
        """The new fp32 master into the parameter (its bf16 rounding when the step wrote one beside p)."""
        if master is None:
            return
        if p.dtype == torch.bfloat16 and bf is not None and bf.device == p.device:
            p.data.copy_(bf.view(p.shape))
        else:
            p.data.copy_(master.view(p.shape))

    def _compute(self, w, g, m: R.Packed, v: R.Packed, args: dict, stream0: int, bf, regions=()):
        """The step over w (a whole flat parameter or a run of whole segments starting at one).

        `regions` (CPU fused step only, from WorkingCopies.fused_regions): NVFP4 copies the step writes as it
        goes; returns the kernel's (new amax, s_dec) per region.
        """
        sc = args["sc"]
        ext = self.cpu_ext() if w.device.type == "cpu" else self.cuda_ext() if w.is_cuda else None
        if ext is not None:  # the fused step (C++ on the CPU, CUDA kernel on the GPU): same signature, same bits
            if g.dtype not in (torch.float32, torch.bfloat16):
                g = g.float()
            extra = {} if args.get("grad_scale") is None else {"grad_scale": args["grad_scale"]}  # CPU only
            return ext.fused_step(w, g.contiguous(), *m, *v, sc.b1, sc.omb1, sc.b2, sc.omb2, sc.eps, sc.decay,
                                  sc.step_size, sc.rsbc2, sc.weight_decay, args["maximize"],
                                  R.V_KIND[args["v_format"]], args["stochastic"], args["seed"], stream0, bf,
                                  **region_kernel_args(regions), v_stochastic=args["v_stochastic"], **extra)
        kern = backend_for(w.device)
        for k, (s0, s1) in enumerate(R.segment_ranges(w.numel())):
            R.packed_step(w[s0:s1], g[s0:s1], R.segment_view(m, s0, s1), R.segment_view(v, s0, s1), sc,
                          v_format=args["v_format"], m_stochastic=args["stochastic"], seed=args["seed"],
                          stream=stream0 + k, maximize=args["maximize"], kern=kern,
                          bf16_out=None if bf is None else bf[s0:s1], v_stochastic=args["v_stochastic"])

    @staticmethod
    def _sampler(w, g, m: R.Packed, v: R.Packed, args):
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


__all__ = ["ParamStep", "scalars", "scaled", "GRAD_LIMIT", "KEYED_STREAM0"]
