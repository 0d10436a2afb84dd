"""The ``fp4offload plan`` and ``fp4offload bench`` subcommands.

``fp4offload.cli`` registers them with :func:`add_plan_parser` and :func:`add_bench_parser`; each
sets ``func(args) -> int`` (exit code: 0 done, 1 nothing fits / nothing to emit, 2 bad input).
``python -m fp4offload._planner.cli_plan plan ...`` runs them on their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any, Sequence

from fp4offload._config.checks import check_choice
from fp4offload._config.grids import BY_NAME as V_GRIDS_BY_NAME
from fp4offload._config.vocab import V_FORMAT_DEFAULT, V_FORMATS
from fp4offload._planner.strategies import TENSOR_CLASSES
from fp4offload.errors import ConfigError

#: the flags that take one of a few words, checked by the validator kit (so a slip reads as it does in a config)
CHOICES = {"--checkpointing": ("auto", "on", "off"), "--engine": ("deepspeed", "fsdp2"), "--format": ("table", "json"),
           "--accelerator": ("cuda", "cpu"), "--v-format": V_FORMATS,
           "--act-format": tuple(f for f in TENSOR_CLASSES["activations"] if f != "bf16")}


def _shown(flag: str) -> str:
    return "{" + ",".join(CHOICES[flag]) + "}"


def check_choices(args: argparse.Namespace) -> None:
    """ConfigError naming the flag when a word-valued flag was given a word it does not take."""
    for flag, allowed in CHOICES.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            check_choice(flag, value, allowed)

__all__ = ["add_plan_parser", "add_bench_parser", "run_plan", "run_bench_cmd", "main"]

GiB = 1 << 30
EXIT_OK, EXIT_NO_FIT, EXIT_BAD_INPUT = 0, 1, 2


# ---------------------------------------------------------------------------------------------
# Parsers


#: what `fp4offload plan` plans for when told nothing: a common model on a common GPU node (the GPU preset
#: is hardware.py's, which build_cluster falls back to)
DEFAULT_MODEL = "llama-3.1-8b"


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on an argparse subparsers object."""
    from fp4offload._planner.hardware import DEFAULT_GPU, GPU_PRESETS
    from fp4offload._planner.models import PRESETS

    p = subparsers.add_parser(
        "plan", help="choose an offload strategy for a model on a machine and write its config",
        description="Read the machine (or --readings, or --gpu PRESET), estimate memory and step time of every "
                    "strategy in the catalogue, and rank those that fit.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="model presets: " + ", ".join(PRESETS) + "\nGPU presets: " + ", ".join(GPU_PRESETS)
               + f"\nwithout a GPU here and no --gpu: a {DEFAULT_GPU} node (8 GPUs, the preset's host RAM)\n\n"
               + COLUMNS)
    p.add_argument("--model", default=None,
                   help=f"(default {DEFAULT_MODEL}) a preset, a Hugging Face config.json (or its folder), or dims "
                        "hidden=4096,layers=32,heads=32,kv_heads=8,ffn=14336,vocab=128256[,experts=8,top_k=2,...]")
    g = p.add_argument_group("machine")
    g.add_argument("--gpu", metavar="PRESET", help="plan for this GPU instead of the probed ones (default: the probed "
                   f"GPUs; on a machine without one, {DEFAULT_GPU})")
    g.add_argument("--gpus", type=int, metavar="N", help="GPUs per node, one rank each (default: probed, or the preset "
                   "node's; with --check, 1)")
    g.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes (default 1)")
    g.add_argument("--readings", metavar="FILE", help="replay saved readings instead of probing this machine")
    g.add_argument("--save-readings", metavar="FILE", help="save the readings used to FILE")
    g.add_argument("--measure", action="store_true",
                   help="also measure NVMe read/write bandwidth at --nvme-path and host<->device bandwidth")
    g.add_argument("--nvme-path", metavar="DIR", help="directory on the NVMe drive used for offload")
    g.add_argument("--nvme-gb", type=float, metavar="GiB", help="NVMe space to assume per node")
    g.add_argument("--host-ram-gb", type=float, metavar="GiB", help="host RAM per node to plan with")
    g.add_argument("--host-cores", type=int, metavar="N", help="CPU cores per node to plan with")
    g.add_argument("--mfu", type=float, help="achievable fraction of the GPU's dense bf16 peak (default 0.45)")
    t = p.add_argument_group("training step")
    t.add_argument("--micro-batch", type=int, default=1, metavar="N",
                   help="sequences per GPU per micro-step (default 1)")
    t.add_argument("--seq-len", type=int, default=4096, metavar="N", help="tokens per sequence (default 4096)")
    t.add_argument("--grad-accum", type=int, default=1, metavar="N", help="micro-steps per optimizer step (default 1)")
    t.add_argument("--checkpointing", metavar=_shown("--checkpointing"), default="auto",
                   help="activation checkpointing: auto tries without first (default auto)")
    t.add_argument("--lr", type=float, default=1e-4,
                   help="learning rate written into the emitted config (default 1e-4)")
    s = p.add_argument_group("strategies and output")
    s.add_argument("--strategy", action="append", metavar="NAME", help="only these strategies (repeatable)")
    s.add_argument("--engine", metavar=_shown("--engine"), help="only strategies of this engine")
    s.add_argument("--strategies", metavar="DIR", help="read the catalogue from DIR instead of the installed one")
    s.add_argument("--format", metavar=_shown("--format"), default="table", help="output format (default table)")
    s.add_argument("--emit", nargs=2, metavar=("KIND", "OUT"),
                   help="write the config of the best strategy of KIND: 'deepspeed OUT.json' or 'fsdp OUT.yaml'")
    s.add_argument("--check", metavar="CONFIG.json",
                   help="instead of planning: the host-RAM estimate of this DeepSpeed config for --model (the "
                        "preflight initialize runs), with and without its fp4offload block. On this machine as it "
                        "is (its free memory and cgroup, DeepSpeed's accelerator here) unless a machine flag names "
                        "the target node: --gpu PRESET, --host-ram-gb, --readings or --accelerator; then on that "
                        "node, as plan's table counts it. --gpus: ranks per node (default: 1 here, the preset's "
                        "on a named node); --nodes: nodes")
    s.add_argument("--v-format", metavar=_shown("--v-format"), default=None,
                   help=f"FP4AdamW's grid of v in every strategy with 4-bit states (default {V_FORMAT_DEFAULT}); "
                        "the plan counts its bytes and prints what it has cost in training, as measured")
    s.add_argument("--act-format", metavar=_shown("--act-format"), default=None,
                   help="the format of the saved activations in every strategy that compresses them (default: each "
                        "strategy's own, nvfp4); the plan counts their bytes and prints what the format has cost in "
                        "training, as measured")
    s.add_argument("--accelerator", metavar=_shown("--accelerator"),
                   help="with --check: the accelerator DeepSpeed runs on (default: cuda on a named GPU node; "
                        "on this machine, DeepSpeed's own choice)")
    p.set_defaults(func=run_plan)
    return p


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "bench", help="measure what the planner's time model uses and save it as readings",
        description="Probe the machine and run micro-benchmarks: CPU optimizer step rate (fp32 AdamW, and "
                    "FP4AdamW when available), NVMe read/write at --nvme-path, host<->device copies on a GPU. "
                    "Replay the file with `fp4offload plan --readings FILE`.")
    p.add_argument("--out", default="fp4offload-readings.json", metavar="FILE", help="readings file to write")
    p.add_argument("--nvme-path", metavar="DIR", help="measure NVMe bandwidth in this directory")
    p.add_argument("--seconds", type=float, default=3.0, help="time budget of each benchmark (default 3)")
    p.add_argument("--numel", type=int, default=None, help="parameters in the optimizer benchmark")
    p.add_argument("--nvme-mb", type=int, default=None, help="largest scratch file of the NVMe test, MiB")
    p.add_argument("--format", metavar=_shown("--format"), default="table", help="output format")
    p.set_defaults(func=run_bench_cmd)
    return p


