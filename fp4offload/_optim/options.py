"""The option groups of FP4AdamW's constructor: how the states are stored (:class:`StateFormat`), the NVMe tier's
settings (:class:`NvmeOptions`) and how the step runs (:class:`StepOptions`).

Frozen dataclasses whose fields are checked when one is made: a bad value raises ConfigError naming the
constructor keyword and the field (``state_format.min_numel``, ``nvme.threads``, ``step_options.backend``), the
value and what is allowed (checks.py). Rules that join fields of several groups (``nvme.master_device`` with
``master`` and ``state_device``, ``step_options.working_copy`` with ``master``) are checked by FP4AdamW's
constructor, before anything is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .._config import MASTER_DEVICES, NVME_IO_ENGINES, STATE_MIN_NUMEL, STEP_BACKENDS, V_FORMAT_DEFAULT, \
    V_ROUNDING_DEFAULT, WORKING_COPIES
from ..errors import ConfigError
from .._config.checks import check_bool, check_choice, check_int
from .checks import NVME_THREADS_MAX, check_hyperparameters


@dataclass(frozen=True)
class StateFormat:
    """How m and sqrt(v) are stored: the defaults of the per-group options beyond torch AdamW's (a param group
    may set each of them for itself).

    Args:
        m_rounding: ``"stochastic"`` (default) or ``"nearest"`` (benchmarks/RESULTS.md, "Accuracy", compares
            them with fp32 AdamW).
        v_rounding: rounding of the stored sqrt(v), ``"nearest"`` or ``"stochastic"`` (default
            config.V_ROUNDING_DEFAULT; docs/numerics.md, "Rounding of the optimizer states", says why).
        v_format: ``"ue2m2"`` (default, config.V_FORMAT_DEFAULT: u = sqrt(v) on a zero-free unsigned grid with two
            mantissa bits), ``"ufp4"`` (the same with one mantissa bit and a wider range: the format before
            2026-12-03, which old state dicts hold and keep) or ``"nvfp4"`` (v itself in NVFP4, the ablation's
            baseline; it flushes small v to zero). docs/numerics.md, "The grid of sqrt(v)", says why.
        min_numel: parameters with fewer elements keep fp32 states (default 4096, config.STATE_MIN_NUMEL).
        seed: base seed of stochastic rounding (see reference_step's docstring for the streams).
    """

    m_rounding: str = "stochastic"
    v_rounding: str = V_ROUNDING_DEFAULT
    v_format: str = V_FORMAT_DEFAULT
    min_numel: int = STATE_MIN_NUMEL
    seed: int = 0

    def __post_init__(self):
        check_hyperparameters("state_format.", m_rounding=self.m_rounding, v_rounding=self.v_rounding,
                              v_format=self.v_format, min_numel=self.min_numel, seed=self.seed)

    def group_defaults(self) -> dict:
        """The per-group options, as FP4AdamW's ``defaults`` and every param group hold them."""
        return dict(m_rounding=self.m_rounding, v_rounding=self.v_rounding, v_format=self.v_format,
                    min_numel=int(self.min_numel), seed=int(self.seed))


@dataclass(frozen=True)
class NvmeOptions:
    """The NVMe tier's settings (``state_device="nvme"``; its folder is FP4AdamW's ``nvme_path``).

    Args:
        threads: I/O threads (default 4).
        reserve_bytes: free space the tier leaves untouched on its disk (default 0).
        io: I/O engine: ``"auto"`` (default: DeepSpeed's async_io handle when it loads and works in ``nvme_path``,
            else the thread pool, with one warning), ``"aio"`` (require it) or ``"threads"``. FP4AdamW's
            :attr:`nvme_io` tells which one runs (see fp4offload/_optim/nvme.py).
        keep: keep the folder when the optimizer closes or the process exits (default None: the environment
            variable ``FP4OFFLOAD_NVME_KEEP``, unset meaning False: the folder is removed). A kept folder is
            marked ``KEEP`` (never swept) and gets a ``manifest.json``; read it back with
            ``fp4offload.read_kept(folder)`` and ``load_param_states``. At start the tier removes this
            user's folders under ``nvme_path`` whose process is gone, with a warning in the log.
        master_device: where split's residual lives between steps: ``"same"`` (default: in host RAM, in
            ``optimizer.state``) or ``"nvme"`` (with ``master="split"`` and ``state_device="nvme"`` only: in each
            segment file beside that segment's m and v, read ahead and written behind with them, so host RAM
            holds no residual between steps; 2 B/param plus a bitmap of 1 bit/param on disk). Parameters under
            ``min_numel`` keep fp32 states and their residual in RAM. Training and the state dict are the same
            bit for bit either way.
    """

    threads: int = 4
    reserve_bytes: int = 0
    io: str = "auto"
    keep: bool | None = None
    master_device: str = "same"

    def __post_init__(self):
        check_int("nvme.threads", self.threads, minimum=1, maximum=NVME_THREADS_MAX)
        check_int("nvme.reserve_bytes", self.reserve_bytes, minimum=0)
        check_choice("nvme.io", self.io, NVME_IO_ENGINES)
        if self.keep is not None and not isinstance(self.keep, bool):
            raise ConfigError("nvme.keep", self.keep, "True, False or None (None: the FP4OFFLOAD_NVME_KEEP "
                              "environment variable, default False)")
        check_choice("nvme.master_device", self.master_device, MASTER_DEVICES)


@dataclass(frozen=True)
class StepOptions:
    """How the step runs.

    Args:
        backend: ``"auto"`` (the fused C++/CUDA step when it builds, else the torch reference step),
            ``"fused"`` (require it) or ``"reference"`` (the torch-op step; same bits, slower).
        working_copy: also produce the new weight as ``"bf16"``, ``"nvfp4"`` (16x16, per-tensor scale),
            ``"both"`` or ``None`` (default); read it with ``FP4AdamW.working_copy(p)``. The fused CPU step writes
            both inside its pass. The NVFP4 copy is ``quantize(w, "nvfp4", block="16x16",
            amax=FP4AdamW.copy_amax(amax(w)))`` (recorded in ``copy.meta["amax"]``): the amax rounded up to a
            power of two, known before the step except when it crosses one, when the copy is encoded in a
            pass of its own (``optim.wcopy_reencodes`` counts those, and first steps).
        skip_nonfinite: skip the whole step when any gradient holds Inf/NaN, or a value of magnitude
            ``GRAD_LIMIT`` (2**64) or more, whose square overflows fp32 (default True); states and weights stay
            untouched and ``optim.skipped_steps`` counts it. With a gradient norm given (``step(grad_norm=)``,
            ``hooks.grad_norm_source``), a norm that is not finite, negative or at least GRAD_LIMIT skips the step.
        metrics_every: every this many steps, sample the relative quantization error of m and v on the
            first chunk of the first packed parameter (0: never; default 100).
        tensor_key: ``f(tensor) -> str | None``, a name for a tensor that does not depend on where it sits in
            ``param_groups``. It names the tensor's NVMe files (without it, or when it returns None: ``t<n>``,
            numbered in order of first step) and picks its stochastic-rounding stream (numbered by name in order
            of first step, in place of the position; see reference_step). A tensor keeps its NVMe key while it
            lives; two tensors holding states may not share one (ConfigError). The DeepSpeed block passes
            DeepSpeed's ``ds_id``, so ZeRO-3 sub-groups (stepped one at a time, each alone in its group) keep their
            own files and their own random streams, also across a re-created tensor.
    """

    backend: str = "auto"
    working_copy: str | None = None
    skip_nonfinite: bool = True
    metrics_every: int = 100
    tensor_key: Callable[[torch.Tensor], str | None] | None = None

    def __post_init__(self):
        check_choice("step_options.backend", self.backend, STEP_BACKENDS)
        check_choice("step_options.working_copy", self.working_copy, WORKING_COPIES)
        check_bool("step_options.skip_nonfinite", self.skip_nonfinite)
        check_int("step_options.metrics_every", self.metrics_every, minimum=0)
        if self.tensor_key is not None and not callable(self.tensor_key):
            raise ConfigError("step_options.tensor_key", self.tensor_key, "None or a function tensor -> str | None")


__all__ = ["StateFormat", "NvmeOptions", "StepOptions", "fp4adamw_kwargs"]


def fp4adamw_kwargs(states) -> dict:
    """FP4AdamW's constructor keywords for the ``optimizer_states`` section of the DeepSpeed block or the FSDP2
    policy (an ``OptimizerStatesConfig``): the one mapping both engines use. ``device`` -> ``state_device``,
    ``nvme_path``, ``master``; ``rounding`` (of m), ``v_rounding``, ``v_format``, ``min_numel`` (0 and 1 both
    mean every tensor) -> ``state_format``; ``master_device`` -> ``nvme``."""
    return {"state_device": states.device, "nvme_path": states.nvme_path, "master": states.master,
            "state_format": StateFormat(m_rounding=states.rounding, v_rounding=states.v_rounding,
                                        v_format=states.v_format, min_numel=max(1, states.min_numel)),
            "nvme": NvmeOptions(master_device=states.master_device)}
