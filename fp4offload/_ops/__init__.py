"""Kernel dispatch: CUDA extension -> CPU extension -> torch reference.

Every backend module exposes ``nvfp4_encode``, ``nvfp4_decode``, ``mx_encode``, ``mx_decode``, ``int2_encode``
and ``int2_decode`` with the signatures of :mod:`fp4offload.formats.reference`.
``FP4OFFLOAD_BACKEND=reference|cpu|cuda`` forces one (read by :mod:`fp4offload._switches`); otherwise (unset, or
``auto``) the first that builds for the tensor's device is used, and a fallback to the reference warns once.
"""

from __future__ import annotations

import warnings
from types import ModuleType

import torch

from .. import _switches as switches
from ..errors import ConfigError
from ..formats import reference

_warned: set[str] = set()


def forced_backend() -> str | None:
    """The backend FP4OFFLOAD_BACKEND forces, or None (unset or ``auto``); ConfigError for any other word."""
    name = switches.get("FP4OFFLOAD_BACKEND")
    return None if name == "auto" else name


def load(name: str) -> tuple[ModuleType | None, str]:
    """(the backend module, "built"), or (None, why) when its extension does not build; builds it on first use
    (build.load: once per process)."""
    if name == "reference":
        return reference, "pure torch"
    from .build import why

    if name == "cpu":
        from . import cpu as mod
    else:
        from . import cuda as mod
    try:
        mod.extension()
    except Exception as e:  # a compiler, toolchain or device problem: fall back, and say why
        return None, why(e)
    return mod, "built"


def backend_for(device: torch.device | str) -> ModuleType:
    """The kernel module for tensors on `device`."""
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError("device", str(dev), "a cpu or cuda tensor")
    forced = forced_backend()
    if forced is not None:
        if forced != "reference" and forced != dev.type:
            raise ConfigError("FP4OFFLOAD_BACKEND", forced, f"'reference' or '{dev.type}' for a {dev.type} tensor")
        mod, why = load(forced)
        if mod is None:
            raise RuntimeError(f"FP4OFFLOAD_BACKEND={forced} but its extension does not build: {why}; "
                               "run `fp4offload doctor` for details, or unset FP4OFFLOAD_BACKEND")
        return mod
    mod, why = load(dev.type)
    if mod is not None:
        return mod
    if dev.type not in _warned:
        _warned.add(dev.type)
        warnings.warn(f"fp4offload: the {dev.type} extension is unavailable ({why}); "
                      "using the slow torch reference. `fp4offload doctor` says more.", RuntimeWarning, stacklevel=3)
    return reference


def backend_name(device: torch.device | str) -> str:
    mod = backend_for(device)
    return "reference" if mod is reference else mod.NAME
