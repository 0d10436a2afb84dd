"""``"fp4offload": {"auto": true}`` and the preflight in a real memory cgroup, from a plain DeepSpeed script.

The script (tests/scripts/linear_deepspeed_script.py, 8 x Linear(2048, 2048): 33.6M parameters, ZeRO-2 with the
optimizer on the CPU) never imports fp4offload. Under a limit the fp32 master does not fit and the bf16 master
does, the explicit fp32 block must be refused before DeepSpeed allocates, never OOM-killed, and ``auto`` must
train with a block that fits, naming it on one line.
"""

from __future__ import annotations

import pytest

from benchmarks import preflight_cgroup as pc
from fp4offload._deepspeed.auto import SPARE_PER_RANK

pytestmark = pytest.mark.slow
ARGS = ["--dim", "2048", "--layers", "8", "--steps", "2"]


@pytest.fixture(scope="module")
def cgroups():
    if not pc.available():
        pytest.skip("needs root and a writable cgroup v1 memory hierarchy at /sys/fs/cgroup/memory")
    pc.prebuild()


def _run(limit: int, block: str) -> dict:
    return pc.run_in_cgroup(limit, ARGS + ["--block", block], timeout=600)


def test_auto_trains_where_the_fp32_master_is_refused_and_nothing_is_oom_killed(cgroups):
    roomy = 4 << 30  # the cgroup, not the machine, is what binds
    runs = {b: _run(roomy, b) for b in ("fp32", "split", "bf16")}
    assert {r["outcome"] for r in runs.values()} == {"trained"}, runs
    # the estimate is an upper bound of the peak RSS from initialize on, and at most 15% above it
    for r in runs.values():
        assert r["peak_rss"] <= r["estimate_per_rank"] <= r["peak_rss"] * 1.15, r
    fp32, split, bf16 = (runs[b] for b in ("fp32", "split", "bf16"))
    assert fp32["preflight_need"] > split["preflight_need"] > bf16["preflight_need"]
    # A limit between what the fp32 master needs and what the bf16 one needs with auto's spare, both as the
    # preflight weighs them, above what the cgroup held when it read the limit (the live readings differ from run
    # to run by some MiB: the limit keeps the widest margin on both sides).
    used = max(roomy - r["preflight_free"] for r in runs.values())
    low, high = bf16["preflight_need"] + SPARE_PER_RANK, fp32["preflight_need"]
    assert high - low > 64 << 20, (low, high)  # the window this model gives
    limit = used + (low + high) // 2
    explicit = _run(limit, "fp32")
    assert explicit["outcome"] == "refused", explicit  # refused before DeepSpeed allocated, not OOM-killed
    assert "cgroup v1:/" in explicit["error"] and "fp32 master partition" in explicit["error"]
    chosen = _run(limit, "auto")
    assert chosen["outcome"] == "trained" and chosen["inner"] == "FP4AdamW", chosen
    assert chosen["block"]["optimizer_states"].get("master") in ("split", "bf16"), chosen["block"]
    line = next(x for x in chosen["stderr"].splitlines() if "fp4offload: auto: chose" in x)
    assert "not taken: fp32 master" in line and "cgroup v1:/" in line and "MiB spare" in line
    assert chosen["cgroup_peak"] <= limit
