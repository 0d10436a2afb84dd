"""Evaluate every strategy on a model and a machine, keep the ones that fit, rank them fastest first,
and say what each compression risks and why the runner-ups lost."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from fp4offload._config.grids import BY_NAME as V_GRID_BY_NAME
from fp4offload._config.vocab import V_FORMAT_DEFAULT
from fp4offload._planner.hardware import Cluster
from fp4offload._planner.memory import MemoryEstimate, TrainSetup, estimate_memory
from fp4offload._planner.models import ModelSpec
from fp4offload._planner.strategies import Strategy
from fp4offload._planner.timing import StepTime, estimate_time

__all__ = ["Candidate", "Plan", "evaluate", "make_plan", "RISKS", "RISK_ORDER", "TIE_TOLERANCE"]

GiB = 1 << 30

#: Accuracy risk of each compression: (level, what it means and how to check it).
RISKS: dict[tuple[str, str], tuple[str, str]] = {
    ("optimizer_states", "nvfp4"): (
        "low", "Adam m in NVFP4 and sqrt(v) on ue2m2 (no zero code, so no blow-up of m/sqrt(v)); within 0.4% of "
               "fp32 AdamW's validation loss with the learning rate decayed to zero, and +0.0 points on a SmolLM2-135M "
               "fine-tune (benchmarks/RESULTS.md): compare the first few hundred steps' loss with an fp32-state run"),
    ("weights", "nvfp4"): (
        "high", "forward and backward compute with 4-bit weights (gradients reach the fp32 master "
                "straight-through); embeddings, head, norms and the first/last block stay bf16. A SmolLM2-135M "
                "fine-tune lost 6.7 +/- 0.4 points of test accuracy with NVFP4 gathers (3 seeds; bf16 gathers "
                "-0.6, benchmarks/RESULTS.md): "
                "keep weights bf16 for fine-tuning, and watch the loss against a bf16 run"),
    ("activations", "nvfp4"): (
        "medium", "gradients are computed from 4-bit copies of the linear layers' inputs (attention's, the norms' "
                  "and the MLP products kept at 8-16 bits by the op rule): -0.1 +/- 0.4 points on a SmolLM2-135M "
                  "fine-tune over 3 seeds, -0.21% validation loss at 10M parameters and 10,000 steps "
                  "(benchmarks/RESULTS.md); use mxfp8 if the loss drifts"),
    ("activations", "int2"): (
        "high", "experimental: the linear layers' inputs in 2 bits (stochastic, unbiased), the rest as nvfp4's op "
                "rule keeps it: -1.5 +/- 1.0 points on a SmolLM2-135M fine-tune over 3 seeds (nvfp4: -0.1), "
                "+0.49% validation loss at 10M parameters and 10,000 steps, for 6% fewer kept bytes; one step's "
                "gradient error 0.52 (median over parameters) against 0.085 (benchmarks/RESULTS.md, Two bits)"),
    ("activations", "mxfp4"): ("medium", "as nvfp4 activations, with coarser power-of-two block scales"),
    ("activations", "mxfp8"): ("low", "8-bit saved activations with a power-of-two scale per 32"),
    ("master", "split"): ("none", "the fp32 master held as the bf16 weight and a 16-bit residual: exactly the fp32 "
                                  "master, training is bit for bit the fp32-master run (ZeRO-3 too: FP4AdamW applies "
                                  "DeepSpeed's clipping factor in fp32); the residual is kept as its bits, in host RAM "
                                  "or in the NVMe state files, so where it lives changes nothing"),
    ("master", "bf16"): ("low", "the bf16 weight is the master, updated with stochastic rounding (unbiased): "
                                "benchmarks/RESULTS.md compares it with fp32 AdamW; use split where every "
                                "update must land"),
}
RISK_ORDER = {"none": 0, "low": 1, "medium": 2, "high": 3}

#: Step times within this fraction of each other count as a tie; the lower risk then ranks first.
TIE_TOLERANCE = 0.03


@dataclass(frozen=True)
class Candidate:
    """One strategy evaluated: memory, time, whether it fits (and if not, by how much it misses)."""

    strategy: Strategy
    memory: MemoryEstimate
    time: StepTime
    shortfalls: tuple[str, ...]
    risk: str
    risk_notes: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return not self.shortfalls

    @property
    def name(self) -> str:
        return self.strategy.name


@dataclass(frozen=True)
class Plan:
    """The ranked outcome: fitting candidates fastest first, then those that do not fit."""

    model: ModelSpec
    cluster: Cluster
    setup: TrainSetup
    ranked: tuple[Candidate, ...]
    rejected: tuple[Candidate, ...]
    why_lost: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def winner(self) -> Candidate | None:
        return self.ranked[0] if self.ranked else None

    @property
    def runner_ups(self) -> tuple[Candidate, ...]:
        return self.ranked[1:3]


def _risk_of(strategy: Strategy, cls: str, fmt: str) -> tuple[str, str]:
    """(level, why) of one compressed tensor class: RISKS', except states whose v is on a grid other than the
    default (plan --v-format), which are "medium" (experimental) with that grid's measured cost."""
    v_format = strategy.optimizer_states.v_format
    if cls == "optimizer_states" and v_format not in (None, V_FORMAT_DEFAULT):
        return "medium", f"v on {v_format}: {V_GRID_BY_NAME[v_format].cost}"
    return RISKS[(cls, fmt)]


