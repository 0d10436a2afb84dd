"""End-to-end DeepSpeed with and without the "fp4offload" block, in the same run, on this machine.

Configurations (one rank, DS_ACCELERATOR=cpu, bf16, a Llama from benchmarks.harness on Shakespeare bytes):

- ``z2_cpu``:  ZeRO-2, offload_optimizer cpu. Baseline: DeepSpeedCPUAdam. Block: FP4AdamW, states in host RAM.
- ``z3_nvme``: ZeRO-3, offload_optimizer nvme. Baseline: DeepSpeed's NVMe optimizer swapper (fp32 master, m, v
  on disk through async_io). Block: FP4AdamW's own NVMe tier (packed m, v on disk; DeepSpeed keeps the fp32
  master in host RAM, since its swapper cannot hold packed states).
- ``z3_cpu`` (only when named in ``--configs``): ZeRO-3, offload_optimizer cpu. Baseline: DeepSpeedCPUAdam.
  Block: FP4AdamW, states in host RAM. The ZeRO-3 configuration DeepSpeed's bf16 mode runs in (below).

Arms (``--arms``, run in this order, each configuration; the default is all but the block's ablations):

- ``baseline``: plain DeepSpeed (fp32 master, fp32 gradient partition, fp32 m and v), glibc's allocator as is.
- ``same_allocator``: plain DeepSpeed with the block's host settings (see Allocator below).
- ``baseline_jemalloc``: plain DeepSpeed with jemalloc preloaded in the child (``LD_PRELOAD=libjemalloc.so.2``,
  ``MALLOC_CONF=background_thread:true,dirty_decay_ms:0,muzzy_decay_ms:0``: freed pages go back at once).
- ``ds_bf16``: DeepSpeed's own low-memory mode, the strongest peer: ``"bf16": {"enabled": true,
  "bf16_master_weights_and_grads": true, "bf16_optimizer_states": true}``, so the master partition, its
  gradient partition and DeepSpeedCPUAdam's m and v are all bf16 (the optimizer block's params carry
  ``fp32_optimizer_states: false``; DeepSpeed 0.19.8 sets it itself in this mode and asserts it). It needs
  ZeRO-Offload with DeepSpeedCPUAdam. It runs in ``z2_cpu`` and ``z3_cpu``, not in ``z3_nvme``: there
  DeepSpeed 0.19.8's optimizer swapper fails at the first step (it releases the swapped-out master to an empty
  fp32 ``torch.Tensor()``, then asks its bf16 SwapBufferManager for that dtype on the next swap-in:
  AssertionError ``dtype == self.dtype`` in swap_tensor/utils.py), so the bf16-mode arms of ``z3_nvme`` are
  skipped with that reason (up to 0.19.8; a later DeepSpeed is tried, and skipped the same way if it fails
  so). Each row records what the engine really ran (``master_dtype`` = the ZeRO optimizer's
  master_weights_and_grads_dtype, ``optimizer_state_dtypes`` from DeepSpeedCPUAdam's state tensors,
  ``fp32_optimizer_states``; with DeepSpeed's NVMe swapper the states are on disk between steps, and
  ``ds_swap_file_B_per_param`` gives its swap files' bytes: 12 B/param for plain DeepSpeed's fp32 master, m
  and v); the parent stops when a bf16-mode row is not bf16, rather than report plain DeepSpeed under this
  name.
- ``ds_bf16_same_allocator``, ``ds_bf16_jemalloc``: DeepSpeed's bf16 mode with the block's host settings, and
  with jemalloc preloaded as above.
- ``block``: the "fp4offload" block (its own defaults); ``block_no_host_cache`` and ``block_no_host_cache_env``
  are the host-cache ablations (``--without-host-cache``, ``--host-env-arm``). ``block_split``, ``block_bf16``:
  the compact masters; ``block_split_nvme`` (``z3_nvme`` only): split with its residual in the NVMe state files.
  ``block_fp32_grads``: the fp32-master block with ``host.bf16_gradient_partition`` off, which under ZeRO-3 is
  the block before its master gradient became DeepSpeed's bf16 gradient partition (an fp32 copy, 4 B/param).

jemalloc is an optional extra of this benchmark (never of the tests): the library is found by ``ldconfig -p``
or the usual lib folders, or given by ``--jemalloc PATH``. When it is missing the jemalloc arms are skipped
with the reason and the fix printed (``apt-get install -y libjemalloc2``), and the rest runs; a row says
``allocator: "jemalloc"`` only when /proc/self/maps of the child shows the library loaded (else the arm is
skipped too). glibc's mallinfo2 (``malloc_end``) is left empty under jemalloc, where it means nothing.

Each configuration runs in its own process (so peak RSS is its own) and reports: seconds per step (median after
one warm-up step), minor page faults per step (median, getrusage), peak host RSS while training (sampled every 5
ms; ``peak_rss_incl_init`` is ru_maxrss, which also holds the model-construction transient) beside the
preflight's estimate of it (``estimate_peak_rss``, fp4offload._deepspeed.preflight, computed before
initialize as the block's initialize does; the preflight does not model DeepSpeed's bf16 mode, so for those
rows it counts fp32 master, gradients and states and reads high), the optimizer's
host bytes counted from its tensors, and NVMe bytes per step: storage-level bytes from /proc/self/io (exact for
DeepSpeed's O_DIRECT swapper) and, for FP4AdamW's buffered tier, the bytes it asks the disk for (its counters;
the page cache may absorb some reads); ``optimizer_host_B_per_param`` is master + gradient partition + states
over the master's elements (plain DeepSpeed 4+4+8 = 16, DeepSpeed's bf16 mode 2+2+4 = 8, the block on ZeRO-2
4+2+1.1). Ratios are block / reference from the same invocation: the flat keys against plain DeepSpeed (and
``_same_allocator``), and ``against``, keyed by the reference arm's variant, against each reference arm that
ran (plain DeepSpeed, DeepSpeed's bf16 mode, each with the block's host settings and with jemalloc).

Host RSS, split. On this machine DeepSpeed's accelerator is the CPU, so the RSS also holds what a GPU run
keeps in device memory: the bf16 parameters (2 B/param), the bf16 gradient bucket (2 B/param while backward
runs) and DeepSpeed's device-side scratch. Each row carries ``buffers`` (bytes per DeepSpeed/optimizer buffer,
counted from the tensors, each tagged ``device`` or ``host``) and ``peak_rss_host_side`` = peak RSS less the
device-tagged bytes, plus the bf16 staging copy when it was shared (the block, and the baseline with the same
host settings, share it with the bf16 partition on the CPU accelerator; a GPU machine's host keeps it), or,
with a compact master, the master partition (the model's own bf16 partition on the CPU accelerator, a host
tensor on a GPU machine, where it is also the staging copy): what the host would hold on a GPU machine (an
upper bound: activations stay in it).

Allocator. With ``optimizer_states`` the block fixes glibc's mmap threshold
(``host.mmap_threshold``), serves torch's large CPU blocks from fp4offload.host_allocator's bounded cache
(``host.allocator_cache``) and shares the bf16 staging buffers with the bf16 partitions
(``host.share_bf16_staging``; fp4offload._deepspeed.zero12). All three would help a run without the block
too, so each configuration also runs the baseline with the same settings (``allocator: "fixed"``) and the
ratios are given against both baselines: ``peak_rss_reduction`` (plain DeepSpeed, the target's definition)
and ``peak_rss_reduction_same_allocator`` (what the packed states alone save). The block also keeps ZeRO-1/2's host
gradient partition in bf16 (bf16_gradient_partition): FP4AdamW reads bf16 gradients, DeepSpeedCPUAdam does not,
so both baselines keep it in fp32.

The largest trainable model is projected from the measured peak RSS, fitted as fixed + bytes/param x N
over two model sizes, against the host RAM this machine has. ``--search`` measures it instead: ZeRO-2 cpu
offload, a fixed width, the number of layers searched (start at the projection from two small sizes, step
out until one size exceeds, then bisect); each try trains 2 steps in a child under an RSS watchdog that
kills it when its RSS passes ``--budget`` (default 20 GiB) or the machine's available memory falls below
``--min-available`` (default 1 GiB), reported as "exceeds".

    python benchmarks/e2e_deepspeed.py                # table
    python benchmarks/e2e_deepspeed.py --json         # one JSON object per line
    python benchmarks/e2e_deepspeed.py --configs z2_cpu --arms baseline,ds_bf16,block   # three arms
    python benchmarks/e2e_deepspeed.py --search --budget 3GiB      # largest model, with and without the block
    python benchmarks/e2e_deepspeed.py --search --search-arms ds_bf16_jemalloc,block_split,block_bf16   # 20 GiB
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("z2_cpu", "z3_nvme")  # the default; z3_cpu on request (--configs)
ALL_CONFIGS = CONFIGS + ("z3_cpu",)


# DeepSpeed's own low-memory offload mode: bf16 master weights, gradients and Adam states (DeepSpeedCPUAdam with
# fp32_optimizer_states=False; DeepSpeed asserts it, see base_optimizer._configure_master_weights)
DS_BF16 = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def trainer_zero3_buckets(hidden: int) -> dict:
    """The ZeRO-3 bucket sizes transformers' Trainer writes for ``"auto"`` (integrations/deepspeed.py): reduce
    bucket hidden^2, prefetch bucket 0.9 hidden^2, parameters under 10 hidden elements kept gathered. DeepSpeed's
    own defaults (reduce bucket 5e8 elements) are sized for a GPU, where the bucket is device memory; on the
    CPU accelerator it is host RAM, resident from the first backward, in every arm alike."""
    return {"reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
            "stage3_param_persistence_threshold": 10 * hidden}


def ds_config(name: str, fp4: bool, nvme_dir: str, host: dict | None = None, ds_bf16: bool = False,
              master: str = "fp32", zero3_buckets: dict | None = None, activations: dict | None = None) -> dict:
    """The DeepSpeed config of one arm: plain DeepSpeed, DeepSpeed's bf16 mode (``ds_bf16``) or the block;
    ``zero3_buckets`` (ZeRO-3 configurations): bucket sizes set over DeepSpeed's defaults."""
    if fp4 and ds_bf16:
        raise ValueError("the block and DeepSpeed's bf16 mode are separate arms")
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}, "steps_per_print": 10 ** 9,
           "wall_clock_breakdown": False}
    if ds_bf16:
        cfg["bf16"] = dict(DS_BF16)
        cfg["optimizer"]["params"]["fp32_optimizer_states"] = False  # engine.py pops it for DeepSpeedCPUAdam
    if name == "z2_cpu":
        cfg["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                    "contiguous_gradients": True, "overlap_comm": False}
        block = {"optimizer_states": {"format": "nvfp4", "device": "cpu"}}
    elif name == "z3_cpu":
        cfg["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                    "sub_group_size": 10 ** 9}
        block = {"optimizer_states": {"format": "nvfp4", "device": "cpu"}}
    elif name == "z3_nvme":
        cfg["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir,
                                                                      "pin_memory": False},
                                    "sub_group_size": 10 ** 9}
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                      "overlap_events": True}
        block = {"optimizer_states": {"format": "nvfp4", "device": "nvme", "nvme_path": nvme_dir}}
    else:
        raise SystemExit(f"unknown config {name!r}; choose from {ALL_CONFIGS}")
    if zero3_buckets and name.startswith("z3"):
        cfg["zero_optimization"].update(zero3_buckets)
    if host:
        block["host"] = host
    if activations:
        block["activations"] = dict(activations)
    if master != "fp32":  # "split", "bf16", or "split_nvme" (split with its residual in the NVMe state files)
        form, _, place = master.partition("_")
        block["optimizer_states"]["master"] = form
        if place:
            block["optimizer_states"]["master_device"] = place
    if fp4:
        cfg["fp4offload"] = block
    return cfg


