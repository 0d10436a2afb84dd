"""The threads a rank's host optimizer step runs on.

The CPU step (csrc/cpu/adam_cpu.cpp) splits its chunks over torch's intra-op threads. Launchers set
``OMP_NUM_THREADS=1`` for every rank, and torch otherwise takes the machine's core count, which 8 ranks on one node
then share eightfold. :func:`use_step_threads` sets torch's intra-op threads to the rank's share of the CPUs it may
use (:func:`fp4offload._machine.step_threads`: affinity, the cgroup's CPU quota, SLURM's CPUs per task, the local
ranks; ``FP4OFFLOAD_STEP_THREADS`` wins), says so once on rank 0, and warns when the ranks of the node would run
more step threads than they have CPUs. FP4AdamW calls it when its states live in host RAM or on NVMe, or its
parameters are on the CPU.
"""

from __future__ import annotations

import torch

from fp4offload._machine import StepThreads, step_threads

__all__ = ["use_step_threads"]

_done: list[StepThreads] = []


def use_step_threads() -> StepThreads:
    """Set torch's intra-op threads for the host step (once per process) and return the choice.

    The rank's share replaces torch's count when it is larger (the machine's cores, shared by every local rank)
    or when a launcher pinned it to OMP_NUM_THREADS=1; a smaller count the program set itself is kept, and
    FP4OFFLOAD_STEP_THREADS always wins."""
    if _done:
        return _done[0]
    import os

    from fp4offload._announce import announce

    share = step_threads()
    before = torch.get_num_threads()
    launcher_one = "WORLD_SIZE" in os.environ and os.environ.get("OMP_NUM_THREADS", "").strip() == "1"
    if share.source == "FP4OFFLOAD_STEP_THREADS" or before > share.threads or (before < share.threads
                                                                                 and launcher_one):
        st = share
    else:
        st = StepThreads(before, share.cpus, share.local_ranks,
                         f"torch.set_num_threads({before}) of this program; its share would be {share.threads}")
    if before != st.threads:
        torch.set_num_threads(st.threads)
        announce(f"host optimizer step on {st.describe()}; torch's intra-op threads {before} -> {st.threads} "
                 "(FP4OFFLOAD_STEP_THREADS sets it)")
    else:
        announce(f"host optimizer step on {st.describe()} (FP4OFFLOAD_STEP_THREADS sets it)")
    if st.threads * st.local_ranks > st.cpus:
        announce(f"warning: {st.local_ranks} local rank(s) x {st.threads} step thread(s) exceed the {st.cpus} "
                 "CPU(s) they may use: the steps will contend; lower FP4OFFLOAD_STEP_THREADS")
    _done.append(st)
    return st
