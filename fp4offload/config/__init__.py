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

Entry points: :func:`parse_block`, :func:`validate_deepspeed_config`, :func:`parse_fsdp_policy`,
:func:`load_fsdp_policy_yaml`. Nothing here imports deepspeed at import time.

Checked where they enter, in two steps. The document (the dataclasses, machine-independent): every number
finite, in range (counts up to int64), of its type (bools are not numbers, "4096" is not an integer); paths a
non-blank string without a NUL byte, within PATH_MAX/NAME_MAX, not in /proc, /sys or /dev (/dev/shm is fine);
settings that would be ignored are refused (``nvme_path`` without ``device: nvme``, ``format: fp32`` with
``device: nvme``). This machine (:func:`check_directory`, run by ``Prepared.checked_paths`` and
``fp4offload.fsdp.Policy.checked_paths`` before anything is built): each folder expanded (``~``, ``$VARS``),
resolved, created one level deep under an existing parent only, and refused when it is not a writable directory.
Adam's numbers (the DeepSpeed ``optimizer`` section, FP4AdamW) go through :func:`check_adam_hyperparameters`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import numbers
import os
import re
import stat
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator, Mapping

from fp4offload.errors import ConfigError

__all__ = [
    "OptimizerStatesConfig", "ActivationsConfig", "WeightsConfig", "MonitorConfig", "HostConfig", "Fp4OffloadConfig",
    "FsdpPolicyConfig", "parse_block", "validate_deepspeed_config", "parse_fsdp_policy",
    "load_fsdp_policy_yaml", "dump_fsdp_policy_yaml", "find_auto_values", "check_fsdp_states",
    "OPTIMIZER_FORMATS", "OPTIMIZER_DEVICES", "ROUNDINGS", "V_FORMATS", "STEP_BACKENDS", "WORKING_COPIES",
    "MASTER_FORMS", "MASTER_DEVICES",
    "NVME_IO_ENGINES", "ACTIVATION_FORMATS", "ACTIVATION_MODULE_FORMATS", "ACTIVATION_NORM_CHOICES",
    "ACTIVATION_DEVICES", "WEIGHT_FORMATS", "WEIGHT_DEVICES", "NONFINITE_MODES", "SCALE_MODES",
    "STATE_MIN_NUMEL", "ACTIVATION_MIN_NUMEL", "ACTIVATION_MODULES", "KEEP_BF16", "MMAP_THRESHOLD",
    "ALLOCATOR_CACHE", "OFF_VALUES", "PREFLIGHT_MODES",
    "check_number", "check_adam_hyperparameters", "check_directory", "check_path_syntax", "with_checked_paths",
    "MMAP_THRESHOLD_MAX",
]

# ---------------------------------------------------------------------------------------------
# The vocabulary: every allowed-value tuple and default of the project, defined here once. The
# engines, FP4AdamW, the activation policy and the codecs import these names.

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
#: sqrt(v)"
V_FORMATS = ("ue2m2", "ufp4", "nvfp4")
V_FORMAT_DEFAULT = "ue2m2"
#: FP4AdamW's step implementation (``backend``); not the codec backends of fp4offload.ops
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
ACTIVATION_FORMATS = ("nvfp4", "mxfp4", "mxfp8", "none")
#: also allowed per module (``module_formats``, ``norm_format``): fp32 rounded to bf16, bf16/fp16 as they are
ACTIVATION_MODULE_FORMATS = ACTIVATION_FORMATS + ("bf16",)
#: ``norm_format`` choices besides ACTIVATION_MODULE_FORMATS
ACTIVATION_NORM_CHOICES = ACTIVATION_MODULE_FORMATS + ("keep", "inherit")
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
#: what turns a host setting off, in the config (a string) or in its FP4OFFLOAD_* environment override
OFF_VALUES = ("off", "0", "none", "false", "no")
#: what initialize does when the host-memory estimate does not fit (``host.preflight``)
PREFLIGHT_MODES = ("error", "warn", "off")
#: the largest mmap threshold glibc documents on a 64-bit machine (mallopt(3): 4 MiB x sizeof(long)); some of its
#: versions refuse more, and the setting would then be dropped
MMAP_THRESHOLD_MAX = 32 * 2**20

#: bounds of the numbers the checks below accept: counts are int64 where they reach the kernels, and the
#: optimizer's step computes in fp32 (its largest finite value, and its smallest normal one for eps)
INT64_MAX = 2**63 - 1
F32_MAX = 3.4028234663852886e38
F32_TINY = 1.1754943508222875e-38
#: path limits of Linux (PATH_MAX with its NUL, NAME_MAX) and the kernel file systems no state file belongs in
PATH_MAX = 4096
NAME_MAX = 255
_KERNEL_FS = ("/proc", "/sys", "/dev")
_KERNEL_FS_OK = ("/dev/shm",)  # a tmpfs: a folder there is a folder in RAM

_KEEP_RULE = re.compile(r"^(first|last):(\d+)$")

# Key-path prefix of the document being parsed ("fp4offload." inside a DeepSpeed config).
_prefix: ContextVar[str] = ContextVar("fp4offload_config_prefix", default="")


@contextlib.contextmanager
def _under(prefix: str) -> Iterator[None]:
    token = _prefix.set(_prefix.get() + prefix)
    try:
        yield
    finally:
        _prefix.reset(token)


def _error(key: str, value: Any, allowed: str, hint: str | None = None) -> ConfigError:
    return ConfigError(_prefix.get() + key, value, allowed, hint)


# ---------------------------------------------------------------------------------------------
# Field checks shared by the dataclasses


def _check_choice(key: str, value: Any, allowed: tuple[str, ...], hint: str | None = None) -> None:
    if not isinstance(value, str) or value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1) if isinstance(value, str) else []
        hint = hint or (f"did you mean {close[0]!r}?" if close else None)
        raise _error(key, value, "one of " + ", ".join(repr(a) for a in allowed), hint)


def _check_int(key: str, value: Any, minimum: int = 0, maximum: int = INT64_MAX) -> None:
    allowed = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum != INT64_MAX else "")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(key, value, allowed, _not_a_number_hint(value, "integer"))
    if value < minimum:
        raise _error(key, value, allowed)
    if value > maximum:
        raise _error(key, value, allowed, "a count past int64 reaches no real tensor" if maximum == INT64_MAX
                     else None)


