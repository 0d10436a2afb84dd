"""Fuzz: mutated DeepSpeed blocks, FSDP policy YAML files and FP4AdamW arguments; validation only, nothing is built.

Each case starts from a valid input and applies one or two mutations drawn by a seeded random generator:
a value replaced by a bad one (NaN, +-Inf, strings, bools, None, lists of the wrong length, negative, huge), a
value replaced by another allowed one (which makes combinations: ``format: fp32`` with ``device: nvme``, an
``nvme_path`` with ``device: cpu``), a key deleted, a value nested wrongly, an unknown key added, a path replaced
by a bad or tricky one (a regular file, /dev/null, /proc, a read-only mount, a NUL byte, an over-long name, a
missing parent, ``~`` and ``$VARS``, unset variables), and for YAML text mutations (duplicate keys, empty
documents, bytes that are not UTF-8, invalid YAML).

Every case must end in a ConfigError whose message names the mutated key (or, for a combination or a deleted
key, a key of the same sub-block), or be accepted: then an oracle written here from the documented rules (not
from the validators) checks that what was accepted is valid: hyperparameters finite and in range, each path
the expanded, resolved folder that was meant and a writable directory (created only under a parent that
existed), and no setting that the engines would ignore. FP4AdamW cases that are accepted also take one real
step, after which every weight must be finite.
"""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
import os
import random
import re
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import yaml

from fp4offload._config import (ACTIVATION_DEVICES, ACTIVATION_FORMATS, MASTER_FORMS, OPTIMIZER_DEVICES,
                               OPTIMIZER_FORMATS, PREFLIGHT_MODES, ROUNDINGS, WEIGHT_FORMATS)
from fp4offload.errors import ConfigError

NAN, INF = float("nan"), float("inf")
F32_MAX = 3.4028234663852886e38
INT64_MAX = 2**63 - 1
MMAP_MAX = 32 * 2**20  # glibc refuses a larger M_MMAP_THRESHOLD on 64-bit machines

BAD_VALUES = [NAN, INF, -INF, "abc", "", "1e-3", True, False, None, [], [0.9], [0.9, 0.99, 0.999], [NAN, 0.9],
              {}, {"x": 1}, -1, -1e-3, 0, 10**30, 1e300, 1.5, 2**63, "auto"]
UNKNOWN = ["colour", "optimiser", "nvme_pth", "lr_", "device ", "Format"]

# the documented vocabulary of each leaf (for "another allowed value" mutations)
CHOICES = {"format": OPTIMIZER_FORMATS + ACTIVATION_FORMATS + WEIGHT_FORMATS, "device": OPTIMIZER_DEVICES
           + ACTIVATION_DEVICES, "rounding": ROUNDINGS, "master": MASTER_FORMS, "preflight": PREFLIGHT_MODES,
           "share_bf16_staging": (True, False), "bf16_gradient_partition": (True, False),
           "cpu_offload": (True, False), "reshard_after_forward": (True, False), "min_numel": (0, 1, 4096),
           "every": (1, 10), "mmap_threshold": (4096, 2**20, "off"), "allocator_cache": (0.01, 1.0, "off"),
           "modules": ([], ["*.mlp"]), "exclude": ([], ["*.attn"]), "keep_bf16": ([], ["embed", "first:1"]),
           "lr": (0.0, 1e-2, 1), "betas": ([0.5, 0.9], (0.0, 0.0)), "eps": (1e-6, 1), "weight_decay": (0.0, 0.1)}


# ------------------------------------------------------------------------------------------------ the sandbox


@dataclass
class Sandbox:
    """Real folders and files for the path cases: a writable folder, a regular file, a read-only mount, links."""

    root: Path
    ok: Path
    file: Path
    ro: Path
    home: Path
    mounted: bool = False
    n: int = 0

    def fresh(self, stem: str) -> str:
        self.n += 1
        return f"{stem}{self.n}"

    def bad_paths(self) -> list[Any]:
        """Path values for one case (names that may get created are fresh each time)."""
        f = self.fresh
        return [str(self.file), "/dev/null", "/proc/self/" + f("fp4fuzz"), "/sys/kernel/" + f("fp4fuzz"),
                str(self.ok) + "/a\0b", str(self.ok / ("a" * 300)),
                str(self.ok) + "/" + "/".join([f("d") + "d" * 200] * 25),
                str(self.ro), str(self.ro / f("x")), str(self.root / f("nope") / "deeper" / "x"),
                "~/" + f("home_x"), "$FP4FUZZ_DIR/" + f("x"), "${FP4FUZZ_DIR}/" + f("y"), "$FP4FUZZ_UNSET/x",
                "~fp4fuzz_no_such_user/x", str(self.root / "link_to_file"), str(self.root / "dangling" / "x"),
                "", "   ", 5, True, [str(self.ok)], {"path": str(self.ok)},
                str(self.ok), str(self.ok / f("new")), "/dev/" + f("fp4fuzz")]


@contextlib.contextmanager
def sandbox(root: Path):
    root.mkdir(parents=True, exist_ok=True)
    # on a tmpfs of its own when this process may mount one: thousands of small files and folders, kept off the disk
    own_fs = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs",
                                                   str(root)], capture_output=True).returncode == 0
    sb = Sandbox(root=root, ok=root / "ok", file=root / "file", ro=root / "ro", home=root / "home")
    for d in (sb.ok, sb.ro, sb.home):
        d.mkdir(exist_ok=True)
    sb.file.write_text("not a folder\n")
    (root / "link_to_file").symlink_to(sb.file)
    (root / "dangling").symlink_to(root / "gone")
    if os.geteuid() == 0:  # root writes anywhere: a read-only tmpfs is what it cannot write to
        sb.mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(sb.ro)],
                                    capture_output=True).returncode == 0
    if not sb.mounted:
        sb.ro.chmod(0o500)
    old = {k: os.environ.get(k) for k in ("HOME", "FP4FUZZ_DIR", "FP4FUZZ_UNSET")}
    os.environ.update(HOME=str(sb.home), FP4FUZZ_DIR=str(sb.ok))
    os.environ.pop("FP4FUZZ_UNSET", None)
    cwd = os.getcwd()
    os.chdir(root)  # a literal "~" or "$X" folder made by mistake lands here, not in the repository
    try:
        yield sb
    finally:
        os.chdir(cwd)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if sb.mounted:
            subprocess.run(["umount", str(sb.ro)], check=True)
        else:
            sb.ro.chmod(0o700)
        if own_fs:
            subprocess.run(["umount", str(root)], check=True)


# ------------------------------------------------------------------------------------------------ the oracle