# ---------------------------------------------------------------------------------------------
# plan


def _readings(args: argparse.Namespace):
    from fp4offload._planner.probe import probe
    from fp4offload._planner.readings import Readings

    if args.readings:
        if args.measure:
            raise ConfigError("--measure", True, "not with --readings", "the readings were taken elsewhere")
        return Readings.load(args.readings, "--readings")
    return probe(getattr(args, "nvme_dir", None) or args.nvme_path, measure=args.measure)


#: every number a flag takes: flag -> (int or float, lowest, highest, what it is). Floats must be finite and
#: above the lowest (exclusive), integers at least the lowest; both at most the highest. The highest are past
#: any real machine or run, so a typo is refused instead of planned for (and every product stays finite).
LIMITS: dict[str, tuple[type, float, float, str]] = {
    "--gpus": (int, 1, 1024, "GPUs per node"),
    "--nodes": (int, 1, 100_000, "nodes"),
    "--host-cores": (int, 1, 1 << 16, "CPU cores per node"),
    "--micro-batch": (int, 1, 1 << 20, "sequences per GPU per micro-step"),
    "--seq-len": (int, 1, 1 << 30, "tokens per sequence"),
    "--grad-accum": (int, 1, 1 << 20, "micro-steps per optimizer step"),
    "--host-ram-gb": (float, 0, 1e9, "GiB of host RAM per node"),
    "--nvme-gb": (float, 0, 1e12, "GiB of NVMe space per node"),
    "--mfu": (float, 0.001, 1.0, "the fraction of the GPU's dense bf16 peak a step achieves"),
    "--lr": (float, 0, 1.0, "the AdamW learning rate"),
    "--seconds": (float, 0, 3600.0, "seconds per benchmark"),
    "--numel": (int, 1024, 1 << 30, "parameters in the optimizer benchmark"),
    "--nvme-mb": (int, 1, 1 << 20, "MiB of the NVMe benchmark's scratch file"),
}


