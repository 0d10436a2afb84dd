"""Kernel dispatch: CUDA extension -> CPU extension -> torch reference.

Every backend module exposes ``nvfp4_encode``, ``nvfp4_decode``, ``mx_encode`` and ``mx_decode`` with
the signatures of :mod:`fp4offload.formats.reference`. ``FP4OFFLOAD_BACKEND=reference|cpu|cuda``
forces one (read by :mod:`fp4offload._switches`); otherwise (unset, or ``auto``) the first that builds for the
tensor's device is used, and a fallback to the reference warns once.
"""

from __future__ import annotations

import warnings
from types import ModuleType

import torch

from .. import _switches as switches
from .._config.vocab import CODEC_BACKENDS as CODEC_BACKENDS  # the backends, in the order they are tried
from ..errors import ConfigError
from ..formats import reference

_status: dict[str, tuple[bool, str]] = {}
_warned: set[str] = set()


def forced_backend() -> str | None:
    """The backend FP4OFFLOAD_BACKEND forces, or None (unset or ``auto``); ConfigError for any other word."""
    name = switches.get("FP4OFFLOAD_BACKEND")
    return None if name == "auto" else name


def _load(name: str) -> ModuleType | None:
    """Import (and JIT-build on first use) a compiled backend; remember why it failed."""
    if name == "reference":
        return reference
    if name in _status and not _status[name][0]:
        return None
    try:
        if name == "cpu":
            from . import cpu as mod
        else:
            from . import cuda as mod
        mod.extension()
        _status[name] = (True, "built")
        return mod
    except Exception as e:  # a compiler or toolchain problem: fall back, and say why
        _status[name] = (False, f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}")
        return None


def backend_for(device: torch.device | str) -> ModuleType:
    """The kernel module for tensors on `device`."""
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError("device", str(dev), "a cpu or cuda tensor")
    forced = forced_backend()
    if forced is not None:
        if forced != "reference" and forced != dev.type:
            raise ConfigError("FP4OFFLOAD_BACKEND", forced, f"'reference' or '{dev.type}' for a {dev.type} tensor")
        mod = _load(forced)
        if mod is None:
            raise RuntimeError(f"FP4OFFLOAD_BACKEND={forced} but its extension does not build: {_status[forced][1]}; "
                               "run `fp4offload doctor` for details, or unset FP4OFFLOAD_BACKEND")
        return mod
    mod = _load(dev.type)
    if mod is not None:
        return mod
    if dev.type not in _warned:
        _warned.add(dev.type)
        warnings.warn(f"fp4offload: the {dev.type} extension is unavailable ({_status[dev.type][1]}); "
                      "using the slow torch reference. `fp4offload doctor` says more.", RuntimeWarning, stacklevel=3)
    return reference


def backend_name(device: torch.device | str) -> str:
    mod = backend_for(device)
    return "reference" if mod is reference else mod.NAME


def load(name: str) -> tuple[ModuleType | None, str]:
    """(the backend module or None, why): builds it on first use, as dispatch does."""
    mod = _load(name)
    return mod, "pure torch" if name == "reference" else _status.get(name, (False, ""))[1]
