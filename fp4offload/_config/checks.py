"""The validator kit: the field checks of the JSON block, the YAML policy, FP4AdamW's arguments, the codec's and the
CLI's, and the one function that prepares a folder on this machine.

A mistake reads the same wherever it is made: :func:`check_choice` (``one of 'a', 'b'``, with the closest word
when one is close), :func:`check_int`, :func:`check_bool`, :func:`check_number`, :func:`check_adam_hyperparameters`
and :func:`check_path_syntax` look at the value alone: every number finite, in range (counts up to int64), of its
type (bools are not numbers, "4096" is not an integer); paths a non-blank string without a NUL byte, within
PATH_MAX/NAME_MAX, not in /proc, /sys or /dev (/dev/shm is fine). None of them reads or writes the disk, so a
config may be checked on one machine for another.

:func:`prepare_path` is the machine's side, for where a folder is first used: ``~`` and ``$VARS`` expanded, the
path resolved, refused when it is not a writable directory, and created one level deep under an existing parent.
:func:`with_checked_paths` applies it to the nvme_path folders of a parsed block or policy.

Every error is a :class:`fp4offload.errors.ConfigError` naming the key path (with the prefix of the document
being parsed, :func:`_under`), the value and what is allowed.
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
from pathlib import Path
from typing import Any, Iterator, Mapping

from fp4offload.errors import ConfigError

from .vocab import ACTIVATION_GENTLENESS, F32_MAX, F32_TINY, INT64_MAX, MASTER_FORMS, NAME_MAX, PATH_MAX, V_FORMATS

__all__ = ["check_choice", "check_int", "check_bool", "one_of", "check_number", "check_adam_hyperparameters",
           "check_path_syntax", "prepare_path", "with_checked_paths", "check_class_formats"]

#: the kernel file systems no state file belongs in
_KERNEL_FS = ("/proc", "/sys", "/dev")
_KERNEL_FS_OK = ("/dev/shm",)  # a tmpfs: a folder there is a folder in RAM

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



def one_of(allowed: tuple) -> str:
    """The allowed-values text of an error: ``one of 'a', 'b'`` (None written as None)."""
    return "one of " + ", ".join(repr(a) for a in allowed)


#: what a choice means, said with every mistake in it (JSON, YAML, Python or the command line alike)
CHOICE_HINTS = {
    V_FORMATS: "ue2m2 stores sqrt(v) and is the default",
    MASTER_FORMS: "'split' keeps the fp32 master exactly in 2 B/param beside the bf16 parameter; 'bf16' rounds the "
                  "bf16 parameter stochastically",
}


def check_choice(key: str, value: Any, allowed: tuple, hint: str | None = None) -> None:
    """``value`` is one of ``allowed`` (strings, or None where None is allowed); ConfigError naming ``key``, with
    the closest allowed word when one is close, then `hint` or what the choice means (CHOICE_HINTS)."""
    if not isinstance(value, (str, type(None))) or value not in allowed:
        words = [a for a in allowed if isinstance(a, str)]
        close = difflib.get_close_matches(value, words, n=1) if isinstance(value, str) else []
        said = [f"did you mean {close[0]!r}?"] if close else []
        said += [h for h in (hint or CHOICE_HINTS.get(tuple(allowed)),) if h]
        raise _error(key, value, one_of(allowed), " ".join(said) or None)


def check_int(key: str, value: Any, minimum: int = 0, maximum: int = INT64_MAX) -> int:
    """``value`` as an int when it is an integer (not a bool, a float or a string) in [minimum, maximum]."""
    allowed = f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum != INT64_MAX else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _error(key, value, allowed, _not_a_number_hint(value, "integer"))
    if value < minimum:
        raise _error(key, value, allowed)
    if value > maximum:
        raise _error(key, value, allowed, "a count past int64 reaches no real tensor" if maximum == INT64_MAX
                     else None)
    return int(value)


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


def check_bool(key: str, value: Any) -> None:
    """``value`` is a bool (true or false; True or False in Python)."""
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
    is :func:`prepare_path`'s."""
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


# ---------------------------------------------------------------------------------------------
# The machine's side: a folder prepared where it is first used (the only code here that looks at the disk)

_ENV_VAR = re.compile(r"\$(\w+)|\$\{(\w+)\}")


def prepare_path(key: str, value: Any, *, create: bool = True) -> Path:
    """The folder ``value`` names, made ready on this machine where it is first used: every nvme_path
    (``optimizer_states.nvme_path`` and ``activations.nvme_path`` of the block and the FSDP policy, DeepSpeed's
    ``offload_optimizer.nvme_path`` that the block reads, FP4AdamW's ``nvme_path``).

    ``~`` and ``$VARS`` / ``${VARS}`` are expanded (an unset variable or an unknown ``~user`` is an error, not a
    literal folder), the path made absolute and resolved (symlinks followed). Refused: a NUL byte, a path over
    PATH_MAX or a component over NAME_MAX, anything in /proc, /sys or /dev (but /dev/shm), something that exists
    and is not a directory (a regular file, a device, a FIFO), a folder this process cannot write to (a read-only
    mount, permissions), and a missing folder whose parent does not exist (a mistyped mount point is not created
    with its parents; a dangling symlink counts as its missing target). Relative paths are taken from the working
    directory. A missing folder under an existing, writable parent is created (one level, mode 0700; not with
    ``create=False``, which only checks). Returns the
    resolved path; raises ConfigError naming ``key``, the value and the fix.
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
    if not create:  # checking only (plan --check): what initialize would refuse, without making the folder
        return p
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


def with_checked_paths(cfg: Any, prefix: str = "", *, create: bool = True) -> Any:
    """``cfg`` (an Fp4OffloadConfig or FsdpPolicyConfig) with each nvme_path of ``optimizer_states`` and
    ``activations`` prepared by :func:`prepare_path` (created under an existing parent) and replaced by the
    resolved folder. For where a run starts on this machine (``Prepared.checked_paths``, which
    ``fp4offload.deepspeed.initialize`` calls first); parsing never calls it: a config may be written on one
    machine for another."""
    changes = {}
    for name in ("optimizer_states", "activations"):
        sub = getattr(cfg, name, None)
        path = getattr(sub, "nvme_path", None)
        if path is not None:
            resolved = str(prepare_path(f"{prefix}{name}.nvme_path", path, create=create))
            if resolved != path:
                changes[name] = dataclasses.replace(sub, nvme_path=resolved)
    return dataclasses.replace(cfg, **changes) if changes else cfg


def check_class_formats(prefix: str, fmt: str, module_formats: tuple[str, ...], classes: Mapping[str, str]) -> None:
    """Refuse an op class's format (``classes``: key -> value, e.g. ``{"attention_format": "nvfp4"}``) that
    would be ignored wherever it could apply: an op rule only makes storage gentler, so a form harsher than ``fmt``
    and every module format, or as harsh but another format (nvfp4 against mxfp4), is never used."""
    if fmt == "none":
        return
    applies = (fmt, *module_formats)
    g = ACTIVATION_GENTLENESS
    for key, want in classes.items():
        if want in ("inherit", "keep"):
            continue
        if all(g[want] < g[f] or (g[want] == g[f] and want != f) for f in applies):
            gentler = [f for f in ACTIVATION_GENTLENESS if g[f] > g[fmt] and f != "none"]
            raise _error(f"{prefix}{key}", want, f"'inherit' or a form gentler than format {fmt!r} "
                         f"({', '.join(repr(f) for f in gentler)})",
                         "an op rule only makes storage gentler than the module around it, so this one would never "
                         "be used: 'inherit' stores these tensors like their module")