def _io() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def _storage_bytes(t, seen: set) -> int:
    import torch

    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        return 0
    st = t.untyped_storage()
    if st.data_ptr() in seen or st.nbytes() == 0:
        return 0
    seen.add(st.data_ptr())
    return st.nbytes()


def _kind(tensors) -> str:
    """'fp32', or 'bf16' (any other dtype's name) when some tensor is not fp32."""
    import torch

    other = {t.dtype for t in tensors if t is not None and t.dtype != torch.float32}
    return "fp32" if not other else "bf16" if other == {torch.bfloat16} else "/".join(sorted(map(str, other)))


def buffer_account(engine, model) -> dict[str, dict]:
    """Bytes of DeepSpeed's and the optimizer's buffers, counted from the tensors (storages once each).

    ``{name: {"bytes": int, "side": "device" | "host"}}``; ``side`` is where the buffer sits on a GPU machine
    with the same config. The gradient bucket is emptied after each backward; it is given at the size backward
    fills (the bucket, or the model's gradients when they are fewer).
    """
    import torch

    zo = engine.optimizer
    inner = getattr(engine, "basic_optimizer", None) or getattr(zo, "optimizer", None)
    seen: set[int] = set()
    out: dict[str, dict] = {}

    def add(name, side, tensors, again: bool = False) -> None:
        # again: count storages already seen as well (a compact master that is the model's bf16 partition on the
        # CPU accelerator; on a GPU host it is a host tensor of its own)
        b = sum(_storage_bytes(t, seen) for t in tensors if t is not None)
        if again:
            b = sum(t.numel() * t.element_size() for t in tensors if t is not None and t.device.type == "cpu")
        if b:
            out[name] = {"bytes": b, "side": side}

    n_model = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 empties p.data
    if hasattr(zo, "bit16_groups_flat"):  # ZeRO-1/2
        add("bf16 params (bit16_groups_flat)", "device", zo.bit16_groups_flat)
        masters = zo.single_partition_of_fp32_groups  # bf16 in DeepSpeed's bf16 mode, despite the name
        add(f"{_kind(masters)} master partition", "host", masters, again=True)
        grads = [t.grad for t in masters]
        # bf16: the block's bf16_gradient_partition, or DeepSpeed's bf16 mode (bf16_master_weights_and_grads)
        add(f"{_kind(grads)} gradient partition", "host", grads)
        add("bf16 staging copy of the partition (param_buffer_of_bit16_for_cpu_offload)", "host",
            getattr(zo, "param_buffer_of_bit16_for_cpu_offload_groups", []))
        add("temp_grad_buffer_for_cpu_offload", "host", [getattr(zo, "temp_grad_buffer_for_cpu_offload", None)])
        add("temp_grad_buffer_for_gpu_offload", "device", [getattr(zo, "temp_grad_buffer_for_gpu_offload", None)])
        bucket = min(int(getattr(zo, "reduce_bucket_size", n_model)), n_model) * 2
        out["bf16 gradient bucket (ipg, during backward)"] = {"bytes": bucket, "side": "device"}
    else:  # ZeRO-3
        add("bf16 param partitions (fp16_partitioned_groups_flat)", "device",
            getattr(zo, "fp16_partitioned_groups_flat", []) or [])
        masters = getattr(zo, "fp32_partitioned_groups_flat", []) or []
        add(f"{_kind(masters)} master partition", "host", masters, again=True)
        # the flat gradient partition, and the master's gradient (counted once when it is a slice of it)
        add("gradient partition", "host", [getattr(zo, "grad_partitions_flat_buffer", None)])
        add(f"{_kind([m.grad for m in masters])} master gradient", "host", [m.grad for m in masters])
        add("bf16 params outside partitions", "device", [p.data for p in model.parameters()])
        # the reduce bucket (allocated at reduce_bucket_size, touched as far as backward fills it)
        for dtype, b in (getattr(zo, "ipg_buckets", None) or {}).items():
            if getattr(b, "buffer", None) is not None and b.buffer.device.type == "cpu":
                size = b.buffer.element_size() * min(b.buffer.numel(), n_model)
                out[f"{str(dtype).replace('torch.', '')} gradient bucket (ipg, during backward)"] = \
                    {"bytes": size, "side": "device"}
        # parameters ZeRO-3 gathers for forward and backward (device memory on a GPU) are released by the end of
        # the step, when this is counted: device_side is a lower bound, the host side an upper bound
    if inner is not None:
        add("optimizer states (" + type(inner).__name__ + ")", "host",
            [t for st in inner.state.values() for t in st.values() if isinstance(t, torch.Tensor)])
    return out


