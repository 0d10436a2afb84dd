"""FP4AdamW and its state tiers (GPU, pinned host RAM, NVMe).

- adamw.py: the optimizer; reference_step.py: the normative step in torch ops (and its numerics);
- state.py: per-parameter state and its state-dict form; nvme.py: the NVMe tier; fused.py: the compiled steps.
"""

from .adamw import FP4AdamW, WeightRegion
from .reference_step import CHUNK, SEGMENT

__all__ = ["FP4AdamW", "WeightRegion", "CHUNK", "SEGMENT"]
