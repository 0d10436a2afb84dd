"""Codec throughput: encode and decode of every format on every backend, against x.clone() and torchao.

    python -m benchmarks.codec                      # 16M elements, CPU: cpu extension + torch reference
    python -m benchmarks.codec --device cuda        # CUDA extension + reference on the GPU
    python -m benchmarks.codec --numel 4194304 --repeats 7 --json

Each variant (backend x format x source dtype x encode/decode) runs through the public
`fp4offload.quantize` / `dequantize` (the backend forced with FP4OFFLOAD_BACKEND), on one tensor made
once. The yardstick is `x.clone()` of the same source in the same run: it reads and writes the
source's bytes once, so "x clone" > 1 means faster than a plain copy of the tensor. torchao's NVFP4 and
MX quantizers (eager, and under torch.compile) are the peers where torchao is installed. Variants run
round-robin, one timing of each per round, because memory bandwidth drifts on a shared machine; the
median of the rounds is reported. GB/s counts the bytes of the source tensor (the decoded output for
decode), Gelem/s its elements.

The codec's speed targets are checked at the end (CPU extension, fp32 source, NVFP4 1x16):
encode >= 0.5x clone, decode >= 0.7x clone, and >= 5x the torch reference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

import fp4offload

FORMATS = [("nvfp4", "1x16"), ("nvfp4", "16x16"), ("mxfp4", "1x32"), ("mxfp8", "1x32"), ("ufp4", "1x16")]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TARGETS = (("encode", "clone", 0.5), ("decode", "clone", 0.7), ("encode", "reference", 5.0),
           ("decode", "reference", 5.0))


@dataclass
class Variant:
    """One timed thing: `fn` runs it once; `times` collects one sample per round."""

    backend: str  # cpu | cuda | reference | torchao-eager | torchao-compile | clone
    fmt: str
    block: str
    src: str  # fp32 | bf16
    op: str  # encode | decode | copy
    fn: Callable[[], object]
    repeats: int
    warm: bool = True
    times: list[float] = field(default_factory=list)

    @property
    def key(self) -> tuple:
        return (self.backend, self.fmt, self.block, self.src, self.op)

    def median(self) -> float:
        return statistics.median(self.times)


def log(msg: str) -> None:
    print(f"[codec {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _forced(backend: str, fn: Callable[[], object]) -> Callable[[], object]:
    def run():
        os.environ["FP4OFFLOAD_BACKEND"] = backend
        return fn()
    return run


def _available(backend: str, device: str) -> tuple[bool, str]:
    old = os.environ.get("FP4OFFLOAD_BACKEND")
    os.environ["FP4OFFLOAD_BACKEND"] = backend
    try:
        fp4offload.quantize(torch.ones(32, device=device))
        return True, ""
    except Exception as e:
        return False, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}"
    finally:
        if old is None:
            os.environ.pop("FP4OFFLOAD_BACKEND", None)
        else:
            os.environ["FP4OFFLOAD_BACKEND"] = old


def _sources(numel: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    cols = 4096 if numel % 4096 == 0 else numel
    x = torch.randn(numel // cols, cols, generator=g).to(device)
    return {name: x.to(dt) for name, dt in DTYPES.items()}


def _torchao_peers(srcs, repeats, modes, notes) -> list[Variant]:
    """torchao's NVFP4 (two-level, per-tensor amax included in the timing) and MX (rceil) quantizers."""
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.prototype.mx_formats.mx_tensor import MXTensor, to_mx
            from torchao.prototype.mx_formats.nvfp4_tensor import (NVFP4Tensor, nvfp4_quantize,
                                                                   per_tensor_amax_to_scale)
    except Exception as e:
        notes.append(f"torchao peers skipped: {type(e).__name__}: {e}")
        return []
    rceil = ScaleCalculationMode.RCEIL

    def nv_enc(x):
        return nvfp4_quantize(x, 16, per_tensor_amax_to_scale(x.abs().amax()))

    def mx4_enc(x):
        return to_mx(x, torch.float4_e2m1fn_x2, 32, rceil)

    def mx8_enc(x):
        return to_mx(x, torch.float8_e4m3fn, 32, rceil)

    def dequant(t, dtype):
        return t.dequantize(dtype)

    out = []
    for src, x in srcs.items():
        if x.dim() != 2 or x.shape[-1] % 32:
            notes.append("torchao peers skipped: --numel must be a multiple of 4096")
            return []
        packed = {"nvfp4": NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().amax())),
                  "mxfp4": MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32, rceil),
                  "mxfp8": MXTensor.to_mx(x, torch.float8_e4m3fn, 32, rceil)}
        for mode in modes:
            wrap = (lambda f: torch.compile(f, dynamic=False)) if mode == "compile" else (lambda f: f)
            encs = {"nvfp4": wrap(nv_enc), "mxfp4": wrap(mx4_enc), "mxfp8": wrap(mx8_enc)}
            dec = wrap(dequant)
            for fmt, block in (("nvfp4", "1x16"), ("mxfp4", "1x32"), ("mxfp8", "1x32")):
                out.append(Variant(f"torchao-{mode}", fmt, block, src, "encode",
                                   (lambda f, x: lambda: f(x))(encs[fmt], x), repeats))
                out.append(Variant(f"torchao-{mode}", fmt, block, src, "decode",
                                   (lambda f, p, dt: lambda: f(p, dt))(dec, packed[fmt], x.dtype), repeats))
    return out


