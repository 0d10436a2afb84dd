"""DeepSpeed with the ``"fp4offload"`` config block.

    import fp4offload.deepspeed as fds
    engine, optimizer, loader, scheduler = fds.initialize(model=model, config="ds_config.json")

or, for code that calls ``deepspeed.initialize`` itself (Accelerate, the Hugging Face Trainer)::

    fds.install()

See :mod:`fp4offload._deepspeed.engine` for what the block changes and in which order.
"""

from __future__ import annotations

from fp4offload._deepspeed.config import Prepared, prepare_config, read_config
from fp4offload._deepspeed.engine import initialize, install, installed, uninstall

__all__ = ["initialize", "install", "uninstall", "installed", "prepare_config", "read_config", "Prepared"]