_VAR = re.compile(r"\$(\w+)|\$\{(\w+)\}")


def path_verdict(given: Any) -> Path | None:
    """The folder a path value means (expanded, absolute, resolved) when it is a usable one, else None.

    Usable: a writable directory, or a missing one whose parent is a writable directory; not under /proc or /sys,
    nor under /dev other than /dev/shm; no NUL byte, under 4096 bytes, components under 256 bytes; ``~`` and
    environment variables expanded, and every variable set.
    """
    if not isinstance(given, str) or not given.strip() or "\0" in given:
        return None
    s = os.path.expanduser(given)
    if s.startswith("~"):
        return None
    if any((m.group(1) or m.group(2)) not in os.environ for m in _VAR.finditer(s)):
        return None
    s = os.path.expandvars(s)
    if len(os.fsencode(s)) >= 4096 or any(len(os.fsencode(c)) > 255 for c in Path(s).parts):
        return None
    try:
        r = Path(os.path.abspath(s)).resolve()
    except (OSError, RuntimeError):
        return None
    for bad in ("/proc", "/sys", "/dev"):
        if (r == Path(bad) or Path(bad) in r.parents) and not (r == Path("/dev/shm") or Path("/dev/shm") in r.parents):
            return None
    target = r if r.exists() else r.parent
    if not target.is_dir() or not os.access(target, os.W_OK | os.X_OK):
        return None
    return r


def _real(x: Any) -> float | None:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.dtype == torch.bool or x.is_complex():
            return None
        x = x.item()
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        return None
    x = float(x)
    return x if math.isfinite(x) and abs(x) <= F32_MAX else None


def adam_problems(lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str = "") -> list[str]:
    """What is wrong with Adam hyperparameters (documented: lr >= 0, betas a pair in [0, 1), eps > 0,
    weight_decay >= 0, all finite fp32 numbers, and lr x weight_decay <= 1: the decay factor 1 - lr x wd >= 0)."""
    out = []
    lr_, eps_, wd_ = _real(lr), _real(eps), _real(weight_decay)
    if lr_ is None or lr_ < 0:
        out.append(f"{where}lr={lr!r}")
    if eps_ is None or eps_ <= 0 or eps_ < 1e-38:
        out.append(f"{where}eps={eps!r}")
    if wd_ is None or wd_ < 0:
        out.append(f"{where}weight_decay={weight_decay!r}")
    if lr_ is not None and wd_ is not None and lr_ * wd_ > 1.0:
        out.append(f"{where}lr*weight_decay")
    if isinstance(betas, (str, bytes, dict)) or not hasattr(betas, "__len__") or len(betas) != 2:
        out.append(f"{where}betas={betas!r}")
    else:
        for b in betas:
            b_ = _real(b)
            if b_ is None or not 0.0 <= b_ < 1.0:
                out.append(f"{where}betas={betas!r}")
    return out


def _int_ok(v: Any, lo: int, hi: int = INT64_MAX) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and lo <= v <= hi


def _names_ok(v: Any) -> bool:
    return isinstance(v, tuple) and all(isinstance(s, str) and s for s in v)


def _path_problem(key: str, accepted: Any, given: Any, verdicts: dict) -> list[str]:
    want = verdicts.get(key, path_verdict(given))
    if want is None:
        return [f"{key}={given!r} accepted but not a usable folder"]
    try:
        got = Path(os.path.abspath(str(accepted))).resolve()
    except (OSError, RuntimeError, ValueError):
        return [f"{key}={accepted!r}"]
    if got != want:
        return [f"{key}={given!r} accepted as {accepted!r}, meant {want}"]
    return []


def states_problems(st: Any, prefix: str, raw: dict, verdicts: dict, placement: Any = None,
                    fsdp_cpu_offload: bool | None = None) -> list[str]:
    out = []
    if st.format not in OPTIMIZER_FORMATS or st.device not in OPTIMIZER_DEVICES or st.rounding not in ROUNDINGS \
            or st.master not in MASTER_FORMS:
        out.append(f"{prefix}: a value outside the vocabulary")
    if not _int_ok(st.min_numel, 0):
        out.append(f"{prefix}.min_numel={st.min_numel!r}")
    if st.format == "fp32" and (st.device == "nvme" or st.nvme_path is not None or st.master != "fp32"):
        out.append(f"{prefix}: format fp32 is torch AdamW, never on NVMe; device/nvme_path ignored")
    if fsdp_cpu_offload is not None and st.format == "fp32" and st.device == "cpu" and not fsdp_cpu_offload:
        out.append(f"{prefix}: FSDP2's torch AdamW keeps fp32 states beside the shards; device 'cpu' ignored")
    if st.device != "nvme" and st.nvme_path is not None:
        out.append(f"{prefix}.nvme_path ignored with device {st.device!r}")
    if st.device == "nvme":
        out += _path_problem(f"{prefix}.nvme_path", st.nvme_path, raw.get("nvme_path"), verdicts)
    if placement is not None and placement.format == "fp32" and placement.device == "nvme":
        out.append(f"{prefix}: fp32 states placed on {placement.device!r}, but torch AdamW keeps them beside the "
                   "parameters")
    return out


def activations_problems(a: Any, prefix: str, raw: dict, verdicts: dict) -> list[str]:
    out = []
    if a.format not in ACTIVATION_FORMATS or a.device not in ACTIVATION_DEVICES:
        out.append(f"{prefix}: a value outside the vocabulary")
    if not _int_ok(a.min_numel, 0):
        out.append(f"{prefix}.min_numel={a.min_numel!r}")
    if not _names_ok(a.modules) or not _names_ok(a.exclude):
        out.append(f"{prefix}.modules/exclude")
    if a.device != "nvme" and a.nvme_path is not None:
        out.append(f"{prefix}.nvme_path ignored with device {a.device!r}")
    if a.device == "nvme":
        out += _path_problem(f"{prefix}.nvme_path", a.nvme_path, raw.get("nvme_path"), verdicts)
    if a.format == "none" and a.device == "same":
        out.append(f"{prefix}: format none on device same does nothing")
    return out


