"""Activations saved for backward, compressed to FP4/FP8 and moved off the accelerator.

- ``ActivationPolicy``: format, device (pinned host RAM, NVMe files, or in place), size threshold,
  host cap, module patterns.
- ``offload_activations(policy, model=None)``: a context manager over
  ``torch.autograd.graph.saved_tensors_hooks``; yields the ``ActivationOffloader`` whose
  ``snapshot()`` holds the counters (bytes before/after, bytes moved, seconds, sampled error).
- ``wrap_modules(model, policy)``: offload only the forward of chosen modules, for every step.
"""

from .errors import SavedTensorReleasedError
from .context import offload_activations
from .hooks import ActivationOffloader
from .modules import ModuleOffload, wrap_modules
from .pinned_pool import HostSlabPool, shared_pool
from .policy import ActivationPolicy

__all__ = ["ActivationPolicy", "offload_activations", "wrap_modules", "ActivationOffloader", "ModuleOffload",
           "HostSlabPool", "shared_pool", "SavedTensorReleasedError"]
