"""CPU encode throughput, round to nearest against stochastic rounding, per CPU path and thread count, in one process.

    python -m benchmarks.codec_rounding                     # 16M fp32, each vector path this CPU has, 1 and 2 threads
    python -m benchmarks.codec_rounding --baseline HEAD~1   # and the same builds of another revision: after/before
    python -m benchmarks.codec_rounding --isas avx2 --threads 2 --dtype bf16

The codec extension of each path (FP4OFFLOAD_CPU_ISA's builds, fp4offload/_ops/cpu_isa.py) is loaded side by side,
and its kernel bindings are called as the activation offloader calls them (NVFP4 1x16 with one tensor scale, MXFP4
1x32 rceil, int2; and NVFP4 16x16 tiles), so every ratio compares builds on the same source in the same process. With
--baseline, the csrc/ of that git revision is built too (under its own module names) and its bytes are checked equal
to this tree's. Every variant runs once per round, round-robin (a shared machine drifts); the median of the rounds is
reported. GB/s counts the bytes of the source tensor.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import torch

from benchmarks.harness import cpu_name
from fp4offload._ops import cpu_isa
from fp4offload._ops.build import build

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FORMATS = ("nvfp4 1x16", "nvfp4 16x16", "mxfp4", "int2")
ROUNDINGS = ("nearest", "stochastic")


def _extension(isa: str, root: Path | None, tag: str):
    name = cpu_isa.module_name("fp4offload_cpu", isa) + tag
    return build(name, ["cpu/fp4_cpu.cpp"], extra_cflags=[*cpu_isa.flags(isa), "-fopenmp"], root=root)


def _checkout_csrc(rev: str, into: Path) -> Path:
    """csrc/ of git revision `rev` of this repository, unpacked under `into`."""
    repo = Path(__file__).resolve().parents[1]
    blob = subprocess.run(["git", "-C", str(repo), "archive", rev, "csrc"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    return into / "csrc"


def _encoder(ext, x: torch.Tensor, fmt: str, stochastic: bool):
    rows, cols = x.shape
    if fmt == "int2":
        if not hasattr(ext, "int2_encode"):
            raise SystemExit("the baseline has no int2 encoder: pass --formats without int2")
        return lambda: ext.int2_encode(x, stochastic, 1234, 5, False)
    if fmt.startswith("nvfp4"):
        tile = 16 if fmt.endswith("16x16") else 1
        return lambda: ext.nvfp4_encode(x, rows, cols, tile, 0, False, stochastic, 1234, 5, False, None)
    return lambda: ext.mx_encode(x, False, False, stochastic, 1234, 5, False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=16 * 2 ** 20, help="elements of the source (default 16M)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--isas", default=None, help="comma list of CPU paths (default: the vector paths this CPU has)")
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts (default 1,2)")
    ap.add_argument("--repeats", type=int, default=7, help="rounds (default 7)")
    ap.add_argument("--baseline", default=None, help="git revision whose csrc/ to build and time as 'before'")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"comma list of {', '.join(FORMATS)} (default all)")
    args = ap.parse_args(argv)
    formats = args.formats.split(",")
    for f in formats:
        if f not in FORMATS:
            ap.error(f"--formats: {f!r} is not one of {', '.join(FORMATS)}")
    have = cpu_isa.available()
    isas = [i for i in have if i != "scalar"] if args.isas is None else args.isas.split(",")
    for isa in isas:
        if isa not in have:
            ap.error(f"--isas: this CPU has no {isa} path (it has {', '.join(have)})")
    cols = 4096 if args.numel % 4096 == 0 else args.numel
    x = torch.randn(args.numel // cols, cols, generator=torch.Generator().manual_seed(0)).to(DTYPES[args.dtype])
    builds = {"after": {isa: _extension(isa, None, "") for isa in isas}}
    tmp = tempfile.TemporaryDirectory()
    if args.baseline:
        root = _checkout_csrc(args.baseline, Path(tmp.name))
        builds["before"] = {isa: _extension(isa, root, "_baseline") for isa in isas}
    variants = {}
    for which, exts in builds.items():
        for isa, ext in exts.items():
            ext.set_simd(True)
            for fmt in formats:
                for rounding in ROUNDINGS:
                    variants[(which, isa, fmt, rounding)] = _encoder(ext, x, fmt, rounding == "stochastic")
    notes = []
    if args.baseline:
        for (which, isa, fmt, rounding), fn in variants.items():
            if which == "before":
                same = all(torch.equal(a, b) for a, b in zip(fn(), variants[("after", isa, fmt, rounding)]()))
                if not same:
                    notes.append(f"{isa} {fmt} {rounding}: the baseline's bytes differ from this tree's")
    threads = [int(t) for t in args.threads.split(",")]
    med = {}
    for th in threads:
        torch.set_num_threads(th)
        times = {k: [] for k in variants}
        for fn in variants.values():  # warm-up
            fn()
        for _ in range(args.repeats):
            for k, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        for k, ts in times.items():
            med[(th, *k)] = statistics.median(ts)
    nbytes = x.numel() * x.element_size()
    print(f"# encode, {args.numel:,} {args.dtype} elements, torch {torch.__version__}, {cpu_name()}, "
          f"median of {args.repeats} rounds; GB/s of the source; sr/nearest = stochastic GB/s / nearest GB/s"
          + (f"; after/before against {args.baseline}" if args.baseline else ""))
    head = ["threads", "path", "format", "nearest GB/s", "stochastic GB/s", "sr/nearest"]
    if args.baseline:
        head += ["before: nearest", "before: stochastic", "before: sr/nearest", "after/before nearest",
                 "after/before stochastic"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for th in threads:
        for isa in isas:
            for fmt in formats:
                gbs = {(w, r): nbytes / med[(th, w, isa, fmt, r)] / 1e9 for w in builds for r in ROUNDINGS}
                row = [str(th), isa, fmt, f"{gbs['after', 'nearest']:.2f}", f"{gbs['after', 'stochastic']:.2f}",
                       f"{gbs['after', 'stochastic'] / gbs['after', 'nearest']:.2f}"]
                if args.baseline:
                    row += [f"{gbs['before', 'nearest']:.2f}", f"{gbs['before', 'stochastic']:.2f}",
                            f"{gbs['before', 'stochastic'] / gbs['before', 'nearest']:.2f}",
                            f"{gbs['after', 'nearest'] / gbs['before', 'nearest']:.2f}",
                            f"{gbs['after', 'stochastic'] / gbs['before', 'stochastic']:.2f}"]
                print("| " + " | ".join(row) + " |")
    for n in notes:
        print(f"note: {n}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