def block_problems(block: Any, prefix: str, raw: dict, verdicts: dict, placement: Any = None) -> list[str]:
    out = []
    raw = raw if isinstance(raw, dict) else {}
    if block.optimizer_states is not None:
        out += states_problems(block.optimizer_states, prefix + "optimizer_states",
                               raw.get("optimizer_states") or {}, verdicts, placement,
                               getattr(block, "cpu_offload", None))
    if block.activations is not None and hasattr(block.activations, "min_numel"):
        out += activations_problems(block.activations, prefix + "activations", raw.get("activations") or {},
                                    verdicts)
    w = block.weights
    if w is not None and (w.format not in WEIGHT_FORMATS or w.device != "cpu" or not _names_ok(w.keep_bf16)):
        out.append(f"{prefix}weights")
    if block.monitor is not None and not _int_ok(block.monitor.every, 1):
        out.append(f"{prefix}monitor.every={block.monitor.every!r}")
    h = getattr(block, "host", None)
    if h is not None:
        if not (h.mmap_threshold == "off" or _int_ok(h.mmap_threshold, 4096, MMAP_MAX)):
            out.append(f"{prefix}host.mmap_threshold={h.mmap_threshold!r}")
        ac = h.allocator_cache
        if not (ac == "off" or (_real(ac) is not None and 0 < ac <= 1)):
            out.append(f"{prefix}host.allocator_cache={ac!r}")
        if not isinstance(h.share_bf16_staging, bool) or not isinstance(h.bf16_gradient_partition, bool) \
                or h.preflight not in PREFLIGHT_MODES:
            out.append(f"{prefix}host")
    return out


# ------------------------------------------------------------------------------------------------ mutations


@dataclass
class Case:
    doc: Any
    keys: list[str] = field(default_factory=list)  # the keys a ConfigError must name (any of them)
    related: list[str] = field(default_factory=list)  # or a key under one of these prefixes (combinations)
    kinds: list[str] = field(default_factory=list)
    text: bytes | None = None  # YAML text mutations


def _paths(doc: Any, base: str = "") -> tuple[list[str], list[str]]:
    """(leaf key paths, mapping key paths) of a nested dict."""
    leaves, maps = [], []
    for k, v in doc.items():
        p = f"{base}.{k}" if base else k
        if isinstance(v, dict) and v:
            maps.append(p)
            sub_l, sub_m = _paths(v, p)
            leaves += sub_l
            maps += sub_m
        else:
            leaves.append(p)
    return leaves, maps


def _get(doc: dict, path: str) -> Any:
    for part in path.split("."):
        doc = doc[part]
    return doc


def _parent(doc: dict, path: str) -> tuple[dict, str]:
    *head, last = path.split(".")
    for part in head:
        doc = doc[part]
    return doc, last


def _prefix(path: str, depth: int) -> str:
    return ".".join(path.split(".")[:depth]) + "."


def mutate(rng: random.Random, base: dict, targets: Callable[[str], bool], sb: Sandbox, sub_depth: int) -> Case:
    """One or two random mutations of `base` at the key paths `targets` accepts."""
    doc = copy.deepcopy(base)
    case = Case(doc)
    for _ in range(1 if rng.random() < 0.7 else 2):
        leaves, maps = _paths(doc)
        leaves = [p for p in leaves if targets(p)]
        maps = [p for p in maps if targets(p + ".x")]
        kind = rng.choice(["bad", "bad", "bad", "choice", "choice", "delete", "nest", "unknown", "path"])
        if kind == "path":
            leaves_p = [p for p in leaves if p.endswith("nvme_path")]
            if not leaves_p:
                kind = "bad"
            else:
                p = rng.choice(leaves_p)
                d, k = _parent(doc, p)
                d[k] = rng.choice(sb.bad_paths())
                case.keys.append(p)
        if kind == "unknown" and maps:
            m = rng.choice(maps)
            name = rng.choice(UNKNOWN)
            _get(doc, m)[name] = rng.choice([1, "x", None])
            case.keys.append(f"{m}.{name}")
        elif kind == "delete" and leaves:
            p = rng.choice(leaves + maps)
            d, k = _parent(doc, p)
            d.pop(k, None)
            case.keys.append(p)
            case.related.append(_prefix(p, min(sub_depth, p.count(".")) or 1))
        elif kind == "nest" and leaves:
            p = rng.choice(leaves + maps)
            d, k = _parent(doc, p)
            d[k] = rng.choice([[d[k]], {"value": d[k]}, [[d[k]]], str(d[k])])
            case.keys.append(p)
        elif kind == "choice" and leaves:
            p = rng.choice([q for q in leaves if q.rsplit(".", 1)[-1] in CHOICES] or leaves)
            d, k = _parent(doc, p)
            d[k] = copy.deepcopy(rng.choice(CHOICES.get(k, BAD_VALUES)))
            case.keys.append(p)
            case.related.append(_prefix(p, sub_depth))
        elif kind in ("bad", "unknown", "delete", "nest", "choice") and leaves:
            p = rng.choice(leaves)
            d, k = _parent(doc, p)
            d[k] = copy.deepcopy(rng.choice(BAD_VALUES))
            case.keys.append(p)
        case.kinds.append(kind)
    return case


def names_key(exc: BaseException, case: Case) -> bool:
    msg = str(exc)
    return any(k in msg for k in case.keys) or any(r in msg for r in case.related)


def classify(case: Case, run: Callable[[], Any], problems: Callable[[Any], list[str]], tally: Counter,
             examples: dict) -> None:
    try:
        out = run()
    except ConfigError as e:
        verdict = "clean" if names_key(e, case) else "unclear"
        detail = str(e)
    except TypeError as e:  # Python's own unexpected-keyword error names the argument
        verdict = "clean" if "unexpected keyword" in str(e) and names_key(e, case) else "raw"
        detail = f"{type(e).__name__}: {e}"
    except Exception as e:
        verdict, detail = "raw", f"{type(e).__name__}: {e}"
    else:
        found = problems(out)
        verdict, detail = ("accepted", "") if not found else ("silent", "; ".join(found))
    tally[verdict] += 1
    if verdict in ("unclear", "raw", "silent"):
        examples.setdefault(verdict, []).append((case.keys, case.kinds, detail[:300]))


def report(name: str, tally: Counter, examples: dict) -> str:
    n = sum(tally.values())
    line = (f"fuzz {name}: {n} cases: {tally['clean']} ConfigError naming the key, {tally['accepted']} accepted and "
            f"valid, {tally['unclear']} ConfigError not naming it, {tally['raw']} raw errors, {tally['silent']} "
            "accepted but invalid")
    print(line)
    for verdict, items in examples.items():
        for keys, kinds, detail in items[:6]:
            print(f"  {verdict}: {keys} {kinds}: {detail}")
    return line


# ------------------------------------------------------------------------------------------------ DeepSpeed block


