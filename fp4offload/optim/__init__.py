"""FP4AdamW and its state tiers (GPU, pinned host RAM, NVMe).

- adamw.py: the optimizer (param groups, the step, state-dict entry points); checks.py: its argument checks;
- tiers.py: where m and v live between steps (device, pinned host with the GPU-to-CPU segment pipeline, NVMe);
- nvme.py: the NVMe tier's file store; working_copy.py: working copies and weight regions;
- state.py: per-parameter state and its state-dict form; convert.py: saved forms and torch AdamW states;
- reference_step.py: the normative step in torch ops (and its numerics); fused.py: the compiled steps.
"""

from .adamw import FP4AdamW
from .convert import load_param_states
from .reference_step import CHUNK, SEGMENT
from .working_copy import WeightRegion

__all__ = ["FP4AdamW", "WeightRegion", "CHUNK", "SEGMENT", "load_param_states"]