def _not_a_number_hint(value: Any, what: str = "number") -> str | None:
    """Why a value that is not a number was refused, when the reason is a common slip."""
    if isinstance(value, bool):
        return f"true/false is not a{'n' if what[0] in 'aeiou' else ''} {what}"
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return None
        return f"write it as a {what}, without quotes"
    if isinstance(value, float) and what == "integer":
        return "write it without a fraction or exponent, e.g. 4096"
    if isinstance(value, (list, tuple, dict)):
        return f"one {what}, not a {'mapping' if isinstance(value, dict) else 'list'}"
    return None


def check_number(key: str, value: Any, *, minimum: float | None = None, above: float | None = None,
                 below: float | None = None, allowed: str | None = None, hint: str | None = None) -> float:
    """``value`` as a float when it is a finite real number (not a bool, not a string) within fp32's range and
    the bounds (``minimum`` <= value, ``above`` < value, value < ``below``); ConfigError naming ``key`` otherwise.

    Key paths of the document being parsed get its prefix, as every error of this module does.
    """
    parts = ["a finite number"]
    if minimum is not None:
        parts.append(f">= {minimum:g}")
    if above is not None:
        parts.append(f"> {above:g}")
    if below is not None:
        parts.append(f"< {below:g}")
    allowed = allowed or " ".join(parts)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _error(key, value, allowed, _not_a_number_hint(value) or hint)
    try:
        x = float(value)
    except (OverflowError, ValueError):
        raise _error(key, value, allowed, "it is past fp32's range (3.4e38), where the step computes") from None
    if not math.isfinite(x):
        raise _error(key, value, allowed, "NaN and Infinity are not values a step can compute with (JSON's NaN and "
                     "Infinity, YAML's .nan and .inf): write a finite number")
    if abs(x) > F32_MAX:
        raise _error(key, value, allowed, "it is past fp32's range (3.4e38), where the step computes")
    too_low = (minimum is not None and x < minimum) or (above is not None and x <= above)
    if too_low or (below is not None and x >= below):
        raise _error(key, value, allowed, hint)
    return x


_UNSET: Any = object()


def check_adam_hyperparameters(prefix: str = "", *, lr: Any = _UNSET, betas: Any = _UNSET, eps: Any = _UNSET,
                               weight_decay: Any = _UNSET, defaults: Mapping[str, Any] | None = None
                               ) -> dict[str, Any]:
    """Adam's hyperparameters checked where they enter (the DeepSpeed ``optimizer`` section, FP4AdamW, its param
    groups): lr >= 0, betas a pair in [0, 1), eps >= 1.2e-38 (the smallest normal fp32: it is added in fp32),
    weight_decay >= 0, every one a finite number in fp32's range, and lr x weight_decay <= 1 (the decoupled decay
    multiplies each weight by 1 - lr x weight_decay, which must not turn negative). Arguments not given are not
    checked (None is checked, and refused); ``defaults`` supplies the other half of the lr x weight_decay check.
    Returns the given ones as floats (betas as a tuple). Errors name ``prefix + key`` (``optimizer.params.lr``,
    ``betas[1]``, ``param_groups[2].eps``).
    """
    out: dict[str, Any] = {}
    if lr is not _UNSET:
        out["lr"] = check_number(prefix + "lr", lr, minimum=0.0, allowed="a finite learning rate >= 0")
    if betas is not _UNSET:
        if isinstance(betas, (str, bytes, Mapping)) or not isinstance(betas, (list, tuple)) or len(betas) != 2:
            n = len(betas) if isinstance(betas, (list, tuple)) else None
            raise _error(prefix + "betas", betas, "a pair [beta1, beta2], each in [0, 1)",
                         f"it has {n} value(s); e.g. [0.9, 0.999]" if n is not None else "e.g. [0.9, 0.999]")
        out["betas"] = tuple(check_number(f"{prefix}betas[{i}]", b, minimum=0.0, below=1.0,
                                          allowed="a value in [0, 1)",
                                          hint="a beta of 1 or more never forgets: the moments grow without bound")
                             for i, b in enumerate(betas))
    if eps is not _UNSET:
        out["eps"] = check_number(prefix + "eps", eps, minimum=F32_TINY, allowed="eps > 0 (at least 1.2e-38)",
                                  hint="eps is added to sqrt(v) in fp32: 0, or less than fp32's smallest normal "
                                  "number, divides by zero where v is 0")
    if weight_decay is not _UNSET:
        out["weight_decay"] = check_number(prefix + "weight_decay", weight_decay, minimum=0.0,
                                           allowed="a finite weight decay >= 0")
    lr_v = out.get("lr", _plain_float((defaults or {}).get("lr")))
    wd_v = out.get("weight_decay", _plain_float((defaults or {}).get("weight_decay")))
    if lr_v is not None and wd_v is not None and lr_v * wd_v > 1.0:
        key = "weight_decay" if "weight_decay" in out else "lr"
        raise _error(prefix + key, out[key], "lr x weight_decay <= 1",
                     f"decoupled weight decay multiplies every weight by 1 - lr x weight_decay = "
                     f"{1.0 - lr_v * wd_v:g} ({prefix}lr={lr_v:g}, {prefix}weight_decay={wd_v:g}); past 1 the "
                     "weights flip sign and grow each step: lower one of them")
    return out