def ds_bases(sb: Sandbox) -> list[dict]:
    opt = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}}
    common = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "optimizer": opt}
    a = {**common, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
         "fp4offload": {"optimizer_states": {"format": "nvfp4", "device": "nvme", "nvme_path": str(sb.ok / "states"),
                                             "rounding": "stochastic", "min_numel": 4096, "master": "fp32"},
                        "activations": {"format": "nvfp4", "device": "nvme", "nvme_path": str(sb.ok / "acts"),
                                        "min_numel": 65536, "modules": ["*.mlp"], "exclude": ["*.attn"]},
                        "monitor": {"every": 10},
                        "host": {"mmap_threshold": 131072, "allocator_cache": 0.125, "share_bf16_staging": True,
                                 "bf16_gradient_partition": True, "preflight": "error"}}}
    b = {**common, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                         "offload_param": {"device": "cpu"}},
         "fp4offload": {"optimizer_states": {"format": "nvfp4", "device": "cpu", "nvme_path": None},
                        "activations": {"format": "mxfp8", "device": "cpu", "nvme_path": None},
                        "weights": {"format": "nvfp4", "device": "cpu", "keep_bf16": ["embed", "first:1"]}}}
    c = {**common, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme",
                                                                           "nvme_path": str(sb.ok / "ds")}},
         "fp4offload": {"optimizer_states": {"format": "nvfp4"}, "host": {"preflight": "warn"}}}
    return [a, b, c]


def _ds_target(path: str) -> bool:
    return path.startswith("fp4offload.") or path.startswith("optimizer.params.") \
        or path == "zero_optimization.offload_optimizer.nvme_path"


def ds_problems(prep: Any, case: Case, verdicts: dict) -> list[str]:
    from fp4offload._deepspeed import optim as ds_optim

    out = block_problems(prep.block, "fp4offload.", case.doc.get("fp4offload"), verdicts, prep.states)
    if prep.block.optimizer_states is not None:
        hp = ds_optim.settings_from_ds_section(prep.ds_config.get("optimizer"))
        out += adam_problems(hp.lr, hp.betas, hp.eps, hp.weight_decay, "optimizer.params.")
        st, raw = prep.states, case.doc.get("fp4offload", {}).get("optimizer_states", {})
        if st.device == "nvme":  # the folder FP4AdamW gets is a subfolder of the one configured
            given = raw.get("nvme_path") if isinstance(raw, dict) and raw.get("nvme_path") is not None else \
                case.doc["zero_optimization"]["offload_optimizer"].get("nvme_path")
            out += _path_problem("nvme_path", Path(st.nvme_path).parent, given, verdicts)
    return out


def run_ds(sb: Sandbox, n: int, seed: int) -> tuple[Counter, dict]:
    from fp4offload._deepspeed.config import prepare_config

    rng = random.Random(seed)
    tally: Counter = Counter()
    examples: dict = {}
    bases = ds_bases(sb)
    for i in range(n):
        case = mutate(rng, bases[i % len(bases)], _ds_target, sb, sub_depth=2)
        verdicts = {}
        for k in ("optimizer_states", "activations"):
            sub = case.doc.get("fp4offload", {})
            raw = sub.get(k) if isinstance(sub, dict) else None
            if isinstance(raw, dict):
                verdicts[f"fp4offload.{k}.nvme_path"] = path_verdict(raw.get("nvme_path"))
        # what fp4offload.deepspeed.initialize checks before it builds anything: the config, then its folders
        classify(case, lambda: prepare_config(case.doc).checked_paths(), lambda p: ds_problems(p, case, verdicts),
                 tally, examples)
    return tally, examples


# ------------------------------------------------------------------------------------------------ FSDP YAML


def yaml_bases(sb: Sandbox) -> list[dict]:
    a = {"weights": None,
         "optimizer_states": {"format": "nvfp4", "device": "nvme", "nvme_path": str(sb.ok / "fsdp_states"),
                              "rounding": "stochastic", "min_numel": 4096, "master": "split"},
         "activations": {"format": "nvfp4", "device": "nvme", "nvme_path": str(sb.ok / "fsdp_acts"),
                         "min_numel": 65536, "modules": ["*.mlp"], "exclude": []},
         "monitor": {"every": 10}, "cpu_offload": False, "reshard_after_forward": True, "block_classes": ["Block"]}
    b = {"weights": {"format": "nvfp4", "device": "cpu", "keep_bf16": ["embed", "norm", "first:1", "last:1"]},
         "optimizer_states": {"format": "nvfp4", "device": "cpu", "nvme_path": None},
         "activations": {"format": "mxfp8", "device": "cpu"}, "cpu_offload": True, "block_classes": ["Block"]}
    return [a, b]


_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def _text_mutation(rng: random.Random, doc: dict, case: Case) -> bytes:
    text = yaml.dump(doc, Dumper=_DUMPER, sort_keys=False)
    lines = text.splitlines(keepends=True)
    kind = rng.choice(["duplicate", "duplicate", "empty", "bytes", "invalid"])
    case.kinds.append("text-" + kind)
    if kind == "duplicate":  # a key written twice (the second one with another value)
        keyed = [i for i, ln in enumerate(lines) if re.match(r"^\s*[A-Za-z_]+:", ln)]
        i = rng.choice(keyed)
        indent = len(lines[i]) - len(lines[i].lstrip())
        key = lines[i].strip().split(":")[0]
        path = [key]
        for j in range(i - 1, -1, -1):  # the mapping it sits in
            ind = len(lines[j]) - len(lines[j].lstrip())
            if ind < indent and re.match(r"^\s*[A-Za-z_]+:", lines[j]):
                path.insert(0, lines[j].strip().split(":")[0])
                indent = ind
        own = len(lines[i]) - len(lines[i].lstrip())
        end = i + 1  # past its value's lines (deeper, or "- " items at its own indent)
        while end < len(lines) and (len(lines[end]) - len(lines[end].lstrip()) > own
                                    or lines[end][own:].startswith("- ")):
            end += 1
        dup = " " * own + key + ": " + rng.choice(["1", "null", "x", "[]"]) + "\n"
        lines.insert(end if rng.random() < 0.5 else i, dup)
        case.keys.append(".".join(path))
        return "".join(lines).encode()
    case.keys.append("p.yaml")
    if kind == "empty":
        return rng.choice([b"", b"\n", b"# only a comment\n", b"null\n", b"~\n", b"---\n"])
    if kind == "bytes":
        i = rng.randrange(len(text) + 1)
        return text[:i].encode() + rng.choice([b"\xff", b"\xfe\xff", b"\xc3(", b"\x80"]) + text[i:].encode()
    return rng.choice([b"weights: [unclosed\n", b"\tcpu_offload: true\n", b"a: b: c\n", b"- 1\n- 2\n", b"42\n",
                       b"!!python/object/apply:os.getcwd []\n", b"? [a]\n: 1\n", b"&a [*a]\n", b"'x'\n"])


