"""FP4AdamW: AdamW whose moments are stored in 4 bits (docs/design.md 3.7), on the GPU, in host RAM or on NVMe.

Owns the optimizer: param groups, the step (which parameters, the fused or reference kernel, the stochastic-
rounding streams, the quantization-error sample) and the state_dict / load_state_dict entry points. Where the
states live is tiers.py's, the working copies and weight regions working_copy.py's, the saved forms and the
torch AdamW conversion convert.py's, the argument checks checks.py's.
"""

from __future__ import annotations

import copy
import math
import weakref
from collections import defaultdict
from typing import Callable, Iterable

import torch
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from .. import metrics
from ..config import STATE_MIN_NUMEL, V_FORMAT_DEFAULT, V_ROUNDING_DEFAULT
from ..errors import ConfigError
from ..ops import backend_for
from . import convert, fused
from . import master as MW
from . import reference_step as R
from .checks import UNSUPPORTED, check_arguments, check_param_group, check_unsupported
from .state import PACKED_KEYS, decode_state, residual_sizes, step_of
from .tiers import make_tier
from .working_copy import WeightRegion, WorkingCopies, copy_amax, region_kernel_args

_NO_ODD = torch.zeros(0, dtype=torch.int64)


def _scaled(g: torch.Tensor, scale) -> torch.Tensor:
    """`g` multiplied by an engine's gradient factor (set_grad_scale) in fp32, as a new tensor; `g` if none."""
    return g if scale is None else g.to(torch.float32, copy=True).mul_(scale)
KEYED_STREAM0 = 1 << 15  # stochastic-rounding stream ids of tensors named by tensor_key start here
#: a gradient element this large or larger skips the step like Inf/NaN: its square overflows fp32 in the v update
GRAD_LIMIT = 2.0 ** 64


