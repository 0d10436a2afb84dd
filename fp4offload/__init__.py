"""fp4offload: 4-bit floating point (NVFP4, MXFP4) for what training holds but is not computing with.

Public names: `quantize`, `dequantize`, `PackedTensor`; `FP4AdamW`; `offload_activations`,
`ActivationPolicy`; and the modules `fp4offload.deepspeed` and `fp4offload.fsdp`.
"""

from __future__ import annotations

from .codec import dequantize, quantize
from .errors import CapacityError, ConfigError, CorruptionError, NonFiniteError
from .formats.packed import PackedTensor

__version__ = "0.1.0"

__all__ = ["quantize", "dequantize", "PackedTensor", "FP4AdamW", "offload_activations", "ActivationPolicy",
           "ConfigError", "NonFiniteError", "CorruptionError", "CapacityError", "__version__"]

_LAZY = {"FP4AdamW": ("fp4offload.optim", "FP4AdamW"),
         "offload_activations": ("fp4offload.offload", "offload_activations"),
         "ActivationPolicy": ("fp4offload.offload", "ActivationPolicy")}


def __getattr__(name):  # PEP 562: heavy parts load on first use
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'fp4offload' has no attribute {name!r}")