def _rss_ladder() -> dict[str, int]:
    """Heap bytes in use and free (glibc mallinfo2), to tell allocator retention from live tensors."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")

        class MI2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]

        libc.mallinfo2.restype = MI2
        m = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {"heap_in_use": m.uordblks, "heap_free": m.fordblks, "mmapped": m.hblkhd}


JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:0,muzzy_decay_ms:0"
JEMALLOC_FIX = "apt-get install -y libjemalloc2 (Debian/Ubuntu), or pass --jemalloc /path/to/libjemalloc.so.2"


def find_jemalloc(hint: str | None = None) -> tuple[str | None, str]:
    """(path of libjemalloc.so.2, '') or (None, why not, naming the fix). An optional benchmark extra."""
    if hint:
        return (hint, "") if Path(hint).is_file() else (None, f"--jemalloc {hint}: no such file; {JEMALLOC_FIX}")
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if "libjemalloc.so.2" in line and "=>" in line and Path(line.split("=>")[-1].strip()).is_file():
                return line.split("=>")[-1].strip(), ""
    except (OSError, subprocess.SubprocessError):
        pass
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"):
        if (Path(d) / "libjemalloc.so.2").is_file():
            return str(Path(d) / "libjemalloc.so.2"), ""
    return None, f"libjemalloc.so.2 not found; to run the jemalloc arms: {JEMALLOC_FIX}"


def _jemalloc_loaded() -> bool:
    """Whether jemalloc is mapped into this process (LD_PRELOAD took effect)."""
    try:
        return "libjemalloc" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _host_cache_stats() -> dict:
    from fp4offload import host_allocator

    keys = ("installed", "allocs", "hits", "maps", "peak_cached_bytes", "peak_in_use_bytes")
    return {k: v for k, v in host_allocator.stats().items() if k in keys}


def child(args) -> dict:
    """One configuration in this process; returns its measurements."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", LOCAL_RANK="0",
                     WORLD_SIZE="1").items():
        os.environ.setdefault(k, v)
    sys.path.insert(0, str(ROOT))
    import deepspeed
    import torch

    import fp4offload.deepspeed as fds
    from benchmarks import harness
    from fp4offload import _metrics as metrics
    from fp4offload._deepspeed import host as ds_host
    from fp4offload._deepspeed import monitor as ds_monitor
    from fp4offload._deepspeed import zero12

    torch.manual_seed(0)
    if args.bf16_build:  # --search: no fp32 copy of the model while building it (4 B/param of init transient)
        torch.set_default_dtype(torch.bfloat16)
    model = harness.small_llama(hidden=args.hidden, layers=args.layers, heads=args.heads,
                                intermediate=args.intermediate, vocab=256, max_seq=args.seq).to(torch.bfloat16)
    torch.set_default_dtype(torch.float32)
    nparams = sum(p.numel() for p in model.parameters())
    cfg = ds_config(args.config, args.fp4, args.nvme_dir, json.loads(args.host) if args.host else None,
                    ds_bf16=args.ds_bf16, master=args.master,
                    activations=json.loads(args.activations) if args.activations else None,
                    zero3_buckets=trainer_zero3_buckets(args.hidden) if args.zero3_buckets == "trainer" else None)
    t0 = time.perf_counter()
    allocator = None
    if not args.fp4 and args.allocator == "fixed":  # the baseline with the block's allocator setting
        allocator = ds_host.control_host_allocator()
    # the preflight's estimate of this process's host RAM (what initialize computes before DeepSpeed allocates)
    from fp4offload._deepspeed import preflight as ds_preflight

    if args.fp4:
        prepared = fds.prepare_config(cfg)
        estimate = ds_preflight.estimate(prepared.ds_config, model, prepared.host, states=prepared.states)
    else:
        estimate = ds_preflight.estimate(cfg, model, None)
    import threading

    import psutil

    proc, peak_train, peak_from_init, stop = psutil.Process(), [0], [0], threading.Event()

    def sample() -> None:  # RSS peaks from initialize on, and while training (ru_maxrss also holds the build)
        while not stop.is_set():
            rss = proc.memory_info().rss
            peak_train[0], peak_from_init[0] = max(peak_train[0], rss), max(peak_from_init[0], rss)
            stop.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    init = fds.initialize if args.fp4 else deepspeed.initialize  # without the block: DeepSpeed untouched
    engine, _, _, _ = init(model=model, config=cfg)
    shared = 0
    if not args.fp4 and args.allocator == "fixed":  # ... and its bf16 staging buffers shared, as the block does
        shared = zero12.share_bf16_staging(engine)
    if allocator is not None and allocator.get("mmap_threshold"):
        ds_host.release_free_host_memory()  # what the block does after initialize
    if args.fp4:
        allocator = getattr(getattr(engine, "fp4offload", None), "allocator", None)
        att = getattr(engine, "fp4offload", None)
        # what a GPU host keeps that the CPU accelerator let the block share: the bf16 staging copy (fp32 master),
        # or the compact master itself, which is the model's bf16 partition here (the staging copy is the master)
        shared = getattr(att, "master_shared_bytes", 0) if args.master != "fp32" else \
            getattr(att, "staging_shared_bytes", 0)
    init_s = time.perf_counter() - t0
    train, _ = harness.byte_splits()
    g = torch.Generator().manual_seed(0)
    peak_train[0] = 0  # from here: the peak while training
    times, ios, losses, faults = [], [], [], []
    metrics.reset() if hasattr(metrics, "reset") else None
    for step in range(args.steps + 1):
        tokens = harness.batch(train, 1, args.seq, g)
        io0 = _io()
        snap0 = metrics.snapshot()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        loss = harness.lm_loss(engine, tokens)
        engine.backward(loss)
        engine.step()
        dt = time.perf_counter() - t
        df = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        io1 = _io()
        snap1 = metrics.snapshot()
        losses.append(float(loss.detach()))
        if step == 0:
            continue  # warm-up: first states allocated, files created
        times.append(dt)
        faults.append(df)
        logical = sum(snap1.get(k, 0) - snap0.get(k, 0) for k in ("optim.nvme.bytes_written", "optim.nvme.bytes_read"))
        ios.append({"disk_read": io1["read_bytes"] - io0["read_bytes"],
                    "disk_write": io1["write_bytes"] - io0["write_bytes"], "tier_logical": logical})
    stop.set()
    sampler.join()
    mem = ds_monitor.optimizer_host_bytes(engine)
    inner = engine.basic_optimizer
    state_dtypes = sorted({str(t.dtype).replace("torch.", "") for st in inner.state.values() for t in st.values()
                           if isinstance(t, torch.Tensor) and t.numel() > 1})
    master_dtype = str(getattr(engine.optimizer, "master_weights_and_grads_dtype", torch.float32))
    jemalloc = _jemalloc_loaded()
    # DeepSpeed's NVMe swapper (z3_nvme): master and states are on disk between steps, their host tensors empty;
    # the swap files' sizes say what it keeps there (fp32 master, m, v: 12 B/param; bf16 mode: 6)
    swap_files = [f for f in Path(args.nvme_dir).rglob("*.tensor.swp") if "_gradient_" not in f.name] \
        if args.nvme_dir and Path(args.nvme_dir).is_dir() else []
    swap_bytes = sum(f.stat().st_size for f in swap_files)
    peak_all = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    disk = statistics.median(i["disk_read"] + i["disk_write"] for i in ios)
    tier = statistics.median(i["tier_logical"] for i in ios)
    buffers = buffer_account(engine, model)
    device_side = sum(b["bytes"] for b in buffers.values() if b["side"] == "device")
    return {"config": args.config, "fp4": args.fp4, "params": nparams, "init_s": init_s,
            "zero3_buckets": args.zero3_buckets,
            "mode": "block" if args.fp4 else "ds_bf16" if args.ds_bf16 else "plain", "master": args.master,
            # what the engine really runs (a bf16-mode row whose master is fp32 ran plain DeepSpeed)
            "master_dtype": master_dtype.replace("torch.", ""), "optimizer_state_dtypes": state_dtypes,
            "fp32_optimizer_states": getattr(inner, "fp32_optimizer_states", None),
            "bf16_config": cfg["bf16"],
            "allocator": ("jemalloc" if jemalloc else
                          "fixed" if allocator and allocator.get("mmap_threshold") else "glibc default"),
            "jemalloc": {"loaded": jemalloc, "LD_PRELOAD": os.environ.get("LD_PRELOAD"),
                         "MALLOC_CONF": os.environ.get("MALLOC_CONF")} if jemalloc else None,
            "mmap_threshold": (allocator or {}).get("mmap_threshold"), "host_cache": _host_cache_stats(),
            "s_per_step": statistics.median(times), "step_times": times,
            "page_faults_per_step": statistics.median(faults), "peak_rss": peak_train[0],
            "peak_rss_from_init": peak_from_init[0],
            "estimate_peak_rss": estimate.per_rank, "estimate_error": estimate.per_rank / peak_from_init[0] - 1,
            "estimate_consumers": estimate.consumers, "estimate_runtime": estimate.runtime,
            "peak_rss_incl_init": peak_all, "rss_end": proc.memory_info().rss,
            "malloc_end": {} if jemalloc else _rss_ladder(),  # glibc's counters: meaningless under jemalloc
            "buffers": buffers, "device_side_bytes": device_side, "staging_shared_bytes": shared,
            # a GPU machine's host keeps the staging copy the CPU accelerator lets the block share: add it back
            "peak_rss_host_side": peak_train[0] - device_side + shared,
            "optimizer_host_bytes": mem["total"], "optimizer_host_B_per_param": mem["total"] / max(1, mem["numel"]),
            "nvme_bytes_per_step": max(disk, tier), "nvme_disk_bytes_per_step": disk,
            "nvme_tier_logical_bytes_per_step": tier, "losses": losses,
            "optimizer_host_split": {k: mem[k] for k in ("master", "grad", "states")},
            "ds_swap_file_bytes": swap_bytes, "ds_swap_file_B_per_param": swap_bytes / nparams,
            "inner": type(inner).__name__}