def _risk(strategy: Strategy) -> tuple[str, tuple[str, ...]]:
    level, notes = "none", []
    for cls, fmt in strategy.compressions():
        lv, text = _risk_of(strategy, cls, fmt)
        notes.append(f"{cls} {fmt}: {lv} - {text}")
        if RISK_ORDER[lv] > RISK_ORDER[level]:
            level = lv
    return level, tuple(notes)


def _shortfalls(s: Strategy, mem: MemoryEstimate, c: Cluster) -> tuple[str, ...]:
    out = []
    if mem.device_total > c.gpu_memory:
        out.append(f"GPU short by {(mem.device_total - c.gpu_memory) / GiB:.1f} GiB "
                   f"(needs {mem.device_total / GiB:.1f} of {c.gpu_memory / GiB:.1f})")
    if mem.host_total > c.host_ram:
        out.append(f"host RAM short by {(mem.host_total - c.host_ram) / GiB:.0f} GiB per node "
                   f"(needs {mem.host_total / GiB:.0f} of {c.host_ram / GiB:.0f})")
    if mem.nvme_total:
        if c.nvme_free is None:
            out.append("needs an NVMe path (--nvme-path)")
        elif mem.nvme_total > c.nvme_free:
            out.append(f"NVMe short by {(mem.nvme_total - c.nvme_free) / GiB:.0f} GiB per node")
    return tuple(out)


def _master_shortfalls(s: Strategy, c: Cluster, t: TrainSetup) -> tuple[str, ...]:
    """A compact master runs on DeepSpeed's bf16 master mode: one micro-batch per step, and bf16."""
    if s.master.format == "fp32" or s.engine != "deepspeed":
        return ()
    out = []
    if t.grad_accum != 1:
        out.append(f"master {s.master.format} needs one micro-batch per step (grad_accum {t.grad_accum})")
    if not c.gpu.bf16:
        out.append(f"master {s.master.format} needs bf16 ({c.gpu.name} has none)")
    return tuple(out)


def evaluate(strategy: Strategy, model: ModelSpec, cluster: Cluster, setup: TrainSetup,
             checkpointing: bool | None = None) -> Candidate:
    """Memory and time of one strategy. Checkpointing follows the strategy ("auto": off if that
    fits, else on) unless forced with ``checkpointing``."""
    if checkpointing is not None:
        options = [checkpointing]
    elif strategy.checkpointing == "auto":
        options = [False, True]
    else:
        options = [bool(strategy.checkpointing)]
    risk, notes = _risk(strategy)
    cand = None
    for ckpt in options:
        mem = estimate_memory(strategy, model, cluster, setup, ckpt)
        cand = Candidate(strategy, mem, estimate_time(strategy, model, cluster, setup, mem),
                         _shortfalls(strategy, mem, cluster) + _master_shortfalls(strategy, cluster, setup), risk,
                         notes)
        if cand.fits:
            break
    assert cand is not None
    return cand