def policy_problems(pol: Any, case: Case, verdicts: dict) -> list[str]:
    from fp4offload._fsdp.optim import inner_optimizer_class

    out = block_problems(pol, "", case.doc, verdicts)
    for k in ("cpu_offload", "reshard_after_forward"):
        if not isinstance(getattr(pol, k), bool):
            out.append(k)
    if not (callable(pol.block_classes) or all(isinstance(c, str) and c for c in pol.block_classes)):
        out.append("block_classes")
    cls, extra, _ = inner_optimizer_class(pol)  # the FP4AdamW arguments the policy leads to must be valid too
    fmt = extra.get("state_format")
    if fmt is not None and not _int_ok(fmt.min_numel, 1):
        out.append(f"optimizer_states.min_numel={fmt.min_numel!r} becomes an invalid FP4AdamW min_numel")
    return out


def run_yaml(sb: Sandbox, n: int, seed: int) -> tuple[Counter, dict]:
    from fp4offload.fsdp import policy_from_yaml

    rng = random.Random(seed)
    tally: Counter = Counter()
    examples: dict = {}
    bases = yaml_bases(sb)
    path = sb.root / "p.yaml"
    for i in range(n):
        if rng.random() < 0.2:
            case = Case(copy.deepcopy(bases[i % len(bases)]))
            case.text = _text_mutation(rng, case.doc, case)
        else:
            case = mutate(rng, bases[i % len(bases)], lambda p: True, sb, sub_depth=1)
            case.text = yaml.dump(case.doc, Dumper=_DUMPER, sort_keys=False).encode()
        path.unlink(missing_ok=True)  # a new file each time: truncating one in place makes ext4 flush it
        path.write_bytes(case.text)
        verdicts = {f"{k}.nvme_path": path_verdict(case.doc[k].get("nvme_path"))
                    for k in ("optimizer_states", "activations") if isinstance(case.doc.get(k), dict)}
        if any(k.startswith("text-") for k in case.kinds):  # the document read is not case.doc
            def problems(pol, _case=case):
                return [f"a damaged document was accepted as {pol}"]
        else:
            def problems(pol, _case=case, _v=verdicts):
                return policy_problems(pol, _case, _v)
        # what fp4offload.fsdp.apply checks before it shards anything: the policy, then its folders on this machine
        classify(case, lambda: policy_from_yaml(path).checked_paths(), problems, tally, examples)
    return tally, examples


# ------------------------------------------------------------------------------------------------ FP4AdamW


def adamw_bases(sb: Sandbox) -> list[dict]:
    """FP4AdamW's arguments, flat: ``group.field`` keys are fields of its option groups (see _fp4adamw)."""
    a = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "maximize": False,
         "state_format.m_rounding": "stochastic", "state_format.v_format": "ufp4", "state_format.min_numel": 16,
         "state_device": "same", "step_options.backend": "auto", "state_format.seed": 0,
         "step_options.skip_nonfinite": True, "step_options.metrics_every": 100, "master": "fp32",
         "step_options.working_copy": None, "step_options.tensor_key": None}
    b = dict(a, state_device="nvme", nvme_path=str(sb.ok / "adamw"), **{"nvme.io": "threads", "nvme.threads": 2,
                                                                         "nvme.reserve_bytes": 0})
    return [a, b]


def _fp4adamw(params, kw: dict):
    """FP4AdamW from flat arguments: a ``group.field`` key goes into that option group (StateFormat, NvmeOptions,
    StepOptions), the others are keywords of their own."""
    from fp4offload._optim import FP4AdamW, NvmeOptions, StateFormat, StepOptions

    classes = {"state_format": StateFormat, "nvme": NvmeOptions, "step_options": StepOptions}
    top, groups = {}, {}
    for k, v in kw.items():
        group, _, field_name = k.partition(".")
        if field_name:
            groups.setdefault(group, {})[field_name] = v
        else:
            top[k] = v
    return FP4AdamW(params, **top, **{g: classes[g](**fields) for g, fields in groups.items()})


_FORMAT_CHOICES = {"m_rounding": ROUNDINGS, "v_format": ("ufp4", "nvfp4"), "min_numel": (1, 4096, 16.0),
                   "seed": (1, 2**32)}
ADAMW_CHOICES = {"lr": (0.0, 1e-2, 1, torch.tensor(1e-3), torch.tensor([1e-3, 2e-3]), torch.tensor(NAN)),
                 "betas": ((0.5, 0.9), [0.0, 0.0], (0.9, None), (torch.tensor(0.9), 0.99)),
                 "eps": (1e-6, 1e-45, 1e-50), "weight_decay": (0.0, 0.1), "maximize": (True, False),
                 **_FORMAT_CHOICES, **{f"state_format.{k}": v for k, v in _FORMAT_CHOICES.items()},
                 "state_device": ("same", "cpu"), "step_options.backend": ("auto", "reference"),
                 "step_options.skip_nonfinite": (True, False), "step_options.metrics_every": (0, 1),
                 "master": ("fp32",), "step_options.working_copy": (None, "bf16"), "nvme.io": ("threads",),
                 "nvme.threads": (1, 8), "nvme.reserve_bytes": (0, 4096),
                 "step_options.tensor_key": (None, lambda t: None)}
GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "maximize", "m_rounding", "v_format", "min_numel")


def _params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(64, generator=g)), torch.nn.Parameter(torch.randn(3, generator=g))]


def adamw_problems(opt: Any, params: list) -> list[str]:
    out = []
    for i, g in enumerate(opt.param_groups):
        out += adam_problems(g["lr"], g["betas"], g["eps"], g["weight_decay"], f"param_groups[{i}].")
        if not isinstance(g["maximize"], bool) or g["m_rounding"] not in ROUNDINGS or \
                g["v_format"] not in ("ufp4", "nvfp4") or not _int_ok(g["min_numel"], 1) or not _int_ok(g["seed"], 0):
            out.append(f"param_groups[{i}]: maximize/m_rounding/v_format/min_numel/seed")
    if not isinstance(opt.skip_nonfinite, bool) or not _int_ok(opt.metrics_every, 0):
        out.append("skip_nonfinite/metrics_every")
    if out:
        return out
    g = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    try:
        opt.step()
    except Exception as e:
        return [f"accepted, then the first step raised {type(e).__name__}: {e}"]
    if not all(bool(torch.isfinite(p).all()) for p in params):
        out.append("non-finite weights after one step")
    return out


