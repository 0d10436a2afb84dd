"""End-to-end FSDP2 benchmark: a small Llama trained with plain ``fully_shard`` and with fp4offload.fsdp policies.

Arms, run one after another in the same invocation, same model, same batches, same number of ranks:

- ``plain``: ``fully_shard`` per decoder layer and at the root, bf16 compute (MixedPrecisionPolicy),
  torch AdamW (CPUOffloadPolicy as well on a single GPU, where nothing would be gathered otherwise);
- ``fp4``: ``fp4offload.fsdp.apply`` with NVFP4 weight all-gathers (everything but the norms, or the
  policy's ``keep_bf16``) and FP4AdamW states (torch AdamW with ``--optimizer torch``, the default on CUDA);
- ``fp4+act``: the same plus activations saved for backward in NVFP4 (``ActivationPolicy``);
- ``convert``: ``fp4offload.fsdp.convert`` (NVFP4 weight all-gathers), then the user's own ``fully_shard`` as in
  ``plain`` and ``fp4offload.FP4AdamW(model.parameters())`` (torch AdamW with ``--optimizer torch``).

Per arm: median step time, peak memory (GPU: ``max_memory_allocated`` per rank; CPU: the peak RSS of the
rank process above its RSS once torch, the modules and the data are loaded, each arm in fresh processes),
bytes all-gathered per step (counted by a custom FSDP2 all-gather on every unit), bytes copied
host-to-device per step under CPU offload (counted in the NVFP4 hooks for packed weights; for plain
offload, the fp32 shards of each gather), final loss. Ratios against ``plain`` close the table.

    python benchmarks/e2e_fsdp.py                          # CPU: 2 gloo ranks, a small Llama
    python benchmarks/e2e_fsdp.py --device cuda --json     # every visible GPU (1 GPU: CPU offload, 1 rank)
    python benchmarks/e2e_fsdp.py --hidden 512 --layers 8 --steps 12
    python benchmarks/e2e_fsdp.py --host-cache             # ranks allocate through fp4offload.host_allocator
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fp4offload/torch_extensions"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

ARMS = ("plain", "fp4", "fp4+act", "convert")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _gathers_per_step(name: str, reshard: bool) -> int:
    return 2 if (".layers." in name and reshard) else 1


def _rank(rank: int, world: int, port: int, args: dict, arm: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist

    if args.get("host_cache"):  # before anything large is allocated: the rank's tensors come from the cache
        from fp4offload import host_allocator

        got = host_allocator.install()
        if not got["installed"]:
            raise SystemExit(f"--host-cache: not installed ({got['reason']})")

    cuda = args["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(args["threads"])
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        res = _train(rank, world, args, arm)
        Path(out_dir, f"{arm}.{rank}.json").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def _train(rank: int, world: int, args: dict, arm: str) -> dict:
    import fp4offload
    import fp4offload.fsdp as ff
    from benchmarks import harness
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    cuda = args["device"] == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    offload = args["cpu_offload"]
    train, _ = harness.byte_splits()
    rss0 = 0 if cuda else _rss_bytes()  # after imports and data: what the arm adds on top is its own
    model = harness.small_llama(hidden=args["hidden"], layers=args["layers"], heads=args["heads"],
                                intermediate=args["intermediate"], seed=0)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    model.to(dev)
    if arm in ("plain", "convert"):  # the user's own fully_shard (after ff.convert in "convert")
        if arm == "convert":
            model = ff.convert(model, ff.Policy(weights={"keep_bf16": args["keep_bf16"]}))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        off = CPUOffloadPolicy(pin_memory=cuda) if offload else OffloadPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp, offload_policy=off)
        fully_shard(model, mp_policy=mp, offload_policy=off)
        if arm == "convert" and args["optimizer"] != "torch":
            import fp4offload

            opt = fp4offload.FP4AdamW(model.parameters(), lr=args["lr"])
            inner = "fp4offload.FP4AdamW"
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=args["lr"])
            inner = "torch.optim.AdamW"
        counter = ff.count_all_gathers(model)
        packed_names: list[str] = [n for n, _ in ff.fp4_parameters(model)]
    else:
        acts = None
        if arm == "fp4+act":
            acts = {"format": "nvfp4", "device": "cpu" if cuda else "same", "min_numel": 4096}
        policy = ff.Policy(weights={"keep_bf16": args["keep_bf16"]}, block_classes=["LlamaDecoderLayer"],
                           cpu_offload=offload, activations=acts,
                           optimizer_states=None if args["optimizer"] == "torch" else {"min_numel": 4096})
        model = ff.apply(model, policy)
        opt = ff.optimizer(model, policy, lr=args["lr"])
        counter = model._fp4offload_all_gather
        inner = "fp4offload.FP4AdamW" if isinstance(opt, fp4offload.FP4AdamW) else "torch.optim.AdamW"
        packed_names = [n for n, _ in ff.fp4_parameters(model)]
    g = torch.Generator().manual_seed(1234 + rank)
    times, losses = [], []
    warm = args["warmup"]
    for step in range(args["steps"] + warm):
        if step == warm:
            counter.reset()
            ff.reset_stats()
            harness.reset_device_peak(cuda)
        tok = harness.device_batch(train, args["batch"], args["seq"], g, dev)
        t0 = time.perf_counter()
        loss = harness.lm_loss(model, tok)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        if step >= warm:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    steps = args["steps"]
    st = ff.stats()
    reshard = True
    if offload and cuda:  # on CPU ranks the offload "copy" stays on the host: nothing crosses
        plain_h2d = sum(4 * _padded(s, world) * _gathers_per_step(n, reshard) for n, s in shapes.items()
                        if n not in packed_names)
        h2d = st["h2d_packed_bytes"] / steps + plain_h2d
        if arm == "plain":
            h2d = sum(4 * _padded(s, world) * _gathers_per_step(n, reshard) for n, s in shapes.items())
    else:
        h2d = 0
    return {"arm": arm, "rank": rank, "world": world, "inner": inner, "step_s": statistics.median(times),
            "peak_bytes": torch.cuda.max_memory_allocated(dev) if cuda else max(_peak_rss_bytes() - rss0, 0),
            "ag_bytes_per_step": counter.bytes / steps, "h2d_bytes_per_step": h2d,
            "packs_per_step": st["packs"] / steps, "loss_first": losses[0], "loss_last": losses[-1],
            "packed_params": len(packed_names), "params": sum(int(torch.Size(s).numel()) for s in shapes.values())}


def _padded(shape, world: int) -> int:
    rows0 = -(-shape[0] // world)
    inner = 1
    for s in shape[1:]:
        inner *= s
    return rows0 * inner


def _prebuild(cuda: bool, fp4_optimizer: bool) -> dict:
    """Build the JIT extensions once, here, so that no rank pays (or races for) the build inside a timed arm."""
    from fp4offload._ops import backend_name

    out = {}
    for dev in (["cpu", "cuda"] if cuda else ["cpu"]):
        t = time.time()
        out[f"codec_{dev}"] = f"{backend_name(dev)} ({time.time() - t:.1f} s)"
    if fp4_optimizer:
        from fp4offload._optim import fused

        t = time.time()
        ok = fused.cpu_extension() is not None and (not cuda or fused.cuda_extension() is not None)
        out["fp4adamw_fused"] = f"{'built' if ok else 'reference step'} ({time.time() - t:.1f} s)"
    return out


def run_arm(arm: str, world: int, args: dict, out_dir: str) -> list[dict]:
    import torch.multiprocessing as mp

    port = _free_port()
    mp.start_processes(_rank, args=(world, port, args, arm, out_dir), nprocs=world, join=True,
                       start_method="spawn")
    return [json.loads(Path(out_dir, f"{arm}.{r}.json").read_text()) for r in range(world)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--ranks", type=int, default=None, help="ranks (default: 2 on CPU, every GPU on CUDA)")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None, help="sequences per rank and step")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    ap.add_argument("--optimizer", choices=["auto", "fp4", "torch"], default="auto",
                    help="FP4AdamW or torch AdamW in the fp4 arms; auto: FP4AdamW on CPU, torch AdamW on CUDA "
                         "(gpu_check.sh gives this benchmark 90 s, too little to JIT-build the fused steps too)")
    ap.add_argument("--cpu-offload", choices=["auto", "on", "off"], default="auto",
                    help="auto: on for a single GPU (else nothing is gathered), off otherwise")
    ap.add_argument("--keep-bf16", default="norm", help="comma list for weights.keep_bf16 (default: norm)")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--host-cache", action="store_true",
                    help="every arm's ranks allocate large CPU tensors through fp4offload.host_allocator")
    ap.add_argument("--json", action="store_true", help="one JSON object per line after the table")
    a = ap.parse_args(argv)

    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("e2e_fsdp: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    world = a.ranks or (torch.cuda.device_count() if cuda else 2)
    big = cuda
    defaults = dict(hidden=768 if big else 128, layers=6 if big else 4, heads=12 if big else 4,
                    intermediate=2048 if big else 344, batch=8 if big else 4, seq=512 if big else 128,
                    steps=6)
    args = {k: (getattr(a, k) if getattr(a, k) is not None else v) for k, v in defaults.items()}
    offload = {"on": True, "off": False}.get(a.cpu_offload, cuda and world == 1)
    optimizer = a.optimizer if a.optimizer != "auto" else ("torch" if cuda else "fp4")
    args.update(device=a.device, warmup=a.warmup, lr=a.lr, threads=a.threads, optimizer=optimizer,
                cpu_offload=offload, keep_bf16=[k for k in a.keep_bf16.split(",") if k], host_cache=a.host_cache)
    arms = [x for x in a.arms.split(",") if x]
    bad = [x for x in arms if x not in ARMS]
    if bad:
        ap.error(f"--arms: unknown {bad}; choose from {', '.join(ARMS)}")
    builds = _prebuild(cuda, optimizer == "fp4")
    rows = []
    with tempfile.TemporaryDirectory(prefix="fp4offload_e2e_fsdp_") as out:
        for arm in arms:
            t0 = time.time()
            res = run_arm(arm, world, args, out)
            r0 = res[0]
            r0["peak_bytes"] = max(r["peak_bytes"] for r in res)
            r0["step_s"] = max(r["step_s"] for r in res)
            r0["wall_s"] = round(time.time() - t0, 1)
            rows.append(r0)
    base = next((r for r in rows if r["arm"] == "plain"), None)
    machine = (torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine())
    print(f"# e2e_fsdp: {world} rank(s) on {a.device} ({machine}), Llama hidden={args['hidden']} "
          f"layers={args['layers']} params={rows[0]['params'] / 1e6:.2f}M, batch {args['batch']}x{args['seq']} "
          f"per rank, cpu_offload={offload}, host cache={'on' if a.host_cache else 'off'}, "
          f"{args['steps']} timed steps, "
          f"torch {torch.__version__}")
    print("# backends: " + ", ".join(f"{k} {v}" for k, v in builds.items()))
    hdr = f"{'arm':8} {'optimizer':26} {'step s':>8} {'peak MiB':>9} {'AG MiB/step':>12} {'H2D MiB/step':>13} " \
          f"{'loss':>7} {'x step':>7} {'x peak':>7} {'x AG':>6} {'x H2D':>6}"
    print(hdr)
    for r in rows:
        def ratio(k):
            return f"{base[k] / r[k]:.2f}" if base and r[k] else "-"

        print(f"{r['arm']:8} {r['inner'][:26]:26} {r['step_s']:8.3f} {r['peak_bytes'] / 2**20:9.1f} "
              f"{r['ag_bytes_per_step'] / 2**20:12.3f} {r['h2d_bytes_per_step'] / 2**20:13.3f} {r['loss_last']:7.3f} "
              f"{ratio('step_s'):>7} {ratio('peak_bytes'):>7} {ratio('ag_bytes_per_step'):>6} "
              f"{ratio('h2d_bytes_per_step'):>6}")
    print("(x columns: plain / arm, so > 1 means the arm uses less)")
    if a.json:
        for r in rows:
            print(json.dumps({"bench": "e2e_fsdp", "device": a.device, "machine": machine, **args, **r}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
