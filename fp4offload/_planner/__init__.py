"""The planner behind ``fp4offload plan`` and ``fp4offload bench``.

Data flows one way: probe/readings (the machine) + models (the model) + strategies (the
catalogue) -> memory and timing (per strategy) -> rank (the plan) -> emit (DeepSpeed JSON or FSDP2
policy YAML, validated by :mod:`fp4offload._config`). cli_plan wires it to the command line.

Modules: hardware (GPU/node presets, the planning target), readings (saved measurements),
probe (NVML, psutil, disk), bench (CPU optimizer step rate), models, strategies, sizes (every byte
size, derived from fp4offload.formats), memory, timing, rank, emit, cli_plan. No planner module
imports cli_plan, and sizes imports no other planner module. None of them imports deepspeed
at import time.
"""
