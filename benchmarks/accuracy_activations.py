"""Accuracy with compressed activations: final validation loss of a small Llama trained with torch AdamW,
activations saved for backward uncompressed vs MXFP8 vs NVFP4 (fp4offload.offload_activations, host RAM).

Every arm of a seed starts from the same weights and sees the same batches, so the gap between arms
is the effect of the activation format alone; three seeds give the spread. Targets: MXFP8 within
0.5% and NVFP4 within 2% of the uncompressed final validation loss. The policies are the defaults
(NVFP4 rounded stochastically, MXFP8 to nearest, norm layers' tensors in bf16). A control arm rounds
the same tensors to bf16 (no offload): training is chaotic, and it shows how far a harmless
perturbation moves the final loss.

    python benchmarks/accuracy_activations.py                 # defaults: 3 seeds x 3 arms
    python benchmarks/accuracy_activations.py --steps 50 --seeds 0   # a quick look
    python benchmarks/accuracy_activations.py --json          # one JSON object per line as well

Writes ``accuracy_activations.json`` and ``accuracy_activations.png`` to --out (default benchmarks/out/)
and, with --plot, the PNG to that path too (benchmarks/plots/ holds the one RESULTS.md shows).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness
from fp4offload._offload import ActivationPolicy, offload_activations
from fp4offload._offload.selection import from_parameter as _from_parameter

ARMS = ("uncompressed", "mxfp8", "nvfp4", "bf16-control")
TARGETS = {"mxfp8": 0.005, "nvfp4": 0.02}


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of `lr`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(steps - warmup, 1)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


class _Bf16Control:
    """Control arm: saved fp32 activations rounded to bf16 and back (a 0.2% perturbation, no offload).

    Training is chaotic: any perturbation moves the final loss a little. This arm shows how much a
    harmless one moves it, so the gaps of the compressed arms can be read against that noise.
    """

    def __init__(self, min_numel: int):
        self.min_numel = min_numel

    def pack(self, t):
        if (t.dtype == torch.float32 and t.numel() >= self.min_numel and not _from_parameter(t)
                and type(t.grad_fn).__name__ != "LogSoftmaxBackward0"):  # the tensors the offloader would take
            return ("bf16", t.detach().to(torch.bfloat16))
        return t.detach()

    @staticmethod
    def unpack(p):
        return p[1].float() if isinstance(p, tuple) else p

    def context(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def train_run(arm: str, *, seed: int, steps: int, args, train, val) -> dict:
    """Train one arm; returns the validation curve, the final validation loss and timing."""
    model = harness.small_llama(hidden=args.hidden, layers=args.layers, heads=args.heads,
                                intermediate=args.intermediate, seed=seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(10_000 + seed)
    policy = None
    if arm in ("mxfp8", "nvfp4"):
        policy = ActivationPolicy(format=arm, device="cpu", min_numel=args.min_numel)
    control = _Bf16Control(args.min_numel) if arm == "bf16-control" else None
    curve, t0, snap = [], time.perf_counter(), None
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, args.lr, args.warmup)
        tokens = harness.batch(train, args.batch, args.seq, gen)
        if control is not None:
            with control.context():
                loss = harness.lm_loss(model, tokens)
        elif policy is None:
            loss = harness.lm_loss(model, tokens)
        else:
            with offload_activations(policy) as off:
                loss = harness.lm_loss(model, tokens)
            snap = off.snapshot()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == steps:
            curve.append((step + 1, harness.evaluate(model, val, batch_size=16, seq_len=args.seq, batches=8)))
    out = {"arm": arm, "seed": seed, "steps": steps, "final_val_loss": curve[-1][1], "curve": curve,
           "seconds": time.perf_counter() - t0}
    if snap is not None:
        out["last_step"] = {k: snap[k] for k in ("bytes_in", "bytes_out", "saved_bytes_before", "saved_bytes_after",
                                                 "rel_error_mean", "tensors_stored")}
    return out


def summarize(runs: list[dict]) -> dict:
    seeds = sorted({r["seed"] for r in runs})
    final = {(r["arm"], r["seed"]): r["final_val_loss"] for r in runs}
    summary = {}
    for arm in ARMS:
        vals = [final[(arm, s)] for s in seeds if (arm, s) in final]
        if not vals:
            continue
        entry = {"mean_val_loss": sum(vals) / len(vals), "per_seed": vals}
        if arm != "uncompressed":
            gaps = [(final[(arm, s)] - final[("uncompressed", s)]) / final[("uncompressed", s)] for s in seeds
                    if (arm, s) in final and ("uncompressed", s) in final]
            entry["rel_gap_per_seed"] = gaps
            entry["rel_gap_mean"] = sum(gaps) / len(gaps) if gaps else None
            entry["rel_gap_max_abs"] = max(abs(g) for g in gaps) if gaps else None
            if len(gaps) > 1:  # standard error of the mean gap over seeds
                mg = entry["rel_gap_mean"]
                entry["rel_gap_sem"] = (sum((g - mg) ** 2 for g in gaps) / (len(gaps) - 1) / len(gaps)) ** 0.5
            if arm in TARGETS:
                entry["target"] = TARGETS[arm]
                entry["meets_target"] = bool(gaps) and abs(entry["rel_gap_mean"]) <= TARGETS[arm]
        summary[arm] = entry
    base = [final[("uncompressed", s)] for s in seeds if ("uncompressed", s) in final]
    if len(base) > 1:
        m = sum(base) / len(base)
        summary["uncompressed"]["seed_std_rel"] = (sum((b - m) ** 2 for b in base) / (len(base) - 1)) ** 0.5 / m
    return summary


def plot(runs: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=90)
    colors = {"uncompressed": "black", "mxfp8": "tab:blue", "nvfp4": "tab:red", "bf16-control": "tab:gray"}
    for arm in ARMS:
        curves = [r["curve"] for r in runs if r["arm"] == arm]
        if not curves:
            continue
        steps = [s for s, _ in curves[0]]
        mean = [sum(c[i][1] for c in curves) / len(curves) for i in range(len(steps))]
        ax1.plot(steps, mean, label=arm, color=colors[arm], lw=1.5)
    ax1.set_xlabel("step")
    ax1.set_ylabel("validation loss (mean over seeds)")
    ax1.set_title("small Llama, Shakespeare bytes")
    ax1.legend()
    arms = [a for a in ("bf16-control", "mxfp8", "nvfp4") if a in summary]
    for i, arm in enumerate(arms):
        gaps = [100 * g for g in summary[arm]["rel_gap_per_seed"]]
        ax2.scatter([i] * len(gaps), gaps, color=colors[arm], zorder=3)
        ax2.bar(i, 100 * summary[arm]["rel_gap_mean"], color=colors[arm], alpha=0.35)
        if arm in TARGETS:
            ax2.hlines(100 * TARGETS[arm], i - 0.4, i + 0.4, colors="gray", linestyles="--")
            ax2.hlines(-100 * TARGETS[arm], i - 0.4, i + 0.4, colors="gray", linestyles="--")
    ax2.axhline(0, color="black", lw=0.8)
    ax2.set_xticks(range(len(arms)), arms)
    ax2.set_ylabel("final val loss gap vs uncompressed (%)")
    ax2.set_title("per seed (dots), mean (bar), target (--)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=344)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--min-numel", type=int, default=4096, help="elements; smaller saved tensors stay as they are")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    ap.add_argument("--plot", type=Path, default=None, help="also write the PNG here")
    ap.add_argument("--json", action="store_true", help="print one JSON object per run and one for the summary")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a small shared host more threads spin and run slower)")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="summarize and plot the runs of an earlier JSON output instead of training")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.from_json is not None:
        old = json.loads(args.from_json.read_text())
        summary = summarize(old["runs"])
        old["summary"] = summary
        print(json.dumps(summary, indent=1))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "accuracy_activations.json").write_text(json.dumps(old, indent=1))
        plot(old["runs"], summary, args.out / "accuracy_activations.png")
        if args.plot is not None:
            plot(old["runs"], summary, args.plot)
        return 0

    train, val = harness.byte_splits()
    runs = []
    print(f"{'seed':>4} {'arm':>12} {'final val loss':>14} {'seconds':>8}")
    for seed in args.seeds:
        for arm in args.arms:
            r = train_run(arm, seed=seed, steps=args.steps, args=args, train=train, val=val)
            runs.append(r)
            print(f"{seed:>4} {arm:>12} {r['final_val_loss']:>14.4f} {r['seconds']:>8.1f}", flush=True)
            if args.json:
                print(json.dumps(r))
    summary = summarize(runs)
    print()
    print(f"{'arm':>12} {'mean val loss':>14} {'gap vs uncompressed':>20} {'+-sem':>7} {'target':>8}")
    for arm, s in summary.items():
        gap, sem, tgt = s.get("rel_gap_mean"), s.get("rel_gap_sem"), s.get("target")
        print(f"{arm:>12} {s['mean_val_loss']:>14.4f} {'' if gap is None else f'{100 * gap:+.2f}%':>20} "
              f"{'' if sem is None else f'{100 * sem:.2f}%':>7} {'' if tgt is None else f'{100 * tgt:.1f}%':>8}")
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "cpus": torch.get_num_threads(),
            "torch": torch.__version__,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "command": "python benchmarks/accuracy_activations.py "
                       + " ".join(argv if argv is not None else sys.argv[1:])}
    result = {"meta": meta, "summary": summary, "runs": runs}
    if args.json:
        print(json.dumps({"summary": summary}))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy_activations.json").write_text(json.dumps(result, indent=1))
    plot(runs, summary, args.out / "accuracy_activations.png")
    if args.plot is not None:
        plot(runs, summary, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
