"""The one host-memory model: byte sizes per element and per parameter (:mod:`.sizes`) and the host-RAM estimate
of a DeepSpeed config (:mod:`.host_model`). It sits below both the planner (``fp4offload plan``, ``plan --check``)
and the runtime (the preflight at ``initialize``, ``"fp4offload": {"auto": true}``, ``Policy.auto()``), so every
figure they print comes from the same arithmetic. Imports only the formats and the optimizer's layout constants.
"""