def risk_profile(strategy: Strategy) -> tuple[int, ...]:
    """The accuracy risks of a strategy's lossy parts, highest first: a strategy with fewer or milder lossy parts
    compares lower. An exact part (the split master) adds nothing, so split ties with the fp32 master and beats
    the bf16 master, whose overall risk level is the same."""
    levels = (RISK_ORDER[_risk_of(strategy, cls, fmt)[0]] for cls, fmt in strategy.compressions())
    return tuple(sorted((lv for lv in levels if lv > 0), reverse=True))


def _rank(fitting: list[Candidate]) -> list[Candidate]:
    def key(c):
        return risk_profile(c.strategy), c.memory.device_total, c.memory.host_total

    out = sorted(fitting, key=lambda c: (c.time.step_s, *key(c)))
    # Near-ties: the lower accuracy risk first (the exact master over the lossy one), then the smaller GPU
    # footprint, then the smaller host footprint.
    changed = True
    while changed:
        changed = False
        for i in range(len(out) - 1):
            a, b = out[i], out[i + 1]
            tied = b.time.step_s <= a.time.step_s * (1 + TIE_TOLERANCE)
            if tied and key(b) < key(a):
                out[i], out[i + 1] = b, a
                changed = True
    return out


def _why_lost(loser: Candidate, winner: Candidate) -> str:
    slower = loser.time.step_s / winner.time.step_s - 1
    bound = loser.time.bound
    share = loser.time.terms[bound]
    if slower > TIE_TOLERANCE:
        return (f"{slower:.0%} slower ({loser.time.step_s:.2f} s/step vs {winner.time.step_s:.2f}); "
                f"bound by {bound} ({share:.2f} s)")
    if RISK_ORDER[loser.risk] > RISK_ORDER[winner.risk]:
        return f"as fast within {TIE_TOLERANCE:.0%}, but a higher accuracy risk ({loser.risk} vs {winner.risk})"
    if risk_profile(loser.strategy) > risk_profile(winner.strategy):
        lossy = sorted(set(loser.strategy.compressions()) - set(winner.strategy.compressions()))
        parts = ", ".join(f"{cls} {fmt}" for cls, fmt in lossy) or "its lossy parts"
        return f"as fast within {TIE_TOLERANCE:.0%}, but lossier ({parts}) where the exact form fits"
    more = (loser.memory.device_total - winner.memory.device_total) / GiB
    if more > 0.05:
        return f"as fast within {TIE_TOLERANCE:.0%}, with {more:.1f} GiB more per GPU (less headroom)"
    more_host = (loser.memory.host_total - winner.memory.host_total) / GiB
    if more_host > 0.05:
        return f"as fast within {TIE_TOLERANCE:.0%}, with {more_host:.1f} GiB more host RAM per node"
    return (f"as fast within {TIE_TOLERANCE:.0%}; ranked by step time "
            f"({loser.time.step_s:.3f} s vs {winner.time.step_s:.3f})")


def make_plan(strategies: Iterable[Strategy], model: ModelSpec, cluster: Cluster, setup: TrainSetup,
              checkpointing: bool | None = None) -> Plan:
    """Evaluate and rank ``strategies``."""
    cands = [evaluate(s, model, cluster, setup, checkpointing) for s in strategies]
    ranked = _rank([c for c in cands if c.fits])
    rejected = sorted((c for c in cands if not c.fits), key=lambda c: c.memory.device_total)
    why = {c.name: _why_lost(c, ranked[0]) for c in ranked[1:]} if ranked else {}
    notes = list(cluster.notes)
    if not cluster.gpu.bf16:
        notes.append(f"{cluster.gpu.name} has no bf16: the emitted config uses fp16 with loss scaling")
    if not ranked:
        notes.append("nothing fits: add GPUs or nodes, shorten the sequence, lower the micro batch, or give an "
                     "NVMe path")
    return Plan(model, cluster, setup, tuple(ranked), tuple(rejected), why, tuple(notes))
