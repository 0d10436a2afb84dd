"""The schema of the ``"fp4offload"`` block of a DeepSpeed config and of the FSDP2 policy YAML.

Both are described by frozen dataclasses. Every sub-block is optional: an absent sub-block means
the feature is off. Construction validates, so an object that exists is a valid one; every
violation raises :class:`fp4offload.errors.ConfigError` naming the key path, the value and what
is allowed.

DeepSpeed JSON::

    "fp4offload": {
      "optimizer_states": {"format": "nvfp4", "device": "cpu", "nvme_path": null,
                           "rounding": "stochastic", "v_rounding": "stochastic", "min_numel": 4096},
      "activations": {"format": "nvfp4", "device": "cpu", "nvme_path": null, "min_numel": 65536,
                      "modules": ["*.mlp"], "exclude": []},
      "weights": {"format": "nvfp4", "device": "cpu",
                  "keep_bf16": ["embed", "lm_head", "norm", "bias", "first:1", "last:1"]},
      "monitor": {"every": 10}
    }

FSDP2 policy YAML: the same sub-blocks plus ``cpu_offload``, ``reshard_after_forward`` and
``block_classes`` at the top level.

The package, one room per module (every name is re-exported here):

- :mod:`~fp4offload._config.vocab`: every allowed-value tuple and shared default, the on/off words;
- :mod:`~fp4offload._config.checks`: the number and path checks the schemas share, and :func:`prepare_path`,
  the one function that looks at (and creates) a folder on this machine;
- :mod:`~fp4offload._config.block`: the block's sub-blocks, :class:`Fp4OffloadConfig` and :func:`parse_block`;
- :mod:`~fp4offload._config.fsdp`: :class:`FsdpPolicyConfig`, :func:`parse_fsdp_policy` and the YAML file.

Checked where they enter, in two steps. The document (the dataclasses, machine-independent, never touching the
disk): every number finite, in range (counts up to int64), of its type (bools are not numbers, "4096" is not an
integer); paths a non-blank string without a NUL byte, within PATH_MAX/NAME_MAX, not in /proc, /sys or /dev
(/dev/shm is fine); settings that would be ignored are refused (``nvme_path`` without ``device: nvme``,
``format: fp32`` with ``device: nvme``). This machine, where a folder is first used (:func:`prepare_path`):
each folder expanded (``~``, ``$VARS``), resolved, refused when it is not a writable directory, and created one
level deep under an existing parent only. Adam's numbers (the DeepSpeed ``optimizer`` section, FP4AdamW) go
through :func:`check_adam_hyperparameters`. Nothing here imports deepspeed at import time.
"""

from __future__ import annotations

from .block import (ActivationsConfig, Fp4OffloadConfig, HostConfig, MonitorConfig, OptimizerStatesConfig,
                    WeightsConfig, parse_block)
from .checks import (check_adam_hyperparameters, check_number, check_path_syntax, prepare_path,
                     with_checked_paths)
from .fsdp import (POLICY_MAX_BYTES, FsdpPolicyConfig, check_fsdp_states, dump_fsdp_policy_yaml,
                   load_fsdp_policy_yaml, parse_fsdp_policy)
from .vocab import (ACTIVATION_DEVICES, ACTIVATION_FORMATS, ACTIVATION_GENTLENESS, ACTIVATION_MIN_NUMEL,
                    ACTIVATION_MODULE_FORMATS,
                    ACTIVATION_MODULES, ACTIVATION_NORM_CHOICES, ALLOCATOR_CACHE, CODEC_BACKENDS, CPU_ISAS, F32_MAX,
                    F32_TINY, INT64_MAX, KEEP_BF16, MASTER_DEVICES, MASTER_FORMS, MMAP_THRESHOLD, MMAP_THRESHOLD_MAX,
                    NAME_MAX, NONFINITE_MODES, NVME_IO_ENGINES, OFF_VALUES, OFF_WORDS, ON_WORDS, OPTIMIZER_DEVICES,
                    OPTIMIZER_FORMATS, PATH_MAX, PREFLIGHT_MODES, ROUNDINGS, SCALE_MODES, STATE_MIN_NUMEL,
                    STEP_BACKENDS, V_FORMAT_DEFAULT, V_FORMATS, V_ROUNDING_DEFAULT, WEIGHT_DEVICES, WEIGHT_FORMATS,
                    WORKING_COPIES)

__all__ = [
    "OptimizerStatesConfig", "ActivationsConfig", "WeightsConfig", "MonitorConfig", "HostConfig", "Fp4OffloadConfig",
    "FsdpPolicyConfig", "parse_block", "parse_fsdp_policy",
    "load_fsdp_policy_yaml", "dump_fsdp_policy_yaml", "check_fsdp_states", "POLICY_MAX_BYTES",
    "OPTIMIZER_FORMATS", "OPTIMIZER_DEVICES", "ROUNDINGS", "V_FORMATS", "STEP_BACKENDS", "WORKING_COPIES",
    "MASTER_FORMS", "MASTER_DEVICES",
    "NVME_IO_ENGINES", "ACTIVATION_FORMATS", "ACTIVATION_GENTLENESS", "ACTIVATION_MODULE_FORMATS",
    "ACTIVATION_NORM_CHOICES",
    "ACTIVATION_DEVICES", "WEIGHT_FORMATS", "WEIGHT_DEVICES", "NONFINITE_MODES", "SCALE_MODES",
    "STATE_MIN_NUMEL", "ACTIVATION_MIN_NUMEL", "ACTIVATION_MODULES", "KEEP_BF16", "MMAP_THRESHOLD",
    "ALLOCATOR_CACHE", "OFF_VALUES", "ON_WORDS", "OFF_WORDS", "PREFLIGHT_MODES", "CODEC_BACKENDS", "CPU_ISAS",
    "V_FORMAT_DEFAULT", "V_ROUNDING_DEFAULT", "INT64_MAX", "F32_MAX", "F32_TINY", "PATH_MAX", "NAME_MAX",
    "check_number", "check_adam_hyperparameters", "prepare_path", "check_path_syntax",
    "with_checked_paths", "MMAP_THRESHOLD_MAX",
]
