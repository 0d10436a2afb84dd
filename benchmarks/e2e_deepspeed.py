"""End-to-end DeepSpeed with and without the "fp4offload" block, in the same run, on this machine.

Configurations (one rank, DS_ACCELERATOR=cpu, bf16, a Llama from benchmarks.harness on Shakespeare bytes):

- ``z2_cpu``:  ZeRO-2, offload_optimizer cpu. Baseline: DeepSpeedCPUAdam. Block: FP4AdamW, states in host RAM.
- ``z3_nvme``: ZeRO-3, offload_optimizer nvme. Baseline: DeepSpeed's NVMe optimizer swapper (fp32 master, m, v
  on disk through async_io). Block: FP4AdamW's own NVMe tier (packed m, v on disk; DeepSpeed keeps the fp32
  master in host RAM, since its swapper cannot hold packed states).

Each configuration runs in its own process (so peak RSS is its own) and reports: seconds per step (median
after one warm-up step), peak host RSS while training (sampled every 5 ms; ``peak_rss_incl_init`` is
ru_maxrss, which also holds the model-construction transient), the optimizer's host bytes counted from its tensors,
and NVMe bytes per step: storage-level bytes from /proc/self/io (exact for DeepSpeed's O_DIRECT swapper)
and, for FP4AdamW's buffered tier, the bytes it asks the disk for (its counters; the page cache may
absorb some reads). Ratios are block / baseline from the same invocation.

The largest trainable model is projected from the measured peak RSS, fitted as fixed + bytes/param x N
over two model sizes, against the host RAM this machine has (not by allocating it: the machine is shared).

    python benchmarks/e2e_deepspeed.py                # table
    python benchmarks/e2e_deepspeed.py --json         # one JSON object per line
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("z2_cpu", "z3_nvme")


def ds_config(name: str, fp4: bool, nvme_dir: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}}, "steps_per_print": 10 ** 9,
           "wall_clock_breakdown": False}
    if name == "z2_cpu":
        cfg["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                    "contiguous_gradients": True, "overlap_comm": False}
        block = {"optimizer_states": {"format": "nvfp4", "device": "cpu"}}
    elif name == "z3_nvme":
        cfg["zero_optimization"] = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir,
                                                                      "pin_memory": False},
                                    "sub_group_size": 10 ** 9}
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                      "overlap_events": True}
        block = {"optimizer_states": {"format": "nvfp4", "device": "nvme", "nvme_path": nvme_dir}}
    else:
        raise SystemExit(f"unknown config {name!r}; choose from {CONFIGS}")
    if fp4:
        cfg["fp4offload"] = block
    return cfg


def _io() -> dict[str, int]:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def child(args) -> dict:
    """One configuration in this process; returns its measurements."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", LOCAL_RANK="0",
                     WORLD_SIZE="1").items():
        os.environ.setdefault(k, v)
    sys.path.insert(0, str(ROOT))
    import deepspeed
    import torch

    import fp4offload.deepspeed as fds
    from benchmarks import harness
    from fp4offload import metrics
    from fp4offload.integrations import ds_monitor

    torch.manual_seed(0)
    model = harness.small_llama(hidden=args.hidden, layers=args.layers, heads=args.heads,
                                intermediate=args.intermediate, vocab=256, max_seq=args.seq).to(torch.bfloat16)
    nparams = sum(p.numel() for p in model.parameters())
    cfg = ds_config(args.config, args.fp4, args.nvme_dir)
    t0 = time.perf_counter()
    init = fds.initialize if args.fp4 else deepspeed.initialize
    engine, _, _, _ = init(model=model, config=cfg)
    init_s = time.perf_counter() - t0
    train, _ = harness.byte_splits()
    g = torch.Generator().manual_seed(0)
    import threading

    import psutil

    proc, peak_train, stop = psutil.Process(), [0], threading.Event()

    def sample() -> None:  # RSS peak while training (ru_maxrss also holds the initialization transient)
        while not stop.is_set():
            peak_train[0] = max(peak_train[0], proc.memory_info().rss)
            stop.wait(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    times, ios, losses = [], [], []
    metrics.reset() if hasattr(metrics, "reset") else None
    for step in range(args.steps + 1):
        tokens = harness.batch(train, 1, args.seq, g)
        io0 = _io()
        snap0 = metrics.snapshot()
        t = time.perf_counter()
        loss = harness.lm_loss(engine, tokens)
        engine.backward(loss)
        engine.step()
        dt = time.perf_counter() - t
        io1 = _io()
        snap1 = metrics.snapshot()
        losses.append(float(loss.detach()))
        if step == 0:
            continue  # warm-up: first states allocated, files created
        times.append(dt)
        logical = sum(snap1.get(k, 0) - snap0.get(k, 0) for k in ("optim.nvme.bytes_written", "optim.nvme.bytes_read"))
        ios.append({"disk_read": io1["read_bytes"] - io0["read_bytes"],
                    "disk_write": io1["write_bytes"] - io0["write_bytes"], "tier_logical": logical})
    stop.set()
    sampler.join()
    mem = ds_monitor.optimizer_host_bytes(engine)
    peak_all = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    disk = statistics.median(i["disk_read"] + i["disk_write"] for i in ios)
    tier = statistics.median(i["tier_logical"] for i in ios)
    return {"config": args.config, "fp4": args.fp4, "params": nparams, "init_s": init_s,
            "s_per_step": statistics.median(times), "step_times": times, "peak_rss": peak_train[0],
            "peak_rss_incl_init": peak_all,
            "optimizer_host_bytes": mem["total"], "optimizer_host_B_per_param": mem["total"] / max(1, mem["numel"]),
            "nvme_bytes_per_step": max(disk, tier), "nvme_disk_bytes_per_step": disk,
            "nvme_tier_logical_bytes_per_step": tier, "losses": losses,
            "inner": type(engine.basic_optimizer).__name__}


def run_child(config: str, fp4: bool, a) -> dict:
    with tempfile.TemporaryDirectory(prefix="fp4ds_nvme_", dir=a.nvme_root) as nvme, \
            tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, "--child", "--config", config, "--out", out.name, "--nvme-dir", nvme,
               "--hidden", str(a.hidden), "--layers", str(a.layers), "--heads", str(a.heads),
               "--intermediate", str(a.intermediate), "--seq", str(a.seq), "--steps", str(a.steps),
               "--port", str(29700 + (hash((config, fp4)) % 200))] + (["--fp4"] if fp4 else [])
        env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
        env.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fp4offload/torch_extensions"))
        p = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=a.timeout)
        if p.returncode != 0:
            raise RuntimeError(f"{config} fp4={fp4} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
        return json.loads(Path(out.name).read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--small-layers", type=int, default=4, help="second size for the RSS fit (0: skip the fit)")
    ap.add_argument("--nvme-root", default=None, help="folder on the disk to test (default: the temp dir)")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--fp4", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--nvme-dir", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29701, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        Path(a.out).write_text(json.dumps(child(a)))
        return
    import psutil

    rows = []
    for config in a.configs.split(","):
        pair = {}
        for fp4 in (False, True):
            pair[fp4] = r = run_child(config, fp4, a)
            rows.append(r)
            if a.json:
                print(json.dumps({k: v for k, v in r.items() if k not in ("step_times",)}), flush=True)
        b, f = pair[False], pair[True]
        ratio = {"config": config, "params": b["params"],
                 "step_time_ratio": f["s_per_step"] / b["s_per_step"],
                 "peak_rss_reduction": 1 - f["peak_rss"] / b["peak_rss"],
                 "optimizer_host_reduction": (1 - f["optimizer_host_bytes"] / b["optimizer_host_bytes"]
                                              if b["optimizer_host_bytes"] else None),
                 "nvme_bytes_ratio": (b["nvme_bytes_per_step"] / f["nvme_bytes_per_step"]
                                      if f["nvme_bytes_per_step"] else None)}
        rows.append(ratio)
        if a.json:
            print(json.dumps(ratio), flush=True)
    fit = []
    if a.small_layers:
        small = argparse.Namespace(**{**vars(a), "layers": a.small_layers})
        ram = psutil.virtual_memory().total
        for fp4 in (False, True):
            s = run_child("z2_cpu", fp4, small)
            big = next(r for r in rows if r.get("config") == "z2_cpu" and r.get("fp4") is fp4 and "peak_rss" in r)
            per = (big["peak_rss"] - s["peak_rss"]) / (big["params"] - s["params"])
            fixed = big["peak_rss"] - per * big["params"]
            usable = 0.9 * ram
            fit.append({"fit": "z2_cpu", "fp4": fp4, "rss_bytes_per_param": per, "fixed_bytes": fixed,
                        "ram": ram, "largest_params_at_90pct_ram": (usable - fixed) / per})
            if a.json:
                print(json.dumps(fit[-1]), flush=True)
    if not a.json:
        print(f"{'config':10} {'block':5} {'params':>8} {'s/step':>8} {'peak RSS':>10} {'opt host':>10} "
              f"{'B/param':>8} {'NVMe B/step':>12}")
        for r in rows:
            if "fp4" in r:
                print(f"{r['config']:10} {'yes' if r['fp4'] else 'no':5} {r['params'] / 1e6:7.1f}M "
                      f"{r['s_per_step']:8.2f} {r['peak_rss'] / 2**30:9.2f}G {r['optimizer_host_bytes'] / 2**30:9.2f}G "
                      f"{r['optimizer_host_B_per_param']:8.2f} {r['nvme_bytes_per_step'] / 2**20:10.1f}Mi")
        for r in rows:
            if "step_time_ratio" in r:
                nv = f"{r['nvme_bytes_ratio']:.1f}x fewer" if r["nvme_bytes_ratio"] else "n/a"
                oh = r["optimizer_host_reduction"]
                oh = f"{-100 * oh:+.0f}%" if oh is not None else "n/a (baseline keeps them on NVMe)"
                print(f"{r['config']}: step time x{r['step_time_ratio']:.2f}, peak RSS "
                      f"{-100 * r['peak_rss_reduction']:+.0f}%, optimizer host bytes change {oh}, NVMe bytes/step {nv}")
        for r in fit:
            print(f"largest z2_cpu model (fp4={r['fp4']}): {r['largest_params_at_90pct_ram'] / 1e9:.2f}B params "
                  f"({r['rss_bytes_per_param']:.1f} B/param RSS + {r['fixed_bytes'] / 2**30:.2f} GiB fixed, 90% of "
                  f"{r['ram'] / 2**30:.0f} GiB)")


if __name__ == "__main__":
    main()
