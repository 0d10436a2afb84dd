"""The argument checks of FP4AdamW's constructor (and of its NVMe store's I/O engine).

Each bad value raises ConfigError naming the argument, the value and what is allowed. The allowed values
are the project's vocabulary in fp4offload.config (OPTIMIZER_DEVICES, ROUNDINGS, V_FORMATS, STEP_BACKENDS,
WORKING_COPIES, NVME_IO_ENGINES, MASTER_FORMS), and each error's text is built from those tuples, so it always lists
exactly what the constructor accepts.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import (MASTER_FORMS, NVME_IO_ENGINES, OPTIMIZER_DEVICES, ROUNDINGS, STEP_BACKENDS, V_FORMATS,
                      WORKING_COPIES)
from ..errors import ConfigError
from . import fused


def one_of(allowed: tuple) -> str:
    """The allowed-values text of an error: ``'a' | 'b'`` (None written as None)."""
    return " | ".join(repr(a) for a in allowed)


def check_choice(key: str, value: Any, allowed: tuple, hint: str | None = None) -> None:
    if value not in allowed:
        raise ConfigError(key, value, one_of(allowed), hint)


def check_arguments(*, lr, betas, eps, weight_decay, m_rounding, v_format, min_numel, state_device, nvme_path,
                    nvme_io, tensor_key, backend, working_copy, master="fp32") -> None:
    """FP4AdamW's hyperparameters and options (see its docstring); raises ConfigError for the first bad one."""
    if not 0.0 <= lr:
        raise ConfigError("lr", lr, "a learning rate >= 0")
    if not 0.0 < eps:
        raise ConfigError("eps", eps, "eps > 0")
    for i, b in enumerate(betas):
        if not 0.0 <= b < 1.0:
            raise ConfigError(f"betas[{i}]", b, "a value in [0, 1)")
    if weight_decay < 0:
        raise ConfigError("weight_decay", weight_decay, "a value >= 0")
    check_choice("m_rounding", m_rounding, ROUNDINGS)
    check_choice("v_format", v_format, V_FORMATS, "ufp4 stores sqrt(v) and is the default")
    check_choice("state_device", state_device, OPTIMIZER_DEVICES)
    if state_device == "nvme" and nvme_path is None:
        raise ConfigError("nvme_path", None, "a folder on a local disk for state_device='nvme'")
    check_choice("nvme_io", nvme_io, NVME_IO_ENGINES)
    if tensor_key is not None and not callable(tensor_key):
        raise ConfigError("tensor_key", tensor_key, "None or a function tensor -> str | None")
    check_choice("backend", backend, STEP_BACKENDS)
    check_choice("working_copy", working_copy, WORKING_COPIES)
    check_choice("master", master, MASTER_FORMS, "'split' keeps the fp32 master exactly in 2 B/param beside the bf16 "
                 "parameter; 'bf16' rounds the bf16 parameter stochastically")
    if master != "fp32" and working_copy is not None:
        raise ConfigError("working_copy", working_copy, f"None with master={master!r}",
                          "the bf16 parameter is the working copy; use master='fp32' for an NVFP4 copy")
    if int(min_numel) < 1:
        raise ConfigError("min_numel", min_numel, "an integer >= 1")
    if backend == "fused" and fused.cpu_extension() is None and not torch.cuda.is_available():
        raise ConfigError("backend", backend, "'auto' or 'reference' on this machine",
                          f"the fused CPU step does not build: {fused.failures().get('cpu')}")
