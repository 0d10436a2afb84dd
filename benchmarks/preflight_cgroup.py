"""The host-memory preflight against the OOM killer: a plain DeepSpeed script in cgroup v1 memory limits.

    python benchmarks/preflight_cgroup.py --limits 2.0 2.3 --blocks fp32 split bf16 auto

Each (limit, block) runs tests/scripts/linear_deepspeed_script.py (8 x Linear(4096, 4096), ZeRO-2 with the
optimizer offloaded to the CPU, bf16; it never imports fp4offload) in a fresh memory cgroup whose limit is
``limit`` GB (10^9 bytes), and reports the outcome: ``trained``, ``refused`` (the preflight's CapacityError
before DeepSpeed allocated) or ``OOM-killed``; the cgroup's peak usage (``memory.max_usage_in_bytes``, page
cache included); the process's peak RSS from initialize on; and the preflight's estimate of it when the block
ran. A good preflight leaves no ``OOM-killed`` row with the block. Needs root and a writable cgroup v1 memory
hierarchy at /sys/fs/cgroup/memory.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "linear_deepspeed_script.py"
CG_ROOT = Path("/sys/fs/cgroup/memory")


def available() -> bool:
    return sys.platform == "linux" and (CG_ROOT / "memory.limit_in_bytes").exists() and os.access(CG_ROOT, os.W_OK)


def _read(cg: Path, name: str) -> int:
    try:
        return int((cg / name).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _oom_kills(cg: Path) -> int:
    try:
        for line in (cg / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def prebuild() -> None:
    """Build the JIT ops the script loads (DeepSpeed's CPU communication op, fp4offload's CPU kernels) outside
    the cgroup: a compiler run inside a tight limit would be what the OOM killer stops, and a build killed
    half-way leaves a lock that every later load waits on."""
    subprocess.run([sys.executable, "-c", "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; "
                    "B().load(); import fp4offload._ops.cpu as c; c.extension()"], check=True, cwd=str(ROOT),
                   env=dict(os.environ, DS_ACCELERATOR="cpu"), capture_output=True, timeout=900)


def run_in_cgroup(limit: int, args: list[str], env: dict | None = None, timeout: float = 900) -> dict:
    """Run the linear script with ``args`` in a new cgroup limited to ``limit`` bytes; its RESULT plus
    ``outcome``, ``cgroup_peak``, ``returncode``, ``stderr`` (tail). The cgroup is removed afterwards."""
    cg = CG_ROOT / f"fp4offload-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    try:
        (cg / "memory.limit_in_bytes").write_text(str(limit))
        try:
            (cg / "memory.memsw.limit_in_bytes").write_text(str(limit))  # no swap to spill into, where accounted
        except OSError:
            pass
        run_env = dict(os.environ if env is None else env)
        run_env.setdefault("DS_ACCELERATOR", "cpu")
        run_env.setdefault("OMP_NUM_THREADS", "2")
        for k in ("FP4OFFLOAD_PREFLIGHT", "FP4OFFLOAD_AUTO"):
            run_env.pop(k, None)
        cmd = f'echo $$ > {cg}/cgroup.procs && exec "{sys.executable}" "$0" "$@"'
        p = subprocess.run(["sh", "-c", cmd, str(SCRIPT), *args], capture_output=True, text=True, env=run_env,
                           timeout=timeout, cwd=str(ROOT))
        line = next((x for x in reversed(p.stdout.splitlines()) if x.startswith("RESULT ")), None)
        r = json.loads(line[7:]) if line else {}
        kills = _oom_kills(cg)
        if r.get("trained"):
            outcome = "trained"
        elif "CapacityError" in r.get("error", ""):
            outcome = "refused"
        elif kills or p.returncode in (-9, 137):
            outcome = "OOM-killed"
        else:
            outcome = f"failed (exit {p.returncode})"
        r.update(outcome=outcome, cgroup_peak=_read(cg, "memory.max_usage_in_bytes"), returncode=p.returncode,
                 oom_kills=kills, limit=limit, stderr=p.stderr[-3000:])
        return r
    finally:
        for _ in range(100):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limits", type=float, nargs="+", default=[2.0, 2.3], help="cgroup limits, GB (10^9 bytes)")
    ap.add_argument("--blocks", nargs="+", default=["fp32", "split", "bf16", "auto"])
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, nargs="+", default=[8], help="one model per value (dim x dim layers)")
    ap.add_argument("--stages", type=int, nargs="+", default=[2], choices=[1, 2, 3], help="ZeRO stages")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows here")
    a = ap.parse_args()
    if not available():
        sys.exit("needs root and a writable cgroup v1 memory hierarchy at /sys/fs/cgroup/memory")
    prebuild()
    rows = []
    print("| ZeRO | parameters | cgroup limit | block | outcome | cgroup peak | peak RSS | estimate | estimate / peak "
          "RSS | block run |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for stage, layers, gb, block in itertools.product(a.stages, a.layers, a.limits, a.blocks):
        t0 = time.time()
        r = run_in_cgroup(int(gb * 1e9), ["--dim", str(a.dim), "--layers", str(layers), "--block", block,
                                          "--steps", str(a.steps), "--stage", str(stage)])
        r["seconds"] = round(time.time() - t0, 1)
        rows.append(dict(r, block_asked=block, stage=stage))
        est = r.get("estimate_per_rank")
        ran = r.get("block")
        rss = r.get("peak_rss")
        ratio = f"{100 * (est / rss - 1):+.1f}%" if est and rss else "-"
        print(f"| {stage} | {a.dim * a.dim * layers / 1e6:.1f}M | {gb:.1f} GB | {block} | {r['outcome']} | "
              f"{r['cgroup_peak'] / 1e9:.2f} GB | {'-' if rss is None else f'{rss / 1e9:.3f} GB'} | "
              f"{'-' if est is None else f'{est / 1e9:.3f} GB'} | {ratio} | {json.dumps(ran) if ran else '-'} |",
              flush=True)
        if r["outcome"].startswith("failed"):
            print(r["stderr"][-1500:], file=sys.stderr)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
