"""``fp4offload plan --check CONFIG.json``: the host-RAM estimate of a DeepSpeed config, on this machine or on a
named node, with the Hugging Face Trainer's "auto" values filled (docs/design.md, section 9)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from fp4offload.errors import ConfigError
from fp4offload._planner.cli_plan import (DEFAULT_MODEL, EXIT_BAD_INPUT, EXIT_NO_FIT, EXIT_OK, GiB, _readings,
                                         check_directory, check_number)


HF_AUTO = {("train_micro_batch_size_per_gpu",): 1, ("gradient_accumulation_steps",): 1,
           ("gradient_clipping",): 1.0, ("bf16", "enabled"): True, ("fp16", "enabled"): False,
           ("optimizer", "params", "lr"): 1e-3, ("optimizer", "params", "betas"): [0.9, 0.999],
           ("optimizer", "params", "eps"): 1e-8, ("optimizer", "params", "weight_decay"): 0.01,
           ("scheduler", "params", "warmup_min_lr"): 0.0, ("scheduler", "params", "warmup_max_lr"): 1e-3,
           ("scheduler", "params", "warmup_num_steps"): 0, ("scheduler", "params", "total_num_steps"): 1}


#: ZeRO keys the Trainer fills from the model's hidden size h (transformers' DeepSpeed integration): h*h, 0.9*h*h,
#: 10*h
HF_AUTO_HIDDEN = {("zero_optimization", "reduce_bucket_size"): lambda h: h * h,
                  ("zero_optimization", "stage3_prefetch_bucket_size"): lambda h: int(0.9 * h * h),
                  ("zero_optimization", "stage3_param_persistence_threshold"): lambda h: 10 * h}


def fill_hf_auto(cfg: dict, world: int, hidden: int = 4096) -> list[str]:
    """Replaces the Hugging Face Trainer's "auto" values in `cfg` (in place) as the Trainer fills them: HF_AUTO's
    (its TrainingArguments' defaults), the ZeRO bucket sizes from the model's `hidden` size, train_batch_size as
    micro-batch x accumulation x ranks; any other "auto" outside the block is dropped, so DeepSpeed's default
    applies. Returns what it did, as "key=value"."""
    filled = []
    for path, rule in HF_AUTO_HIDDEN.items():
        node = cfg.get(path[0])
        if isinstance(node, dict) and node.get(path[1]) == "auto":
            node[path[1]] = rule(int(hidden))
            filled.append(f"{'.'.join(path)}={node[path[1]]}")
    for path, value in HF_AUTO.items():
        node = cfg
        for k in path[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(path[-1]) == "auto":
            node[path[-1]] = value
            filled.append(f"{'.'.join(path)}={value}")
    if cfg.get("train_batch_size") == "auto":
        mb, ga = cfg.get("train_micro_batch_size_per_gpu", 1), cfg.get("gradient_accumulation_steps", 1)
        cfg["train_batch_size"] = (mb if isinstance(mb, int) else 1) * (ga if isinstance(ga, int) else 1) * world
        filled.append(f"train_batch_size={cfg['train_batch_size']}")

    def drop(node: dict, where: str) -> None:
        for k in list(node):
            if where == "" and k == "fp4offload":
                continue
            if node[k] == "auto":
                del node[k]
                filled.append(f"{where}{k}=(DeepSpeed's default)")
            elif isinstance(node[k], dict):
                drop(node[k], f"{where}{k}.")
    drop(cfg, "")
    return filled


@dataclasses.dataclass(frozen=True)
class CheckTarget:
    """The machine ``plan --check`` checks a config for: this one as it is (``here``), or a named node."""

    here: bool
    accelerator: str  # host_model's "gpu" or "cpu"
    local_ranks: int
    limits: Any  # fp4offload._machine.Limits: free = what a rank may still use here, or the node's RAM
    runtime: int  # one rank's process before initialize: measured here, TrainSetup's on a named node
    describe: str


def check_target(args: argparse.Namespace) -> CheckTarget:
    """This machine unless a machine flag (--gpu, --host-ram-gb, --readings, --accelerator) names another node; a
    named node is built as plan builds its cluster (same presets, same RAM), so the two print the same GiB."""
    from fp4offload._deepspeed import preflight as ds_preflight
    from fp4offload._planner.memory import TrainSetup

    for name in ("nodes", "gpus", "host_ram_gb"):
        check_number("--" + name.replace("_", "-"), getattr(args, name, None))
    named = [f for f, v in (("--gpu", args.gpu), ("--host-ram-gb", args.host_ram_gb), ("--readings", args.readings),
                            ("--accelerator", getattr(args, "accelerator", None))) if v is not None]
    if not named:
        acc = ds_preflight.accelerator_kind()
        lim = ds_preflight.limits()
        local = args.gpus or 1
        why = ("DeepSpeed's CPU accelerator: device buffers are host RAM" if acc == "cpu"
               else "DeepSpeed's GPU accelerator")
        return CheckTarget(True, acc, local, lim, 0,
                           f"this machine as it is ({local} rank(s), accelerator {acc}: {why}; may use "
                           f"{lim.describe()}); for a GPU node pass --gpu PRESET [--gpus N] [--host-ram-gb GiB]")
    from fp4offload._machine import Limits
    from fp4offload._planner.hardware import build_cluster

    if args.nvme_path is not None:
        args.nvme_dir = check_directory("--nvme-path", args.nvme_path, here=args.readings is None)
    cluster = build_cluster(readings=_readings(args), gpu=args.gpu, gpus=args.gpus, nodes=args.nodes or 1,
                            host_ram_gb=args.host_ram_gb, host_cores=args.host_cores,
                            nvme_path=getattr(args, "nvme_dir", None), nvme_gb=args.nvme_gb, mfu=args.mfu)
    acc = "cpu" if getattr(args, "accelerator", None) == "cpu" else "gpu"
    ram = int(cluster.host_ram)
    text = (f"{cluster.describe()} (from {', '.join(named)}); accelerator {'cuda' if acc == 'gpu' else 'cpu'}; host "
            f"RAM {ram / GiB:.0f} GiB per node ({cluster.host_ram_source}); each rank's process before initialize "
            f"{TrainSetup().host_runtime_bytes / GiB:.0f} GiB, as plan counts it")
    return CheckTarget(False, acc, cluster.gpus_per_node, Limits(available=ram, total=ram),
                       TrainSetup().host_runtime_bytes, text)


def run_check(args: argparse.Namespace) -> int:
    """``fp4offload plan --check CONFIG.json``: the preflight's estimate for ``--model``, with and without the
    block, against what this machine (and its cgroup) lets a process use. Exit 0 fits, 1 does not, 2 bad input."""
    import copy

    from fp4offload._memory import host_model
    from fp4offload._planner.models import resolve_model

    try:
        for name in ("nodes", "gpus"):
            check_number("--" + name, getattr(args, name))
        if args.emit or args.save_readings is not None:
            raise ConfigError("--emit" if args.emit else "--save-readings", args.emit or args.save_readings,
                              "not with --check", "--check writes nothing; plan without --check to write a config")
        from fp4offload._deepspeed import preflight as ds_preflight
        from fp4offload._deepspeed.config import BLOCK_KEY, prepare_config, read_config
        from fp4offload._jsonfile import read_json

        model = resolve_model(args.model or DEFAULT_MODEL)
        node = check_target(args)
        local = node.local_ranks
        world = local * (args.nodes or 1)
        raw = read_config(read_json(Path(args.check), "--check", args.check,
                                    readable="a readable DeepSpeed JSON file", valid="valid JSON",
                                    detail="line {exc.lineno} column {exc.colno}: {exc.msg}",
                                    top="a JSON object at the top level"))
        from fp4offload._deepspeed.auto import is_auto

        auto = fill_hf_auto(raw, world, model.hidden)
        choose_block = is_auto(raw.get(BLOCK_KEY))
        prepared = prepare_config(raw, world_size=world) if BLOCK_KEY in raw and not choose_block else None
        if prepared is not None and node.here:  # the folders initialize would refuse on this machine
            prepared.checked_paths(create=False)
    except ConfigError as exc:
        print(f"fp4offload plan --check: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    import psutil

    try:  # what a rank's process holds before it builds its model: Python, torch and DeepSpeed imported
        import deepspeed  # noqa: F401
    except Exception:
        pass
    runtime = psutil.Process().memory_info().rss if node.here else node.runtime
    accelerator = node.accelerator
    lim = node.limits
    params = model.param_count()
    decision = None
    if choose_block:  # what "fp4offload": {"auto": true} would pick on this machine, by the preflight's own model
        from fp4offload._deepspeed import auto as ds_auto
        from fp4offload.errors import CapacityError

        try:
            chosen, decision = ds_auto.choose(raw, (params, 0), lim=lim, rss=runtime, world=world, local_ranks=local,
                                              accelerator=accelerator)
            prepared = prepare_config(chosen, world_size=world)
        except CapacityError as exc:
            print(f"fp4offload plan --check: {exc}", file=sys.stderr)
            return EXIT_NO_FIT
        except ConfigError as exc:
            print(f"fp4offload plan --check: {exc}", file=sys.stderr)
            return EXIT_BAD_INPUT
        raw = dict(raw, **{BLOCK_KEY: chosen[BLOCK_KEY]})
    arms = []
    plain = copy.deepcopy(raw)
    plain.pop(BLOCK_KEY, None)
    arms.append(("without the block", plain, None, None))
    if prepared is not None:  # its placement says what the rewritten config no longer does (DeepSpeed's NVMe offload)
        arms.append(("with the block", prepared.ds_config, prepared.host, prepared.states))
    out, fits_all = [], True
    for label, cfg, host, states in arms:
        x = host_model.inputs_from_config(cfg, params, world=world, local_ranks=local, accelerator=accelerator,
                                          host=host, states=states, free_bytes=lim.free)
        est = host_model.estimate_host(x, runtime)
        # here: what each rank adds against what this process may still use; on a named node: the node's total
        # against its RAM, as plan's table decides
        fits = ds_preflight.fits(est, lim, 0) if node.here else est.node_total <= lim.free
        # the config as written decides: its block when it has one, else DeepSpeed alone
        if label == "with the block" or prepared is None:
            fits_all = fits_all and fits
        out.append({"arm": label, "fits": fits, "per_rank_bytes": est.per_rank, "node_bytes": est.node_total,
                    "consumers": est.consumers, "runtime_bytes": est.runtime, "nvme": est.nvme, "text":
                    ds_preflight.render(est, lim, node_ram=None if node.here else lim.free)})
    if args.format == "json":
        print(json.dumps({"config": args.check, "model": model.name, "params": params, "accelerator": accelerator,
                          "node": node.describe, "here": node.here,
                          "world": world, "local_ranks": local, "free_bytes": lim.free, "hf_auto_filled": auto,
                          "auto": None if decision is None else {
                              "choice": decision.choice.name, "block": raw[BLOCK_KEY], "line": decision.line(),
                              "tried": [{"candidate": n, "adds_bytes": b, "why": w} for n, b, w in decision.tried]},
                          "arms": [{k: v for k, v in a.items() if k != "text"} for a in out]}, indent=2))
    else:
        print(f"checking for: {node.describe}")
        print(f"host RAM of {args.check} for {model.name} ({params / 1e9:.2f}B parameters), {world} rank(s), "
              f"{local} per node, accelerator {accelerator}:")
        if decision is not None:
            print(f"fp4offload {decision.line()}\n  block: {json.dumps(raw[BLOCK_KEY])}")
        if auto:
            print("note: the Hugging Face Trainer fills the \"auto\" values; estimated with " + ", ".join(auto))
        for a in out:
            print(f"\n{a['arm']}: {'fits' if a['fits'] else 'does NOT fit'}\n{a['text']}")
    return EXIT_OK if fits_all else EXIT_NO_FIT