def check_number(flag: str, value: int | float | None) -> None:
    """ConfigError naming ``flag`` unless ``value`` is None or in :data:`LIMITS`."""
    if value is None:
        return
    typ, low, high, what = LIMITS[flag]
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(flag, value, f"an integer in {low:,}..{high:,} ({what})")
    elif not isinstance(value, (int, float)) or not math.isfinite(value) or not low < value <= high:
        raise ConfigError(flag, value, f"a finite number in ({low:g}, {high:g}] ({what})",
                          "NaN and Infinity are not numbers to plan with" if isinstance(value, float)
                          and not math.isfinite(value) else None)


def check_directory(flag: str, path: str | None, *, here: bool = True) -> str | None:
    """``path`` with ``~`` and environment variables expanded, once it is known to be usable as the NVMe
    directory; else ConfigError naming ``flag``.

    ``here``: the directory is on this machine (planning for it, or measuring): it must exist, be a directory
    and be on a real filesystem (not /proc, /sys, /dev). Otherwise (``--readings`` from another node) it must be
    an absolute path, and if it exists here, a directory on a real filesystem."""
    if path is None:
        return None
    if not path or "\0" in path:
        raise ConfigError(flag, path, "a directory path" + (" without NUL bytes" if path else ""))
    p = os.path.expandvars(os.path.expanduser(path))
    if not os.path.isabs(p) and not here:
        raise ConfigError(flag, path, "an absolute path", "with --readings the path is the other node's")
    exists = os.path.lexists(p)
    if not exists and here:
        raise ConfigError(flag, path, "an existing directory", "create it or point at the NVMe mount")
    if exists:
        if not os.path.isdir(p):
            raise ConfigError(flag, path, "a directory", "it is a file or a device, not a directory")
        real = os.path.realpath(p)
        for d in ("/proc", "/sys", "/dev"):
            if real == d or real.startswith(d + "/"):
                raise ConfigError(flag, path, "a directory on a disk", f"{real} is in {d}, a filesystem of the "
                                  "kernel's")
    return p