def run_adamw(sb: Sandbox, n: int, seed: int) -> tuple[Counter, dict]:
    rng = random.Random(seed)
    tally: Counter = Counter()
    examples: dict = {}
    bases = adamw_bases(sb)
    for i in range(n):
        kw = dict(bases[i % len(bases)])
        case = Case(kw)
        where = rng.choice(["kwarg", "kwarg", "kwarg", "group", "add_group", "unknown"])
        key = rng.choice(GROUP_KEYS if where in ("group", "add_group") else list(kw))
        if where == "unknown":
            key = rng.choice(["amsgrad", "foreach", "capturable", "fused", "colour", "betas1"])
        pool = list(ADAMW_CHOICES.get(key, ())) + BAD_VALUES
        if key == "nvme_path":
            pool = sb.bad_paths()
        value = rng.choice(pool if where != "unknown" else [True, 1])
        case.keys.append(key)
        case.kinds.append(where)
        params = _params()
        verdict_path = path_verdict(value) if key == "nvme_path" else None

        def run(kw=kw, key=key, value=value, where=where, params=params):
            if where in ("kwarg", "unknown"):
                return _fp4adamw(params, {**kw, key: value})
            if where == "group":
                return _fp4adamw([{"params": params[:1], key: value}, {"params": params[1:]}], kw)
            opt = _fp4adamw(params[:1], kw)
            try:
                opt.add_param_group({"params": params[1:], key: value})
            except ConfigError:
                if len(opt.param_groups) != 1:  # a refused group must not stay behind
                    raise AssertionError("a refused param group was left in the optimizer") from None
                raise
            return opt

        def problems(opt, key=key, value=value, params=params, verdict_path=verdict_path):
            out = adamw_problems(opt, params)
            if key == "nvme_path" and opt.state_device == "nvme":
                if verdict_path is None:
                    out.append(f"nvme_path={value!r} accepted but not a usable folder")
                elif opt.placement.store is not None and opt.placement.store.dir.parent.resolve() != verdict_path:
                    out.append(f"nvme_path={value!r} used as {opt.placement.store.dir.parent}, meant {verdict_path}")
            with contextlib.suppress(Exception):
                opt.close()
            return out

        classify(case, run, problems, tally, examples)
    return tally, examples


# ------------------------------------------------------------------------------------------------ the tests

N_DS, N_YAML, N_ADAMW = 1500, 1000, 1000


@pytest.fixture
def sb(tmp_path):
    with sandbox(tmp_path / "sb") as s:
        yield s


def _check(name: str, result: tuple[Counter, dict], t0: tuple[float, float]) -> None:
    tally, examples = result
    line = report(name, tally, examples)
    print(f"  ({time.perf_counter() - t0[0]:.1f} s, {time.process_time() - t0[1]:.1f} s of CPU)")
    assert tally["unclear"] == tally["raw"] == tally["silent"] == 0, line
    assert tally["clean"] > tally["accepted"] > 0, line  # most mutations are bad, some are fine


def test_fuzz_deepspeed_block(sb):
    t0 = time.perf_counter(), time.process_time()
    _check("DeepSpeed block (prepare_config, checked_paths)", run_ds(sb, N_DS, seed=16), t0)


def test_fuzz_fsdp_policy_yaml(sb):
    t0 = time.perf_counter(), time.process_time()
    _check("FSDP policy YAML (policy_from_yaml, checked_paths)", run_yaml(sb, N_YAML, seed=17), t0)


def test_fuzz_fp4adamw_arguments(sb):
    t0 = time.perf_counter(), time.process_time()
    _check("FP4AdamW arguments", run_adamw(sb, N_ADAMW, seed=18), t0)


# ------------------------------------------------------------------------------------------------ the rules, pinned
# One test per documented rule, with real files and mounts, so a regression names the rule it broke.


def _ds(block: dict, **extra) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "fp4offload": block}
    cfg.update(extra)
    return cfg


def _raises(fn, key: str, *fragments: str) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        fn()
    msg = str(e.value)
    assert key in msg, msg
    for f in fragments:
        assert f in msg, msg
    return e.value


@pytest.mark.parametrize("params, key, fragment", [
    ('{"lr": Infinity}', "optimizer.params.lr", "NaN and Infinity"),
    ('{"weight_decay": NaN}', "optimizer.params.weight_decay", "NaN and Infinity"),
    ('{"eps": Infinity}', "optimizer.params.eps", "NaN and Infinity"),
    ('{"lr": "abc"}', "optimizer.params.lr", "'abc'"),
    ('{"lr": "1e-3"}', "optimizer.params.lr", "without quotes"),
    ('{"lr": true}', "optimizer.params.lr", "true/false is not a number"),
    ('{"betas": [0.9]}', "optimizer.params.betas", "it has 1 value(s)"),
    ('{"betas": [0.9, 1.0]}', "optimizer.params.betas[1]", "[0, 1)"),
    ('{"eps": 0}', "optimizer.params.eps", "divides by zero"),
    ('{"lr": 1e300}', "optimizer.params.lr", "fp32"),
    ('[0.001]', "optimizer.params", "JSON object"),
])
def test_deepspeed_optimizer_numbers_from_json_are_checked(params, key, fragment):
    """JSON allows NaN and Infinity; every number the block reads is refused where it enters, naming its key."""
    import json

    from fp4offload._deepspeed.config import prepare_config

    cfg = _ds({"optimizer_states": {"device": "cpu"}})
    cfg["optimizer"]["params"] = json.loads(params)
    _raises(lambda: prepare_config(cfg), key, fragment)


@pytest.mark.parametrize("kwargs, key, fragment", [
    ({"lr": INF}, "lr", "NaN and Infinity"), ({"lr": "abc"}, "lr", "expected a finite learning rate"),
    ({"weight_decay": NAN}, "weight_decay", "NaN"), ({"eps": INF}, "eps", "NaN"), ({"eps": 0.0}, "eps", "eps > 0"),
    ({"betas": (0.9,)}, "betas", "a pair"), ({"betas": (0.9, None)}, "betas[1]", "[0, 1)"),
    ({"betas": (0.9, 0.999, 0.9)}, "betas", "3 value(s)"), ({"lr": True}, "lr", "true/false"),
    ({"lr": torch.tensor([1e-3, 2e-3])}, "lr", "one element"), ({"lr": torch.tensor(NAN)}, "lr", "NaN"),
    ({"lr": 1e3, "weight_decay": 0.1}, "weight_decay", "flip sign"),
    ({"state_format.min_numel": 16.0}, "state_format.min_numel", "integer"),
    ({"state_format.seed": "1"}, "state_format.seed", "integer"),
    ({"step_options.metrics_every": -1}, "step_options.metrics_every", ">= 0"),
    ({"nvme.threads": 0, "state_device": "nvme", "nvme_path": "/tmp"}, "nvme.threads", ">= 1"),
    ({"step_options.skip_nonfinite": 1}, "step_options.skip_nonfinite", "true or false"),
    ({"maximize": "no"}, "maximize", "true or false"),
])
def test_fp4adamw_numbers_are_checked_in_the_constructor(kwargs, key, fragment):
    _raises(lambda: _fp4adamw(_params(), kwargs), key, fragment)


