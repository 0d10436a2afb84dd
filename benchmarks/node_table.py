"""The node table: FP4AdamW's host step against DeepSpeedCPUAdam's on real GPU nodes, predicted from per-element
costs. A model, not a measurement of those nodes.

When every core of a node steps at once (each rank's optimizer on its share of the cores), one element costs a
core the larger of its compute time (ns per element on one thread, data hot in cache) and its memory time (bytes
per element over the core's share of the node's memory bandwidth). The step time of each optimizer on each node is
that cost; the ratio DeepSpeed / FP4AdamW above 1 means the block's step is faster there.

Inputs (each a flag):

- x86 compute: ``--measure`` times both steps here on the AVX-512 and AVX2 paths (DeepSpeed's op built for each),
  one thread, 256K elements (benchmarks/optimizer.py, interleaved in one process, the fastest of the rounds), and
  the bytes each moves per element; otherwise the figures given (defaults: this file's last measurement).
- ARM (Grace) compute: instructions per element counted under qemu (benchmarks/arm_instructions.py) over an assumed
  instructions per cycle and clock, since no ARM machine runs here.
- nodes: cores, memory bandwidth (vendor figures) and the step's path there (``--node NAME:CORES:GBPS:PATH`` adds
  one).

    python benchmarks/node_table.py --measure
    python benchmarks/node_table.py --avx512-ns 1.55 0.42 --node mybox:64:300:avx512
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (name, cores, memory GB/s, the step's path there): the hosts of the GPU nodes people train on, vendor figures
NODES = [("Grace (GH200 / GB200, 72 Neoverse V2)", 72, 500.0, "neon"),
         ("DGX H100 / B200 (2 x Xeon 8480C, 112 cores)", 112, 650.0, "avx512"),
         ("DGX A100 (2 x EPYC 7742, AVX2)", 128, 400.0, "avx2")]
# ns per element, one thread, 256K elements hot (the fastest of 15 interleaved rounds), measured 2026-12-05 on a
# 2-vCPU AMD EPYC (Zen 4) with another process on the second core; NEON: instructions per element counted under
# qemu (RESULTS.md, Optimizer). The defaults when --measure is not given.
NS = {"avx512": (3.03, 1.66), "avx2": (3.23, 0.79)}  # (FP4AdamW, DeepSpeedCPUAdam built for that path)
FP4_BYTES, DS_BYTES = 18.27, 28.0
FP4_ARM_INSNS, DS_ARM_INSNS = 24.9, 8.5  # NEON: the SIMD-layer step (adam_simd.h), 2026-12-05


def measure() -> dict:
    """ns per element (fastest round) of both steps on the AVX-512 and AVX2 paths, one thread, 256K elements, and
    the bytes each moves per element, here."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    arms = "deepspeed_cpu_adam,fp4adamw,deepspeed_cpu_adam@avx2,fp4adamw@avx2"
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "optimizer.py"), "--numel", "256K", "--threads",
                          "1", "--rounds", "15", "--optimizers", arms, "--nvme-numel", "0", "--json"],
                         capture_output=True, text=True, env=env, check=True).stdout
    rows = {r["optimizer"]: r for r in map(json.loads, out.strip().splitlines()) if r.get("bench") == "step"}
    ns = lambda r: 1e9 * r["min_s"] / r["numel"]  # noqa: E731
    return {"ns": {"avx512": (ns(rows["fp4adamw"]), ns(rows["deepspeed_cpu_adam"])),
                   "avx2": (ns(rows["fp4adamw@avx2"]), ns(rows["deepspeed_cpu_adam@avx2"]))},
            "fp4_bytes": rows["fp4adamw"]["bytes_per_param"], "ds_bytes": rows["deepspeed_cpu_adam"]["bytes_per_param"]}


def predict(cores: int, gbps: float, ns: float, nbytes: float) -> tuple[float, float]:
    """(compute, memory) ns per element on one core while every core steps."""
    return ns, nbytes / (gbps / cores)