def check_plan_args(args: argparse.Namespace) -> None:
    """Every flag of ``plan`` checked before anything is read or measured (ConfigError naming the flag)."""
    from fp4offload._jsonfile import check_output

    check_choices(args)
    for flag in ("--gpus", "--nodes", "--host-cores", "--micro-batch", "--seq-len", "--grad-accum",
                 "--host-ram-gb", "--nvme-gb", "--mfu", "--lr"):
        check_number(flag, getattr(args, flag[2:].replace("-", "_"), None))
    if args.emit:
        kind, out = args.emit
        check_choice("--emit KIND", kind, ("deepspeed", "fsdp"))
        check_output(out, "--emit")
    if args.save_readings is not None:
        check_output(args.save_readings, "--save-readings")
    if args.readings is not None and args.save_readings is not None and \
            os.path.abspath(args.readings) == os.path.abspath(args.save_readings):
        raise ConfigError("--save-readings", args.save_readings, "another file than --readings")
    if args.model is not None and not args.model.strip():
        raise ConfigError("--model", args.model, "a preset, a config.json or dims")
    if getattr(args, "accelerator", None) is not None:
        raise ConfigError("--accelerator", args.accelerator, "only with --check",
                          "plan's table is for GPU nodes; --check takes the accelerator a config runs on")
    args.nvme_dir = check_directory("--nvme-path", args.nvme_path, here=args.readings is None)


def build_plan(args: argparse.Namespace):
    """Everything ``plan`` computes, from parsed arguments: (plan, readings, catalogue)."""
    from fp4offload._planner.hardware import build_cluster
    from fp4offload._planner.memory import TrainSetup
    from fp4offload._planner.models import resolve_model
    from fp4offload._planner.rank import make_plan
    from fp4offload._planner.strategies import load_catalogue, select

    check_plan_args(args)
    model = resolve_model(args.model or DEFAULT_MODEL)
    readings = _readings(args)
    if args.save_readings is not None:
        readings.save(args.save_readings, "--save-readings")
    cluster = build_cluster(readings=readings, gpu=args.gpu, gpus=args.gpus, nodes=args.nodes,
                            host_ram_gb=args.host_ram_gb, host_cores=args.host_cores, nvme_path=args.nvme_dir,
                            nvme_gb=args.nvme_gb, mfu=args.mfu)
    setup = TrainSetup(micro_batch=args.micro_batch, seq_len=args.seq_len, grad_accum=args.grad_accum)
    catalogue = load_catalogue(args.strategies)
    strategies = select(catalogue, args.strategy, args.engine)
    if not strategies:
        raise ConfigError("--engine", args.engine, "an engine with strategies among those selected")
    v_format = getattr(args, "v_format", None)
    if v_format not in (None, V_FORMAT_DEFAULT):  # FP4AdamW's v on another grid: every strategy with 4-bit states
        strategies = [dataclasses.replace(s, optimizer_states=dataclasses.replace(s.optimizer_states,
                                                                                  v_format=v_format))
                      if s.optimizer_states.format != "fp32" else s for s in strategies]
    act_format = getattr(args, "act_format", None)
    if act_format is not None:  # every strategy that compresses saved activations stores them so
        strategies = [dataclasses.replace(s, activations=dataclasses.replace(s.activations, format=act_format))
                      if s.activations.format != "bf16" else s for s in strategies]
    ckpt = {"auto": None, "on": True, "off": False}[args.checkpointing]
    plan = make_plan(strategies, model, cluster, setup, ckpt)
    if not args.model:
        plan = dataclasses.replace(plan, notes=(f"no --model given: planning for {DEFAULT_MODEL} (name yours with "
                                                "--model PRESET, a config.json or dims)", *plan.notes))
    if v_format not in (None, V_FORMAT_DEFAULT):
        cost = V_GRIDS_BY_NAME[v_format].cost
        plan = dataclasses.replace(plan, notes=(f"--v-format {v_format}: {cost}", *plan.notes))
    if act_format is not None:
        from fp4offload._planner.rank import RISKS

        level, cost = RISKS[("activations", act_format)]
        plan = dataclasses.replace(plan, notes=(f"--act-format {act_format} ({level} risk): {cost}", *plan.notes))
    return plan, readings


def _gib(n: int) -> str:
    return f"{n / GiB:.1f}"


