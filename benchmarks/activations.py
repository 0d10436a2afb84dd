"""Step time and activation memory of a Llama training step with and without activation offload.

Each configuration runs the same training step (forward inside ``offload_activations``, backward,
AdamW step) on the same model and batch; configurations are interleaved step by step so that drift of
a shared machine hits all of them alike, and the median step time is compared with the baseline (no
hooks) of the same run.

Memory:
- CUDA: bytes allocated on the GPU right after the forward minus before it (what the forward keeps
  for backward, including the loss's tensors), and the peak of the whole step above the model's own.
- CPU: bytes in use by glibc's allocator (``mallinfo2``: heap and mmap, so RSS caching does not blur
  them) after the forward minus before, plus the bytes the forward put into the host slab pool (its
  slabs are allocated during warmup and reused, so malloc does not see them again); the peak is
  sampled every 2 ms by a thread (same sum). Here the host store is host memory too, so the cut
  shows the compression alone.
- The hooks' own accounting: bytes saved for backward before and after.

    python benchmarks/activations.py                      # CPU preset
    python benchmarks/activations.py --device cuda        # GPU preset (bf16, a larger Llama)
    python benchmarks/activations.py --json               # also one JSON object per configuration
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness
from fp4offload._offload import ActivationPolicy, offload_activations

PRESETS = {
    "cpu": dict(hidden=128, layers=4, heads=4, intermediate=344, batch=8, seq=256, dtype="float32"),
    "cuda": dict(hidden=2048, layers=4, heads=16, intermediate=5632, batch=4, seq=2048, dtype="bfloat16"),
}
# format-device; nvfp4 is rounded stochastically (the policy's default), nvfp4rtn to nearest
CONFIGS = ("baseline", "none-cpu", "nvfp4-cpu", "nvfp4rtn-cpu", "mxfp8-cpu", "nvfp4-same", "nvfp4-nvme")
DEFAULT_CONFIGS = {"cpu": CONFIGS, "cuda": ("baseline", "nvfp4-cpu", "nvfp4rtn-cpu", "mxfp8-cpu", "nvfp4-same")}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]


def _host_allocated():
    """Bytes glibc's malloc has handed out (heap + mmap), or None where mallinfo2 is missing."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None

    def f() -> int:
        m = libc.mallinfo2()
        return int(m.uordblks + m.hblkhd)

    return f