class Exceeds(Exception):
    """A child killed by the watchdog; ``peak`` is the RSS it had reached."""

    def __init__(self, why: str, peak: int):
        super().__init__(why)
        self.why, self.peak = why, peak


def parse_size(text: str) -> int:
    """'20GiB', '3GiB', '512MiB', '2G', '1500000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?)B?\s*", str(text), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 20GiB, 512MiB)")
    unit = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}[m.group(2).upper()]
    return int(float(m.group(1)) * ((1024 if m.group(3) or unit else 1000) ** unit))


def _own_rss(proc) -> int:
    """RSS of the training process itself. Its children are left out: a child it forks (a build step's
    ``ninja``, a ``subprocess`` probe) shares the parent's pages until it execs, so summing RSS over the
    tree counts them twice (a 15 GiB trainer read as 31 GiB); the available-memory guard covers the rest."""
    import psutil

    try:
        return proc.memory_info().rss
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


def _child_port(key: str) -> int:
    """A port for the child's torch.distributed rendezvous: one the OS reports free on 127.0.0.1 (the socket
    is closed before the child starts), else one fixed by the crc32 of ``key`` (stable across processes)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    except OSError:
        return 29700 + zlib.crc32(key.encode()) % 200


def run_child(config: str, fp4: bool, a, *, allocator: str = "default", budget: int | None = None,
              min_available: int = 0, env_extra: dict | None = None, host: dict | None = None,
              ds_bf16: bool = False, master: str = "fp32", activations: dict | None = None) -> dict:
    """One configuration in a child process. With ``budget``, the child (with its children) is killed as soon
    as its RSS passes it, or the machine's available memory falls below ``min_available``: raises Exceeds."""
    import psutil

    with tempfile.TemporaryDirectory(prefix="fp4ds_nvme_", dir=a.nvme_root) as nvme, \
            tempfile.NamedTemporaryFile(suffix=".json") as out, tempfile.TemporaryFile("w+") as log:
        cmd = [sys.executable, __file__, "--child", "--config", config, "--out", out.name, "--nvme-dir", nvme,
               "--hidden", str(a.hidden), "--layers", str(a.layers), "--heads", str(a.heads),
               "--intermediate", str(a.intermediate), "--seq", str(a.seq), "--steps", str(a.steps),
               "--allocator", allocator,
               "--port", str(_child_port(f"{config}/{int(fp4)}/{allocator}/{int(ds_bf16)}/{master}/"
                                         f"{sorted(env_extra or {})}")), "--master", master,
               "--zero3-buckets", getattr(a, "zero3_buckets", "deepspeed"),
               ] + (["--fp4"] if fp4 else []) + (["--ds-bf16"] if ds_bf16 else []) + \
              (["--bf16-build"] if getattr(a, "bf16_build", False) else []) + \
              (["--host", json.dumps(host)] if host else []) + \
              (["--activations", json.dumps(activations)] if activations else [])
        env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT), **(env_extra or {}))
        env.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fp4offload/torch_extensions"))
        p = subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        proc, peak, killed, t0 = psutil.Process(p.pid), 0, None, time.monotonic()
        while p.poll() is None:
            if budget is not None:
                rss = _own_rss(proc)
                peak = max(peak, rss)
                avail = psutil.virtual_memory().available
                if rss > budget:
                    killed = f"RSS {rss / 2**30:.2f} GiB passed the budget {budget / 2**30:.2f} GiB"
                elif avail < min_available:
                    killed = (f"machine's available memory {avail / 2**30:.2f} GiB fell below "
                              f"{min_available / 2**30:.2f} GiB (child RSS {rss / 2**30:.2f} GiB)")
            if time.monotonic() - t0 > a.timeout:
                killed = f"timeout after {a.timeout:.0f} s"
            if killed:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
                break
            time.sleep(0.02 if budget is not None else 0.2)
        if killed and not killed.startswith("timeout"):
            raise Exceeds(killed, peak)
        log.seek(0)
        text = log.read()
        if killed or p.returncode != 0:
            raise RuntimeError(f"{config} fp4={fp4} failed ({killed or p.returncode}):\n{text[-6000:]}")
        r = json.loads(Path(out.name).read_text())
        if budget is not None:
            r["watchdog_peak_rss"] = peak
        return r