def table(x: dict, ipc: float, ghz: float, nodes=NODES) -> str:
    arm_fp4, arm_ds = x["fp4_arm_insns"] / (ipc * ghz), x["ds_arm_insns"] / (ipc * ghz)
    lines = ["| host | path | cores | GB/s per core | FP4AdamW ns/element (compute, memory) | DeepSpeedCPUAdam "
             "ns/element (compute, memory) | DeepSpeed / FP4AdamW step time |", "|---|---|---|---|---|---|---|"]
    for name, cores, gbps, path in nodes:
        fp4_ns, ds_ns = (arm_fp4, arm_ds) if path == "neon" else x["ns"][path]
        fc, fm = predict(cores, gbps, fp4_ns, x["fp4_bytes"])
        dc, dm = predict(cores, gbps, ds_ns, x["ds_bytes"])
        ratio = max(dc, dm) / max(fc, fm)
        bound = lambda c, m: "compute" if c > m else "memory"  # noqa: E731
        lines.append(f"| {name} | {path} | {cores} | {gbps / cores:.1f} | {max(fc, fm):.2f} ({fc:.2f}, {fm:.2f}; "
                     f"{bound(fc, fm)}) | {max(dc, dm):.2f} ({dc:.2f}, {dm:.2f}; {bound(dc, dm)}) | {ratio:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measure", action="store_true", help="time the x86 steps here (one thread, hot)")
    ap.add_argument("--avx512-ns", type=float, nargs=2, default=NS["avx512"], metavar=("FP4", "DS"))
    ap.add_argument("--avx2-ns", type=float, nargs=2, default=NS["avx2"], metavar=("FP4", "DS"))
    ap.add_argument("--fp4-bytes", type=float, default=FP4_BYTES)
    ap.add_argument("--ds-bytes", type=float, default=DS_BYTES)
    ap.add_argument("--fp4-arm-insns", type=float, default=FP4_ARM_INSNS, help="NEON instructions per element")
    ap.add_argument("--ds-arm-insns", type=float, default=DS_ARM_INSNS)
    ap.add_argument("--arm-ipc", type=float, default=4.0, help="assumed instructions per cycle on Neoverse V2")
    ap.add_argument("--arm-ghz", type=float, default=3.1, help="assumed clock of Grace, GHz")
    ap.add_argument("--node", action="append", default=[], metavar="NAME:CORES:GBPS:PATH",
                    help="another host; PATH one of avx512, avx2, neon")
    a = ap.parse_args(argv)
    x = {"ns": {"avx512": tuple(a.avx512_ns), "avx2": tuple(a.avx2_ns)}, "fp4_bytes": a.fp4_bytes,
         "ds_bytes": a.ds_bytes,
         "fp4_arm_insns": a.fp4_arm_insns, "ds_arm_insns": a.ds_arm_insns}
    source = "given"
    if a.measure:
        x.update(measure())
        source = "measured here, one thread, 256K elements"
    nodes = list(NODES)
    for spec in a.node:
        parts = spec.split(":")
        if len(parts) != 4 or not parts[1].isdigit() or parts[3] not in ("avx512", "avx2", "neon"):
            ap.error(f"--node {spec!r}: expected NAME:CORES:GBPS:PATH, PATH one of avx512, avx2, neon")
        nodes.append((parts[0], int(parts[1]), float(parts[2]), parts[3]))
    (f5, d5), (f2, d2) = x["ns"]["avx512"], x["ns"]["avx2"]
    print(f"inputs ({source}): FP4AdamW / DeepSpeedCPUAdam ns per element AVX-512 {f5:.2f} / {d5:.2f}, AVX2 "
          f"{f2:.2f} / {d2:.2f}; bytes per element {x['fp4_bytes']:.2f} / {x['ds_bytes']:.2f}; NEON "
          f"{x['fp4_arm_insns']:.1f} / "
          f"{x['ds_arm_insns']:.1f} instructions per element at an assumed {a.arm_ipc:g} per cycle, {a.arm_ghz:g} GHz")
    print(table(x, a.arm_ipc, a.arm_ghz, nodes))


if __name__ == "__main__":
    main()
