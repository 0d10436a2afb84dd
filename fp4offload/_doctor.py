"""`fp4offload doctor`: what this machine offers fp4offload, and why each backend is or is not active."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time
import warnings

import torch

_GENERATIONS = {7: "Volta/Turing", 8: "Ampere/Ada", 9: "Hopper", 10: "Blackwell", 11: "Blackwell", 12: "Blackwell"}


def gpu_report() -> dict:
    """GPUs through NVML, else AMD SMI (:func:`fp4offload._machine.gpus`): name, memory, compute capability (NVIDIA),
    generation, FP4 hardware, and the source of the memory figures; when neither answered, why (both reasons)."""
    from ._machine import gpus

    got = gpus()
    if not got.devices:
        return {"available": False, "why": got.note, "source": got.source}
    out = []
    for d in got.devices:
        cc = d.compute_capability
        out.append({"index": d.index, "name": d.name, "total_gib": round(d.total / 2**30, 1),
                    "free_gib": round(d.free / 2**30, 1), "total_bytes": d.total, "free_bytes": d.free,
                    "source": d.source, "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
                    "generation": _GENERATIONS.get(cc[0], "unknown") if cc else "unknown",
                    "fp4_hardware": bool(cc and cc[0] >= 10)})
    return {"available": True, "driver": got.driver, "gpus": out, "source": got.source}


def _try_backend(name: str) -> dict:
    from . import _ops as ops

    if name == "cuda" and not torch.cuda.is_available():
        return {"builds": False, "why": "torch sees no CUDA device (CPU build of torch, or no GPU)"}
    t0 = time.perf_counter()
    mod, why = ops.load(name)
    out = {"builds": mod is not None, "why": why,
           "seconds": round(time.perf_counter() - t0, 1)}
    if name == "cpu" and mod is not None:
        out["isa"] = mod.extension().isa()
    return out


def _try_adam(name: str) -> dict:
    """The FP4AdamW step kernel `name` ("cpu" or "cuda"), built (or loaded) as the first step would."""
    from ._optim import fused

    if name == "cuda" and not torch.cuda.is_available():
        return {"builds": False, "why": "torch sees no CUDA device (CPU build of torch, or no GPU)"}
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = fused.cpu_extension() if name == "cpu" else fused.cuda_extension()
    except Exception as e:  # a build failure is a finding here, not a crash
        return {"builds": False, "why": f"{type(e).__name__}: {e}"[:300]}
    if mod is None:
        why = next((w for k, w in fused.failures().items() if k.split(" ")[0] == name), "the build failed")
        return {"builds": False, "why": f"{why} (the torch reference step runs)"}
    return {"builds": True, "why": "built", "seconds": round(time.perf_counter() - t0, 1)}


def stale_locks_report() -> list[dict]:
    """Build locks left in the extension cache by builds that were killed, each with the command that clears it
    (fp4offload's own builds clear theirs; another package's, such as DeepSpeed's ops, hang its next build)."""
    from ._ops.build import stale_locks

    return [{"path": str(p), "fix": f"rm -f {p}"} for p in stale_locks()]


def deepspeed_report() -> dict:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator, without its warning
    from ._deepspeed.engine import auto_status

    try:
        import deepspeed  # the start-up hook, when active, patches deepspeed.initialize here
    except Exception as e:
        return {"usable": False, "why": f"import failed: {e}", "auto": auto_status()}
    from ._deepspeed import internals as ds_internals

    gone = ds_internals.missing(ds_internals.FEATURES)
    out = {"usable": True, "version": deepspeed.__version__,
           "accelerator": os.environ.get("DS_ACCELERATOR", "auto"),
           "supported": ds_internals.requirement(),
           "in_range": ds_internals.supported(deepspeed.__version__),
           "missing_names": [f"{r.qualname} ({', '.join(r.features)})" for r in gone],
           "auto": auto_status()}
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        out["async_io"] = bool(AsyncIOBuilder().is_compatible(verbose=False))
        if not out["async_io"]:
            out["async_io_fix"] = "apt-get install -y libaio-dev (NVMe tiers fall back to a thread pool without it)"
    except Exception as e:
        out["async_io"] = False
        out["async_io_fix"] = f"async_io builder unavailable: {e}"
    return out


def read_doctor_config(config: str | None):
    """``doctor --config FILE`` read and checked (a regular UTF-8 JSON file, each key once), or None: a
    ConfigError naming ``--config``. Done before anything slow runs."""
    if config is None:
        return None
    from pathlib import Path

    from ._jsonfile import read_json

    return read_json(Path(config), "--config", config, readable="a readable DeepSpeed JSON file",
                     valid="valid JSON", detail="line {exc.lineno} column {exc.colno}: {exc.msg}",
                     top="a JSON object at the top level")


def host_settings(config=None) -> dict:
    """The DeepSpeed block's effective host settings and where each came from: the FP4OFFLOAD_* environment
    override, the key of the ``host`` sub-block of ``config`` (a DeepSpeed JSON, as a path or a parsed dict), or
    the default (:func:`fp4offload._switches.host_settings`)."""
    from . import _switches as switches

    block = None
    if config is not None:
        ds = read_doctor_config(config) if isinstance(config, str) else config
        block = ds.get(switches.BLOCK_KEY)
    return {k: {"value": s.value, "source": s.source} for k, s in switches.host_settings(block).items()}


def settings_in_effect(config=None, isa: str | None = None) -> dict:
    """Every setting an FP4OFFLOAD_* variable sets (:func:`fp4offload._switches.in_effect`), with the value in
    effect and the source that won: the variable, the JSON key of ``config`` (a parsed DeepSpeed config), or the
    default. ``isa``: the CPU path in effect, shown for FP4OFFLOAD_CPU_ISA in place of its word ``auto``."""
    from . import _switches as switches

    rows = switches.in_effect(config)
    if isa is not None:
        rows["FP4OFFLOAD_CPU_ISA"]["value"] = isa
    return rows


def memory_report() -> dict:
    """The host memory this process may use, bytes, with its source (:func:`fp4offload._machine.limits`: the
    tightest cgroup's path, limit, usage and reclaimable page cache, or the machine's MemAvailable)."""
    from ._machine import limits

    lim = limits()
    return {"free_bytes": lim.free, "total_bytes": lim.total, "machine_available_bytes": lim.available,
            "cgroup": lim.cgroup or None, "cgroup_limit_bytes": lim.cgroup_limit,
            "cgroup_usage_bytes": lim.cgroup_usage, "reclaimable_bytes": lim.reclaimable, "source": lim.source,
            "describe": lim.describe()}


def ranks_report() -> dict:
    """World size and ranks on this node from the launcher's environment, with the variable they came from
    (:func:`fp4offload._machine.launcher_ranks`)."""
    from ._machine import launcher_ranks

    r = launcher_ranks()
    return {"world": r.world, "local": r.local, "source": r.source}


def host_report(config=None) -> dict:
    """What the DeepSpeed block's host settings will find: the memory this process may use and the ranks on this
    node (each with its source), glibc, transparent huge pages, the allocator cache, and the settings themselves
    (:func:`host_settings`)."""
    thp = None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = next((w.strip("[]") for w in f.read().split() if w.startswith("[")), None)
    except OSError:
        pass
    libc = platform.libc_ver()
    out = {"libc": " ".join(x for x in libc if x) or "unknown", "transparent_hugepages": thp or "unknown",
           "memory": memory_report(), "local_ranks": ranks_report(), "settings": host_settings(config)}
    if platform.system() != "Linux":
        out["host_cache"] = {"builds": False, "why": "Linux only"}
        return out
    from . import host_allocator

    t0 = time.perf_counter()
    try:
        host_allocator._extension()
        out["host_cache"] = {"builds": True, "seconds": round(time.perf_counter() - t0, 1)}
    except Exception as e:
        out["host_cache"] = {"builds": False, "why": f"{type(e).__name__}: {e}"[:300]}
    return out


def report(config: str | None = None) -> dict:
    """Everything ``fp4offload doctor`` prints; ``config``: a DeepSpeed JSON whose host settings to resolve
    (read and checked first, so a bad file fails at once)."""
    from . import __version__

    if isinstance(config, str):
        config = read_doctor_config(config)
    from ._ops import cpu_isa, forced_backend

    # the block and every FP4OFFLOAD_* variable checked before the slow probes: a bad one fails here, in one line
    isa, isa_why = cpu_isa.chosen()
    settings = settings_in_effect(config, isa)
    forced = forced_backend()
    locks = stale_locks_report()  # before any build clears fp4offload's own
    backends = {"cpu": _try_backend("cpu"), "cuda": _try_backend("cuda"),
                "reference": {"builds": True, "why": "pure torch"}}
    adam = {"cpu": _try_adam("cpu"), "cuda": _try_adam("cuda")}
    if forced:
        active_cpu, why = forced, f"forced by FP4OFFLOAD_BACKEND={forced}"
    elif backends["cpu"]["builds"]:
        active_cpu, why = "cpu", "the CPU extension built"
    else:
        active_cpu, why = "reference", f"the CPU extension does not build: {backends['cpu']['why']}"
    active = {"cpu_tensors": {"backend": active_cpu, "why": why}}
    if torch.cuda.is_available():
        b = forced or ("cuda" if backends["cuda"]["builds"] else "reference")
        active["cuda_tensors"] = {"backend": b, "why": "forced" if forced else backends["cuda"]["why"]}
    return {
        "fp4offload": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_hip": getattr(torch.version, "hip", None),
        "cuda_available": torch.cuda.is_available(),
        "nvcc": shutil.which("nvcc"),
        "nvcc_version": _nvcc_version(),
        "torch_extensions_dir": os.environ.get("TORCH_EXTENSIONS_DIR", "(torch default)"),
        "cpu_threads": torch.get_num_threads(),
        "step_threads": _step_threads(),
        "cpu_isa": isa,
        "cpu_isa_why": isa_why,
        "cpu_isa_available": cpu_isa.available(),
        "gpu": gpu_report(),
        "backends": backends,
        "optimizer_kernels": adam,
        "stale_locks": locks,
        "active": active,
        "deepspeed": deepspeed_report(),
        "host": host_report(config),
        "settings": settings,
    }


def _step_threads() -> dict:
    """The threads a rank's host optimizer step would run on here (fp4offload._machine.step_threads)."""
    from ._machine import step_threads

    st = step_threads()
    return {"threads": st.threads, "cpus": st.cpus, "local_ranks": st.local_ranks, "source": st.source}


def _nvcc_version() -> str | None:
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
        return out.strip().splitlines()[-1] if out.strip() else None
    except Exception:
        return None


def render(r: dict) -> str:
    lines = [f"fp4offload {r['fp4offload']}  python {r['python']}  torch {r['torch']} "
             f"(CUDA {r['torch_cuda'] or 'none'}" + (f", ROCm {r['torch_hip']})" if r.get("torch_hip") else ")")]
    g = r["gpu"]
    if g["available"]:
        lines.append(f"GPUs (driver {g['driver'] or 'unknown'}; memory from {g['source']}):")
        for d in g["gpus"]:
            fp4 = "hardware FP4" if d["fp4_hardware"] else "FP4 as storage/transfer format"
            cc = d["compute_capability"]
            sm = f"sm_{cc.replace('.', '')}" if cc else "compute capability unknown"
            kind = "AMD" if d["source"] == "amdsmi" else f"{sm} {d['generation']}"
            lines.append(f"  [{d['index']}] {d['name']}  {d['total_gib']} GiB ({d['free_gib']} free, {d['source']})  "
                         f"{kind}: {fp4}")
    else:
        lines.append(f"GPU: none ({g['why']})")
    lines.append(f"nvcc: {r['nvcc_version'] or 'not found'}")
    lines.append(f"CPU kernels: {r['cpu_isa']} path ({r['cpu_isa_why']}); this CPU has "
                 f"{', '.join(r['cpu_isa_available'])}")
    lines.append("codec backends:")
    for name, b in r["backends"].items():
        extra = ""
        if "isa" in b:
            extra = f", {b['isa']} build"
        if "seconds" in b:
            extra += f", {b['seconds']} s to load/build"
        state = "ok" if b["builds"] else "unavailable"
        lines.append(f"  {name:9s} {state}{extra}" + ("" if b["builds"] else f"  ({b['why']})"))
    lines.append("FP4AdamW step kernels:")
    for name, b in r["optimizer_kernels"].items():
        extra = f", {b['seconds']} s to load/build" if "seconds" in b else ""
        lines.append(f"  {name:9s} {'ok' if b['builds'] else 'unavailable'}{extra}"
                     + ("" if b["builds"] else f"  ({b['why']})"))
    if r["stale_locks"]:
        lines.append("stale build locks (a build was killed; the next build of that kernel waits forever):")
        lines.extend(f"  {lk['path']}  fix: {lk['fix']}" for lk in r["stale_locks"])
    for what, a in r["active"].items():
        lines.append(f"active for {what.replace('_', ' ')}: {a['backend']}  ({a['why']})")
    d = r["deepspeed"]
    if d["usable"]:
        aio = "yes" if d.get("async_io") else f"no: {d.get('async_io_fix')}"
        lines.append(f"deepspeed {d['version']} (accelerator {d['accelerator']}); async_io usable: {aio}")
        names = ("every private name the block uses is present" if not d["missing_names"]
                 else "missing: " + "; ".join(d["missing_names"]))
        rng = "" if d["in_range"] else f"; outside the supported range, install '{d['supported']}'"
        lines.append(f"  block on this DeepSpeed ({d['supported']}): {names}{rng}")
    else:
        lines.append(f"deepspeed: not usable ({d['why']})")
    auto = d["auto"]
    lines.append(f"  zero-code block (fp4offload-auto.pth): {'active' if auto['active'] else 'inactive'}, "
                 f"{auto['state']} ({auto['why']})")
    h = r["host"]
    cache = h["host_cache"]
    cache_txt = "builds" if cache["builds"] else f"unavailable ({cache['why']})"
    hint = "" if h["transparent_hugepages"] in ("always", "madvise") else " (large host blocks fault 4 KiB at a time)"
    lines.append(f"host: {h['libc']}; transparent huge pages: {h['transparent_hugepages']}{hint}; "
                 f"allocator cache: {cache_txt}")
    m, ranks = h["memory"], h["local_ranks"]
    total = f" of {m['total_bytes'] / 2**30:.2f} GiB" if m["total_bytes"] else ""
    lines.append(f"host memory: {m['free_bytes'] / 2**30:.2f} GiB free{total}, from {m['source']}")
    if m["cgroup"] and not m["source"].startswith("cgroup"):
        lines.append(f"  cgroup {m['cgroup']} leaves more: {m['describe']}")
    lines.append(f"local ranks: {ranks['local']} ({ranks['source']}); world size {ranks['world']}")
    st = r["step_threads"]
    lines.append(f"host optimizer step threads per rank: {st['threads']} ({st['source']}; FP4OFFLOAD_STEP_THREADS "
                 "sets it)")
    lines.append("settings in effect (value, from: an FP4OFFLOAD_* variable, a JSON key of --config, or the default):")
    for name, st in r["settings"].items():
        value = ("on" if st["value"] else "off") if isinstance(st["value"], bool) else st["value"]
        if value is None:
            from ._switches import BY_NAME, _shown

            value = _shown(None, BY_NAME.get(name))
        over = f"  (override: {st['variable']})" if st["source"] not in (name, st["variable"]) else ""
        lines.append(f"  {name:42s} {value!s:10s} {st['source']}{over}")
    lines.append(f"extension cache: {r['torch_extensions_dir']}")
    return "\n".join(lines)