def build_variants(args, notes) -> list[Variant]:
    device = args.device
    srcs = _sources(args.numel, device)
    backends = []
    for b in ([device, "reference"] if args.backends is None else args.backends.split(",")):
        ok, why = _available(b, device)
        if ok:
            backends.append(b)
        else:
            notes.append(f"backend {b} unavailable: {why}")
    variants = [Variant("clone", "-", "-", src, "copy", (lambda x: lambda: x.clone())(x), args.repeats)
                for src, x in srcs.items()]
    for fmt, block in FORMATS:
        for src, x in srcs.items():
            xs = x.abs() if fmt == "ufp4" else x
            os.environ["FP4OFFLOAD_BACKEND"] = backends[0] if backends else "reference"
            packed = fp4offload.quantize(xs, fmt, block=block)
            for b in backends:
                slow = b == "reference"
                reps = args.ref_repeats if slow else args.repeats
                enc = (lambda xs, fmt, block: lambda: fp4offload.quantize(xs, fmt, block=block))(xs, fmt, block)
                dec = (lambda p: lambda: fp4offload.dequantize(p))(packed)
                variants.append(Variant(b, fmt, block, src, "encode", _forced(b, enc), reps, warm=not slow))
                variants.append(Variant(b, fmt, block, src, "decode", _forced(b, dec), reps, warm=not slow))
    if args.torchao != "none":
        modes = ["eager", "compile"] if args.torchao == "both" else [args.torchao]
        variants += _torchao_peers(srcs, args.repeats, modes, notes)
    return variants


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(variants: list[Variant], device: str, notes: list[str]) -> list[Variant]:
    t_start = time.perf_counter()
    live = []
    for v in variants:  # warm-up: first-use costs (extension build, allocator, torch.compile) stay out
        if not v.warm:
            live.append(v)
            continue
        t0 = time.perf_counter()
        try:
            v.fn()
            _sync(device)
        except Exception as e:
            why = str(e).strip().splitlines()[0][:160] if str(e).strip() else ""
            notes.append(f"{v.backend} {v.fmt} {v.src} {v.op} skipped: {type(e).__name__}: {why}")
            continue
        dt = time.perf_counter() - t0
        if v.backend == "torchao-compile" and dt > 1.0:
            log(f"compiled torchao {v.fmt} {v.src} {v.op} in {dt:.0f} s")
        live.append(v)
    rounds = max(v.repeats for v in live)
    for r in range(rounds):
        for v in live:
            if len(v.times) >= v.repeats:
                continue
            _sync(device)
            t0 = time.perf_counter()
            v.fn()
            _sync(device)
            v.times.append(time.perf_counter() - t0)
        log(f"round {r + 1}/{rounds} done, {time.perf_counter() - t_start:.0f} s elapsed")
    return live