def _plain_float(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    try:
        x = float(v)
    except (OverflowError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _check_bool(key: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise _error(key, value, "true or false")


def _check_path(key: str, value: Any) -> None:
    """What can be said of a folder path without looking at this machine (a config may be written for another):
    a non-blank string without a NUL byte, within Linux's length limits, not in a kernel file system."""
    if value is None:
        return
    if not isinstance(value, str) or not value.strip():
        raise _error(key, value, "a directory path (string) or null")
    _check_path_text(key, value, value)


def check_path_syntax(key: str, value: Any) -> None:
    """A folder path as far as it can be checked without this machine (a non-blank string, no NUL byte, within
    PATH_MAX and NAME_MAX, not in /proc, /sys or /dev): ConfigError naming ``key`` otherwise. The machine's side
    is :func:`check_directory`'s."""
    if value is None:
        raise _error(key, value, "a directory path (string)")
    _check_path(key, value)


def _check_path_text(key: str, value: Any, text: str) -> None:
    if "\0" in text:
        raise _error(key, value, "a directory path without a NUL byte", "a path cannot hold one; it is cut there")
    if len(os.fsencode(text)) >= PATH_MAX:
        raise _error(key, _short(value), f"a directory path under {PATH_MAX} bytes",
                     f"it is {len(os.fsencode(text))} bytes; Linux's PATH_MAX is {PATH_MAX}")
    long = [c for c in text.split("/") if len(os.fsencode(c)) > NAME_MAX]
    if long:
        raise _error(key, _short(value), f"path components of at most {NAME_MAX} bytes",
                     f"one is {len(os.fsencode(long[0]))} bytes (NAME_MAX is {NAME_MAX})")
    if text.startswith("/"):
        _check_not_kernel_fs(key, value, Path(os.path.normpath(text)))


def _check_not_kernel_fs(key: str, value: Any, p: Path) -> None:
    for top in _KERNEL_FS:
        if (p == Path(top) or Path(top) in p.parents) and not any(
                p == Path(ok) or Path(ok) in p.parents for ok in _KERNEL_FS_OK):
            raise _error(key, value, "a folder on a disk (or in /dev/shm)",
                         f"{p} is in {top}, a kernel file system: state files cannot live there")


def _short(value: Any) -> Any:
    """A long string value cut for an error message (its length said)."""
    return f"{value[:60]}...({len(value)} characters)" if isinstance(value, str) and len(value) > 120 else value


_ENV_VAR = re.compile(r"\$(\w+)|\$\{(\w+)\}")


def check_directory(key: str, value: Any, *, create: bool = True) -> Path:
    """The folder ``value`` names, checked where it enters, before anything is built: the one check of every
    nvme_path (``optimizer_states.nvme_path`` and ``activations.nvme_path`` of the block and the FSDP policy,
    DeepSpeed's ``offload_optimizer.nvme_path`` that the block reads, FP4AdamW's ``nvme_path``).

    ``~`` and ``$VARS`` / ``${VARS}`` are expanded (an unset variable or an unknown ``~user`` is an error, not a
    literal folder), the path made absolute and resolved (symlinks followed). Refused: a NUL byte, a path over
    PATH_MAX or a component over NAME_MAX, anything in /proc, /sys or /dev (but /dev/shm), something that exists
    and is not a directory (a regular file, a device, a FIFO), a folder this process cannot write to (a read-only
    mount, permissions), and a missing folder whose parent does not exist (a mistyped mount point is not created
    with its parents; a dangling symlink counts as its missing target). Relative paths are taken from the working
    directory. A missing folder under an existing, writable
    parent is created (one level, mode 0700) when ``create``. Returns the resolved path; raises ConfigError
    naming ``key``, the value and the fix.
    """
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value.strip():
        raise _error(key, value, "a directory path (string)")
    if "\0" in value:
        _check_path_text(key, value, value)
    text = os.path.expanduser(value)
    if text.startswith("~"):
        user = text[1:].split("/", 1)[0]
        raise _error(key, value, "a directory path", f"~{user} is not a user on this machine: write the folder out")
    unset = [m.group(1) or m.group(2) for m in _ENV_VAR.finditer(text) if (m.group(1) or m.group(2)) not in os.environ]
    if unset:
        raise _error(key, value, "a directory path", f"environment variable {unset[0]} is not set: set it, or write "
                     "the folder out")
    text = os.path.expandvars(text)
    _check_path_text(key, value, text)
    try:
        p = Path(os.path.abspath(text)).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise _error(key, value, "a directory path", str(exc)) from None
    _check_path_text(key, value, str(p))
    try:
        st = os.stat(p)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise _error(key, value, "a folder this process can reach", str(exc)) from None
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise _error(key, value, "a directory", f"{p} is {_kind(st.st_mode)}: name a folder (it may not exist "
                         "yet, under one that does)")
        if not os.access(p, os.W_OK | os.X_OK):
            raise _error(key, value, "a folder this process can write to",
                         f"{p} is not writable (a read-only mount, or its permissions): pick another, or fix them")
        return p
    parent = p.parent
    if not parent.is_dir():
        raise _error(key, value, "an existing folder, or a new one inside an existing folder",
                     f"{parent} does not exist: a mistyped mount point? Nothing is created above the folder "
                     "itself; create it first if it is meant")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _error(key, value, "a folder this process can create",
                     f"{p} does not exist and {parent} is not writable (a read-only mount, or its permissions)")
    if create:
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            if not p.is_dir():
                raise _error(key, value, "a directory", f"{p} appeared as something else") from None
        except OSError as exc:
            raise _error(key, value, "a folder this process can create", f"{p}: {exc.strerror}") from None
    return p


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a directory"


def with_checked_paths(cfg: Any, prefix: str = "") -> Any:
    """``cfg`` (an Fp4OffloadConfig or FsdpPolicyConfig) with each nvme_path of ``optimizer_states`` and
    ``activations`` checked by :func:`check_directory` (created under an existing parent) and replaced by the
    resolved folder. Called where a run starts on this machine (``Prepared.checked_paths``, which
    ``fp4offload.deepspeed.initialize`` calls first), not by ``parse_block``: a config may be written on one
    machine for another."""
    changes = {}
    for name in ("optimizer_states", "activations"):
        sub = getattr(cfg, name, None)
        path = getattr(sub, "nvme_path", None)
        if path is not None:
            resolved = str(check_directory(f"{prefix}{name}.nvme_path", path))
            if resolved != path:
                changes[name] = dataclasses.replace(sub, nvme_path=resolved)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def _as_tuple(obj: Any, name: str) -> None:
    """Store a list given for a tuple field as a tuple (the dataclasses are frozen and hashable)."""
    v = getattr(obj, name)
    if isinstance(v, list):
        object.__setattr__(obj, name, tuple(v))


def _check_names(key: str, value: Any, *, non_empty: bool = False) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
        raise _error(key, value, "a list of non-empty strings")
    if non_empty and not value:
        raise _error(key, value, "a non-empty list of strings")


def _check_nvme(prefix: str, device: str, nvme_path: str | None) -> None:
    if device == "nvme" and nvme_path is None:
        raise _error(f"{prefix}.nvme_path", None, "a directory on an NVMe drive when device is 'nvme'",
                     f"set {_prefix.get()}{prefix}.nvme_path, e.g. \"/local_nvme/fp4offload\"")


# ---------------------------------------------------------------------------------------------
# The sub-blocks


@dataclass(frozen=True)
class OptimizerStatesConfig:
    """Adam's m and v in 4-bit (``optimizer_states``).

    Attributes:
        format: ``"nvfp4"`` (m in NVFP4 1x16, sqrt(v) on a 4-bit grid, see docs/design.md 3.7) or ``"fp32"``
            (unpacked; for ablations). Default ``"nvfp4"``.
        device: where the states live between steps. ``"same"`` (default): with the parameter
            partition the optimizer is handed (the GPU, or host RAM when DeepSpeed's
            ``offload_optimizer.device`` is ``"cpu"``). ``"cpu"``: pinned host RAM. ``"nvme"``:
            files under ``nvme_path``, staged through pinned host buffers.
        nvme_path: directory for the state files; required when device is ``"nvme"``. Default None.
        rounding: rounding of m, ``"stochastic"`` (default) or ``"nearest"``.
        v_rounding: rounding of the stored sqrt(v), ``"nearest"`` or ``"stochastic"`` (default
            :data:`V_ROUNDING_DEFAULT`; docs/numerics.md, "Rounding of the optimizer states").
        v_format: the grid of the stored sqrt(v), ``"ue2m2"`` (default, :data:`V_FORMAT_DEFAULT`) or ``"ufp4"``
            (the grid before 2026-12-03; docs/numerics.md, "The grid of sqrt(v)"); ``"nvfp4"`` stores v itself
            (ablation).
        min_numel: tensors with fewer elements keep fp32 states. Elements; default 4096.
        master: how the master weight is held (FP4AdamW's ``master``, docs/numerics.md "Master weights"):
            ``"fp32"`` (default: DeepSpeed's fp32 partition), ``"split"`` (a bf16 partition plus a 16-bit
            residual in the optimizer: the fp32 master exactly, 2 B/param less) or ``"bf16"`` (a bf16 partition
            updated with stochastic rounding, 4 B/param less). The compact forms run on DeepSpeed's bf16 master
            mode (``bf16.bf16_master_weights_and_grads``, which the block turns on) with ZeRO-1/2 and
            offload_optimizer.
        master_device: where split's residual lives between steps: ``"same"`` (default: host RAM) or ``"nvme"``
            (in the state files beside the packed m and v, read ahead and written behind with them; with master
            ``"split"`` and the states on NVMe only). Host RAM then holds no residual between steps.
    """

    format: str = "nvfp4"
    device: str = "same"
    nvme_path: str | None = None
    rounding: str = "stochastic"
    v_rounding: str = V_ROUNDING_DEFAULT
    v_format: str = V_FORMAT_DEFAULT
    min_numel: int = STATE_MIN_NUMEL
    master: str = "fp32"
    master_device: str = "same"

    def __post_init__(self) -> None:
        _check_choice("optimizer_states.format", self.format, OPTIMIZER_FORMATS)
        _check_choice("optimizer_states.device", self.device, OPTIMIZER_DEVICES)
        _check_path("optimizer_states.nvme_path", self.nvme_path)
        _check_choice("optimizer_states.rounding", self.rounding, ROUNDINGS)
        _check_choice("optimizer_states.v_rounding", self.v_rounding, ROUNDINGS)
        _check_choice("optimizer_states.v_format", self.v_format, V_FORMATS)
        _check_choice("optimizer_states.master", self.master, MASTER_FORMS)
        if self.master != "fp32" and self.format != "nvfp4":
            raise _error("optimizer_states.master", self.master, "'fp32' with format 'fp32'",
                              "a compact master is FP4AdamW's; set format 'nvfp4' or master 'fp32'")
        _check_choice("optimizer_states.master_device", self.master_device, MASTER_DEVICES)
        if self.master_device == "nvme" and self.master != "split":
            raise _error("optimizer_states.master_device", "nvme", f"'same' with master {self.master!r}",
                         "only split keeps a residual, and it goes to NVMe beside the states: set master 'split', "
                         "or master_device 'same'")
        if self.master_device == "nvme" and self.device == "cpu":
            raise _error("optimizer_states.master_device", "nvme", "'same' with device 'cpu'",
                         "the residual goes into the NVMe state files: set device 'nvme', or master_device 'same'")
        _check_int("optimizer_states.min_numel", self.min_numel)
        _check_nvme("optimizer_states", self.device, self.nvme_path)
        if self.format == "fp32" and self.device == "nvme":
            raise _error("optimizer_states.device", "nvme", "'same' or 'cpu' with format 'fp32'",
                         "format 'fp32' is torch AdamW, which keeps its states in memory beside the parameters and "
                         "never on NVMe: set format 'nvfp4' for NVMe states, or drop device 'nvme'")
        if self.nvme_path is not None and self.format == "fp32":
            raise _error("optimizer_states.nvme_path", self.nvme_path, "null with format 'fp32'",
                         "torch AdamW's fp32 states never go to NVMe, so the folder would be ignored: remove it, "
                         "or set format 'nvfp4' and device 'nvme'")
        if self.nvme_path is not None and self.device == "cpu":
            raise _error("optimizer_states.nvme_path", self.nvme_path, "null unless device is 'nvme'",
                         "device 'cpu' keeps the states in host RAM, so the folder would be ignored: remove it, or "
                         "set device 'nvme'")


@dataclass(frozen=True)
class ActivationsConfig:
    """Tensors autograd saves for backward, packed and moved (``activations``).

    Attributes:
        format: ``"nvfp4"`` (default), ``"mxfp4"``, ``"mxfp8"`` (gentler, 8-bit) or ``"none"``
            (moved unpacked, in their own dtype).
        device: ``"cpu"`` (pinned host RAM, default), ``"nvme"`` (files under ``nvme_path``) or
            ``"same"`` (stay on the GPU, compressed only).
        nvme_path: directory for activation files; required when device is ``"nvme"``. Default None.
        min_numel: saved tensors with fewer elements are left alone. Elements; default 65536.
        modules: glob patterns (fnmatch) over module qualified names whose saved tensors are
            handled, e.g. ``["*.mlp"]``. Default ``[]``: every module (the whole forward).
        exclude: glob patterns of modules to leave alone even if ``modules`` matches. Default [].
        max_host_bytes: cap on the pinned host RAM each rank's activation pool may hold, in bytes; past it
            tensors stay on their device, compressed. Default None: half of the RAM available when the pool
            is created, divided by the node's local ranks (LOCAL_WORLD_SIZE), so the ranks of a node share half.
    """

    format: str = "nvfp4"
    device: str = "cpu"
    nvme_path: str | None = None
    min_numel: int = ACTIVATION_MIN_NUMEL
    modules: tuple[str, ...] = ACTIVATION_MODULES
    exclude: tuple[str, ...] = ()
    max_host_bytes: int | None = None

    def __post_init__(self) -> None:
        _as_tuple(self, "modules")
        _as_tuple(self, "exclude")
        _check_choice("activations.format", self.format, ACTIVATION_FORMATS)
        _check_choice("activations.device", self.device, ACTIVATION_DEVICES)
        _check_path("activations.nvme_path", self.nvme_path)
        _check_int("activations.min_numel", self.min_numel)
        _check_names("activations.modules", self.modules)
        _check_names("activations.exclude", self.exclude)
        if self.max_host_bytes is not None:
            _check_int("activations.max_host_bytes", self.max_host_bytes)
        _check_nvme("activations", self.device, self.nvme_path)
        if self.nvme_path is not None and self.device != "nvme":
            raise _error("activations.nvme_path", self.nvme_path, "null unless device is 'nvme'",
                         f"device {self.device!r} keeps activations "
                         f"{'in host RAM' if self.device == 'cpu' else 'where they are'}, so the folder would be "
                         "ignored: remove it, or set device 'nvme'")
        if self.format == "none" and self.device == "same":
            raise _error("activations.device", "same", "'cpu' or 'nvme' when format is 'none'",
                         "format 'none' with device 'same' does nothing: pick a 4-bit format or move them")


@dataclass(frozen=True)
class WeightsConfig:
    """The weight working copy that forward and backward compute with (``weights``).

    Under DeepSpeed this needs ZeRO stage 3 with ``offload_param`` on the same device (the host
    partition is stored packed and fetched per layer); under FSDP2 the shards are all-gathered packed, and with
    ``cpu_offload: true`` the host copy is the packed one too.

    Attributes:
        format: ``"nvfp4"`` (16x16 blocks, nearest; default) or ``"bf16"``.
        device: ``"cpu"`` (default, and the only choice: both engines keep packed shards in host RAM).
        keep_bf16: parameters that stay bf16: substrings of parameter names (``"embed"``,
            ``"lm_head"``, ``"norm"``, ``"bias"``) and ``"first:N"`` / ``"last:N"`` for the first and
            last N transformer blocks. Default: embeddings, head, norms, biases, first and last block.
    """

    format: str = "nvfp4"
    device: str = "cpu"
    keep_bf16: tuple[str, ...] = KEEP_BF16

    def __post_init__(self) -> None:
        _as_tuple(self, "keep_bf16")
        _check_choice("weights.format", self.format, WEIGHT_FORMATS)
        _check_choice("weights.device", self.device, WEIGHT_DEVICES)
        _check_names("weights.keep_bf16", self.keep_bf16)
        for rule in self.keep_bf16:
            if ":" in rule and not _KEEP_RULE.match(rule):
                raise _error("weights.keep_bf16", rule, "a name substring, or 'first:N' / 'last:N' with N >= 0")


@dataclass(frozen=True)
class MonitorConfig:
    """Metrics written through the engine's monitor (``monitor``).

    Attributes:
        every: write the counters every this many optimizer steps. Steps; default 10.
    """

    every: int = 10

    def __post_init__(self) -> None:
        _check_int("monitor.every", self.every, minimum=1)


@dataclass(frozen=True)
class HostConfig:
    """Host-memory settings of the DeepSpeed block (``host``). They apply when ``optimizer_states`` is set.

    Each has an environment override that wins over the config (for a quick experiment without editing
    it); ``fp4offload doctor`` shows the effective value of each and where it came from.

    Attributes:
        mmap_threshold: glibc's mmap threshold, fixed so memory freed during backward leaves the heap.
            Bytes (>= 4096), or ``"off"`` to leave glibc's adaptive default. Default 131072 (128 KiB).
            Override: ``FP4OFFLOAD_MMAP_THRESHOLD``.
        allocator_cache: torch's CPU blocks of 128 KiB and more come from fp4offload's host allocator cache,
            which keeps freed blocks for reuse up to this share of the bytes in use. A fraction in (0, 1],
            or ``"off"``. Default 0.125. Override: ``FP4OFFLOAD_HOST_CACHE``.
        share_bf16_staging: on the CPU accelerator, ZeRO-1/2 offload writes the updated weights straight
            into the bf16 partition instead of through a second bf16 copy (2 B/param). Default true.
            Override: ``FP4OFFLOAD_SHARE_STAGING`` (0/1).
        bf16_gradient_partition: with one micro-batch per step, ZeRO-1/2 offload's host gradient partition
            is bf16 instead of fp32 (2 B/param); under ZeRO-3 offload the fp32 master's gradient is DeepSpeed's
            own bf16 gradient partition instead of an fp32 copy of it (4 B/param), clipped in fp32 by FP4AdamW.
            Default true. Override: ``FP4OFFLOAD_BF16_GRADS`` (0/1).
        preflight: before DeepSpeed allocates, initialize estimates the host RAM this rank and the node's
            local ranks will hold and compares it with what the process may use (available memory, the
            cgroup limit). ``"error"`` (default) raises CapacityError when it does not fit, ``"warn"``
            logs and goes on, ``"off"`` skips the check. The one host key allowed without
            optimizer_states. Override: ``FP4OFFLOAD_PREFLIGHT``.
    """

    mmap_threshold: int | str = MMAP_THRESHOLD
    allocator_cache: float | str = ALLOCATOR_CACHE
    share_bf16_staging: bool = True
    bf16_gradient_partition: bool = True
    preflight: str = "error"

    def __post_init__(self) -> None:
        _check_choice("host.preflight", self.preflight, PREFLIGHT_MODES,
                      "error stops before allocating when the estimate does not fit, warn logs it, off skips it")
        object.__setattr__(self, "mmap_threshold", _size_or_off("host.mmap_threshold", self.mmap_threshold))
        object.__setattr__(self, "allocator_cache", _fraction_or_off("host.allocator_cache", self.allocator_cache))
        _check_bool("host.share_bf16_staging", self.share_bf16_staging)
        _check_bool("host.bf16_gradient_partition", self.bf16_gradient_partition)


def _size_or_off(key: str, value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() in OFF_VALUES:
        return "off"
    if isinstance(value, bool) or not isinstance(value, int) or not 4096 <= value <= MMAP_THRESHOLD_MAX:
        raise _error(key, value, f"a size in bytes >= 4096 and <= {MMAP_THRESHOLD_MAX} (32 MiB), or \"off\"",
                     f"the default is {MMAP_THRESHOLD} (glibc's own starting threshold, kept fixed); 32 MiB is "
                     "glibc's upper limit on 64-bit machines (mallopt(3)), past which it may refuse it")
    return value


def _fraction_or_off(key: str, value: Any) -> float | str:
    if isinstance(value, str) and value.strip().lower() in OFF_VALUES:
        return "off"
    x = _plain_float(value) if isinstance(value, (int, float)) else None
    if x is None or not 0.0 < x <= 1.0:
        raise _error(key, value, "a fraction in (0, 1] of the bytes in use, or \"off\"",
                     f"it bounds the freed memory the host cache keeps resident; the default is {ALLOCATOR_CACHE}")
    return float(value)


_SUBBLOCKS: dict[str, type] = {
    "optimizer_states": OptimizerStatesConfig,
    "activations": ActivationsConfig,
    "weights": WeightsConfig,
    "monitor": MonitorConfig,
    "host": HostConfig,
}
#: FSDP2 policies take the same sub-blocks but host (the host settings are DeepSpeed's; under FSDP2
#: ``fp4offload.host_allocator.install()`` is a call of its own, since it is process-wide)
_FSDP_SUBBLOCKS = {n: c for n, c in _SUBBLOCKS.items() if n != "host"}


def _to_plain(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return out


@dataclass(frozen=True)
class Fp4OffloadConfig:
    """The whole ``"fp4offload"`` block of a DeepSpeed config. A None sub-block is a feature that is off."""

    optimizer_states: OptimizerStatesConfig | None = None
    activations: ActivationsConfig | None = None
    weights: WeightsConfig | None = None
    monitor: MonitorConfig | None = None
    host: HostConfig | None = None

    def __post_init__(self) -> None:
        for name, cls in _SUBBLOCKS.items():
            v = getattr(self, name)
            if v is not None and not isinstance(v, cls):
                raise _error(name, v, f"a {cls.__name__} or None")
        if self.host is not None and self.optimizer_states is None:
            default = HostConfig()
            set_keys = {f.name for f in fields(HostConfig) if getattr(self.host, f.name) != getattr(default, f.name)}
            if set_keys - {"preflight"}:
                raise _error("host", _to_plain(self.host), "only host.preflight without optimizer_states",
                             "the other host settings shape the memory of the offloaded optimizer step; add "
                             "optimizer_states or remove them")

    @property
    def enabled(self) -> bool:
        """True when at least one feature is on."""
        return any(getattr(self, n) is not None for n in _SUBBLOCKS if n != "host")

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (absent sub-blocks left out), as ``parse_block`` reads it back."""
        return {n: _to_plain(getattr(self, n)) for n in _SUBBLOCKS if getattr(self, n) is not None}


# ---------------------------------------------------------------------------------------------
# Parsing


def _unknown(key: str, value: Any, allowed: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"unknown key; did you mean {close[0]!r}?" if close else "unknown key; remove it"
    return _error(key, value, "one of the keys " + ", ".join(allowed), hint)


def _parse_sub(name: str, cls: type, raw: Any) -> Any:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise _error(name, raw, "a mapping of settings, or null to turn the feature off")
    names = [f.name for f in fields(cls)]
    kwargs: dict[str, Any] = {}
    for k, v in raw.items():
        if k not in names:
            with _under(name + "."):
                raise _unknown(str(k), v, names)
        if isinstance(v, list):
            v = tuple(v)
        kwargs[k] = v
    return cls(**kwargs)


def parse_block(block: Mapping[str, Any] | None, *, prefix: str = "") -> Fp4OffloadConfig:
    """Validate the ``"fp4offload"`` block (a dict from JSON) and return it as a dataclass.

    ``None`` or ``{}`` give a config with every feature off. ``prefix`` is prepended to key paths
    in error messages (``validate_deepspeed_config`` passes ``"fp4offload."``).
    """
    with _under(prefix):
        if block is None:
            return Fp4OffloadConfig()
        if not isinstance(block, Mapping):
            raise ConfigError(_prefix.get().rstrip(".") or "fp4offload", block,
                              "a JSON object with optional keys " + ", ".join(_SUBBLOCKS))
        for k in block:
            if k not in _SUBBLOCKS:
                raise _unknown(str(k), block[k], list(_SUBBLOCKS))
        return Fp4OffloadConfig(**{n: _parse_sub(n, c, block.get(n)) for n, c in _SUBBLOCKS.items()})


def find_auto_values(cfg: Any, path: str = "") -> list[str]:
    """Key paths in ``cfg`` whose value is the string ``"auto"`` (DeepSpeed drops those silently)."""
    found: list[str] = []
    if isinstance(cfg, Mapping):
        for k, v in cfg.items():
            found += find_auto_values(v, f"{path}.{k}" if path else str(k))
    elif isinstance(cfg, (list, tuple)):
        for i, v in enumerate(cfg):
            found += find_auto_values(v, f"{path}[{i}]")
    elif isinstance(cfg, str) and cfg.strip().lower() == "auto":
        found.append(path)
    return found


def _get(d: Mapping[str, Any], dotted: str) -> Any:
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _offload_device(ds: Mapping[str, Any], which: str) -> str | None:
    dev = _get(ds, f"zero_optimization.{which}.device")
    return None if dev in (None, "none") else dev


def validate_deepspeed_config(ds: Mapping[str, Any], *, world_size: int | None = None,
                              check_with_deepspeed: bool = False) -> Fp4OffloadConfig:
    """Check a whole DeepSpeed config dict that may carry an ``"fp4offload"`` block.

    The one place that checks how the block combines with DeepSpeed's own keys. Checks: no DeepSpeed
    key holds ``"auto"``; the block itself (``parse_block``); weights need ZeRO-3 with ``offload_param``
    on the same device, and neither ZeRO++'s quantized weights nor hierarchical partitions; packed
    optimizer states need DeepSpeed to accept a client optimizer (``zero_force_ds_cpu_optimizer``
    false, ``zero_allow_untested_optimizer`` true), must not sit behind DeepSpeed's own NVMe
    optimizer swapper, and need ZeRO for an offloaded optimizer or fp16; bf16 and fp16 are not both
    on; the batch sizes agree when ``world_size`` is given. With ``check_with_deepspeed`` the
    ``zero_optimization`` section is also validated by DeepSpeed's own schema (imports deepspeed, slow).
    Returns the parsed block.
    """
    if not isinstance(ds, Mapping):
        raise ConfigError("<deepspeed config>", type(ds).__name__, "a JSON object (dict)")
    own = {k: v for k, v in ds.items() if k != "fp4offload"}
    autos = find_auto_values(own)
    if autos:
        raise ConfigError(autos[0], "auto", "a concrete value",
                          "DeepSpeed drops keys set to \"auto\" without a word (only the HF Trainer fills them); "
                          "write the number, or let `fp4offload plan --emit deepspeed` write the config")
    block = parse_block(ds.get("fp4offload"), prefix="fp4offload.")

    zero = ds.get("zero_optimization") or {}
    if not isinstance(zero, Mapping):
        raise ConfigError("zero_optimization", zero, "a JSON object")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError("zero_optimization.stage", stage, "0, 1, 2 or 3")

    if _get(ds, "bf16.enabled") is True and _get(ds, "fp16.enabled") is True:
        raise ConfigError("fp16.enabled", True, "false when bf16.enabled is true", "pick one of bf16 and fp16")

    if block.weights is not None:
        w = block.weights
        if stage != 3:
            raise ConfigError("fp4offload.weights", block.to_dict()["weights"],
                              "only with zero_optimization.stage 3",
                              f"stage is {stage}: set \"stage\": 3 and offload_param, or remove the weights block")
        dev = _offload_device(ds, "offload_param")
        if dev != w.device:
            raise ConfigError("zero_optimization.offload_param.device", dev,
                              f"{w.device!r} (fp4offload.weights.device)",
                              "packed weights live in the host/NVMe partition DeepSpeed fetches from; "
                              f"add \"offload_param\": {{\"device\": \"{w.device}\", \"pin_memory\": true}}")

    if block.optimizer_states is not None:
        if ds.get("zero_force_ds_cpu_optimizer") is not False:
            raise ConfigError("zero_force_ds_cpu_optimizer", ds.get("zero_force_ds_cpu_optimizer"), "false",
                              "fp4offload's optimizer is a client optimizer; DeepSpeed replaces or rejects it unless "
                              "\"zero_force_ds_cpu_optimizer\": false")
        if stage >= 1 and ds.get("zero_allow_untested_optimizer") is not True:
            raise ConfigError("zero_allow_untested_optimizer", ds.get("zero_allow_untested_optimizer"), "true",
                              "ZeRO refuses client optimizers it does not know unless "
                              "\"zero_allow_untested_optimizer\": true")
        if _offload_device(ds, "offload_optimizer") == "nvme":
            raise ConfigError("zero_optimization.offload_optimizer.device", "nvme",
                              "'cpu' or 'none' when fp4offload.optimizer_states is set",
                              "DeepSpeed's NVMe optimizer swapper cannot hold packed states: set offload_optimizer "
                              "to \"cpu\" and fp4offload.optimizer_states.device to \"nvme\" with an nvme_path")
        if _offload_device(ds, "offload_optimizer") == "cpu" and stage == 0:
            raise ConfigError("zero_optimization.stage", 0, "1, 2 or 3 when offload_optimizer is set",
                              "DeepSpeed offloads the optimizer only under ZeRO")
        if _get(ds, "fp16.enabled") and stage == 0:
            raise ConfigError("fp16.enabled", True, "false without ZeRO when fp4offload.optimizer_states is set",
                              "DeepSpeed's fp16 optimizer wrapper flattens states itself; use ZeRO 1-3 or bf16")

    if block.weights is not None and block.weights.format == "nvfp4":
        if zero.get("zero_quantized_weights") or zero.get("zero_quantized_nontrainable_weights"):
            raise ConfigError("zero_optimization.zero_quantized_weights", True, "false with fp4offload.weights",
                              "both replace how partitions are stored and fetched; keep one")
        if zero.get("zero_hpz_partition_size", 1) not in (1, None):
            raise ConfigError("zero_optimization.zero_hpz_partition_size", zero.get("zero_hpz_partition_size"),
                              "1 with fp4offload.weights", "hierarchical partitions keep a second bf16 copy")

    _check_batch(ds, world_size)
    if check_with_deepspeed and zero:
        _check_zero_with_deepspeed(zero)
    return block


def _check_batch(ds: Mapping[str, Any], world_size: int | None) -> None:
    keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    for k in keys:
        v = ds.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConfigError(k, v, "a positive integer")
    tb, mb, ga = (ds.get(k) for k in keys)
    if world_size and None not in (tb, mb, ga) and tb != mb * ga * world_size:
        raise ConfigError("train_batch_size", tb, f"{mb} x {ga} x {world_size} = {mb * ga * world_size}",
                          "train_batch_size must equal micro batch x accumulation steps x data-parallel ranks")


def _check_zero_with_deepspeed(zero: Mapping[str, Any]) -> None:
    try:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # slow import, on demand only
    except Exception as exc:  # pragma: no cover - deepspeed is a dependency
        raise ConfigError("zero_optimization", "<not checked>", "a config DeepSpeed accepts",
                          f"deepspeed could not be imported to check it: {exc}") from exc
    try:
        DeepSpeedZeroConfig(**dict(zero))
    except Exception as exc:
        first = str(exc).strip().splitlines()
        raise ConfigError("zero_optimization", "<see hint>", "keys and values DeepSpeed's ZeRO config accepts",
                          " ".join(first[:4])) from None


# ---------------------------------------------------------------------------------------------
# FSDP2 policy


@dataclass(frozen=True)
class FsdpPolicyConfig:
    """An FSDP2 (``fully_shard``) policy with the same sub-blocks as the DeepSpeed block.

    Attributes:
        weights: weight shards all-gathered as NVFP4 (the fp32 shard stays the master; with
            ``cpu_offload`` the host-to-device copy carries the packed bytes too). ``weights.device``
            must be ``"cpu"`` (FSDP2 offloads to host RAM only). Default None (off).
        optimizer_states: packed Adam states, as in the DeepSpeed block. Default None.
        activations: saved-tensor packing and offload. Default None.
        monitor: metrics interval. Default None.
        cpu_offload: shard parameters, gradients and optimizer states in host RAM
            (``CPUOffloadPolicy``); the optimizer steps on the CPU. Default False.
        reshard_after_forward: free gathered parameters after forward and gather again in
            backward (ZeRO-3 behaviour) rather than keep them (ZeRO-2). Default True.
        block_classes: class names of the modules to wrap with ``fully_shard`` one by one
            (e.g. ``["LlamaDecoderLayer"]``); the root module is always wrapped. Default [].
    """

    weights: WeightsConfig | None = None
    optimizer_states: OptimizerStatesConfig | None = None
    activations: ActivationsConfig | None = None
    monitor: MonitorConfig | None = None
    cpu_offload: bool = False
    reshard_after_forward: bool = True
    block_classes: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name, cls in _FSDP_SUBBLOCKS.items():
            v = getattr(self, name)
            if v is not None and not isinstance(v, cls):
                raise _error(name, v, f"a {cls.__name__} or None")
        _as_tuple(self, "block_classes")
        _check_bool("cpu_offload", self.cpu_offload)
        _check_bool("reshard_after_forward", self.reshard_after_forward)
        _check_names("block_classes", self.block_classes)
        if self.weights is not None and self.weights.device != "cpu":
            raise _error("weights.device", self.weights.device, "'cpu' under FSDP2",
                         "FSDP2 offloads to host RAM only; NVMe weights need DeepSpeed ZeRO-3 offload_param")
        check_fsdp_states(self.optimizer_states, self.cpu_offload)

    def to_dict(self) -> dict[str, Any]:
        """The YAML form (absent sub-blocks left out), as ``parse_fsdp_policy`` reads it back."""
        out: dict[str, Any] = {n: _to_plain(getattr(self, n)) for n in _FSDP_SUBBLOCKS if getattr(self, n) is not None}
        out.update(cpu_offload=self.cpu_offload, reshard_after_forward=self.reshard_after_forward,
                   block_classes=list(self.block_classes))
        return out


_FSDP_SCALARS = ("cpu_offload", "reshard_after_forward", "block_classes")


def check_fsdp_states(states: OptimizerStatesConfig | None, cpu_offload: Any = False) -> None:
    """What the FSDP2 optimizer would ignore in ``optimizer_states``: an nvme_path with device 'same' (DeepSpeed
    reads that pair for its NVMe offload; FSDP2 has none, so the states stay beside the shards), and device 'cpu'
    with format 'fp32' without cpu_offload (torch AdamW keeps its states beside the shards, on the GPU)."""
    if states is None:
        return
    if states.nvme_path is not None and states.device != "nvme":
        raise _error("optimizer_states.nvme_path", states.nvme_path, "null unless device is 'nvme'",
                     f"under FSDP2 device {states.device!r} keeps the states beside the shards, so the folder would "
                     "be ignored: remove it, or set device 'nvme'")
    if states.format == "fp32" and states.device == "cpu" and cpu_offload is not True:
        raise _error("optimizer_states.device", "cpu", "'same' with format 'fp32' (or cpu_offload: true)",
                     "format 'fp32' is torch AdamW, whose states stay beside the shards (on the GPU without "
                     "cpu_offload): set cpu_offload true to keep shards and states in host RAM, or format 'nvfp4'")


def parse_fsdp_policy(doc: Mapping[str, Any] | None) -> FsdpPolicyConfig:
    """Validate an FSDP2 policy mapping (from YAML) and return it as a dataclass."""
    if doc is None:
        return FsdpPolicyConfig()
    if not isinstance(doc, Mapping):
        raise _error("<fsdp policy>", doc, "a mapping with optional keys "
                     + ", ".join([*_FSDP_SUBBLOCKS, *_FSDP_SCALARS]))
    allowed = [*_FSDP_SUBBLOCKS, *_FSDP_SCALARS]
    for k in doc:
        if k not in allowed:
            raise _unknown(str(k), doc[k], allowed)
    kwargs: dict[str, Any] = {n: _parse_sub(n, c, doc.get(n)) for n, c in _FSDP_SUBBLOCKS.items()}
    for k in _FSDP_SCALARS:
        if k in doc:
            v = doc[k]
            kwargs[k] = tuple(v) if isinstance(v, list) else v
    return FsdpPolicyConfig(**kwargs)


#: the largest policy file read (a policy is a few hundred bytes; anything this large is the wrong file)
POLICY_MAX_BYTES = 1 << 20


def load_fsdp_policy_yaml(path: str | Path) -> FsdpPolicyConfig:
    """Read and validate an FSDP2 policy YAML file.

    The file must be a regular file (a FIFO or a device is not opened: it could block or never end) of at most
    1 MiB, UTF-8, valid YAML, one mapping with no key written twice (YAML would keep the last one without a
    word; the error names the key path and both lines), and not empty: an empty document, or one of comments
    only, is a ConfigError (a truncated or wrong file; write ``{}`` for a policy with every feature off).
    """
    import yaml

    p = Path(path)
    try:
        st = os.stat(p)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(str(p), f"<{_kind(st.st_mode)}>", "a regular YAML file",
                              "it is not read: it could block or never end")
        if st.st_size > POLICY_MAX_BYTES:
            raise ConfigError(str(p), f"<{st.st_size} bytes>", f"a policy file of at most {POLICY_MAX_BYTES} bytes",
                              "a policy is a few hundred bytes: is this the right file?")
        with open(p, "rb") as f:
            data = f.read(POLICY_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(str(p), "<unreadable>", "a readable YAML file", str(exc)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(p), "<not UTF-8>", "a UTF-8 YAML file",
                          f"byte {exc.start} ({data[exc.start:exc.start + 1]!r}) is not UTF-8: {exc.reason}") from None
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)  # libyaml when PyYAML has it: the same documents
    try:
        node = loader.get_single_node()  # composed first, so duplicate keys are seen before they are merged
        if node is not None:
            _refuse_duplicate_keys(node, p)
        doc = None if node is None else loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ConfigError(str(p), "<invalid YAML>", "a YAML mapping", str(exc).splitlines()[0]) from None
    except RecursionError:
        raise ConfigError(str(p), "<invalid YAML>", "a YAML mapping", "it nests too deeply") from None
    finally:
        loader.dispose()
    if node is None or doc is None:
        raise ConfigError(str(p), "<empty document>", "a YAML mapping of the policy's keys",
                          "the file holds no policy (empty, comments only, or null): write {} for one with every "
                          "feature off, or check that this is the right file")
    if not isinstance(doc, Mapping):
        raise ConfigError(str(p), doc, "a YAML mapping with optional keys " + ", ".join([*_FSDP_SUBBLOCKS,
                                                                                          *_FSDP_SCALARS]))
    return parse_fsdp_policy(doc)


def _refuse_duplicate_keys(node: Any, p: Path, path: str = "", seen: set | None = None) -> None:
    """ConfigError for a mapping key written twice anywhere in the composed YAML document (key path, lines)."""
    import yaml

    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias to a node already walked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first: dict[Any, int] = {}
        for k, v in node.value:
            name = k.value if isinstance(k, yaml.ScalarNode) else None
            key = f"{path}.{name}" if path else str(name)
            if name is not None:
                if name in first and name != "<<":
                    raise ConfigError(key, "<written twice>", "each key once in its mapping",
                                      f"{p} sets it on line {first[name]} and again on line {k.start_mark.line + 1}; "
                                      "YAML would keep the last one without a word: delete one")
                first[name] = k.start_mark.line + 1
            _refuse_duplicate_keys(v, p, key, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _refuse_duplicate_keys(v, p, f"{path}[{i}]", seen)


def dump_fsdp_policy_yaml(policy: FsdpPolicyConfig, path: str | Path | None = None, *, header: str = "") -> str:
    """Write ``policy`` as YAML (to ``path`` if given) and return the text."""
    import yaml

    text = "".join(f"# {line}\n" for line in header.splitlines()) + yaml.safe_dump(policy.to_dict(), sort_keys=False)
    if path is not None:
        Path(path).write_text(text)
    return text
