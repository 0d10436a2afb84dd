"""The threads a rank's host optimizer step runs on follow affinity, the cgroup's CPU quota, the local ranks and
SLURM, never the machine's core count (fp4offload._machine.step_threads, fp4offload._optim.threads)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from fp4offload._machine import cgroup_cpu_quota, step_threads

PROBE = ("import torch, fp4offload\n"
         "torch.set_num_threads(64)  # the machine-sized default a process starts with on a big node\n"
         "fp4offload.FP4AdamW([torch.nn.Parameter(torch.zeros(8))])\n"
         "print('threads', torch.get_num_threads())\n")


def _fake_cgroup(tmp_path: Path, quota: str) -> tuple[str, str]:
    root = tmp_path / "cg"
    (root / "job").mkdir(parents=True, exist_ok=True)
    (root / "job" / "cpu.max").write_text(quota)
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job\n")
    return str(proc), str(root)


def test_local_ranks_share_the_cpus_and_slurm_and_the_switch_win():
    cpus = len(os.sched_getaffinity(0))
    assert step_threads({}).threads == cpus
    assert step_threads({"LOCAL_WORLD_SIZE": str(cpus * 2)}).threads == 1  # never 0
    two = step_threads({"LOCAL_WORLD_SIZE": "2"})
    assert two.threads == max(1, cpus // 2) and "shared by 2 local rank(s)" in two.source
    assert step_threads({"SLURM_CPUS_PER_TASK": "1"}).threads == 1
    assert step_threads({"FP4OFFLOAD_STEP_THREADS": "7"}).threads == 7


def test_a_cgroup_cpu_quota_caps_the_threads(tmp_path):
    proc, root = _fake_cgroup(tmp_path, "150000 100000\n")  # 1.5 CPUs
    assert cgroup_cpu_quota(proc, root) == (1.5, "v2:/job")
    st = step_threads({}, proc, root)
    assert st.threads == st.cpus == 1 and "cgroup v2:/job CPU quota 1.5" in st.source
    proc, root = _fake_cgroup(tmp_path, "max 100000\n")
    assert cgroup_cpu_quota(proc, root) is None


def _probe(env_extra: dict, prefix: list[str] = ()) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    env.update(env_extra)
    out = subprocess.run([*prefix, sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout + out.stderr


def test_affinity_set_by_taskset_decides_and_the_choice_is_said():
    out = _probe({}, ["taskset", "-c", "0"])
    assert "threads 1" in out and "host optimizer step on 1 thread(s) (1 CPU(s) in this process's affinity" in out


def test_a_launchers_one_thread_is_raised_to_the_ranks_share():
    cpus = len(os.sched_getaffinity(0))
    env = {"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE.replace("torch.set_num_threads(64)", "pass")],
                         capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
    assert out.returncode == 0 and f"threads {cpus}" in out.stdout, out.stderr[-2000:]


def test_too_many_threads_per_rank_is_a_warning():
    out = _probe({"FP4OFFLOAD_STEP_THREADS": "4", "LOCAL_WORLD_SIZE": "8"})
    assert "threads 4" in out and "warning: 8 local rank(s) x 4 step thread(s) exceed" in out


@pytest.mark.skipif(not Path("/sys/fs/cgroup/cpu/cgroup.procs").exists() or os.geteuid() != 0,
                    reason="needs root and the cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
def test_a_real_cpu_cgroup_quota_limits_the_step():
    cg = Path("/sys/fs/cgroup/cpu") / f"fp4offload-test-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    try:
        (cg / "cpu.cfs_period_us").write_text("100000")
        (cg / "cpu.cfs_quota_us").write_text("100000")  # one CPU
        cmd = f"echo $$ > {cg}/cgroup.procs && exec {sys.executable} -c \"$0\""
        out = subprocess.run(["sh", "-c", cmd, PROBE], capture_output=True, text=True, timeout=120,
                             env={k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "OMP_NUM_THREADS")})
        assert out.returncode == 0, out.stderr[-2000:]
        assert "threads 1" in out.stdout and "CPU quota 1" in out.stderr, out.stdout + out.stderr
    finally:
        cg.rmdir()