def test_fp4adamw_param_groups_are_checked_and_a_refused_group_is_not_added():
    from fp4offload._optim import FP4AdamW

    a, b = _params()
    _raises(lambda: FP4AdamW([{"params": [a]}, {"params": [b], "lr": NAN}]), "param_groups[1].lr", "NaN")
    opt = FP4AdamW([a], lr=1e-3)
    _raises(lambda: opt.add_param_group({"params": [b], "betas": [0.9]}), "param_groups[1].betas", "a pair")
    _raises(lambda: opt.add_param_group({"params": [b], "weight_decay": 1e38, "lr": 1e3}),
            "param_groups[1].weight_decay", "flip sign")
    _raises(lambda: opt.add_param_group({"params": [b], "lr": 1e3}), "param_groups[1].lr", "flip sign")  # wd 1e-2
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [b], "lr": torch.tensor(1e-2), "betas": [0.5, 0.9]})  # a tensor lr is fine
    for p in (a, b):
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(bool(torch.isfinite(p).all()) for p in (a, b))


def test_nvme_path_rules_for_fp4adamw(sb):
    """The one folder check (fp4offload._config.prepare_path), as FP4AdamW's nvme_path meets it."""
    from fp4offload._optim import FP4AdamW, NvmeOptions

    def opt(path):
        return FP4AdamW(_params(), state_device="nvme", nvme_path=path, nvme=NvmeOptions(io="threads"))

    o = opt("~/states")  # ~ expanded: the folder is made in $HOME, not as ./~ in the working directory
    assert o.placement.store.dir.parent == sb.home / "states" and not (sb.root / "~").exists()
    o.close()
    o = opt("$FP4FUZZ_DIR/st")
    assert o.placement.store.dir.parent == sb.ok / "st"
    o.close()
    missing = sb.root / "mnt" / "nvme0" / "fp4"  # a mistyped mount point: refused, and nothing is created
    _raises(lambda: opt(str(missing)), "nvme_path", "mistyped mount point")
    assert not (sb.root / "mnt").exists()
    _raises(lambda: opt(str(sb.file)), "nvme_path", "is a regular file")
    _raises(lambda: opt("/dev/null"), "nvme_path", "kernel file system")
    _raises(lambda: opt("/proc/self/x"), "nvme_path", "kernel file system")
    _raises(lambda: opt(str(sb.ro)), "nvme_path", "not writable")
    _raises(lambda: opt(str(sb.ok) + "/a\0b"), "nvme_path", "NUL")
    _raises(lambda: opt(str(sb.ok / ("x" * 256))), "nvme_path", "NAME_MAX")
    _raises(lambda: opt(str(sb.ok) + "/y" * 2100), "nvme_path", "PATH_MAX")
    _raises(lambda: opt("$FP4FUZZ_UNSET/x"), "nvme_path", "FP4FUZZ_UNSET is not set")
    os.mkfifo(sb.root / "fifo")
    _raises(lambda: opt(str(sb.root / "fifo")), "nvme_path", "a FIFO")


def test_deepspeed_block_paths_are_checked_before_anything_is_built(sb):
    from fp4offload._deepspeed.config import prepare_config

    nvme = {"optimizer_states": {"device": "nvme", "nvme_path": "~/states"},
            "activations": {"device": "nvme", "nvme_path": "$FP4FUZZ_DIR/acts"}}
    plain = prepare_config(_ds(nvme))  # the document alone: nothing looked up, nothing made
    assert plain.states.nvme_path == "~/states/optimizer_states" and not (sb.home / "states").exists()
    p = plain.checked_paths()  # what initialize does first
    assert p.states.nvme_path == str(sb.home / "states" / "optimizer_states") and (sb.home / "states").is_dir()
    assert p.block.activations.nvme_path == str(sb.ok / "acts") and (sb.ok / "acts").is_dir()
    bad = _ds({"optimizer_states": {"device": "nvme", "nvme_path": "/dev/null"}})
    _raises(lambda: prepare_config(bad), "fp4offload.optimizer_states.nvme_path", "kernel file system")
    gone = _ds({"optimizer_states": {"device": "nvme", "nvme_path": str(sb.root / "nvme9" / "x")}})
    _raises(lambda: prepare_config(gone).checked_paths(), "fp4offload.optimizer_states.nvme_path", "mistyped")
    zero = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(sb.file)}}
    _raises(lambda: prepare_config(_ds({"optimizer_states": {}}, zero_optimization=zero)).checked_paths(),
            "zero_optimization.offload_optimizer.nvme_path", "regular file")


def test_deepspeed_initialize_refuses_a_bad_folder_before_anything_is_built(sb):
    import fp4offload.deepspeed as fds

    model = torch.nn.Linear(8, 8)
    before = [p.data_ptr() for p in model.parameters()]
    cfg = _ds({"optimizer_states": {"device": "nvme", "nvme_path": str(sb.ro / "x")}})
    _raises(lambda: fds.initialize(model=model, config=cfg), "fp4offload.optimizer_states.nvme_path", "not writable")
    assert not torch.distributed.is_initialized()
    assert [p.data_ptr() for p in model.parameters()] == before and not hasattr(model, "ds_id")


