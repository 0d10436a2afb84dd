"""The vocabulary: every allowed-value tuple and shared default of the project, defined here once.

The schemas (:mod:`fp4offload._config.block`, :mod:`fp4offload._config.fsdp`), FP4AdamW, the activation policy, the
codecs and the environment switches (:mod:`fp4offload._switches`) import these names. Two lists come from the
registries beside it (:mod:`~fp4offload._config.grids`, :mod:`~fp4offload._config.isas`, which import nothing); this
module imports nothing else.
"""

from __future__ import annotations

from .grids import V_GRIDS
from .isas import ISAS

#: packed or plain Adam states (``optimizer_states.format``)
OPTIMIZER_FORMATS = ("nvfp4", "fp32")
#: where states live between steps (``optimizer_states.device``, FP4AdamW's ``state_device``)
OPTIMIZER_DEVICES = ("same", "cpu", "nvme")
#: rounding of a codec or of Adam's m (``optimizer_states.rounding``, FP4AdamW's ``m_rounding``)
ROUNDINGS = ("nearest", "stochastic")
#: rounding of Adam's sqrt(v) (FP4AdamW's ``v_rounding``, ``optimizer_states.v_rounding``; docs/numerics.md,
#: "Rounding of the optimizer states")
V_ROUNDING_DEFAULT = "stochastic"
#: how sqrt(v) or v is stored (FP4AdamW's ``v_format``): ue2m2 (the default) and ufp4 hold sqrt(v) on unsigned
#: zero-free grids of two and one mantissa bits, nvfp4 holds v itself (ablation); docs/numerics.md, "The grid of
#: sqrt(v)". The rows of _config/grids.py
V_FORMATS = tuple(g.name for g in V_GRIDS)
V_FORMAT_DEFAULT = "ue2m2"
#: FP4AdamW's step implementation (``backend``); not the codec backends of fp4offload._ops
STEP_BACKENDS = ("auto", "fused", "reference")
#: the weight copy FP4AdamW's step also writes (``working_copy``)
WORKING_COPIES = (None, "bf16", "nvfp4", "both")
#: how FP4AdamW holds the master weight (``master``; docs/numerics.md, "Master weights"): fp32, the bf16
#: parameter plus a 16-bit residual (exactly the fp32 master), or the bf16 parameter with stochastic rounding
MASTER_FORMS = ("fp32", "split", "bf16")
#: where split's residual lives between steps (``master_device``): beside the parameter (host RAM under
#: offload), or in the NVMe tier's segment files beside the packed states
MASTER_DEVICES = ("same", "nvme")
#: I/O engine of the optimizer's NVMe tier (``nvme_io``)
NVME_IO_ENGINES = ("auto", "aio", "threads")
#: formats a saved activation is stored in; "none" moves it without compressing
ACTIVATION_FORMATS = ("nvfp4", "mxfp4", "mxfp8", "int2", "none")
#: also allowed per module (``module_formats``, ``norm_format``): fp32 rounded to bf16, bf16/fp16 as they are
ACTIVATION_MODULE_FORMATS = ACTIVATION_FORMATS + ("bf16",)
#: ``norm_format`` choices besides ACTIVATION_MODULE_FORMATS
ACTIVATION_NORM_CHOICES = ACTIVATION_MODULE_FORMATS + ("keep", "inherit")
#: how much of a saved tensor each form keeps, harshest first: an op class's format (``attention_format``...) only
#: ever makes storage gentler than its module's, so one that is not gentler than anything it could apply to is ignored
ACTIVATION_GENTLENESS = {"int2": -1, "nvfp4": 0, "mxfp4": 0, "mxfp8": 1, "bf16": 2, "none": 3, "keep": 4}
#: where a saved activation goes: pinned host RAM, files under ``nvme_path``, or where it was
ACTIVATION_DEVICES = ("cpu", "nvme", "same")
#: weight working copy format (``weights.format``)
WEIGHT_FORMATS = ("nvfp4", "bf16")
#: where packed weight shards live (``weights.device``): both engines keep them in host RAM
WEIGHT_DEVICES = ("cpu",)
#: what a codec does with Inf/NaN input (``nonfinite``)
NONFINITE_MODES = ("raise", "propagate")
#: MX block-scale rules (``scale_mode``)
SCALE_MODES = ("rceil", "floor")

#: defaults shared by the schema, FP4AdamW and ActivationPolicy
STATE_MIN_NUMEL = 4096
ACTIVATION_MIN_NUMEL = 65536
ACTIVATION_MODULES = ()  # no patterns: every module (the whole forward)
KEEP_BF16 = ("embed", "lm_head", "norm", "bias", "first:1", "last:1")

#: host settings (``host``): glibc's mmap threshold in bytes (its own starting value, kept fixed), and the
#: freed bytes the host allocator cache keeps, as a share of the bytes in use
MMAP_THRESHOLD = 128 * 1024
ALLOCATOR_CACHE = 0.125
#: the words of an on/off setting, in the environment and wherever a string turns a setting on or off
#: (compared case-insensitively, surrounding spaces ignored)
ON_WORDS = ("1", "true", "yes", "on")
OFF_WORDS = ("0", "false", "no", "off", "none")
#: what turns a host setting off, in the config (a string) or in its FP4OFFLOAD_* environment override
OFF_VALUES = OFF_WORDS
#: what initialize does when the host-memory estimate does not fit (``host.preflight``)
PREFLIGHT_MODES = ("error", "warn", "off")
#: the largest mmap threshold glibc documents on a 64-bit machine (mallopt(3): 4 MiB x sizeof(long)); some of its
#: versions refuse more, and the setting would then be dropped
MMAP_THRESHOLD_MAX = 32 * 2**20

#: bounds of the numbers the checks accept: counts are int64 where they reach the kernels, and the
#: optimizer's step computes in fp32 (its largest finite value, and its smallest normal one for eps)
INT64_MAX = 2**63 - 1
F32_MAX = 3.4028234663852886e38
F32_TINY = 1.1754943508222875e-38
#: path limits of Linux (PATH_MAX with its NUL, NAME_MAX)
PATH_MAX = 4096
NAME_MAX = 255

#: the codec backends, in the order they are tried (FP4AdamW's step backends are STEP_BACKENDS)
CODEC_BACKENDS = ("cuda", "cpu", "reference")
#: the host kernels' vector paths, fastest first; "scalar" runs everywhere. The rows of _config/isas.py
CPU_ISAS = tuple(i.name for i in ISAS)
