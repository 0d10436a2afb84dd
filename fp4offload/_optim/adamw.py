"""FP4AdamW: AdamW whose moments are stored in 4 bits (docs/design.md 3.7), on the GPU, in host RAM or on NVMe.

Owns the optimizer: its arguments, param groups, which parameters a step visits and the step as a whole (the
non-finite check, the counters), and torch's entry points (state dict, hooks, copy and pickle). One
parameter's step is step.py's (ParamStep), where the states live and the step's transaction placement.py's
(Placement), what an engine plugs in hooks.py's (EngineHooks), the option groups options.py's, the saved forms
and the torch AdamW conversion convert.py's, the argument checks checks.py's.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Callable, Iterable, Iterator

import torch
from torch.optim import Optimizer

from .. import _metrics as metrics
from ..errors import ConfigError
from . import convert
from .checks import (check_arguments, check_extra_keywords, check_master, check_not_sharded,
                     check_param_group, check_unsupported)
from .hooks import EngineHooks
from .options import NvmeOptions, StateFormat, StepOptions
from .placement import Placement
from .shards import STATE, LocalShards, ShardedEntryPoints, zero_lr_step
from .step import GRAD_LIMIT, KEYED_STREAM0, ParamStep
from .working_copy import WeightRegion, copy_amax


class FP4AdamW(ShardedEntryPoints, Optimizer):
    """AdamW (decoupled weight decay, bias correction) with m in NVFP4 and sqrt(v) in 4 bits (ue2m2).

    Args:
        params: parameters or param groups, as for any torch optimizer.
        lr, betas, eps, weight_decay, maximize: as torch.optim.AdamW (weight_decay default 1e-2).
        master: how the master weight of a bf16 parameter is held (docs/numerics.md, "Master weights"):
            ``"fp32"`` (default: an fp32 copy, 4 B/param), ``"split"`` (the bf16 parameter is the upper half
            and the optimizer keeps a 16-bit residual, 2 B/param: the fp32 master exactly, so training is bit
            for bit the ``"fp32"`` run) or ``"bf16"`` (the bf16 parameter is the master, updated with
            stochastic rounding: no extra bytes). The compact forms need bf16 parameters, contiguous, stepped
            where they live (``state_device`` "same", or "nvme" for CPU parameters), and no working copy
            (the parameter is the bf16 copy). A parameter changed from outside between steps keeps its new
            value under "bf16"; under "split" its residual is kept (the master moves to within half a bf16
            step of the new value).
        state_device: ``"same"`` (states beside the parameters), ``"cpu"`` (host RAM, pinned when CUDA is
            present; for GPU parameters the CPU runs the step segment by segment, overlapped with the
            copies) or ``"nvme"`` (packed states in files under `nvme_path`, read ahead and written behind).
        nvme_path: folder for ``state_device="nvme"`` (a private subfolder is created in it).
        state_format: a :class:`StateFormat`: ``m_rounding``, ``v_rounding``, ``v_format``, ``min_numel`` and
            ``seed``, the defaults of the per-group options (default ``StateFormat()``).
        nvme: an :class:`NvmeOptions`: the NVMe tier's ``threads``, ``reserve_bytes``, ``io``, ``keep`` and
            ``master_device`` (where split's residual lives; default ``NvmeOptions()``).
        step_options: a :class:`StepOptions`: ``backend``, ``working_copy``, ``skip_nonfinite``,
            ``metrics_every`` and ``tensor_key`` (default ``StepOptions()``).
        amsgrad, foreach, fused, capturable, differentiable: torch.optim.AdamW's options, accepted as keywords
            only when off (ConfigError naming the option and why otherwise; checks.UNSUPPORTED). An option of a
            group given as a keyword of its own (``min_numel=``) is a ConfigError naming its group.

    Engines plug in through :attr:`hooks` (hooks.EngineHooks: the gradient-norm source, gradient scales, split's
    starting residual, NVFP4 weight regions). :attr:`placement` (placement.Placement) holds the states' tier,
    :attr:`stepper` (step.ParamStep) steps one parameter.

    A torch optimizer in full: step, state-dict and load-state-dict hooks, LR schedulers, ``lr`` as a 0-dim
    tensor, a state dict that a fresh optimizer loads to continue bit for bit, and ``copy.deepcopy`` / pickle
    that give a working optimizer (with its own tier; hooks, working copies, registered weight regions and the
    gradient-norm source are not copied; a ``tensor_key`` that cannot be pickled, e.g. a lambda, makes pickle
    fail with Python's error, deepcopy keeps the same function).

    Per-group options: lr, betas, eps, weight_decay, maximize, m_rounding, v_rounding, v_format, min_numel.

    Metrics (fp4offload._metrics): ``optim.steps``, ``optim.skipped_steps``, timers ``optim.time.step`` /
    ``.compute`` / ``.nvme_read_wait`` / ``.nvme_write_wait`` / ``.d2h_wait``, counters ``optim.nvme.bytes_read``
    / ``bytes_written``, ``optim.bytes_d2h`` / ``bytes_h2d``, gauges ``optim.state_bytes.{host,device,nvme}`` and
    ``optim.qerr.{m,v}`` (relative L2 error of the stored m and v against the exact fp32 values of that step).

    NVMe tier, a failed step is all or nothing (placement.Placement.run_step): after a CapacityError,
    CorruptionError or any other error out of ``step()`` the parameters, step counts and m and v are those before
    the step, and once the cause is gone training continues as if that step had been skipped.

    Over a sharded model's DTensor parameters (FSDP2's ``fully_shard``, HSDP) each rank steps its local shards
    (:attr:`local_shards`, shards.LocalShards): non-finite gradients skip the step on every rank together,
    ``state_dict()`` is torch AdamW's form with DTensor moments (what torch.distributed.checkpoint reshards) and
    ``packed_state_dict()`` the packed one; over plain tensors the two are the same.
    """

    state = STATE  # keyed by the tensors the step uses; over DTensors readable by the model's parameters too

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, maximize: bool = False, master: str = "fp32",
                 state_device: str = "same", nvme_path=None, state_format: StateFormat | None = None,
                 nvme: NvmeOptions | None = None, step_options: StepOptions | None = None,
                 _defer_master_check: bool = False, **torch_options):
        check_extra_keywords(torch_options)
        state_format = StateFormat() if state_format is None else state_format
        nvme = NvmeOptions() if nvme is None else nvme
        step_options = StepOptions() if step_options is None else step_options
        nvme_path = check_arguments(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize,
                                    master=master, state_device=state_device, nvme_path=nvme_path,
                                    state_format=state_format, nvme=nvme, step_options=step_options)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, maximize=maximize,
                        **state_format.group_defaults())
        self.local_shards = None
        params, shards = LocalShards.of(params)  # over DTensors: proxies of the local shards (shards.py)
        super().__init__(params, defaults)
        self.master, self.state_device, self.nvme_path = master, state_device, nvme_path
        self.state_format, self.nvme_options, self.step_options = state_format, nvme, step_options
        self.master_device = nvme.master_device
        self.backend, self.working_copy_format = step_options.backend, step_options.working_copy
        self.skip_nonfinite, self.metrics_every = step_options.skip_nonfinite, int(step_options.metrics_every)
        self.skipped_steps = 0
        self._steps_taken = 0
        self._build_rooms({})
        if state_device in ("cpu", "nvme") or any(p.device.type == "cpu" for g in self.param_groups
                                                  for p in g["params"]):
            from .threads import use_step_threads

            use_step_threads()  # the host step's threads: the rank's share of its CPUs, said once
        # an engine that re-points the groups at its own partitions (DeepSpeed's ZeRO) checks at the first step
        for group in [] if _defer_master_check else self.param_groups:
            for p in group["params"]:
                self._check_master(p)
        if shards is not None:
            self.local_shards = shards
            shards.attach(self)

    def _build_rooms(self, stream_numbers: dict[str, int]) -> None:
        """The placement (a tier of its own), the per-parameter step and the engine hooks; a copy builds its own."""
        me = weakref.ref(self)  # the tier must not keep the optimizer alive (its __del__ closes the tier)
        key = self.step_options.tensor_key
        self.placement = Placement(self.state_device, self.nvme_path, self.nvme_options, key,
                                   has_states=lambda t: "step" in me().state.get(t, {}))
        self.stepper = ParamStep(self.placement.tier, self.master, self.backend, self.working_copy_format, key,
                                 self.master_device == "nvme", stream_numbers)
        self.hooks = EngineHooks(self)
        self.nvme_io = self.placement.nvme_io

    def _check_master(self, p) -> None:
        check_master(self.master, self.state_device, p, self.placement.compute_device(p))

    def add_param_group(self, param_group: dict) -> None:
        if isinstance(param_group, dict):  # torch AdamW's per-group options FP4AdamW lacks (ConfigError when on)
            check_unsupported({k: v for k, v in param_group.items() if k != "params"})
        check_param_group(param_group, len(getattr(self, "param_groups", ())), getattr(self, "defaults", None))
        check_not_sharded(param_group)
        super().add_param_group(param_group)
        if getattr(self, "placement", None) is not None:  # the constructor checks its groups once the tier exists
            for p in self.param_groups[-1]["params"]:
                self._check_master(p)

    # ---- parameters and their states ----------------------------------------------------------------------

    def numbered_params(self) -> Iterator[tuple[dict, torch.Tensor, int]]:
        """(group, parameter, position) of every parameter of param_groups, in order; the position numbers the
        parameter's stochastic-rounding stream unless ``tensor_key`` names it."""
        pid = 0
        for group in self.param_groups:
            for p in group["params"]:
                yield group, p, pid
                pid += 1

    def is_packed(self, group: dict, p) -> bool:
        """Whether p holds packed states (at least the group's ``min_numel`` elements), else fp32 ones; a local
        shard counts its padded size, which every rank shares, so all ranks choose alike."""
        n = None if self.local_shards is None else self.local_shards.padded_numel(p)
        return (p.numel() if n is None else n) >= group["min_numel"]

    def fresh_state(self, group: dict, p, m=None, v=None, res=None) -> dict:
        """Make p's fresh state in ``optimizer.state[p]`` and return it: step 0, zero states or the packed (m, v)
        given (whole, CPU), a master where p needs one; `res`: split's residual ``(lo, odd)`` to start from (None:
        zeros)."""
        self._check_master(p)
        return self.stepper.init_state(self.state[p], group, p, self.is_packed(group, p), m, v, res)

    # ---- the step ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable | None = None, *, grad_norm=None):
        """One AdamW step over every parameter with a gradient; returns the closure's loss.

        `grad_norm`: this step's global gradient norm when the caller has it (clipping computes it); the
        non-finite check then costs nothing (see hooks.grad_norm_source)."""
        if self.local_shards is not None:
            return self.local_shards.step(self, closure, lambda: self._step(None, grad_norm))
        return self._step(closure, grad_norm)

    def sample_also_every(self, every: int) -> None:
        """Take the quantization-error sample and refresh the byte gauges every `every` steps as well (a monitor
        that writes every `every` steps: each write then has a fresh sample); no-op when metrics are off."""
        if self.metrics_every > 0 and every > 0:
            self.metrics_every = math.gcd(self.metrics_every, int(every))

    def local_grads_ok(self, grads: list[torch.Tensor]) -> bool:
        """Whether these gradients are fit to step: finite and below GRAD_LIMIT (the sharded step's vote uses it)."""
        return self.stepper.grads_finite(grads)

    def _step(self, closure: Callable | None, grad_norm):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [(g, p, pid) for g, p, pid in self.numbered_params() if p.grad is not None]
        for _, p, _ in todo:
            if p.grad.is_sparse:
                raise ConfigError("grad", "a sparse gradient", "dense gradients", "FP4AdamW has no sparse path")
        for _, p, _ in todo:
            self.stepper.copies.clear_results(p)
        try:
            with metrics.timer("optim.time.step"):
                finite = self.hooks.finite_from_norm(grad_norm) if self.skip_nonfinite and todo else True
                if finite is None and self.local_shards is not None and self.local_shards.voted:
                    finite = True  # every rank's shards passed local_grads_ok in the vote that led here
                if finite is None:
                    finite = self.stepper.grads_finite([p.grad for _, p, _ in todo])
                if not finite:
                    self.skipped_steps += 1
                    metrics.counter("optim.skipped_steps").add(1)
                    return loss
                self._steps_taken += 1
                self._step_params(todo, self.metrics_every > 0 and self._steps_taken % self.metrics_every == 0)
                metrics.counter("optim.steps").add(1)
        finally:
            self.hooks.scales.clear()  # a scale is for this step only, however it ends
        if self.metrics_every > 0 and self._steps_taken % self.metrics_every == 0:
            self.state_bytes()  # refreshes the optim.state_bytes.* gauges
        return loss

    def _step_params(self, todo: list, sample: bool) -> None:
        """Every parameter of `todo`, as one run of the placement (a transaction on the NVMe tier); `sample`: take
        the quantization-error sample on the first packed parameter."""
        counters = (self._steps_taken - 1, dict(self.stepper.stream_numbers))

        def step_all() -> None:
            s = sample
            for group, p, pid in todo:
                s = self._step_param(group, p, pid, s) and s

        def undone() -> None:
            self._steps_taken, self.stepper.stream_numbers = counters
            for _, p, _ in todo:
                self.stepper.copies.clear_results(p)

        self.placement.run_step(todo, self.state, self.is_packed, step_all, undone)

    def _step_param(self, group, p, pid: int, sample: bool) -> bool:
        st = self.state[p]
        fresh = "step" not in st  # its states are new: dropped, not saved, if the step is undone
        if fresh:
            st = self.fresh_state(group, p)
        elif "v_format" in st and st["v_format"] != group["v_format"]:  # the group's v_format changed: convert once
            convert.change_v_format(self, group, p)
            st = self.state[p]
        return self.stepper.step(group, p, st, pid, self.is_packed(group, p), fresh, sample, self.hooks.scales.get(p))

    def init_state(self) -> None:
        """Create every state without changing a parameter (one step with zero gradients and lr 0): what a
        checkpoint of the packed states loads into."""
        run = lambda: self._step(None, None)  # noqa: E731
        if self.local_shards is not None:
            return self.local_shards.init_state(self, run)
        params = [p for g in self.param_groups for p in g["params"]]
        if any("step" not in self.state.get(p, {}) for p in params):
            zero_lr_step(self, params, run)

    # ---- working copies, bytes held, closing ------------------------------------------------------------

    copy_amax = staticmethod(copy_amax)

    def working_copy(self, p) -> dict:
        """The working copies of `p` made by the last step: ``{"bf16": Tensor (flat), "nvfp4": PackedTensor}``."""
        return self.stepper.copies.get(p)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of m and v held, by place: ``{"host": ..., "device": ..., "nvme": ...}`` (masters not counted, but
        "nvme" is the size of the state files, which with ``master_device="nvme"`` hold split's residuals too)."""
        return self.placement.state_bytes(self.state)

    def master_bytes(self) -> dict[str, int]:
        """Bytes the optimizer holds for master weights, by place: ``{"host": ..., "device": ..., "nvme": ...}``
        (fp32 masters, or the residuals and odd positions of ``master="split"``; "bf16" holds none; "nvme": the
        residuals and odd-position bitmaps in the state files with ``master_device="nvme"``, headers and padding
        not counted)."""
        return self.placement.master_bytes(self.state)

    def close(self) -> None:
        """Release the NVMe tier's files and threads (also done when the optimizer is collected, and the
        store's folder at interpreter exit): the folder is removed, or with ``nvme.keep`` kept with a manifest
        of each tensor's step (fp4offload.read_kept reads it back)."""
        self.placement.close(self.state)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---- state dict -------------------------------------------------------------------------------------

    # state_dict, load_state_dict (torch AdamW's form over a sharded model, m and v quantized once on load) and
    # packed_form: shards.ShardedEntryPoints
    _packed_fp4 = True

    def packed_state_dict(self) -> dict:
        """A tier-independent state dict: packed states as uint8 CPU tensors, fp32 ones as fp32 (see state.py).

        As torch's: the state-dict pre-hooks run first and the post-hooks last (one may return a new dict);
        ``param_groups`` hold parameter ids numbered as torch numbers them, ``state`` maps an id to its entry,
        and keys of ``optimizer.state`` that are not tensors are carried over as they are. Each entry is sealed
        with a fingerprint and a CRC-32 (convert.seal_entry) that load_state_dict verifies.
        """
        with self._own_groups():
            for hook in self._optimizer_state_dict_pre_hooks.values():
                hook(self)
            sd = convert.state_dict_of(self)
            for hook in self._optimizer_state_dict_post_hooks.values():
                out = hook(self, sd)
                if out is not None:
                    sd = out
        return sd

    def load_packed_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of FP4AdamW (any tier) or of torch.optim.AdamW (quantized once), checked whole before
        anything changes (convert.load_state_dict_into). As torch's: the load pre-hooks run first (on a shallow
        copy; one may return a new dict), the post-hooks last. To take over the states of a live torch AdamW
        without a state dict: convert.load_param_states.
        """
        state_dict = dict(state_dict)
        with self._own_groups():
            for hook in self._optimizer_load_state_dict_pre_hooks.values():
                out = hook(self, state_dict)
                if out is not None:
                    state_dict = out
            convert.load_state_dict_into(self, state_dict)
            for hook in self._optimizer_load_state_dict_post_hooks.values():
                hook(self)

    def _own_groups(self):
        """Within: ``param_groups`` hold the tensors the states are keyed by (a sharded model's proxies)."""
        return contextlib.nullcontext() if self.local_shards is None else self.local_shards.in_groups(self)

    # ---- copy.deepcopy and pickle -----------------------------------------------------------------------

    def __getstate__(self) -> dict:
        """What copy.deepcopy and pickle carry: every attribute but the placement (the copy builds its own), the
        per-parameter step (its working copies and registered weight regions; the stream numbers travel) and
        the engine hooks, as torch's optimizers drop their hooks. On the NVMe tier the packed states (and
        residuals kept there) are read back from the files and travel along; the copy writes them into a folder
        of its own under the same ``nvme_path``."""
        self.placement.sync()
        cls = type(self)  # an instance attribute shadowing a method (an engine's wrapper) belongs to the original
        out = {k: v for k, v in self.__dict__.items()
               if k not in _NOT_COPIED and not (callable(v) and callable(getattr(cls, k, None)))}
        out["_stream_numbers"] = dict(self.stepper.stream_numbers)
        out["_carried_states"] = self.placement.carried_states(self.state)
        return out

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        carried = state.pop("_carried_states", None)
        stream_numbers = state.pop("_stream_numbers", {})
        had_differentiable = "differentiable" in state.get("defaults", {})
        super().__setstate__(state)  # the hook dicts, the hooked step
        if not had_differentiable:  # torch's __setstate__ adds it; FP4AdamW has no such option
            self.defaults.pop("differentiable", None)
        self._build_rooms(stream_numbers)
        self.placement.adopt(self.state, carried)


_NOT_COPIED = ("placement", "stepper", "hooks", "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
               "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
               "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")

__all__ = ["FP4AdamW", "WeightRegion", "StateFormat", "NvmeOptions", "StepOptions", "GRAD_LIMIT", "KEYED_STREAM0"]