def packs(strategy) -> str:
    """What a strategy stores in a compressed format, from its placements: ``states`` (Adam's m and v),
    ``weights`` (the all-gathered or offloaded weights), ``acts`` (saved activations), and the master form when it
    is not fp32 (``split``, ``bf16 master``); ``-`` when nothing is."""
    out = []
    if strategy.optimizer_states.format != "fp32":
        out.append("states")
    if strategy.weights.format not in ("bf16", "fp32", "fp16"):
        out.append("weights")
    if strategy.activations.format not in ("bf16", "fp32", "fp16", "none"):
        out.append("acts")
    if strategy.master.format == "split":
        out.append("split")
    elif strategy.master.format == "bf16":
        out.append("bf16 master")
    return "+".join(out) or "-"


#: what the table's columns mean (printed under it, and in plan --help)
COLUMNS = """columns: ckpt = activation checkpointing the plan assumes; GPU GiB = peak per GPU; host and NVMe GiB = per
node; bound = what sets the step time (compute, collectives, pcie, nvme, cpu_optimizer); packs = what fp4offload
stores in 4 bits (states: Adam's m and v; weights: all-gathered or offloaded weights; acts: saved activations;
split / bf16 master: the master form); risk = accuracy risk of those compressions (none, low, medium, high: the
notes under the winner say why)"""


