"""fp4offload: 4-bit floating point (NVFP4, MXFP4) for what training holds but is not computing with.

Public names: `quantize`, `dequantize`, `PackedTensor`; `FP4AdamW` with its option groups `StateFormat`,
`NvmeOptions`, `StepOptions`, `read_kept` (the states of a kept NVMe folder) and `to_torch_adamw` (the way back
to torch AdamW); `offload_activations`, `ActivationPolicy`, `wrap_modules`; the errors. Public modules:
`fp4offload.deepspeed`, `fp4offload.fsdp`, `fp4offload.formats`, `fp4offload.host_allocator`, `fp4offload.errors`;
the command line is `fp4offload` (`fp4offload.cli`).
Every module whose name starts with `_` is an implementation detail.
"""

from __future__ import annotations

import os as _os

from ._codec import dequantize, quantize
from .errors import CapacityError, ConfigError, CorruptionError, NonFiniteError
from .formats.packed import PackedTensor

__version__ = "0.1.0"

if "WORLD_SIZE" in _os.environ:  # started by a launcher: an fp4offload error is one line per job
    from ._oneline import install as _install_oneline

    _install_oneline()

__all__ = ["quantize", "dequantize", "PackedTensor", "FP4AdamW", "StateFormat", "NvmeOptions", "StepOptions",
           "read_kept", "to_torch_adamw", "offload_activations", "ActivationPolicy", "wrap_modules", "ConfigError",
           "NonFiniteError", "CorruptionError", "CapacityError", "__version__"]

_LAZY = {**{name: ("fp4offload._optim", name) for name in ("FP4AdamW", "StateFormat", "NvmeOptions", "StepOptions")},
         "read_kept": ("fp4offload._optim.nvme", "read_kept"),
         "to_torch_adamw": ("fp4offload._optim.export", "to_torch_adamw"),
         **{name: ("fp4offload._offload", name)
            for name in ("offload_activations", "ActivationPolicy", "wrap_modules")}}


def __getattr__(name):  # PEP 562: heavy parts load on first use
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'fp4offload' has no attribute {name!r}")