class FP4AdamW(Optimizer):
    """AdamW (decoupled weight decay, bias correction) with m in NVFP4 and sqrt(v) in 4 bits (ue2m2).

    Args:
        params: parameters or param groups, as for any torch optimizer.
        lr, betas, eps, weight_decay, maximize: as torch.optim.AdamW (weight_decay default 1e-2).
        m_rounding: ``"stochastic"`` (default) or ``"nearest"`` (benchmarks/RESULTS.md, "Accuracy", compares
            them with fp32 AdamW).
        v_rounding: rounding of the stored sqrt(v), ``"nearest"`` or ``"stochastic"`` (default
            config.V_ROUNDING_DEFAULT; docs/numerics.md, "Rounding of the optimizer states", says why).
        v_format: ``"ue2m2"`` (default, config.V_FORMAT_DEFAULT: u = sqrt(v) on a zero-free unsigned grid with two
            mantissa bits), ``"ufp4"`` (the same with one mantissa bit and a wider range: the format before
            2026-12-03, which old state dicts hold and keep) or ``"nvfp4"`` (v itself in NVFP4, the ablation's
            baseline; it flushes small v to zero). docs/numerics.md, "The grid of sqrt(v)", says why.
        min_numel: parameters with fewer elements keep fp32 states (default 4096, config.STATE_MIN_NUMEL).
        state_device: ``"same"`` (states beside the parameters), ``"cpu"`` (host RAM, pinned when CUDA is
            present; for GPU parameters the CPU runs the step segment by segment, overlapped with the
            copies) or ``"nvme"`` (packed states in files under `nvme_path`, read ahead and written behind).
        nvme_path: folder for ``state_device="nvme"`` (a private subfolder is created in it).
        nvme_threads: I/O threads of the NVMe tier (default 4).
        nvme_reserve_bytes: free space the NVMe tier leaves untouched on its disk (default 0).
        nvme_io: I/O engine of the NVMe tier: ``"auto"`` (default: DeepSpeed's async_io handle when it loads and
            works in `nvme_path`, else the thread pool, with one warning), ``"aio"`` (require it) or ``"threads"``.
            :attr:`nvme_io` tells which one runs (see fp4offload/optim/nvme.py).
        nvme_keep: keep the NVMe tier's folder when the optimizer closes or the process exits (default None:
            the environment variable ``FP4OFFLOAD_NVME_KEEP``, unset meaning False: the folder is removed). A
            kept folder is marked ``KEEP`` (never swept) and gets a ``manifest.json``; read it back with
            ``fp4offload.optim.nvme.read_kept(folder)`` and ``load_param_states``. At start the tier removes this
            user's folders under `nvme_path` whose process is gone, with a warning in the log.
        tensor_key: ``f(tensor) -> str | None``, a name for a tensor that does not depend on where it sits in
            ``param_groups``. It names the tensor's NVMe files (without it, or when it returns None: ``t<n>``,
            numbered in order of first step) and picks its stochastic-rounding stream (numbered by name in order
            of first step, in place of the position; see reference_step). A tensor keeps its NVMe key while it
            lives; two tensors holding states may not share one (ConfigError). The DeepSpeed block passes
            DeepSpeed's ``ds_id``, so ZeRO-3 sub-groups (stepped one at a time, each alone in its group) keep their
            own files and their own random streams, also across a re-created tensor.
        backend: ``"auto"`` (the fused C++/CUDA step when it builds, else the torch reference step),
            ``"fused"`` (require it) or ``"reference"`` (the torch-op step; same bits, slower).
        working_copy: also produce the new weight as ``"bf16"``, ``"nvfp4"`` (16x16, per-tensor scale),
            ``"both"`` or ``None`` (default); read it with :meth:`working_copy`. The fused CPU step writes
            both inside its pass. The NVFP4 copy is ``quantize(w, "nvfp4", block="16x16",
            amax=FP4AdamW.copy_amax(amax(w)))`` (recorded in ``copy.meta["amax"]``): the amax rounded up to a
            power of two, known before the step except when it crosses one, when the copy is encoded in a
            pass of its own (``optim.wcopy_reencodes`` counts those, and first steps).
        seed: base seed of stochastic rounding (see reference_step's docstring for the streams).
        master: how the master weight of a bf16 parameter is held (docs/numerics.md, "Master weights"):
            ``"fp32"`` (default: an fp32 copy, 4 B/param), ``"split"`` (the bf16 parameter is the upper half
            and the optimizer keeps a 16-bit residual, 2 B/param: the fp32 master exactly, so training is bit
            for bit the ``"fp32"`` run) or ``"bf16"`` (the bf16 parameter is the master, updated with
            stochastic rounding: no extra bytes). The compact forms need bf16 parameters, contiguous, stepped
            where they live (``state_device`` "same", or "nvme" for CPU parameters), and no ``working_copy``
            (the parameter is the bf16 copy). A parameter changed from outside between steps keeps its new
            value under "bf16"; under "split" its residual is kept (the master moves to within half a bf16
            step of the new value).
        master_device: where split's residual lives between steps: ``"same"`` (default: in host RAM, in
            ``optimizer.state``) or ``"nvme"`` (with ``master="split"`` and ``state_device="nvme"`` only: in each
            segment file beside that segment's m and v, read ahead and written behind with them, so host RAM
            holds no residual between steps; 2 B/param plus a bitmap of 1 bit/param on disk). Parameters under
            ``min_numel`` keep fp32 states and their residual in RAM. Training and the state dict are the same
            bit for bit either way.
        skip_nonfinite: skip the whole step when any gradient holds Inf/NaN, or a value of magnitude
            ``GRAD_LIMIT`` (2**64) or more, whose square overflows fp32 (default True); states and weights stay
            untouched and ``optim.skipped_steps`` counts it. With a gradient norm given (``grad_norm``,
            set_grad_norm_source), a norm that is not finite, negative or at least GRAD_LIMIT skips the step.
        metrics_every: every this many steps, sample the relative quantization error of m and v on the
            first chunk of the first packed parameter (0: never; default 100).
        amsgrad, foreach, fused, capturable, differentiable: torch.optim.AdamW's options, accepted only when off
            (ConfigError naming the option and why otherwise; checks.UNSUPPORTED). ``backend`` picks the step.

    A torch optimizer in full: step, state-dict and load-state-dict hooks, LR schedulers, ``lr`` as a 0-dim
    tensor, a state dict that a fresh optimizer loads to continue bit for bit, and ``copy.deepcopy`` / pickle
    that give a working optimizer (with its own tier; hooks, working copies, registered weight regions and the
    gradient-norm source are not copied; a ``tensor_key`` that cannot be pickled, e.g. a lambda, makes pickle
    fail with Python's error, deepcopy keeps the same function).

    Per-group options: lr, betas, eps, weight_decay, maximize, m_rounding, v_rounding, v_format, min_numel.

    Metrics (fp4offload.metrics): ``optim.steps``, ``optim.skipped_steps``, timers ``optim.time.step`` /
    ``.compute`` / ``.nvme_read_wait`` / ``.nvme_write_wait`` / ``.d2h_wait``, counters ``optim.nvme.bytes_read``
    / ``bytes_written``, ``optim.bytes_d2h`` / ``bytes_h2d``, gauges ``optim.state_bytes.{host,device,nvme}`` and
    ``optim.qerr.{m,v}`` (relative L2 error of the stored m and v against the exact fp32 values of that step).

    State tiers (tiers.py): where m and v live between steps; the optimizer asks its tier for a tensor's
    states and steps them in place, in one pass or segment by segment (host tier with GPU parameters, NVMe).

    NVMe tier, a failed step is all or nothing: the disk space of the whole step is checked and reserved
    before anything changes; the new states go to a new generation of files, switched in when the whole step
    has landed; what the step changes in place (weights, masters) is saved first (in host RAM up to
    ``tiers.UNDO_RAM_BYTES``, 256 MiB, beyond it on the state disk) and put back after any error. So after a
    CapacityError, CorruptionError or any other error out of ``step()`` the parameters, step counts and m and
    v are those before the step, and once the cause is gone training continues as if that step had been
    skipped. A segment is checked when it is read (checksums, identity, step, generation, run id): a damaged
    or stale file raises CorruptionError naming the file and the segment and is left as it is.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, maximize: bool = False,
                 m_rounding: str = "stochastic", v_rounding: str = V_ROUNDING_DEFAULT,
                 v_format: str = V_FORMAT_DEFAULT,
                 min_numel: int = STATE_MIN_NUMEL,
                 state_device: str = "same", nvme_path=None, nvme_threads: int = 4, nvme_reserve_bytes: int = 0,
                 nvme_io: str = "auto", nvme_keep: bool | None = None,
                 tensor_key: Callable[[torch.Tensor], str | None] | None = None,
                 backend: str = "auto", working_copy: str | None = None, seed: int = 0,
                 skip_nonfinite: bool = True, metrics_every: int = 100, master: str = "fp32",
                 master_device: str = "same", amsgrad: bool = False, foreach: bool | None = None,
                 fused: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 _defer_master_check: bool = False):
        check_unsupported(dict(amsgrad=amsgrad, foreach=foreach, fused=fused, capturable=capturable,
                               differentiable=differentiable))
        nvme_path = check_arguments(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, m_rounding=m_rounding,
                                    v_rounding=v_rounding,
                                    v_format=v_format, min_numel=min_numel, state_device=state_device,
                                    nvme_path=nvme_path, nvme_io=nvme_io, tensor_key=tensor_key, backend=backend,
                                    working_copy=working_copy, master=master, maximize=maximize,
                                    nvme_threads=nvme_threads, nvme_reserve_bytes=nvme_reserve_bytes, seed=seed,
                                    skip_nonfinite=skip_nonfinite, metrics_every=metrics_every,
                                    master_device=master_device)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, maximize=maximize,
                        m_rounding=m_rounding, v_rounding=v_rounding, v_format=v_format, min_numel=int(min_numel),
                        seed=int(seed))
        super().__init__(params, defaults)
        self.state_device = state_device
        self.backend = backend
        self.working_copy_format = working_copy
        self.master = master
        self.master_device = master_device
        self.skip_nonfinite = skip_nonfinite
        self.metrics_every = int(metrics_every)
        self.skipped_steps = 0
        self._steps_taken = 0
        self._copies = WorkingCopies(working_copy)
        self._tensor_key_fn = tensor_key
        self._stream_numbers: dict[str, int] = {}  # tensor_key name -> its stochastic-rounding stream number
        me = weakref.ref(self)  # the tier must not keep the optimizer alive (its __del__ closes the tier)
        # what a copy (copy.deepcopy, pickle) needs to build its own tier: see __setstate__
        self._tier_args = dict(nvme_path=nvme_path, nvme_threads=nvme_threads, nvme_reserve_bytes=nvme_reserve_bytes,
                               nvme_io=nvme_io, nvme_keep=nvme_keep, residuals=master_device == "nvme")
        self._tier = make_tier(state_device, **self._tier_args, tensor_key=tensor_key,
                               has_states=lambda t: "step" in me().state.get(t, {}))
        self.nvme_io = None if self._tier.store is None else self._tier.store.io
        # an engine that re-points the groups at its own partitions (DeepSpeed's ZeRO) checks at the first step
        for group in [] if _defer_master_check else self.param_groups:
            for p in group["params"]:
                self._check_master(p)

    def _check_master(self, p) -> None:
        """A compact master needs a bf16 parameter it can update in place (ConfigError otherwise)."""
        if self.master == "fp32":
            return
        why = None
        if p.dtype != torch.bfloat16:
            why = (f"a {p.dtype} parameter", "cast the model to bf16 first (model.to(torch.bfloat16)), or use "
                   "master='fp32'")
        elif not p.is_contiguous():
            why = ("a non-contiguous parameter", "make it contiguous, or use master='fp32'")
        elif self._tier.compute_device(p) != p.device:
            why = (f"a {p.device.type} parameter with state_device={self.state_device!r}",
                   "keep the states beside the parameter (state_device='same'), or use master='fp32'")
        if why is not None:
            raise ConfigError("master", self.master, "bf16 parameters the step can update where they live", why[1]
                              + f" (got {why[0]} of shape {tuple(p.shape)})")

    def add_param_group(self, param_group: dict) -> None:
        if isinstance(param_group, dict):  # torch AdamW's per-group options FP4AdamW lacks (ConfigError when on)
            check_unsupported({k: v for k, v in param_group.items() if k != "params"})
        check_param_group(param_group, len(getattr(self, "param_groups", ())), getattr(self, "defaults", None))
        super().add_param_group(param_group)
        if getattr(self, "_tier", None) is not None:  # the constructor checks its groups once the tier exists
            for p in self.param_groups[-1]["params"]:
                self._check_master(p)

    # ---- the NVMe tier's store and keys, as tests and integrations reach them -------------------------

    @property
    def _nvme(self):
        """The NVMe tier's NvmeStore (None on the other tiers, or once closed)."""
        return self._tier.store

    @property
    def _nvme_keys(self):
        """tensor -> key of its NVMe files (None on the other tiers)."""
        return getattr(self._tier, "keys", None)

    def _nvme_key(self, p) -> str:
        return self._tier.key(p)

    # ---- helpers ----------------------------------------------------------------------------------------

    def _params(self):
        pid = 0
        for group in self.param_groups:
            for p in group["params"]:
                yield group, p, pid
                pid += 1

    def _packed(self, group, p) -> bool:
        return p.numel() >= group["min_numel"]

    def _cpu_ext(self):
        return None if self.backend == "reference" else fused.cpu_extension()

    def _cuda_ext(self):
        return None if self.backend == "reference" else fused.cuda_extension()

    def _init_state(self, group, p, m: R.Packed | None = None, v: R.Packed | None = None, res=None) -> dict:
        """p's fresh state: step 0, a master when p is not fp32, contiguous and on the compute device, and zero
        states (or the packed (m, v) given, which the tier stores); `res`: split's residual ``(lo, odd)`` to
        start from (None: zeros), in RAM or, with ``master_device="nvme"``, in the tier's files."""
        self._check_master(p)
        st = self.state[p]
        dev = self._tier.compute_device(p)
        st["step"] = torch.tensor(0.0)
        in_files = self.master_device == "nvme" and self._packed(group, p)
        if self.master == "split" and not in_files:  # the bf16 parameter is the master's upper half: residual 0
            st["master_lo"] = torch.zeros(p.numel(), dtype=torch.int16, device=dev)
            st["master_odd"] = torch.zeros(0, dtype=torch.int64, device=dev)
            if res is not None:
                st["master_lo"].copy_(res[0].reshape(-1))
                st["master_odd"] = res[1].to(dev)
        elif self.master in ("split", "bf16"):  # split: the tier's files keep it; bf16: the parameter is the master
            pass
        elif p.dtype != torch.float32 or not p.is_contiguous() or dev != p.device:
            master = torch.empty(p.numel(), dtype=torch.float32, device=dev, pin_memory=self._tier.pinned(p))
            master.copy_(p.detach().reshape(-1))
            st["master"] = master
        if not self._packed(group, p):
            st["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=dev)
            st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=dev)
        else:
            st["v_format"] = group["v_format"]
            self._tier.put(st, p, m, v, res if in_files else None)
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

    # ---- the step ---------------------------------------------------------------------------------------

    def _grads_finite(self, grads: list[torch.Tensor]) -> bool:
        """Whether every gradient is finite and below GRAD_LIMIT in magnitude (one min/max pass per gradient,
        one host read per device). A larger one would overflow g*g in fp32 (docs/numerics.md)."""
        flags: dict[torch.device, list[torch.Tensor]] = {}
        ext = self._cpu_ext() if any(g.device.type == "cpu" for g in grads) else None
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

    def set_grad_norm_source(self, fn: Callable[[], float | None] | None) -> None:
        """Where this step's global gradient norm can be read (an engine that computes it anyway, as DeepSpeed
        does for clipping): ``fn()`` returns it, or None when it was not computed. With a norm, the
        non-finite check reads it instead of every gradient (a norm that is not finite, or negative, as
        DeepSpeed reports Inf/NaN, skips the step). None removes the source."""
        if fn is not None and not callable(fn):
            raise ConfigError("fn", fn, "None or a function () -> float | None")
        self._grad_norm_fn = fn

    def set_grad_scale(self, p, scale) -> None:
        """The next step multiplies p's gradient by `scale` (a float or a 0-d tensor) in fp32, as it reads each
        segment: what an engine's clipping does to an fp32 gradient partition, kept exact for a bf16 gradient,
        which a multiply in place would round to bf16. The fused CPU step applies it as it reads each gradient and
        leaves the gradient as it was; the other backends multiply an fp32 gradient in place. DeepSpeed ZeRO-3
        clips this way when the master's gradient is its bf16 gradient partition (integrations/ds_host.fp32_clip),
        so its steps see the gradients of the run with an fp32 gradient buffer. A step that is
        skipped drops the scale. `p` need not be in param_groups yet (ZeRO-3 points them at each sub-group only
        for its step)."""
        if not torch.is_tensor(p):
            raise ConfigError("p", type(p).__name__, "a parameter tensor")
        v = float(scale.item() if torch.is_tensor(scale) else scale)
        if not (math.isfinite(v) and v > 0):
            raise ConfigError("scale", v, "a finite positive gradient scale")
        if v == 1.0:  # x * 1 is x for every float: no pass over the gradient (DeepSpeed's factor when not clipping)
            self._pending_scales().pop(p, None)
            return
        self._pending_scales()[p] = scale

    def _pending_scales(self):
        if getattr(self, "_grad_scales", None) is None:
            self._grad_scales = WeakIdKeyDictionary()
        return self._grad_scales

    def _finite_from_norm(self, grad_norm) -> bool | None:
        """Whether the gradients are finite, from the norm given or the source's (None: unknown)."""
        if grad_norm is None and getattr(self, "_grad_norm_fn", None) is not None:
            grad_norm = self._grad_norm_fn()
        if grad_norm is None:
            return None
        v = float(grad_norm.item() if torch.is_tensor(grad_norm) else grad_norm)
        return math.isfinite(v) and 0 <= v < GRAD_LIMIT  # no element is larger than the norm

    @torch.no_grad()
    def step(self, closure: Callable | None = None, *, grad_norm=None):
        """One AdamW step over every parameter with a gradient; returns the closure's loss.

        `grad_norm`: this step's global gradient norm when the caller has it (clipping computes it); the
        non-finite check then costs nothing (see set_grad_norm_source)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [(g, p, pid) for g, p, pid in self._params() if p.grad is not None]
        for _, p, _ in todo:
            if p.grad.is_sparse:
                raise ConfigError("grad", "a sparse gradient", "dense gradients", "FP4AdamW has no sparse path")
        for _, p, _ in todo:
            self._copies.clear_results(p)
        scales = self._pending_scales()  # read by _step_param, dropped when this step ends however it ends
        try:
            with metrics.timer("optim.time.step"):
                finite = self._finite_from_norm(grad_norm) if self.skip_nonfinite and todo else True
                if finite is None:
                    finite = self._grads_finite([p.grad for _, p, _ in todo])
                if not finite:
                    self.skipped_steps += 1
                    metrics.counter("optim.skipped_steps").add(1)
                    return loss
                self._steps_taken += 1
                sample = self.metrics_every > 0 and self._steps_taken % self.metrics_every == 0
                if self._tier.transactional:
                    self._step_all_or_nothing(todo, sample)
                else:
                    for group, p, pid in todo:
                        sample = self._step_param(group, p, pid, sample) and sample
                    self._tier.end_step()
                metrics.counter("optim.steps").add(1)
        finally:
            scales.clear()
        if self.metrics_every > 0 and self._steps_taken % self.metrics_every == 0:
            self.state_bytes()  # refreshes the optim.state_bytes.* gauges
        return loss

    def _step_all_or_nothing(self, todo, sample: bool) -> None:
        """The step on a transactional tier (NVMe): all of it lands, or none of it.

        The disk space of the whole step (every packed parameter's new files, and the undo log's share) is
        checked and reserved first: CapacityError there changes nothing. The new states go to a new generation
        of files, switched in once every write landed; what the step changes in place (weights, masters,
        residuals, small fp32 states) is saved in the tier's undo log just before it changes. After any error
        the step is undone (weights and in-place states restored, the step counts, fresh states, stream numbers
        and counters as they were, the new files deleted) and the error re-raised: the optimizer is as before
        the step and usable once the cause is gone."""
        tier = self._tier
        counters = (self._steps_taken - 1, dict(self._stream_numbers))
        try:
            tier.begin_step(*self._step_bytes(todo))
        except BaseException:
            self._steps_taken = counters[0]
            raise
        saved = []
        for _, p, _ in todo:
            st = self.state.get(p)
            saved.append((p, st, None if st is None else dict(st)))
        try:
            for group, p, pid in todo:
                sample = self._step_param(group, p, pid, sample) and sample
            tier.finish_step()
        except BaseException:
            try:
                tier.abort_step()
            finally:
                for p, st, contents in saved:
                    if st is None:
                        self.state.pop(p, None)
                    else:
                        st.clear()
                        st.update(contents)
                        self.state[p] = st
                    self._copies.clear_results(p)
                self._steps_taken, self._stream_numbers = counters
            raise
        tier.commit_step()

    def _step_bytes(self, todo) -> tuple[int, int]:
        """(state-file bytes, undo bytes): at most what a transactional step over `todo` writes to disk (with
        split's residuals when the files keep them: their size is fixed, so this is exact), and what its undo
        log saves (a residual in the files needs none: it goes to the step's generation)."""
        from .nvme import tensor_disk_bytes
        from .tiers import undo_bytes

        write = undo = 0
        for group, p, _ in todo:
            st = self.state.get(p, {})
            packed = self._packed(group, p)
            if packed:
                converts = "v_format" in st and st["v_format"] != group["v_format"]
                write += tensor_disk_bytes(p.numel(), self.master_device == "nvme") * (2 if converts else 1)
            # the parameter, and the states it holds that change in place (new states are dropped, not saved)
            undo += undo_bytes(p, *(st[k] for k in ("master", "master_lo", "exp_avg", "exp_avg_sq") if k in st))
        return write, undo

    def _scalars(self, group, step: int) -> R.StepScalars:
        b1, b2 = group["betas"]
        return R.StepScalars.make(lr=float(group["lr"]), beta1=b1, beta2=b2, eps=group["eps"],
                                  weight_decay=group["weight_decay"], step=step)

    def _step_param(self, group, p, pid, sample: bool) -> bool:
        """Steps one parameter; returns True while the quantization-error sample is still to be taken."""
        st = self.state[p]
        fresh = "step" not in st  # its states are new: dropped, not saved, if the step is undone
        if fresh:
            st = self._init_state(group, p)
        elif "v_format" in st and st["v_format"] != group["v_format"]:  # the group's v_format changed: convert once
            convert.change_v_format(self, group, p)
            st = self.state[p]
        t = step_of(st["step"]) + 1
        st["step"] = torch.tensor(float(t))
        sc = self._scalars(group, t)
        undo = self._tier.undo  # a transactional tier's log of what changes in place (None on the RAM tiers)
        scale = self._pending_scales().get(p)
        if self.master != "fp32":
            self._step_compact(group, p, pid, st, sc, t, undo, fresh, scale)
            return sample
        master = st.get("master")
        w = master if master is not None else p.data.view(-1)
        # the gradient scale: inside the fused CPU step, as each gradient is read; else an fp32 gradient is scaled
        # in place (exact) and a bf16 one in fp32, segment by segment as it is read
        fused_scale = scale is not None and self._packed(group, p) and w.device.type == "cpu" \
            and self._cpu_ext() is not None and p.grad.dtype in (torch.float32, torch.bfloat16)
        seg_scale = scale if scale is not None and not fused_scale and p.grad.dtype != torch.float32 else None
        if scale is not None and not fused_scale and seg_scale is None:
            p.grad.mul_(scale)
        if undo is not None and (not self._tier.segmented(p) or not self._packed(group, p)):  # whole, up front
            for kept in (p.data, *(() if fresh else (st[k] for k in ("master", "exp_avg", "exp_avg_sq") if k in st))):
                undo.save(kept)
        if not self._packed(group, p):
            g = p.grad.reshape(-1).to(w.device)
            g = _scaled(g, seg_scale)
            bf = torch.empty(w.numel(), dtype=torch.bfloat16, device=w.device) if "bf16" in self._copies.wanted \
                else None
            R.fp32_step(w, g, st["exp_avg"], st["exp_avg_sq"], sc, maximize=group["maximize"], bf16_out=bf)
            self._write_back(p, master, bf)
            self._copies.finish(p, w, bf)
            return sample
        args = dict(sc=sc, maximize=group["maximize"], v_format=st["v_format"],
                    stochastic=group["m_rounding"] == "stochastic", v_stochastic=group["v_rounding"] == "stochastic",
                    seed=R.sr_seed(group["seed"], t), grad_scale=float(scale) if fused_scale else None)
        bf = self._copies.bf16_out(p, w, p.is_cuda and w.device.type == "cpu" and p.dtype == torch.bfloat16,
                                   self._tier.pinned(p))
        stream = self._stream_id(p, pid)
        if not self._tier.segmented(p) and seg_scale is None:
            m, v = self._tier.states(st, p)
            check = self._sampler(w, _scaled(p.grad.reshape(-1)[:R.CHUNK], scale if fused_scale else None), m, v,
                                  args) if sample else None
            regions, own = self._copies.fused_regions(p, w, self._cpu_ext() is not None)
            with metrics.timer("optim.time.compute"):
                res = self._compute(w, p.grad.reshape(-1), m, v, args, R.sr_stream(stream, 0), bf, regions)
            if check is not None:
                check(m, v)
                sample = False
            self._write_back(p, master, bf)
            self._copies.finish(p, w, bf, *self._copies.region_results(p, w, regions, res, own))
            return sample

        p_seg = master is not None and p.data.is_contiguous()  # p changes segment by segment (or in one copy)
        if undo is not None and master is not None and not p_seg:
            undo.save(p.data)

        def segment(s0, s1, g, m, v, res=None):
            nonlocal sample
            g = _scaled(g, seg_scale)
            if undo is not None:  # what this segment changes in place, just before it changes
                if master is None or not fresh:
                    undo.save(w, s0, s1)
                if p_seg:
                    undo.save(p.data, s0, s1)
            check = self._sampler(w[s0:s1], _scaled(g[:R.CHUNK], scale if fused_scale else None), m, v, args) \
                if (sample and s0 == 0) else None
            with metrics.timer("optim.time.compute"):
                self._compute(w[s0:s1], g, m, v, args, R.sr_stream(stream, s0 // R.SEGMENT),
                              None if bf is None else bf[s0:s1])
            if check is not None:
                check(m, v)
                sample = False

        if self._tier.segmented(p):
            self._tier.step_segments(st, p, segment, bf if p.dtype == torch.bfloat16 else w)
        else:  # states in RAM, a scaled bf16 gradient: the segments one after another, as a segmented tier's
            self._tier.step_in_place(st, p, segment)
        if not p.is_cuda:  # a GPU parameter got its segments as they were computed
            self._write_back(p, master, bf)
        self._copies.finish(p, w, bf)
        return sample

    def start_master(self, p, lo: torch.Tensor, odd: torch.Tensor | None = None) -> None:
        """Start the split master of `p` from a residual: `p` holds ``rne(x)`` of fp32 values x it was cast
        from, `lo` and `odd` are ``master.split(x)``'s (fp4offload/optim/master.py), so the first step starts
        from x itself, as an fp32 master would. For p without state yet (``master="split"`` only)."""
        if self.master != "split":
            raise ConfigError("master", self.master, "'split' for start_master", "only split keeps a residual")
        group = next((g for g in self.param_groups if any(q is p for q in g["params"])), None)
        if group is None or "step" in self.state.get(p, {}):
            raise ConfigError("p", f"a tensor of shape {tuple(p.shape)}", "a parameter of this optimizer that has "
                              "no state yet")
        if lo.numel() != p.numel() or lo.dtype != torch.int16:
            raise ConfigError("lo", f"{lo.numel()} {lo.dtype} values", f"{p.numel()} int16 values")
        odd = odd if odd is not None else torch.zeros(0, dtype=torch.int64)
        self._init_state(group, p, res=(lo.reshape(-1), odd))  # with master_device="nvme": written to the files

    def _step_compact(self, group, p, pid, st, sc: R.StepScalars, t: int, undo=None, fresh: bool = False,
                      scale=None) -> None:
        """The step of a bf16 parameter with a compact master (``master="split"`` or ``"bf16"``); `undo`: the
        transactional tier's log, given what changes in place (the parameter, the residual in RAM unless `fresh`;
        a residual in the NVMe files goes to the step's generation like the states); `scale`: set_grad_scale's,
        applied to each segment in fp32."""
        h = p.data.view(-1)
        split = self.master == "split"
        stream = self._stream_id(p, pid)
        seed = R.sr_seed(group["seed"], t)
        lo_ram = st.get("master_lo")  # None under split: the residual comes with each segment from its file
        if not self._packed(group, p):  # fp32 states: the torch step on the rebuilt master
            if undo is not None:
                for kept in (h, *(() if fresh else (st[k] for k in ("master_lo", "exp_avg", "exp_avg_sq") if k in st))):
                    undo.save(kept)
            x = MW.join(h, lo_ram, st["master_odd"]) if split else h.float()
            R.fp32_step(x, _scaled(p.grad.reshape(-1), scale), st["exp_avg"], st["exp_avg_sq"], sc,
                        maximize=group["maximize"])
            odd = self._store_compact(h, x, lo_ram, seed, R.sr_stream(stream, 0))
            if split:
                st["master_odd"] = odd
            return
        args = dict(sc=sc, maximize=group["maximize"], v_format=st["v_format"],
                    stochastic=group["m_rounding"] == "stochastic", v_stochastic=group["v_rounding"] == "stochastic",
                    seed=seed)
        # the fused step (C++ on the CPU, the CUDA kernel on the GPU: same signature, same bits) or the reference
        ext = self._cpu_ext() if h.device.type == "cpu" else self._cuda_ext() if h.is_cuda else None
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
            g = _scaled(g, scale)
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

        if self._tier.segmented(p):
            self._tier.step_segments(st, p, segment, None)
        else:  # the CUDA kernel takes every segment in one launch (its streams are stream0 + segment), one sync
            self._tier.step_in_place(st, p, segment, [(0, p.numel())] if ext is not None and h.is_cuda else None)
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

    def _write_back(self, p, master, bf) -> None:
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
        ext = self._cpu_ext() if w.device.type == "cpu" else self._cuda_ext() if w.is_cuda else None
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

    copy_amax = staticmethod(copy_amax)

    def register_weight_regions(self, tensor: torch.Tensor, regions: list[WeightRegion]) -> None:
        """Ask the fused CPU step to write an NVFP4 16x16 copy of each region of `tensor` (a parameter this
        optimizer steps, held in host RAM) as it updates it. Before each step set ``region.amax``; after it,
        ``region.packed`` and ``region.new_amax`` hold the result (see WeightRegion). Replaces earlier regions
        of the tensor; an empty list removes them."""
        if regions and self.master != "fp32":
            raise ConfigError("master", self.master, "'fp32' for a step that writes NVFP4 weight regions",
                              "the fused step encodes regions from the fp32 master it holds")
        self._copies.register(tensor, regions)

    def working_copy(self, p) -> dict:
        """The working copies of `p` made by the last step: ``{"bf16": Tensor (flat), "nvfp4": PackedTensor}``."""
        return self._copies.get(p)

    # ---- introspection ----------------------------------------------------------------------------------

    def state_bytes(self) -> dict[str, int]:
        """Bytes of m and v held, by place: ``{"host": ..., "device": ..., "nvme": ...}`` (masters not counted, but
        "nvme" is the size of the state files, which with ``master_device="nvme"`` hold split's residuals too)."""
        out = {"host": 0, "device": 0, "nvme": 0}
        for p, st in self.state.items():  # in param_groups or not (see master_bytes)
            if not torch.is_tensor(p):
                continue
            for k in (*PACKED_KEYS, "exp_avg", "exp_avg_sq"):
                t = st.get(k)
                if torch.is_tensor(t):
                    out["device" if t.is_cuda else "host"] += t.numel() * t.element_size()
        out["nvme"] = self._tier.disk_bytes()
        for k, val in out.items():
            metrics.gauge(f"optim.state_bytes.{k}").set(val)
        return out

    def master_bytes(self) -> dict[str, int]:
        """Bytes the optimizer holds for master weights, by place: ``{"host": ..., "device": ..., "nvme": ...}``
        (fp32 masters, or the residuals and odd positions of ``master="split"``; "bf16" holds none; "nvme": the
        residuals and odd-position bitmaps in the state files with ``master_device="nvme"``, headers and padding
        not counted)."""
        out = {"host": 0, "device": 0, "nvme": 0}
        # every tensor with state, in param_groups or not (ZeRO-3 points the groups at a sub-group only for its step)
        for p, st in self.state.items():
            if not torch.is_tensor(p):
                continue
            for k in ("master", "master_lo", "master_odd"):
                t = st.get(k)
                if torch.is_tensor(t):
                    out["device" if t.is_cuda else "host"] += t.numel() * t.element_size()
            if self.master_device == "nvme" and "v_format" in st:
                out["nvme"] += sum(sum(residual_sizes(s1 - s0)) for s0, s1 in R.segment_ranges(p.numel()))
        return out

    def close(self) -> None:
        """Release the NVMe tier's files and threads (also done when the optimizer is collected, and the
        store's folder at interpreter exit): the folder is removed, or with ``nvme_keep`` kept with a manifest
        of each tensor's step (fp4offload.optim.nvme.read_kept reads it back)."""
        keys = getattr(self._tier, "keys", None)
        steps = {}
        if keys is not None and self._tier.store is not None and self._tier.store.keep:
            for t, key in list(keys.items()):
                st = self.state.get(t)
                if st and "step" in st:
                    steps[key] = step_of(st["step"])
        self._tier.close(steps=steps)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- state dict -------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """A tier-independent state dict: packed states as uint8 CPU tensors, fp32 ones as fp32 (see state.py).

        As torch's: the state-dict pre-hooks run first and the post-hooks last (one may return a new dict);
        ``param_groups`` hold parameter ids numbered as torch numbers them, ``state`` maps an id to its entry,
        and keys of ``optimizer.state`` that are not tensors are carried over as they are. Each entry is sealed
        with a fingerprint and a CRC-32 (convert.seal_entry) that load_state_dict verifies.
        """
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        ids: dict[int, int] = {}
        start, groups = 0, []
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            ids.update({id(p): i for i, p in enumerate(g["params"], start) if id(p) not in ids})
            packed["params"] = [ids[id(p)] for p in g["params"]]
            start += len(packed["params"])
            groups.append(packed)
        self._tier.sync()
        state, seen = {}, set()
        for g in self.param_groups:
            for p in g["params"]:
                if id(p) in seen:
                    continue
                seen.add(id(p))
                e = convert.saved_entry(self, p)
                if e is not None:
                    state[ids[id(p)]] = convert.seal_entry(e, ids[id(p)], p)
        state.update({k: v for k, v in self.state.items() if not torch.is_tensor(k)})
        sd = {"state": state, "param_groups": groups}
        for hook in self._optimizer_state_dict_post_hooks.values():
            out = hook(self, sd)
            if out is not None:
                sd = out
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of FP4AdamW (any tier) or of torch.optim.AdamW (quantized once).

        As torch's: the load pre-hooks run first (on a shallow copy; one may return a new dict), the post-hooks
        last, group sizes must match, parameters are matched through the saved groups' ids, and keys that are not
        parameter ids (strings that are not integers) are kept in ``optimizer.state`` as they are. Every entry is
        checked before anything changes: a key that is no saved parameter id (``-1``, an id past the end) or an
        entry whose fingerprint names another parameter or shape is a ConfigError naming the key, a checksum
        mismatch a CorruptionError (convert.check_entry). Survives a caller that cast the state tensors to a
        floating dtype (packed states are whole bytes). torch AdamW groups with ``amsgrad=True`` are refused
        (their max_exp_avg_sq would be lost); its implementation flags (foreach, fused, capturable,
        differentiable) are dropped. To take over the states of a live torch AdamW without a state dict:
        convert.load_param_states.
        """
        state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = hook(self, state_dict)
            if out is not None:
                state_dict = out
        if "param_groups" not in state_dict:
            raise ConfigError("state_dict", f"a dict with keys {sorted(map(str, state_dict))}",
                              "an optimizer state dict ('state' and 'param_groups')")
        saved_groups = copy.deepcopy(list(state_dict["param_groups"]))
        if len(saved_groups) != len(self.param_groups):
            raise ConfigError("state_dict['param_groups']", f"{len(saved_groups)} groups",
                              f"{len(self.param_groups)}, as this optimizer has", "the state dict belongs to another "
                              "model (loaded state dict has a different number of parameter groups)")
        for i, (g, sg) in enumerate(zip(self.param_groups, saved_groups)):
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
        for sg, g in zip(saved_groups, self.param_groups):
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
            convert.check_entry(entry, pid, id_map[pid])
            plan.append((id_map[pid], entry))
        groups = []
        for g, sg in zip(self.param_groups, saved_groups):
            sg["params"] = g["params"]
            if "param_names" in g and "param_names" not in sg:
                sg["param_names"] = g["param_names"]
            for k in UNSUPPORTED:
                sg.pop(k, None)
            sg.pop("decoupled_weight_decay", None)
            for k, val in self.defaults.items():  # a torch AdamW state dict lacks our per-group options
                sg.setdefault(k, val)
            sg["betas"] = tuple(sg["betas"])
            groups.append(sg)
        self.param_groups = groups
        self.state = defaultdict(dict)
        group_of: dict[int, dict] = {}
        for g in groups:
            for p in g["params"]:
                group_of.setdefault(id(p), g)
        for p, entry in plan:
            convert.load_entry(self, group_of[id(p)], p, entry)
        self.state.update(extra)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # ---- copy.deepcopy and pickle -----------------------------------------------------------------------

    def __getstate__(self) -> dict:
        """What copy.deepcopy and pickle carry: every attribute but the tier (the copy builds its own), the
        working copies and registered weight regions, the gradient-norm source and the hooks (torch's optimizers
        drop hooks too). On the NVMe tier the packed states (and residuals kept there) are read back from the
        files and travel along; the copy writes them into a folder of its own under the same ``nvme_path``."""
        self._tier.sync()
        cls = type(self)  # an instance attribute shadowing a method (an engine's wrapper) belongs to the original
        out = {k: v for k, v in self.__dict__.items()
               if k not in _NOT_COPIED and not (callable(v) and callable(getattr(cls, k, None)))}
        if self.state_device == "nvme":
            if self._tier.store is None:
                raise ConfigError("state_device", "nvme", "an optimizer that is not closed, to copy or pickle it",
                                  "close() removed its state files")
            out["_nvme_states"] = {p: self._tier.states_and_residual(st, p) for p, st in self.state.items()
                                   if torch.is_tensor(p) and "v_format" in st}
        return out

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        nvme_states = state.pop("_nvme_states", None)
        had_differentiable = "differentiable" in state.get("defaults", {})
        super().__setstate__(state)  # the hook dicts, the hooked step
        if not had_differentiable:  # torch's __setstate__ adds it; FP4AdamW has no such option
            self.defaults.pop("differentiable", None)
        self._copies = WorkingCopies(self.working_copy_format)
        me = weakref.ref(self)
        self._tier = make_tier(self.state_device, **self._tier_args, tensor_key=self._tensor_key_fn,
                               has_states=lambda t: "step" in me().state.get(t, {}))
        self.nvme_io = None if self._tier.store is None else self._tier.store.io
        for p, st in list(self.state.items()):
            if torch.is_tensor(p) and "v_format" in st:
                if nvme_states is not None:
                    self._tier.put(st, p, *nvme_states[p])
                elif self._tier.pinned(p):  # page-locked again (a copied tensor is not)
                    self._tier.put(st, p, *self._tier.states(st, p))


_NOT_COPIED = ("_tier", "_copies", "_grad_norm_fn", "_grad_scales", "_optimizer_step_pre_hooks",
               "_optimizer_step_post_hooks",
               "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
               "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


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


__all__ = ["FP4AdamW", "WeightRegion"]
