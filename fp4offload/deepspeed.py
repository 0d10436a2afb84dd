"""DeepSpeed with the ``"fp4offload"`` config block.

    import fp4offload.deepspeed as fds
    engine, optimizer, loader, scheduler = fds.initialize(model=model, config="ds_config.json")

or, for code that calls ``deepspeed.initialize`` itself (Accelerate, the Hugging Face Trainer)::

    fds.install()

See :mod:`fp4offload.integrations.deepspeed` for what the block changes and in which order.
"""

from __future__ import annotations

from fp4offload.integrations.deepspeed import (Prepared, initialize, install, installed, prepare_config, read_config,
                                               uninstall)

__all__ = ["initialize", "install", "uninstall", "installed", "prepare_config", "read_config", "Prepared"]