def format_table(plan) -> str:
    """The human-readable plan."""
    c, t = plan.cluster, plan.setup
    lines = [f"model:   {plan.model.describe()}", f"machine: {c.describe()}",
             f"sources: host RAM from {c.host_ram_source or 'unknown'}; GPU memory from "
             f"{c.gpu_memory_source or 'unknown'}",
             f"step:    micro batch {t.micro_batch} x seq {t.seq_len} x accum {t.grad_accum} on {c.world} GPU(s) "
             f"= {t.tokens * t.grad_accum * c.world:,} tokens"]
    lines += [f"note:    {n}" for n in plan.notes]
    lines.append("estimate: memory, step times and tokens/s come from a model (vendor peaks x MFU "
                 f"{c.mfu:.2f}, presets where nothing was read); `fp4offload bench` measures this machine and "
                 "`--readings` plans with the measurements")
    w = max([26] + [len(c.name) for c in (*plan.ranked, *plan.rejected)])  # the strategy column fits every name
    head = f"{'#':>2}  {'strategy':{w}s} {'ckpt':4s} {'GPU GiB':>8s} {'host GiB/node':>13s} {'NVMe GiB/node':>13s} " \
           f"{'s/step':>8s} {'tokens/s':>10s}  {'bound':14s} {'packs':19s} risk"
    lines += ["", head, "-" * len(head)]
    for i, cand in enumerate(plan.ranked, 1):
        m, tm = cand.memory, cand.time
        nv = f"{m.nvme_total / GiB:.0f}" if m.nvme_total else "-"
        lines.append(f"{i:>2}  {cand.name:{w}s} {'on' if m.checkpointing else 'off':4s} {_gib(m.device_total):>8s} "
                     f"{_gib(m.host_total):>13s} {nv:>13s} {tm.step_s:8.2f} {tm.tokens_per_s:10,.0f}  "
                     f"{tm.bound:14s} {packs(cand.strategy):19s} {cand.risk}")
    if plan.rejected:
        lines += ["", "does not fit:"]
        for cand in plan.rejected:
            lines.append(f"    {cand.name:{w}s} {'; '.join(cand.shortfalls)}")
    lines += ["", COLUMNS]
    w = plan.winner
    if w is None:
        lines += ["", "no strategy fits this model on this machine."]
        return "\n".join(lines)
    lines += ["", f"winner: {w.name} - {w.strategy.title}", f"    {w.strategy.summary}",
              f"    GPU peak {_gib(w.memory.device_total)} GiB at the {w.memory.peak_phase} phase: "
              + ", ".join(f"{k} {_gib(v)}" for k, v in w.memory.device.items()),
              f"    step {w.time.step_s:.2f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in w.time.terms.items() if v)]
    if w.memory.checkpointing:
        lines.append("    turn activation checkpointing on in the model (HF: model.gradient_checkpointing_enable())")
    for i, r in enumerate(plan.runner_ups, 2):
        lines.append(f"runner-up {i}: {r.name} - {plan.why_lost[r.name]}")
    risks = {n for cand in (w, *plan.runner_ups) for n in cand.risk_notes}
    if risks:
        lines += ["", "accuracy risk of the compressions above:"] + [f"    {n}" for n in sorted(risks)]
    return "\n".join(lines)


def next_step(plan, emitted: tuple[str, str] | None) -> str:
    """The closing "next:" line: how to write the winner's config, or how to launch with the one written."""
    w, gpus = plan.winner, plan.cluster.gpus_per_node
    deepspeed = w.strategy.engine == "deepspeed"
    if emitted is None:
        kind, out = ("deepspeed", "ds_config.json") if deepspeed else ("fsdp", "fsdp_fp4.yaml")
        return f"next: rerun with --emit {kind} {out} to write {w.name}'s config, then launch with it"
    out = emitted[1]
    if deepspeed:
        return f"next: deepspeed --num_gpus {gpus} train.py --deepspeed {out}   (train.py: your DeepSpeed script)"
    return (f"next: torchrun --nproc_per_node {gpus} train.py, where train.py applies {out}: "
            f"fp4offload.fsdp.apply(model, fp4offload.fsdp.policy_from_yaml('{out}'))")


def plan_to_json(plan) -> dict[str, Any]:
    """The plan as a JSON-ready dict."""
    c, t = plan.cluster, plan.setup

    def cand(x) -> dict[str, Any]:
        return {"name": x.name, "title": x.strategy.title, "engine": x.strategy.engine,
                "zero_stage": x.strategy.zero_stage, "fits": x.fits, "shortfalls": list(x.shortfalls),
                "checkpointing": x.memory.checkpointing, "peak_phase": x.memory.peak_phase,
                "memory": {"device_bytes": x.memory.device_total, "device": x.memory.device,
                           "host_bytes_per_node": x.memory.host_total, "host": x.memory.host,
                           "nvme_bytes_per_node": x.memory.nvme_total, "nvme": x.memory.nvme},
                "time": {"step_s": x.time.step_s, "tokens_per_s": x.time.tokens_per_s, "bound": x.time.bound,
                         "terms_s": x.time.terms},
                "risk": x.risk, "risk_notes": list(x.risk_notes), "why_lost": plan.why_lost.get(x.name),
                "packs": packs(x.strategy)}

    return {
        "model": {"name": plan.model.name, "params": plan.model.param_count(),
                  "active_params": plan.model.active_param_count()},
        "machine": {"gpu": c.gpu.key, "gpu_name": c.gpu.name, "gpu_memory_bytes": c.gpu_memory,
                    "gpus_per_node": c.gpus_per_node, "nodes": c.nodes, "host_ram_bytes": c.host_ram,
                    "host_cores": c.host_cores, "nvme_path": c.nvme_path, "nvme_free_bytes": c.nvme_free,
                    "h2d_bps": c.h2d_bps, "cpu_adam_params_per_s": dict(c.cpu_adam), "source": c.source,
                    "host_ram_source": c.host_ram_source, "gpu_memory_source": c.gpu_memory_source},
        "setup": {"micro_batch": t.micro_batch, "seq_len": t.seq_len, "grad_accum": t.grad_accum},
        "winner": plan.winner.name if plan.winner else None,
        "runner_ups": [r.name for r in plan.runner_ups],
        "ranked": [cand(x) for x in plan.ranked],
        "rejected": [cand(x) for x in plan.rejected],
        "notes": list(plan.notes),
    }


def _emit(plan, args: argparse.Namespace) -> str:
    from fp4offload._planner.emit import OptimizerSettings, deepspeed_config, fsdp_policy, write_deepspeed, write_fsdp

    kind, out = args.emit
    engine = "deepspeed" if kind == "deepspeed" else "fsdp2"
    pick = next((x for x in plan.ranked if x.strategy.engine == engine), None)
    if pick is None:
        return ""
    if kind == "deepspeed":
        cfg = deepspeed_config(pick.strategy, plan.model, plan.cluster, plan.setup, OptimizerSettings(lr=args.lr),
                               nvme_path=args.nvme_path)
        write_deepspeed(out, cfg)
    else:
        policy = fsdp_policy(pick.strategy, plan.model, nvme_path=args.nvme_path or plan.cluster.nvme_path)
        write_fsdp(out, policy, header=f"fp4offload plan: {pick.name} for {plan.model.name} "
                                       f"on {plan.cluster.world} x {plan.cluster.gpu.key}")
    return pick.name


#: What `plan --check` estimates with in place of the Hugging Face Trainer's "auto" values (the Trainer fills them
#: from its TrainingArguments before DeepSpeed, and the block, see the config): FP4AdamW's defaults, one
#: micro-batch of one sample, bf16 on. None of them moves the host-RAM estimate except the batch sizes, through
#: the activations.
def run_plan(args: argparse.Namespace) -> int:
    """``fp4offload plan``."""
    if getattr(args, "check", None):
        from fp4offload._planner.check import run_check

        return run_check(args)
    try:
        plan, _ = build_plan(args)
        emitted = _emit(plan, args) if args.emit else None
    except ConfigError as exc:
        print(f"fp4offload plan: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.format == "json":
        doc = plan_to_json(plan)
        if args.emit:
            doc["emitted"] = {"kind": args.emit[0], "path": args.emit[1], "strategy": emitted or None}
        print(json.dumps(doc, indent=2))
    else:
        print(format_table(plan))
        if args.emit and emitted:
            print(f"\nwrote {args.emit[0]} config for {emitted} to {args.emit[1]}")
        if plan.winner is not None:
            print("\n" + next_step(plan, args.emit if emitted else None))
    if args.emit and not emitted:
        engine = "deepspeed" if args.emit[0] == "deepspeed" else "fsdp2"
        print(f"fp4offload plan: no {engine} strategy fits, nothing written to {args.emit[1]}", file=sys.stderr)
        return EXIT_NO_FIT
    return EXIT_OK if plan.winner else EXIT_NO_FIT


# ---------------------------------------------------------------------------------------------
# bench


def run_bench_cmd(args: argparse.Namespace) -> int:
    """``fp4offload bench``."""
    from fp4offload._planner.bench import DEFAULT_BENCH_NUMEL, run_bench
    from fp4offload._planner.probe import probe

    from fp4offload._jsonfile import check_output

    try:
        check_choices(args)
        for flag in ("--seconds", "--numel", "--nvme-mb"):
            check_number(flag, getattr(args, flag[2:].replace("-", "_")))
        if args.nvme_mb is not None and args.nvme_path is None:
            raise ConfigError("--nvme-mb", args.nvme_mb, "with --nvme-path", "without it no NVMe test runs")
        check_output(args.out, "--out")  # before the benchmarks run, not after
        nvme = check_directory("--nvme-path", args.nvme_path)
        if nvme is not None and not os.access(nvme, os.W_OK | os.X_OK):
            raise ConfigError("--nvme-path", args.nvme_path, "a directory this user can write",
                              "the NVMe test writes a scratch file there")
        base = probe(nvme, measure=False)
        readings = run_bench(nvme, numel=args.numel or DEFAULT_BENCH_NUMEL, max_seconds=args.seconds,
                             nvme_max_bytes=(args.nvme_mb << 20) if args.nvme_mb else None, base=base)
        readings.save(args.out, "--out")
    except ConfigError as exc:
        print(f"fp4offload bench: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.format == "json":
        print(json.dumps(readings.to_dict(), indent=2))
        return EXIT_OK
    for fmt, rate in readings.cpu_adam.items():
        print(f"cpu optimizer step ({fmt}): {rate / 1e6:,.0f} M params/s with {readings.cpu_adam_threads} threads")
    if readings.disk and readings.disk.read_bps:
        print(f"nvme at {readings.disk.path}: read {readings.disk.read_bps / 1e9:.2f} GB/s, "
              f"write {readings.disk.write_bps / 1e9:.2f} GB/s")
    if readings.h2d_bps:
        print(f"host->device {readings.h2d_bps / 1e9:.1f} GB/s, device->host {readings.d2h_bps / 1e9:.1f} GB/s")
    for n in readings.notes:
        print(f"note: {n}")
    print(f"wrote {args.out}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Stand-alone entry: ``python -m fp4offload._planner.cli_plan {plan,bench} ...``."""
    parser = argparse.ArgumentParser(prog="fp4offload")
    sub = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    add_bench_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