@pytest.mark.parametrize("block, key, fragment", [
    ({"optimizer_states": {"format": "fp32", "device": "nvme", "nvme_path": "/x"}}, "optimizer_states.device",
     "never on NVMe"),
    ({"optimizer_states": {"format": "fp32", "nvme_path": "/x"}}, "optimizer_states.nvme_path", "never go to NVMe"),
    ({"optimizer_states": {"device": "cpu", "nvme_path": "/x"}}, "optimizer_states.nvme_path", "would be ignored"),
    ({"activations": {"device": "cpu", "nvme_path": "/x"}}, "activations.nvme_path", "would be ignored"),
    ({"activations": {"device": "same", "nvme_path": "/x"}}, "activations.nvme_path", "would be ignored"),
    ({"optimizer_states": {"min_numel": 2**63}}, "optimizer_states.min_numel", "int64"),
    ({"monitor": {"every": 1.5}}, "monitor.every", "without a fraction"),
    ({"host": {"allocator_cache": NAN}}, "host.allocator_cache", "fraction"),
    ({"optimizer_states": {}, "host": {"mmap_threshold": 2**40}}, "host.mmap_threshold", "mallopt"),
    ({"optimizer_states": {"nvme_path": "/proc/x", "device": "nvme"}}, "optimizer_states.nvme_path", "kernel"),
])
def test_block_refuses_what_would_be_ignored_or_out_of_range(block, key, fragment):
    from fp4offload._config import parse_block

    _raises(lambda: parse_block(block, prefix="fp4offload."), "fp4offload." + key, fragment)


def test_deepspeed_refuses_settings_its_rewrite_would_ignore():
    from fp4offload._deepspeed.config import prepare_config

    zero = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}
    # fp32 states with DeepSpeed's NVMe offload: torch AdamW would keep them in host RAM
    _raises(lambda: prepare_config(_ds({"optimizer_states": {"format": "fp32"}}, zero_optimization=zero)),
            "fp4offload.optimizer_states.format", "host RAM")
    # device 'same' takes an nvme_path only from DeepSpeed's NVMe offload; without one it would be ignored
    _raises(lambda: prepare_config(_ds({"optimizer_states": {"nvme_path": "/local_nvme"}})),
            "fp4offload.optimizer_states.nvme_path", "would be ignored")
    ok = prepare_config(_ds({"optimizer_states": {"nvme_path": "/local_nvme"}}, zero_optimization=zero))
    assert ok.states.device == "nvme" and ok.states.nvme_path == "/local_nvme/optimizer_states"


def _yaml(sb: Sandbox, data: bytes | str) -> Path:
    p = sb.root / "policy.yaml"
    p.unlink(missing_ok=True)
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return p


def test_fsdp_yaml_duplicate_keys_are_refused_with_the_key_path_and_lines(sb):
    from fp4offload.fsdp import policy_from_yaml

    e = _raises(lambda: policy_from_yaml(_yaml(sb, "optimizer_states:\n  device: cpu\n  rounding: nearest\n"
                                                   "  device: nvme\n")), "optimizer_states.device",
                "line 2 and again on line 4")
    assert e.key == "optimizer_states.device"
    _raises(lambda: policy_from_yaml(_yaml(sb, "cpu_offload: true\ncpu_offload: false\n")), "cpu_offload",
            "written twice")
    _raises(lambda: policy_from_yaml(_yaml(sb, "weights: {format: nvfp4, format: bf16}\n")), "weights.format")
    policy_from_yaml(_yaml(sb, "a: &x {device: cpu}\n".replace("a: &x", "optimizer_states: &x")))  # no false alarm


@pytest.mark.parametrize("data, fragment", [
    (b"", "no policy"), (b"# just a comment\n", "no policy"), (b"null\n", "no policy"), (b"---\n", "no policy"),
    (b"cpu_offload: true\n\xff\n", "not UTF-8"), (b"- a\n", "a YAML mapping"), (b"42\n", "a YAML mapping"),
    (b"weights: [unclosed\n", "invalid YAML"),
])
def test_fsdp_yaml_empty_undecodable_or_not_a_mapping(sb, data, fragment):
    from fp4offload.fsdp import policy_from_yaml

    p = _yaml(sb, data)
    e = _raises(lambda: policy_from_yaml(p), str(p), fragment)
    assert e.key == str(p)
    assert policy_from_yaml(_yaml(sb, b"{}\n")).weights is None  # {} is how every feature is written off


def test_fsdp_yaml_that_is_not_a_regular_file_is_not_opened(sb):
    from fp4offload.fsdp import policy_from_yaml

    fifo = sb.root / "policy.fifo"
    os.mkfifo(fifo)  # opening it would block until a writer comes
    _raises(lambda: policy_from_yaml(fifo), str(fifo), "a FIFO", "not read")
    _raises(lambda: policy_from_yaml("/dev/zero"), "/dev/zero", "character device")
    big = _yaml(sb, b"# " + b"x" * (1 << 20) + b"\n")
    _raises(lambda: policy_from_yaml(big), str(big), "at most 1048576 bytes")


def test_fsdp_policy_paths_checked_by_apply_before_sharding(sb):
    import fp4offload.fsdp as ff

    text = "optimizer_states: {device: nvme, nvme_path: '~/fsdp'}\nactivations: {device: nvme, nvme_path: " \
           "'${FP4FUZZ_DIR}/a'}\nblock_classes: [Linear]\nweights: null\n"
    pol = ff.policy_from_yaml(_yaml(sb, text))
    assert pol.optimizer_states.nvme_path == "~/fsdp" and not (sb.home / "fsdp").exists()  # the document only
    checked = pol.checked_paths()
    assert checked.optimizer_states.nvme_path == str(sb.home / "fsdp") and (sb.home / "fsdp").is_dir()
    assert checked.activations.nvme_path == str(sb.ok / "a")
    bad = ff.policy_from_yaml(_yaml(sb, f"optimizer_states: {{device: nvme, nvme_path: '{sb.file}'}}\n"
                                        "block_classes: [Linear]\nweights: null\n"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    _raises(lambda: ff.apply(model, bad), "optimizer_states.nvme_path", "regular file")
    assert not torch.distributed.is_initialized() and not hasattr(model, "_fp4offload_policy")
    _raises(lambda: ff.Policy(optimizer_states={"device": "same", "nvme_path": "/x"}), "optimizer_states.nvme_path",
            "would be ignored")
    _raises(lambda: ff.Policy(optimizer_states={"format": "fp32", "device": "cpu"}), "optimizer_states.device",
            "cpu_offload")
    assert ff.Policy(optimizer_states={"format": "fp32", "device": "cpu"}, cpu_offload=True, weights=None)


if __name__ == "__main__":  # counts without asserting: python tests/faults/test_fuzz_config.py
    import tempfile

    with tempfile.TemporaryDirectory() as d, sandbox(Path(d) / "sb") as s:
        for nm, fn, n, sd in (("DeepSpeed block", run_ds, N_DS, 16), ("FSDP YAML", run_yaml, N_YAML, 17),
                              ("FP4AdamW", run_adamw, N_ADAMW, 18)):
            t = time.perf_counter()
            report(nm, *fn(s, n, sd))
            print(f"  ({time.perf_counter() - t:.1f} s)")
