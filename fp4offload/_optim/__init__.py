"""FP4AdamW and its state tiers (GPU, pinned host RAM, NVMe).

- adamw.py: the optimizer (arguments, param groups, the step as a whole, state-dict and copy entry points);
- options.py: its option groups (StateFormat, NvmeOptions, StepOptions); checks.py: its argument checks;
- step.py: one parameter's step (kernels, compact masters, streams); hooks.py: what an engine plugs in;
- placement.py: where the states live and the step's transaction; tiers.py: the tiers (device, pinned host
  with the GPU-to-CPU segment pipeline, NVMe);
- nvme.py: the NVMe tier's file store; working_copy.py: working copies and weight regions;
- state.py: per-parameter state and its state-dict form; convert.py: saved forms and torch AdamW states;
  export.py: the way back, a torch AdamW over the same parameters with the states decoded;
- reference_step.py: the normative step in torch ops (and its numerics); fused.py: the compiled steps;
  master.py: the compact master weights.
"""

from .adamw import FP4AdamW
from .convert import load_param_states
from .hooks import EngineHooks
from .options import NvmeOptions, StateFormat, StepOptions
from .reference_step import CHUNK, SEGMENT
from .working_copy import WeightRegion

__all__ = ["FP4AdamW", "StateFormat", "NvmeOptions", "StepOptions", "EngineHooks", "WeightRegion", "CHUNK", "SEGMENT",
           "load_param_states"]
