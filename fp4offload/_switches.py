"""Every ``FP4OFFLOAD_*`` environment variable in one table, and the one parser of their values.

Settings live in the configs (the DeepSpeed block, the FSDP2 policy, FP4AdamW's arguments). A variable exists
where a launcher cannot pass them: the start-up hook decides before any config is read, the codec backend and the
CPU path are chosen per process, the compiler runs before anything is configured. The five variables that share a
key with the block's ``host`` sub-block are overrides of that key: unset, the JSON key (or its default) holds.

Values are read one way everywhere: case-insensitive, surrounding spaces ignored, an unset or blank variable
meaning the default. An on/off variable takes :data:`ON_WORDS` and :data:`OFF_WORDS`; a choice takes its words;
a number is checked as its JSON key is. Anything else is a one-line :class:`fp4offload.errors.ConfigError`
naming the variable, the value and the accepted words.

    >>> from fp4offload import _switches as switches
    >>> switches.get("FP4OFFLOAD_AUTO", {"FP4OFFLOAD_AUTO": " None "})
    False

:func:`in_effect` gives each setting's value and where it came from (``fp4offload doctor`` prints it);
:func:`markdown_table` is the table of docs/guide.md.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from fp4offload._config.vocab import (ALLOCATOR_CACHE, CODEC_BACKENDS, CPU_ISAS, MMAP_THRESHOLD, MMAP_THRESHOLD_MAX,
                                     OFF_WORDS, ON_WORDS, PREFLIGHT_MODES)
from fp4offload.errors import ConfigError

__all__ = ["ON_WORDS", "OFF_WORDS", "KINDS", "Switch", "Setting", "SWITCHES", "BY_NAME", "on_off", "parse", "get",
           "setting", "host_settings", "in_effect", "markdown_table"]

#: the kinds of value a variable takes
KINDS = ("on/off", "choice", "number", "count", "list")
#: the key of the block a host variable overrides, as doctor and errors name it
BLOCK_KEY = "fp4offload"


@dataclass(frozen=True)
class Switch:
    """One environment variable.

    Attributes:
        name: the variable.
        kind: one of :data:`KINDS`.
        default: the value in effect when the variable is unset or blank (and no JSON key sets it).
        does: what it does, in a sentence.
        words: the words a choice takes.
        values: what a number or a list takes, in words.
        json_key: the block key it overrides (``host.mmap_threshold``), or None when no JSON key covers it.
    """

    name: str
    kind: str
    default: Any
    does: str
    words: tuple[str, ...] = ()
    values: str = ""
    json_key: str | None = None

    def accepted(self) -> str:
        """The values it takes, in words (for errors and the docs' table)."""
        if self.kind == "on/off":
            return f"on: {', '.join(ON_WORDS)}; off: {', '.join(OFF_WORDS)}"
        if self.kind == "choice":
            return ", ".join(self.words)
        return self.values


@dataclass(frozen=True)
class Setting:
    """A value in effect and where it came from: the variable's name, the JSON key, or ``"default"``."""

    value: Any
    source: str


SWITCHES: tuple[Switch, ...] = (
    Switch("FP4OFFLOAD_AUTO", "on/off", True,
           "The start-up hook (fp4offload-auto.pth) routes deepspeed.initialize through fp4offload when deepspeed "
           "is first imported; off leaves the import system alone. Read at interpreter start, before any config."),
    Switch("FP4OFFLOAD_BACKEND", "choice", "auto",
           "Forces the codec backend for every tensor; auto takes the first that builds for the tensor's device.",
           words=("auto", *CODEC_BACKENDS)),
    Switch("FP4OFFLOAD_CPU_ISA", "choice", "auto",
           "Forces the host kernels' vector path (a path this CPU lacks is refused); auto takes the fastest the "
           "CPU reports.", words=("auto", *CPU_ISAS)),
    Switch("FP4OFFLOAD_CUDA_ARCH", "list", None,
           "The CUDA targets the extension is compiled for; unset, every visible GPU's.",
           values="compute capabilities, comma-separated (90, 90a, 100a; an sm_ prefix is dropped)"),
    Switch("FP4OFFLOAD_VERBOSE_BUILD", "on/off", False,
           "Prints the compiler's commands and output while an extension builds."),
    Switch("FP4OFFLOAD_STEP_THREADS", "count", None,
           "The threads each rank's host optimizer step runs on (torch's intra-op threads, set at the block's "
           "initialize); unset, the CPUs the rank may use (affinity, cgroup CPU quota, SLURM_CPUS_PER_TASK) "
           "shared by the node's local ranks.", values="an integer, 1 to 4096"),
    Switch("FP4OFFLOAD_TRACEBACK", "on/off", False,
           "Under a launcher (WORLD_SIZE set), an uncaught fp4offload error prints one line for the job; on prints "
           "every rank's traceback instead."),
    Switch("FP4OFFLOAD_NVME_KEEP", "on/off", False,
           "Keeps the NVMe tier's folder of optimizer states when the optimizer closes (FP4AdamW's nvme_keep, "
           "when that is None)."),
    Switch("FP4OFFLOAD_MMAP_THRESHOLD", "number", MMAP_THRESHOLD,
           "glibc's mmap threshold, fixed so memory freed during backward leaves the heap.",
           values=f"bytes, 4096 to {MMAP_THRESHOLD_MAX} (32 MiB); or an off word", json_key="host.mmap_threshold"),
    Switch("FP4OFFLOAD_HOST_CACHE", "number", ALLOCATOR_CACHE,
           "The freed bytes the host allocator cache keeps, as a share of the bytes in use; also what "
           "fp4offload.host_allocator.install() takes when called without a fraction.",
           values="a fraction in (0, 1]; or an off word", json_key="host.allocator_cache"),
    Switch("FP4OFFLOAD_SHARE_STAGING", "on/off", True,
           "CPU accelerator, ZeRO-1/2 offload: the updated weights go straight into the bf16 partition, without a "
           "second bf16 copy.", json_key="host.share_bf16_staging"),
    Switch("FP4OFFLOAD_BF16_GRADS", "on/off", True,
           "The host gradient partition in bf16 (ZeRO-1/2 offload), DeepSpeed's own bf16 partition as the fp32 "
           "master's gradient (ZeRO-3 offload).", json_key="host.bf16_gradient_partition"),
    Switch("FP4OFFLOAD_PREFLIGHT", "choice", "error",
           "What initialize does when the host-memory estimate does not fit: raise, warn, or skip the check.",
           words=PREFLIGHT_MODES, json_key="host.preflight"),
)

BY_NAME: dict[str, Switch] = {s.name: s for s in SWITCHES}

_ARCH = re.compile(r"^\d{2,3}[a-z]?$")


def _switch(name: str) -> Switch:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not an fp4offload environment variable (fp4offload._switches.SWITCHES)") from None


def _refuse(sw: Switch, raw: str, hint: str | None = None) -> ConfigError:
    word = raw.strip().lower()
    choices = {"on/off": ON_WORDS + OFF_WORDS, "choice": sw.words}.get(sw.kind, ())
    close = difflib.get_close_matches(word, choices, n=1) if word else []
    parts = [hint] if hint else [f"it overrides {BLOCK_KEY}.{sw.json_key}"] if sw.json_key else []
    if close:
        parts.append(f"did you mean {close[0]!r}?")
    parts.append(f"unset it for the default ({_shown(sw.default, sw)})")
    return ConfigError(sw.name, raw, sw.accepted(), "; ".join(parts))


def _shown(value: Any, sw: Switch | None = None) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if value is None and sw is not None and sw.kind == "list":
        return "every visible GPU"
    if value is None and sw is not None and sw.name == "FP4OFFLOAD_STEP_THREADS":
        return "the rank's share of its CPUs"
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


def on_off(name: str, raw: str) -> bool:
    """``raw`` read as an on/off word for the variable ``name``: True for :data:`ON_WORDS`, False for
    :data:`OFF_WORDS` (any case, surrounding spaces ignored); ConfigError naming the variable otherwise."""
    word = raw.strip().lower()
    if word in ON_WORDS:
        return True
    if word in OFF_WORDS:
        return False
    raise _refuse(_switch(name), raw)


def parse(name: str, raw: str | None) -> Any:
    """The value of the variable ``name`` given ``raw`` (None, empty or blank: the default); ConfigError naming
    the variable, the value and the accepted words when ``raw`` is not one of them."""
    sw = _switch(name)
    if raw is None or not raw.strip():
        return sw.default
    word = raw.strip().lower()
    if sw.kind == "on/off":
        return on_off(name, raw)
    if sw.kind == "choice":
        if word not in sw.words:
            raise _refuse(sw, raw)
        return word
    if sw.kind == "count":
        if not word.isdigit() or not 1 <= int(word) <= 4096:
            raise _refuse(sw, raw)
        return int(word)
    if sw.kind == "number":
        return _host_number(sw, raw, word)
    archs = []
    for item in word.split(","):
        a = item.strip().removeprefix("sm_").removeprefix("compute_")
        if a and not _ARCH.match(a):
            raise _refuse(sw, raw, f"{item.strip()!r} is not one")
        if a:
            archs.append(a)
    return tuple(archs) or sw.default


def _host_number(sw: Switch, raw: str, word: str) -> Any:
    """A host number checked as its JSON key is (HostConfig), the error naming the variable."""
    from fp4offload._config.block import HostConfig

    key = sw.json_key.split(".", 1)[1]
    value: Any = "off" if word in OFF_WORDS else word
    if value != "off":
        try:
            value = int(word) if key == "mmap_threshold" else float(word)
        except ValueError:
            raise _refuse(sw, raw, f"it overrides {BLOCK_KEY}.{sw.json_key}") from None
    try:
        return getattr(HostConfig(**{key: value}), key)
    except ConfigError as exc:
        raise ConfigError(sw.name, raw, exc.allowed, f"it overrides {BLOCK_KEY}.{sw.json_key}") from None


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of the variable ``name`` in ``environ`` (default: this process's environment)."""
    return setting(name, environ).value


def setting(name: str, environ: Mapping[str, str] | None = None) -> Setting:
    """The value of the variable ``name`` and its source: the variable's name when set, else ``"default"``."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or not raw.strip():
        return Setting(_switch(name).default, "default")
    return Setting(parse(name, raw), name)


def host_settings(block: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> dict[str, Setting]:
    """The block's five host settings in effect, by key (``mmap_threshold``, ...): the variable when set, else the
    key of ``block`` (the ``"fp4offload"`` block as a JSON dict, checked by ``parse_block``) when written, else
    the default. Sources: the variable's name, ``fp4offload.host.<key>``, or ``"default"``."""
    from fp4offload._config.block import parse_block

    host = parse_block(block, prefix=f"{BLOCK_KEY}.").host
    written = block.get("host") if isinstance(block, Mapping) else None
    written = written if isinstance(written, Mapping) else {}
    out = {}
    for sw in SWITCHES:
        if sw.json_key is None or not sw.json_key.startswith("host."):
            continue
        key = sw.json_key.split(".", 1)[1]
        got = setting(sw.name, environ)
        if got.source == "default" and key in written:
            got = Setting(getattr(host, key), f"{BLOCK_KEY}.{sw.json_key}")
        out[key] = got
    return out


def in_effect(ds_config: Mapping[str, Any] | None = None,
              environ: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Every setting a variable sets, with its value in effect and the source that won, for ``ds_config`` (a
    DeepSpeed config as a dict, or None). Keyed by the JSON key a variable overrides (``fp4offload.host.preflight``)
    or, where none covers it, by the variable; each ``{"value", "source", "variable"}``. Raises ConfigError for
    the first variable (or block key) that does not parse."""
    block = ds_config.get(BLOCK_KEY) if isinstance(ds_config, Mapping) else None
    host = host_settings(block, environ)
    out = {}
    for sw in SWITCHES:
        if sw.json_key is not None and sw.json_key.startswith("host."):
            got = host[sw.json_key.split(".", 1)[1]]
            out[f"{BLOCK_KEY}.{sw.json_key}"] = {"value": got.value, "source": got.source, "variable": sw.name}
        else:
            got = setting(sw.name, environ)
            out[sw.name] = {"value": got.value, "source": got.source, "variable": sw.name}
    return out


def markdown_table() -> str:
    """The table of every variable, as docs/guide.md holds it (one row per variable)."""
    rows = ["| variable | kind | values | default | overrides JSON key | what it does |",
            "|---|---|---|---|---|---|"]
    for sw in SWITCHES:
        key = f"`{BLOCK_KEY}.{sw.json_key}`" if sw.json_key else "none"
        rows.append(f"| `{sw.name}` | {sw.kind} | {sw.accepted()} | {_shown(sw.default, sw)} | {key} | {sw.does} |")
    return "\n".join(rows)