class Meter:
    """Bytes in use on the step's device: the CUDA allocator's, or malloc's on the host."""

    def __init__(self, device: torch.device):
        self.device = device
        self.host = _host_allocated() if device.type == "cpu" else None

    def now(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self.host() if self.host else None

    def reset_peak(self, extra=lambda: 0) -> None:
        """Start tracking the peak; on the host a thread samples malloc's bytes (+ `extra()`) every 2 ms."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self._peak, self._stop = 0, threading.Event()
        if self.host is None:
            return

        def sample():
            while not self._stop.is_set():
                self._peak = max(self._peak, self.host() + extra())
                self._stop.wait(0.002)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()

    def peak(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        if self.host is None:
            return None
        self._stop.set()
        self._thread.join()
        return max(self._peak, self.host())


def policy_for(name: str, args) -> ActivationPolicy | None:
    if name == "baseline":
        return None
    fmt, dev = name.split("-")
    rounding = "auto"
    if fmt == "nvfp4rtn":
        fmt, rounding = "nvfp4", "nearest"
    return ActivationPolicy(format=fmt, device=dev, min_numel=args.min_numel, rounding=rounding,
                            nvme_path=args.nvme_path if dev == "nvme" else None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_step(model, opt, tokens, policy, meter: Meter, device):
    """A training step; returns (seconds, bytes kept by the forward, peak above start, snapshot)."""
    gc.collect()
    sync(device)
    holder = {}

    def pool_bytes() -> int:  # host store bytes in use: host memory too on a CPU-only machine
        off = holder.get("off")
        return off.stats.live.get("host_bytes", 0) if off is not None else 0

    m0 = meter.now()
    meter.reset_peak(pool_bytes)
    t0 = time.perf_counter()
    if policy is None:
        off, loss = None, harness.lm_loss(model, tokens)
    else:
        with offload_activations(policy) as off:
            holder["off"] = off
            loss = harness.lm_loss(model, tokens)
    if device.type == "cuda":
        sync(device)  # the side stream's copies are done: what is left on the GPU is what forward keeps
    m1 = meter.now()
    if off is not None and device.type == "cpu" and m1 is not None:
        # on a CPU-only machine the host store is this same memory; its slabs were allocated in the warmup
        # steps and are reused, so add the bytes the forward put in them
        m1 += off.snapshot()["live"].get("host_bytes", 0)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sync(device)
    dt = time.perf_counter() - t0
    peak = meter.peak()
    kept = None if m0 is None or m1 is None else m1 - m0
    del loss
    return dt, kept, (None if peak is None else peak - m0), (off.snapshot() if off is not None else None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    for k in ("hidden", "layers", "heads", "intermediate", "batch", "seq"):
        ap.add_argument(f"--{k}", type=int, default=None)
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    ap.add_argument("--configs", nargs="+", default=None, choices=CONFIGS,
                    help="default: all on cpu; baseline, nvfp4-cpu, mxfp8-cpu, nvfp4-same on cuda")
    ap.add_argument("--reps", type=int, default=None, help="measured steps per configuration")
    ap.add_argument("--warmup", type=int, default=None, help="unmeasured rounds first (default 2 cpu, 1 cuda)")
    ap.add_argument("--min-numel", type=int, default=1 << 16)
    ap.add_argument("--nvme-path", default=None, help="folder for the nvme configuration (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1 on a shared host)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    for k, v in PRESETS[args.device].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.reps is None:
        args.reps = 5
    if args.warmup is None:
        args.warmup = 2 if args.device == "cpu" else 1
    if args.configs is None:
        args.configs = list(DEFAULT_CONFIGS[args.device])
    tmp = None
    if "nvfp4-nvme" in args.configs and args.nvme_path is None:
        tmp = tempfile.TemporaryDirectory(prefix="fp4offload-bench-")
        args.nvme_path = tmp.name
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    model = harness.small_llama(hidden=args.hidden, layers=args.layers, heads=args.heads,
                                intermediate=args.intermediate, max_seq=max(512, args.seq), seed=0)
    model = model.to(device=device, dtype=dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # random byte tokens: time and memory do not depend on the text, and an offline GPU machine has no corpus
    # to fetch the Shakespeare data with
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    meter = Meter(device)
    policies = {c: policy_for(c, args) for c in args.configs}

    for _ in range(args.warmup):
        for c in args.configs:
            one_step(model, opt, tokens, policies[c], meter, device)
    results = {c: {"times": [], "kept": [], "peak": [], "snap": None} for c in args.configs}
    for _ in range(args.reps):  # interleaved
        for c in args.configs:
            dt, kept, peak, snap = one_step(model, opt, tokens, policies[c], meter, device)
            r = results[c]
            r["times"].append(dt)
            r["kept"].append(kept)
            r["peak"].append(peak)
            r["snap"] = snap

    base = results.get("baseline")
    base_t = statistics.median(base["times"]) if base else None
    base_kept = statistics.median(k for k in base["kept"]) if base and None not in base["kept"] else None
    desc = (f"{args.device}: Llama hidden {args.hidden}, {args.layers} layers, batch {args.batch} x {args.seq}, "
            f"{args.dtype}, {torch.get_num_threads()} thread(s), median of {args.reps} interleaved steps")
    print(desc)
    print(f"{'config':>12} {'step ms':>9} {'overhead':>9} {'fwd keeps MiB':>14} {'cut':>6} {'peak MiB':>9} "
          f"{'hooks MiB before->after':>24} {'to host/nvme MiB':>16}")
    rows = []
    for c in args.configs:
        r = results[c]
        t = statistics.median(r["times"])
        kept = None if None in r["kept"] else statistics.median(r["kept"])
        peak = None if None in r["peak"] else statistics.median(r["peak"])
        s = r["snap"] or {}
        row = {"config": c, "step_seconds": t, "overhead": (t / base_t - 1) if base_t else None,
               "forward_kept_bytes": kept, "cut": (base_kept / kept) if base_kept and kept else None,
               "peak_bytes": peak, "saved_bytes_before": s.get("saved_bytes_before"),
               "saved_bytes_after": s.get("saved_bytes_after"), "bytes_to_host": s.get("bytes_to_host"),
               "bytes_to_nvme": s.get("bytes_to_nvme"), "pack_seconds": s.get("pack_seconds"),
               "unpack_seconds": s.get("unpack_seconds"), "rel_error_mean": s.get("rel_error_mean"),
               "overflow_tensors": s.get("overflow_tensors"), "device": args.device, "args": desc}
        rows.append(row)
        mib = lambda b: "-" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
        hooks = "-" if not s else f"{mib(s['saved_bytes_before'])} -> {mib(s['saved_bytes_after'])}"
        moved = "-" if not s else mib(s["bytes_to_host"] or s["bytes_to_nvme"])
        over = "-" if row["overhead"] is None else f"{100 * row['overhead']:+.1f}%"
        cut = "-" if row["cut"] is None else f"{row['cut']:.2f}x"
        print(f"{c:>12} {1e3 * t:>9.1f} {over:>9} {mib(kept):>14} {cut:>6} {mib(peak):>9} {hooks:>24} {moved:>16}")
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None}
        for row in rows:
            print(json.dumps({**row, **meta}))
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
