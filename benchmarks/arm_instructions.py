"""Instructions per element of the host optimizer step on ARM, counted under qemu: a labelled proxy for speed.

No ARM hardware here, so the aarch64 builds cannot be timed. This counts the instructions they execute instead:
FP4AdamW's step as the build runs it (benchmarks/arm_count/fp4_step.cpp calling step_range_fast: the SIMD-layer
step of csrc/cpu/adam_simd.h on the NEON layer, in the NEON and the SVE builds; the defaults) against
DeepSpeed's cpu_adam vector loop (benchmarks/arm_count/ds_step.cpp over the installed DeepSpeed's
csrc/includes/cpu_adam.h: Step_AVX in its NEON form, Step_SVE), each cross-built with
aarch64-linux-gnu-g++ -O3 and run under qemu-aarch64-static with its translation-block log
(`-d in_asm,exec,nochain`): every executed block times its instruction count. Each program runs at n and 2n
elements, and the difference over n is the count per element, without start-up. NEON runs on a cortex-a72
model, SVE at 128-bit vectors (as on Grace).

A count is not a time: it ignores latencies, memory and the width of the core; it ranks the work each step
issues. Needs `apt-get install -y qemu-user-static g++-aarch64-linux-gnu` and DeepSpeed (for its header).

    python benchmarks/arm_instructions.py [--numel 65536] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CSRC = ROOT / "csrc"
FLAGS = ["-std=c++17", "-O3", "-static"]
OURS = ["-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-DFP4_CPU_VEC=1"]
# the declarations cpu_adam.h takes from torch; nothing of torch runs in the vector loop counted here
STUB = """#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
namespace c10 { struct Half { uint16_t x; }; struct BFloat16 { uint16_t x; }; }
namespace torch { struct Tensor; }
"""
ISAS = {"neon": (["-march=armv8-a"], ["-D__NEON__"], ["-cpu", "cortex-a72"]),
        "sve": (["-march=armv8.2-a+sve"], ["-D__SVE__"], ["-cpu", "max,sve-default-vector-length=16"])}
_EXEC = re.compile(r"^Trace \d+: 0x[0-9a-f]+ \[[0-9a-f]+/([0-9a-f]+)/")
_INSN = re.compile(r"^0x([0-9a-f]+):")


def executed(log: Path) -> int:
    """Instructions executed, from a qemu `-d in_asm,exec,nochain` log."""
    size: dict[int, int] = {}
    block = None
    total = 0
    with open(log) as f:
        for line in f:
            if line.startswith("IN:"):
                block = -1
                continue
            m = _INSN.match(line)
            if m and block is not None:
                if block == -1:
                    block = int(m.group(1), 16)
                    size[block] = 0
                size[block] += 1
                continue
            m = _EXEC.match(line)
            if m:
                block = None
                total += size.get(int(m.group(1), 16), 0)
    return total


def per_element(exe: Path, cpu: list[str], n: int, work: Path) -> float:
    counts = []
    for k in (n, 2 * n):
        log = work / f"{exe.name}-{k}.log"
        subprocess.run([shutil.which("qemu-aarch64-static"), *cpu, "-d", "in_asm,exec,nochain", "-D", str(log),
                        str(exe), str(k)], check=True, timeout=900)
        counts.append(executed(log))
        log.unlink()
    return (counts[1] - counts[0]) / n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=65536, help="elements of the smaller run (a multiple of 1024)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    cxx, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64-static")
    if not cxx or not qemu:
        sys.exit("needs the aarch64 cross compiler and qemu: apt-get install -y qemu-user-static g++-aarch64-linux-gnu")
    try:
        import deepspeed
    except ImportError:
        sys.exit("needs DeepSpeed (its csrc/includes/cpu_adam.h): pip install deepspeed")
    ds_inc = Path(deepspeed.__file__).parent / "ops" / "csrc" / "includes"
    rows = []
    with tempfile.TemporaryDirectory(prefix="fp4-arm-count-") as tmp:
        work = Path(tmp)
        (work / "torch").mkdir()
        (work / "torch" / "extension.h").write_text(STUB)
        for isa, (march, ds_def, cpu) in ISAS.items():
            ours, ds = work / f"fp4_{isa}", work / f"ds_{isa}"
            subprocess.run([cxx, *FLAGS, *OURS, *march, f"-I{CSRC}", str(HERE / "arm_count" / "fp4_step.cpp"), "-o",
                            str(ours)], check=True)
            subprocess.run([cxx, *FLAGS, *march, *ds_def, f"-I{work}", f"-I{ds_inc}",
                            str(HERE / "arm_count" / "ds_step.cpp"), "-o", str(ds)], check=True)
            f, d = per_element(ours, cpu, a.numel, work), per_element(ds, cpu, a.numel, work)
            rows.append({"isa": isa, "fp4adamw": f, "deepspeed_cpu_adam": d, "ratio": f / d,
                         "deepspeed": deepspeed.__version__})
            print(f"# {isa}: FP4AdamW {f:.1f}, DeepSpeed {d:.1f} instructions per element", file=sys.stderr)
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return
    print("| path (qemu model) | FP4AdamW defaults, instructions/element | DeepSpeed cpu_adam | FP4AdamW / DeepSpeed |")
    print("|---|---|---|---|")
    for r in rows:
        model = "cortex-a72" if r["isa"] == "neon" else "max, 128-bit SVE"
        print(f"| {r['isa']} ({model}) | {r['fp4adamw']:.1f} | {r['deepspeed_cpu_adam']:.1f} | {r['ratio']:.1f}x |")


if __name__ == "__main__":
    main()
