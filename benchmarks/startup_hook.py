"""Interpreter start-up with and without fp4offload's start-up hook (fp4offload-auto.pth), same run.

Two throw-away virtual environments see this interpreter's site-packages as a plain path entry (so the
.pth files there are not processed) and differ in one thing: ``with`` has ``fp4offload-auto.pth``, ``without``
does not. Both get the project's own editable-install .pth when there is one, so both find fp4offload the
same way. Each command runs ``--runs`` times per arm, the arms interleaved (with, without, with, ...) so drift
in the machine's load falls on both; the table gives the median, the interquartile range and the median
difference, with a bootstrap 95% interval for it.

    python benchmarks/startup_hook.py                 # table
    python benchmarks/startup_hook.py --runs 300 --json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

PTH = "fp4offload-auto.pth"
COMMANDS = {"python -c pass": "pass", "python -c 'import torch'": "import torch"}


def make_env(root: Path, with_hook: bool) -> Path:
    """A venv at ``root`` whose site-packages reaches this interpreter's, with or without the hook's .pth."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    purelib = Path(sysconfig.get_paths()["purelib"])
    site = Path(subprocess.run([str(root / "bin" / "python"), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    (site / "_base.pth").write_text(str(purelib) + "\n")
    for p in purelib.glob("__editable__*fp4offload*"):  # the editable install's finder, in both arms
        shutil.copy(p, site / p.name)
    if with_hook:
        if not (purelib / PTH).exists():
            raise SystemExit(f"{purelib / PTH} is missing: install fp4offload with pip first")
        shutil.copy(purelib / PTH, site / PTH)
    return root / "bin" / "python"


def run_once(python: Path, code: str) -> float:
    t = time.perf_counter()
    subprocess.run([str(python), "-c", code], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def bootstrap_ci(a: list[float], b: list[float], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    diffs = sorted(statistics.median(rng.choices(a, k=len(a))) - statistics.median(rng.choices(b, k=len(b)))
                   for _ in range(n))
    return diffs[int(0.025 * n)], diffs[int(0.975 * n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=100, help="runs per arm and command (default 100)")
    ap.add_argument("--json", action="store_true", help="one JSON object per command")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fp4offload-startup-") as tmp:
        arms = {"with": make_env(Path(tmp) / "with", True), "without": make_env(Path(tmp) / "without", False)}
        probe = "import sys; print(any(getattr(f, 'fp4offload_auto', False) for f in sys.meta_path))"
        for arm, want in (("with", "True"), ("without", "False")):
            got = subprocess.run([str(arms[arm]), "-c", probe], capture_output=True, text=True, check=True).stdout
            if got.strip() != want:
                raise SystemExit(f"the {arm!r} arm's start-up hook finder: {got.strip()}, expected {want}")
        rows = []
        for label, code in COMMANDS.items():
            times = {k: [] for k in arms}
            for py in arms.values():  # warm the page cache
                run_once(py, code)
            for i in range(a.runs):
                for arm in (("with", "without") if i % 2 == 0 else ("without", "with")):
                    times[arm].append(run_once(arms[arm], code))
            med = {k: statistics.median(v) for k, v in times.items()}
            iqr = {k: statistics.quantiles(v, n=4)[2] - statistics.quantiles(v, n=4)[0] for k, v in times.items()}
            lo, hi = bootstrap_ci(times["with"], times["without"])
            rows.append({"command": label, "runs": a.runs, "median_with_ms": 1e3 * med["with"],
                         "median_without_ms": 1e3 * med["without"], "iqr_with_ms": 1e3 * iqr["with"],
                         "iqr_without_ms": 1e3 * iqr["without"], "diff_ms": 1e3 * (med["with"] - med["without"]),
                         "diff_ci95_ms": [1e3 * lo, 1e3 * hi]})
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"{'command':28s} {'with hook':>16s} {'without':>16s} {'difference (95% CI)':>28s}")
    for r in rows:
        print(f"{r['command']:28s} {r['median_with_ms']:8.1f} ms ±{r['iqr_with_ms'] / 2:4.1f} "
              f"{r['median_without_ms']:8.1f} ms ±{r['iqr_without_ms'] / 2:4.1f} "
              f"{r['diff_ms']:+8.2f} ms [{r['diff_ci95_ms'][0]:+.2f}, {r['diff_ci95_ms'][1]:+.2f}]")
    print(f"(median of {rows[0]['runs']} runs per arm, ± half the interquartile range)")


if __name__ == "__main__":
    main()