def search(a) -> list[dict]:
    """Largest number of layers (at a.hidden / a.intermediate) that trains a step of z2_cpu under a.budget, for
    each arm of a.search_arms (names of ARMS; "baseline" runs with --baseline-allocator)."""
    results = []
    a = argparse.Namespace(**{**vars(a), "steps": 1, "bf16_build": True})
    names = [n.strip() for n in a.search_arms.split(",") if n.strip()]
    unknown = [n for n in names if n not in ARMS]
    if unknown:
        raise SystemExit(f"--search-arms: unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    jemalloc, jemalloc_why = (find_jemalloc(a.jemalloc) if any(ARMS[n].get("jemalloc") for n in names)
                              else (None, ""))

    def label(name: str) -> str:
        return VARIANT_LABELS.get(ARMS[name]["variant"], name)

    def attempt(name: str, kw: dict, layers: int) -> dict:
        t = time.perf_counter()
        spec = ARMS[name]
        try:
            r = run_child("z2_cpu", spec.get("fp4", False), argparse.Namespace(**{**vars(a), "layers": layers}),
                          budget=a.budget, min_available=a.min_available, **kw)
            row = {"arm": name, "fp4": spec.get("fp4", False), "layers": layers, "params": r["params"],
                   "fits": True, "peak_rss": max(r["peak_rss_incl_init"], r["watchdog_peak_rss"]),
                   "s_per_step": r["s_per_step"], "allocator": r["allocator"]}
        except Exceeds as e:
            row = {"arm": name, "fp4": spec.get("fp4", False), "layers": layers, "params": None, "fits": False,
                   "peak_rss": e.peak, "why": e.why}
        row["wall_s"] = time.perf_counter() - t
        results.append(row)
        if a.json:
            print(json.dumps({"search_try": row}), flush=True)
        else:
            print(f"  {label(name)}: layers={layers:4d} "
                  + (f"fits, peak {row['peak_rss'] / 2**30:.2f} GiB, {row['params'] / 1e9:.3f}B params"
                     if row["fits"] else f"exceeds ({row['why']})") + f"  [{row['wall_s']:.0f} s]", flush=True)
        return row

    summary = []
    for name in names:
        kw, why = arm_child_args(name, "z2_cpu", jemalloc, jemalloc_why)
        if name == "baseline":
            kw["allocator"] = a.baseline_allocator
        if why:
            summary.append({"arm": name, "largest_layers": None, "note": f"skipped: {why}"})
            continue
        lo_l, hi_l = a.probe_layers
        lo, hi = attempt(name, kw, lo_l), attempt(name, kw, hi_l)
        if not lo["fits"]:
            summary.append({"arm": name, "largest_layers": None, "note": f"{lo_l} layers already exceed the budget"})
            continue
        if not hi["fits"]:
            best, bad = lo, hi
        else:
            per_layer = (hi["peak_rss"] - lo["peak_rss"]) / (hi_l - lo_l)
            fixed = lo["peak_rss"] - per_layer * lo_l
            guess = max(hi_l + 1, int((a.budget - fixed) / max(per_layer, 1)))
            if a.json:
                print(json.dumps({"search_projection": {"arm": name, "rss_per_layer": per_layer, "fixed": fixed,
                                                        "projected_layers": guess}}), flush=True)
            else:
                print(f"  {label(name)} projection: {per_layer / 2**20:.0f} MiB/layer + "
                      f"{fixed / 2**30:.2f} GiB -> {guess} layers", flush=True)
            best, bad = hi, None
            r = attempt(name, kw, guess)
            if r["fits"]:
                best, stepsz = r, max(1, guess // 16)
                while bad is None:  # step out until a size exceeds
                    r = attempt(name, kw, best["layers"] + stepsz)
                    best, bad = (r, bad) if r["fits"] else (best, r)
                    stepsz *= 2
            else:
                bad = r
        while bad is not None and bad["layers"] - best["layers"] > 1:  # bisect
            r = attempt(name, kw, (best["layers"] + bad["layers"]) // 2)
            best, bad = (r, bad) if r["fits"] else (best, r)
        summary.append({"arm": name, "allocator": best.get("allocator"),
                        "largest_layers": best["layers"], "largest_params": best["params"],
                        "peak_rss": best["peak_rss"], "first_exceeding_layers": bad["layers"] if bad else None,
                        "budget": a.budget, "hidden": a.hidden, "intermediate": a.intermediate})
    ref = next((x for x in summary if x.get("largest_params")), None)
    for x in summary:
        if ref is not None and x.get("largest_params"):
            x["largest_params_ratio_to_first"] = x["largest_params"] / ref["largest_params"]
        if a.json:
            print(json.dumps({"search_result": x}), flush=True)
        elif x.get("largest_layers") is None:
            print(f"largest z2_cpu model ({label(x['arm'])}): none ({x['note']})")
        else:
            print(f"largest z2_cpu model ({label(x['arm'])}) under {a.budget / 2**30:.2f} GiB: "
                  f"{x['largest_layers']} layers x hidden {a.hidden} = {x['largest_params'] / 1e9:.3f}B params "
                  f"(peak {x['peak_rss'] / 2**30:.2f} GiB; {x['first_exceeding_layers']} layers exceed; "
                  f"{x['largest_params_ratio_to_first']:.2f}x {label(ref['arm'])})")
    return summary


# The arms --arms selects, in the order they run. ``reference``: the block's ratios are given against it.
ARMS = {
    "baseline": {"variant": "baseline", "reference": True},
    "same_allocator": {"variant": "baseline, same allocator", "allocator": "fixed", "reference": True},
    "baseline_jemalloc": {"variant": "baseline, jemalloc", "jemalloc": True, "reference": True},
    "ds_bf16": {"variant": "ds bf16 mode", "ds_bf16": True, "reference": True},
    "ds_bf16_same_allocator": {"variant": "ds bf16 mode, same allocator", "ds_bf16": True, "allocator": "fixed",
                               "reference": True},
    "ds_bf16_jemalloc": {"variant": "ds bf16 mode, jemalloc", "ds_bf16": True, "jemalloc": True, "reference": True},
    "block": {"variant": "block", "fp4": True},
    "block_split": {"variant": "block, split master", "fp4": True, "master": "split"},
    "block_bf16": {"variant": "block, bf16 master", "fp4": True, "master": "bf16"},
    # the saved activations packed to NVFP4 in a pinned host pool capped at 64 MiB (the preflight counts the cap)
    "block_acts": {"variant": "block, NVFP4 activations", "fp4": True,
                   "activations": {"format": "nvfp4", "device": "cpu", "max_host_bytes": 64 << 20}},
    "block_split_nvme": {"variant": "block, split master, residual on NVMe", "fp4": True, "master": "split_nvme",
                         "configs": ("z3_nvme",)},
    # the fp32-master block as it was before ZeRO-3's master gradient became DeepSpeed's bf16 gradient partition
    "block_fp32_grads": {"variant": "block, fp32 master gradient", "fp4": True,
                         "host": {"bf16_gradient_partition": False}},
    "block_no_host_cache": {"variant": "block, host cache off", "fp4": True, "host": {"allocator_cache": "off"}},
    "block_no_host_cache_env": {"variant": "block, host cache off by FP4OFFLOAD_HOST_CACHE", "fp4": True,
                                "env": {"FP4OFFLOAD_HOST_CACHE": "off"}},
}
DEFAULT_ARMS = ("baseline", "same_allocator", "baseline_jemalloc", "ds_bf16", "ds_bf16_same_allocator",
                "ds_bf16_jemalloc", "block", "block_split", "block_bf16")


def arm_child_args(name: str, config: str, jemalloc: str | None, jemalloc_why: str = "") -> tuple[dict, str]:
    """run_child's keyword arguments for arm ``name`` in ``config``, or why it cannot run there ('' when it can)."""
    spec = ARMS[name]
    env = dict(spec.get("env", {}))
    why = ds_bf16_unsupported(config) if spec.get("ds_bf16") else ""
    if spec.get("configs") and config not in spec["configs"]:
        why = f"runs with {', '.join(spec['configs'])} only (its residual goes to the NVMe state files)"
    if spec.get("jemalloc") and not why:
        if jemalloc is None:
            why = jemalloc_why or "jemalloc not found"
        else:
            env.update(LD_PRELOAD=jemalloc, MALLOC_CONF=JEMALLOC_CONF)
    return {"allocator": spec.get("allocator", "default"), "host": spec.get("host"), "env_extra": env or None,
            "ds_bf16": spec.get("ds_bf16", False), "master": spec.get("master", "fp32"),
            "activations": spec.get("activations")}, why


def _ran_ds_bf16(r: dict) -> bool:
    """Whether a row ran DeepSpeed's bf16 mode: a bf16 master and bf16 states, in host RAM or, swapped out to
    NVMe (their host tensors then empty), in swap files of at most 2+2+2 B/param (plain DeepSpeed's are 12)."""
    if r["master_dtype"] != "bfloat16" or r["fp32_optimizer_states"] is not False:
        return False
    states = r["optimizer_state_dtypes"]
    return states == ["bfloat16"] or (not states and 0 < r["ds_swap_file_B_per_param"] <= 6.5)


# DeepSpeed's bf16 mode with ZeRO-3 and offload_optimizer nvme, seen failing in 0.19.8 (its first step)
DS_BF16_NVME_FAILS = ("DeepSpeed's bf16 mode fails with ZeRO-3 offload_optimizer nvme (seen in 0.19.8, skipped up "
                      "to that version): the "
                      "swapper releases the swapped master to torch.Tensor() (fp32, empty), and its next swap-in asks "
                      "the bf16 SwapBufferManager for that dtype (AssertionError `dtype == self.dtype` in "
                      "swap_tensor/utils.py allocate); ZeRO-3 with offload_optimizer cpu runs it (--configs z3_cpu)")


def ds_bf16_unsupported(config: str) -> str:
    """Why DeepSpeed's bf16 mode cannot run in ``config`` with the installed DeepSpeed ('' when it can)."""
    if config != "z3_nvme":
        return ""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = tuple(int(x) for x in re.findall(r"\d+", version("deepspeed"))[:3])
    except PackageNotFoundError:
        return ""
    return DS_BF16_NVME_FAILS if v <= (0, 19, 8) else ""


def selected_arms(a) -> list[str]:
    """--arms, less the same-allocator arms under --no-same-allocator, plus the --without-host-cache ablations."""
    names = [n.strip() for n in a.arms.split(",") if n.strip()]
    bad = [n for n in names if n not in ARMS]
    if bad:
        raise SystemExit(f"unknown arm(s) {bad}; choose from {', '.join(ARMS)}")
    if a.no_same_allocator:
        names = [n for n in names if ARMS[n].get("allocator") != "fixed"]
    names += ["block_no_host_cache"] if a.without_host_cache else []
    names += ["block_no_host_cache_env"] if a.without_host_cache and a.host_env_arm else []
    return list(dict.fromkeys(names))


VARIANT_LABELS = {"baseline": "plain DeepSpeed", "baseline, same allocator": "DeepSpeed, the block's host settings",
                  "baseline, jemalloc": "plain DeepSpeed, jemalloc",
                  "ds bf16 mode": "DeepSpeed bf16 mode", "ds bf16 mode, same allocator":
                      "DeepSpeed bf16 mode, the block's host settings",
                  "ds bf16 mode, jemalloc": "DeepSpeed bf16 mode, jemalloc",
                  "block": "fp4offload block", "block, split master": "block, split master",
                  "block, bf16 master": "block, bf16 master", "block, host cache off": "block, host cache off",
                  "block, fp32 master gradient": "block, fp32 master gradient",
                  "block, split master, residual on NVMe": "block, split master, residual on NVMe",
                  "block, host cache off by FP4OFFLOAD_HOST_CACHE": "block, host cache off (env)"}


def plot(rows: list[dict], path: str) -> None:
    """Peak RSS and seconds per step of every run in `rows`, grouped by configuration and model size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in rows if "variant" in r and "s_per_step" in r]
    groups = sorted({(r["config"], r["params"]) for r in runs})
    variants = [v for v in VARIANT_LABELS if any(r["variant"] == v for r in runs)]
    width = 0.8 / max(1, len(variants))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, scale, label in ((axes[0], "peak_rss", 1e9, "peak host RSS while training (GB)"),
                                  (axes[1], "s_per_step", 1.0, "seconds per step (median)")):
        for j, v in enumerate(variants):
            xs, ys = [], []
            for i, g in enumerate(groups):
                r = next((r for r in runs if (r["config"], r["params"]) == g and r["variant"] == v), None)
                if r is not None:
                    xs.append(i + (j - (len(variants) - 1) / 2) * width)
                    ys.append(r[key] / scale)
            ax.bar(xs, ys, width, label=VARIANT_LABELS[v])
        names = {"z2_cpu": "ZeRO-2 cpu", "z3_nvme": "ZeRO-3 nvme", "z3_cpu": "ZeRO-3 cpu"}
        ax.set_xticks(range(len(groups)), [f"{names.get(c, c)}\n{n / 1e6:.0f}M" for c, n in groups])
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.suptitle("DeepSpeed with and without the fp4offload block (one CPU rank, same invocation per size)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)



def _ratios(config: str, block_arm: str, done: dict, a) -> dict:
    """A block arm (fp32, split or bf16 master) against every reference arm that ran in this invocation."""
    f = done[block_arm]
    b, bs = done.get("baseline"), done.get("same_allocator")

    def red(key, ref):
        return 1 - f[key] / ref[key] if ref and ref[key] else None

    ratio = {"config": config, "params": f["params"], "block_arm": block_arm,
             "step_time_ratio": f["s_per_step"] / b["s_per_step"] if b else None,
             "peak_rss_reduction": red("peak_rss", b),
             "peak_rss_reduction_same_allocator": red("peak_rss", bs),
             "peak_rss_host_side_reduction": red("peak_rss_host_side", b),
             "peak_rss_host_side_reduction_same_allocator": red("peak_rss_host_side", bs),
             "optimizer_host_reduction": red("optimizer_host_bytes", b),
             "nvme_bytes_ratio": (b["nvme_bytes_per_step"] / f["nvme_bytes_per_step"]
                                  if b and f["nvme_bytes_per_step"] else None),
             # a compact-master arm against the block with its fp32 master (today's block)
             "peak_rss_reduction_against_fp32_block": red("peak_rss", done.get("block")) if block_arm != "block"
             else None,
             # the block against every reference arm of this invocation (DeepSpeed's bf16 mode among them)
             "against": {ARMS[n]["variant"]: {
                 "step_time_ratio": f["s_per_step"] / ref["s_per_step"],
                 "peak_rss_reduction": red("peak_rss", ref),
                 "peak_rss_host_side_reduction": red("peak_rss_host_side", ref),
                 "optimizer_host_reduction": red("optimizer_host_bytes", ref),
                 "nvme_bytes_ratio": (ref["nvme_bytes_per_step"] / f["nvme_bytes_per_step"]
                                      if f["nvme_bytes_per_step"] else None)}
                 for n, ref in done.items() if ARMS[n].get("reference")}}
    if a.json:
        print(json.dumps(ratio), flush=True)
    return ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                    help=f"comma-separated arms to run, in this order (default: all but the block ablations); from: "
                         f"{', '.join(ARMS)}")
    ap.add_argument("--jemalloc", metavar="PATH",
                    help="libjemalloc.so.2 for the *_jemalloc arms (default: found by ldconfig; arms skipped when "
                         "absent)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--small-layers", type=int, default=4, help="second size for the RSS fit (0: skip the fit)")
    ap.add_argument("--no-same-allocator", action="store_true",
                    help="skip the baseline runs (plain and bf16 mode) with the block's allocator setting")
    ap.add_argument("--without-host-cache", action="store_true",
                    help="also run the block with \"host\": {\"allocator_cache\": \"off\"} (what the host cache is "
                         "worth)")
    ap.add_argument("--host-env-arm", action="store_true",
                    help="with --without-host-cache: also turn the cache off by FP4OFFLOAD_HOST_CACHE=off instead of "
                         "the config (the two must measure the same)")
    ap.add_argument("--search", action="store_true", help="measure the largest z2_cpu model under --budget")
    ap.add_argument("--budget", type=parse_size, default=parse_size("20GiB"),
                    help="--search: RSS at which a try is killed and reported as exceeding (default 20GiB)")
    ap.add_argument("--min-available", type=parse_size, default=parse_size("1GiB"),
                    help="--search: also kill a try when the machine's available memory falls below this")
    ap.add_argument("--probe-layers", type=lambda t: tuple(int(x) for x in t.split(",")), default=(2, 4),
                    help="--search: the two sizes (layers) the projection is fitted on (default 2,4)")
    ap.add_argument("--search-arms", default="baseline,block",
                    help="--search: the arms searched, comma-separated names of --arms (ratios against the first), "
                         "e.g. ds_bf16_jemalloc,block_split,block_bf16")
    ap.add_argument("--baseline-allocator", choices=("default", "fixed"), default="default",
                    help="--search: run the baseline with glibc's default (plain DeepSpeed) or with the block's "
                         "allocator setting")
    ap.add_argument("--nvme-root", default=None, help="folder on the disk to test (default: the temp dir)")
    ap.add_argument("--zero3-buckets", choices=("deepspeed", "trainer"), default="deepspeed",
                    help="ZeRO-3 bucket sizes: DeepSpeed's defaults, or what transformers' Trainer fills for 'auto' "
                         "(reduce bucket hidden^2; the same in every arm)")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", help="draw peak RSS and s/step of the runs into this PNG")
    ap.add_argument("--replot", help="comma-separated --json outputs: draw them into --plot and stop")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--fp4", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ds-bf16", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--master", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--allocator", default="default", choices=("default", "fixed"), help=argparse.SUPPRESS)
    ap.add_argument("--bf16-build", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--host", help=argparse.SUPPRESS)
    ap.add_argument("--activations", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--nvme-dir", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29701, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        Path(a.out).write_text(json.dumps(child(a)))
        return
    if a.replot:
        if not a.plot:
            raise SystemExit("--replot needs --plot OUT.png")
        rows = [json.loads(line) for f in a.replot.split(",") for line in Path(f).read_text().splitlines()
                if line.startswith("{")]
        plot(rows, a.plot)
        print(f"wrote {a.plot} from {len(rows)} rows")
        return
    if a.search:
        search(a)
        return
    import psutil

    rows = []
    arms = selected_arms(a)
    jemalloc, jemalloc_why = (find_jemalloc(a.jemalloc) if any(ARMS[n].get("jemalloc") for n in arms)
                              else (None, ""))
    for config in a.configs.split(","):
        done = {}
        for name in arms:
            spec = ARMS[name]
            kw, why = arm_child_args(name, config, jemalloc, jemalloc_why)
            r = None
            if not why:
                try:
                    r = run_child(config, spec.get("fp4", False), a, **kw)
                except RuntimeError as e:  # a newer DeepSpeed that still fails as 0.19.8 does: skipped, said why
                    if not (spec.get("ds_bf16") and config == "z3_nvme" and "dtype == self.dtype" in str(e)):
                        raise
                    why, r = DS_BF16_NVME_FAILS, None
            if r is not None and not why:
                if spec.get("jemalloc") and r["allocator"] != "jemalloc":
                    why = f"LD_PRELOAD={jemalloc} did not load jemalloc into the child (not in /proc/self/maps)"
                elif spec.get("ds_bf16") and not _ran_ds_bf16(r):
                    raise RuntimeError(f"{config} {name}: DeepSpeed did not run its bf16 mode (master "
                                       f"{r['master_dtype']}, states {r['optimizer_state_dtypes']}, "
                                       f"{r['ds_swap_file_B_per_param']:.2f} B/param in swap files)")
            if why:
                skip = {"config": config, "skipped": spec["variant"], "arm": name, "why": why}
                rows.append(skip)
                print(json.dumps(skip) if a.json else f"skipped {config} {spec['variant']}: {why}", flush=True)
                continue
            r["variant"], r["arm"] = spec["variant"], name
            done[name] = r
            rows.append(r)
            if a.json:
                print(json.dumps({k: v for k, v in r.items() if k not in ("step_times",)}), flush=True)
        for block_arm in [n for n in done if ARMS[n].get("fp4")]:
            rows.append(_ratios(config, block_arm, done, a))

    fit = []
    if a.small_layers:
        small = argparse.Namespace(**{**vars(a), "layers": a.small_layers})
        ram = psutil.virtual_memory().total
        for name in [n for n in ("baseline", "ds_bf16", "ds_bf16_jemalloc", "block", "block_split", "block_bf16")
                     if n in arms]:
            big = next((r for r in rows if r.get("config") == "z2_cpu" and r.get("arm") == name), None)
            if big is None:
                continue
            spec = ARMS[name]
            s = run_child("z2_cpu", spec.get("fp4", False), small, ds_bf16=spec.get("ds_bf16", False))
            per = (big["peak_rss"] - s["peak_rss"]) / (big["params"] - s["params"])
            fixed = big["peak_rss"] - per * big["params"]
            usable = 0.9 * ram
            fit.append({"fit": "z2_cpu", "fp4": spec.get("fp4", False), "arm": name, "rss_bytes_per_param": per,
                        "fixed_bytes": fixed, "ram": ram, "largest_params_at_90pct_ram": (usable - fixed) / per})
            if a.json:
                print(json.dumps(fit[-1]), flush=True)
    if a.plot:
        plot(rows, a.plot)
    if not a.json:
        print(f"{'config':10} {'variant':31} {'params':>8} {'master/m,v':>11} {'s/step':>8} {'peak RSS':>10} "
              f"{'estimate':>15} {'host-side':>10} {'opt host':>10} {'B/param':>8} {'NVMe B/step':>12} "
              f"{'faults/step':>12}")
        for r in rows:
            if "fp4" in r:
                dt = "fp4" if r["fp4"] else "/".join(d.replace("bfloat16", "bf16").replace("float32", "fp32")
                                                     for d in (r["optimizer_state_dtypes"] or ["?"]))
                mv = f"{r['master_dtype'].replace('bfloat16', 'bf16').replace('float32', 'fp32')}/{dt}"
                print(f"{r['config']:10} {r['variant']:31} {r['params'] / 1e6:7.1f}M {mv:>11} "
                      f"{r['s_per_step']:8.2f} {r['peak_rss'] / 2**30:9.2f}G "
                      f"{r['estimate_peak_rss'] / 2**30:6.2f}G ({100 * r['estimate_error']:+4.0f}%) "
                      f"{r['peak_rss_host_side'] / 2**30:9.2f}G "
                      f"{r['optimizer_host_bytes'] / 2**30:9.2f}G "
                      f"{r['optimizer_host_B_per_param']:8.2f} {r['nvme_bytes_per_step'] / 2**20:10.1f}Mi "
                      f"{r['page_faults_per_step']:12.0f}")
            elif "skipped" in r:
                print(f"{r['config']:10} {r['skipped']:31} skipped: {r['why']}")
        for r in rows:
            if "fp4" in r:
                print(f"  {r['config']} {r['variant']}: buffers (B/param; device = in GPU memory on a GPU machine): "
                      + ", ".join(f"{k} {v['bytes'] / r['params']:.2f} [{v['side']}]" for k, v in r["buffers"].items()))

        def pct(x):
            return f"{-100 * x:+.0f}%" if x is not None else "n/a"

        for r in rows:
            if "step_time_ratio" in r:
                for ref, q in r["against"].items():
                    nv = f"{q['nvme_bytes_ratio']:.1f}x fewer" if q["nvme_bytes_ratio"] else "n/a"
                    oh = q["optimizer_host_reduction"]
                    oh = pct(oh) if oh is not None else "n/a (the reference keeps them on NVMe)"
                    print(f"{r['config']}: block vs {VARIANT_LABELS.get(ref, ref)}: step time "
                          f"x{q['step_time_ratio']:.2f}, peak RSS {pct(q['peak_rss_reduction'])}, host-side peak "
                          f"{pct(q['peak_rss_host_side_reduction'])}, optimizer host bytes {oh}, NVMe bytes/step {nv}")
        for r in fit:
            print(f"largest z2_cpu model ({VARIANT_LABELS[ARMS[r['arm']]['variant']]}): "
                  f"{r['largest_params_at_90pct_ram'] / 1e9:.2f}B params "
                  f"({r['rss_bytes_per_param']:.1f} B/param RSS + {r['fixed_bytes'] / 2**30:.2f} GiB fixed, 90% of "
                  f"{r['ram'] / 2**30:.0f} GiB)")

if __name__ == "__main__":
    main()