def summarize(live: list[Variant], numel: int) -> tuple[list[dict], list[dict]]:
    by = {v.key: v for v in live}
    clone = {v.src: v.median() for v in live if v.backend == "clone"}
    rows = []
    for v in live:
        t = v.median()
        nbytes = numel * DTYPES[v.src].itemsize
        row = {"bench": "codec", "backend": v.backend, "format": v.fmt, "block": v.block, "src": v.src, "op": v.op,
               "numel": numel, "median_s": t, "gb_per_s": nbytes / t / 1e9, "gelem_per_s": numel / t / 1e9,
               "vs_clone": clone[v.src] / t, "samples": len(v.times)}
        if v.backend not in ("clone", "reference") and not v.backend.startswith("torchao"):
            ref = by.get(("reference", v.fmt, v.block, v.src, v.op))
            row["vs_reference"] = ref.median() / t if ref else None
            for mode in ("eager", "compile"):
                peer = by.get((f"torchao-{mode}", v.fmt, v.block, v.src, v.op))
                row[f"vs_torchao_{mode}"] = peer.median() / t if peer else None
        rows.append(row)
    targets = []
    for b in ("cpu", "cuda"):
        rowmap = {(r["format"], r["block"], r["src"], r["op"]): r for r in rows if r["backend"] == b}
        for op, peer, goal in TARGETS:
            r = rowmap.get(("nvfp4", "1x16", "fp32", op))
            ratio = None if r is None else (r["vs_clone"] if peer == "clone" else r.get("vs_reference"))
            if ratio is None or b != "cpu":
                continue
            targets.append({"bench": "codec", "target": f"{b} ext nvfp4 1x16 fp32 {op} vs {peer}", "ratio": ratio,
                            "goal": goal, "pass": ratio >= goal})
        worst = [r for r in rows if r["backend"] == b and r.get("vs_reference")]
        if worst:
            w = min(worst, key=lambda r: r["vs_reference"])
            targets.append({"bench": "codec", "target": f"{b} ext vs reference, slowest variant "
                            f"({w['format']} {w['block']} {w['src']} {w['op']})", "ratio": w["vs_reference"],
                            "goal": 5.0, "pass": w["vs_reference"] >= 5.0})
    return rows, targets


def _fmt_ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def print_table(rows, targets, notes, meta) -> None:
    print(f"# codec throughput: {meta['numel']:,} elements, device {meta['device']}, {meta['threads']} threads, "
          f"torch {meta['torch']}, {meta['machine']}")
    print("# median of rounds (round-robin); GB/s of the source tensor; 'x clone' = clone time / time")
    head = ["backend", "format", "src", "op", "ms", "GB/s", "Gelem/s", "x clone", "x ref", "x torchao", "x ao-compile"]
    lines = [head]
    order = {"clone": 0, "cpu": 1, "cuda": 1, "reference": 2, "torchao-eager": 3, "torchao-compile": 4}
    for r in sorted(rows, key=lambda r: (order.get(r["backend"], 9), r["format"], r["block"], r["src"], r["op"])):
        fmt = r["format"] if r["format"] == "-" else f"{r['format']} {r['block']}"
        lines.append([r["backend"], fmt, r["src"], r["op"], f"{r['median_s'] * 1e3:.2f}", f"{r['gb_per_s']:.2f}",
                      f"{r['gelem_per_s']:.3f}", _fmt_ratio(r["vs_clone"]), _fmt_ratio(r.get("vs_reference")),
                      _fmt_ratio(r.get("vs_torchao_eager")), _fmt_ratio(r.get("vs_torchao_compile"))])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for i, line in enumerate(lines):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    print()
    for t in targets:
        print(f"target: {t['target']}: {t['ratio']:.2f}x (goal >= {t['goal']}x) {'PASS' if t['pass'] else 'short'}")
    for n in notes:
        print(f"note: {n}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=16 * 2 ** 20, help="elements of the source tensor (default 16M)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--repeats", type=int, default=5, help="rounds for the fast variants (default 5)")
    ap.add_argument("--ref-repeats", type=int, default=1,
                    help="rounds for the torch reference (default 1: it is 10-100x slower)")
    ap.add_argument("--backends", default=None, help="comma list of fp4offload backends (default: DEVICE,reference)")
    ap.add_argument("--torchao", choices=["both", "eager", "compile", "none"], default="both",
                    help="torchao peers to run when torchao is installed (default both)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per line instead of the table")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    old_backend = os.environ.get("FP4OFFLOAD_BACKEND")
    notes: list[str] = []
    meta = {"bench": "codec", "numel": args.numel, "device": args.device, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "machine": f"{platform.machine()} {os.cpu_count()} cpus",
            "date": time.strftime("%Y-%m-%d")}
    if args.device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    try:
        log(f"building variants ({args.numel:,} elements)")
        variants = build_variants(args, notes)
        log(f"{len(variants)} variants; warming up (torch.compile of torchao peers can take minutes)")
        live = measure(variants, args.device, notes)
    finally:
        if old_backend is None:
            os.environ.pop("FP4OFFLOAD_BACKEND", None)
        else:
            os.environ["FP4OFFLOAD_BACKEND"] = old_backend
    rows, targets = summarize(live, args.numel)
    if args.json:
        for obj in [meta] + rows + targets + [{"bench": "codec", "note": n} for n in notes]:
            print(json.dumps(obj))
    else:
        print_table(rows, targets, notes, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
