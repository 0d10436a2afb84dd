"""Which saved activations cost a real transformer its gradients: every tensor autograd saves in one step,
classed by what saves it, and the gradient error of storing one class at a time in 4 bits.

Classes (:data:`CLASSES`), decided by the torch function that saves the tensor and the module it runs in:

- ``linear_input``: the input a linear layer saves for its weight gradient (q/k/v/o, gate/up/down, LM head);
- ``attention``: what fused attention (``F.scaled_dot_product_attention``) saves: query, key, value, output
  (its log-sum-exp is a statistic, listed as ``statistic``);
- ``mlp_act``: activation-function inputs and the gate products (SiLU's input, SiLU(gate) * up);
- ``norm``: what a normalization layer saves (its input and the normalized input);
- ``rotary``: the rotary embedding's products;
- ``statistic``: tensors an op saves that have no autograd history (log-sum-exp, rstd);
- ``logits``: the cross-entropy's log-probabilities;
- ``other``.

``first_last`` is not a class of its own: it is every class inside the first and the last decoder block.

``python benchmarks/activation_classes.py`` prints the inventory (shape, producer, consumer, module, class,
bytes) of one SmolLM2-135M training step (the downstream task's batch: 8 passages of 52 tokens) and, per class,
the share of saved bytes and the gradient error against the uncompressed gradient with that class alone in
NVFP4 (stochastic rounding, three seeds), then the same for ``ActivationPolicy()``'s defaults.
``--json PATH`` writes it all. :func:`only_class` is the context the downstream benchmark's ``act_only_*`` arms
train under.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from fnmatch import fnmatchcase
from pathlib import Path

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fp4offload/torch_extensions"))
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch
from torch.overrides import TorchFunctionMode

from fp4offload._offload.ops import RULES

_MLP_OPS = {name for name, rule in RULES.items() if rule.cls == "mlp"}  # the activation policy's own MLP rule

CLASSES = ("linear_input", "attention", "mlp_act", "norm", "rotary", "statistic", "logits", "other")
ABLATED = ("linear_input", "attention", "mlp_act", "norm", "first_last")  # the act_only_* arms


class _Where(TorchFunctionMode):
    """Remembers the torch function running (outermost) and its arguments, for the pack hook."""

    def __init__(self):
        super().__init__()
        self.op: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.op.append((getattr(func, "__name__", str(func)), args))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.op.pop()


class Classifier:
    """Saved-tensor hooks that class every tensor autograd saves, record it, and store the ones `select`
    picks (``select(row) -> bool``) in `fmt` through an fp4offload ActivationOffloader; the rest stay as they are.

    Rows: ``{"shape", "dtype", "bytes", "producer", "consumer", "module", "block", "cls", "stored"}``.
    """

    def __init__(self, model: torch.nn.Module, select=None, fmt: str = "nvfp4", seed: int = 0,
                 min_numel: int = 1 << 16):
        from fp4offload import ActivationPolicy
        from fp4offload._offload import ActivationOffloader
        from fp4offload._offload.selection import skip_reason

        self.model, self.select = model, select
        self.names = {id(m): n for n, m in model.named_modules()}
        self.blocks = self._block_names(model)
        self.policy = ActivationPolicy(format=fmt, device="cpu", seed=seed, min_numel=min_numel)
        self.offloader = ActivationOffloader(self.policy)
        self._skip = skip_reason
        self.fmt, self.rows, self._mods, self._where = fmt, [], [], None

    @staticmethod
    def _block_names(model) -> list[str]:
        layers = [n for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
        if not layers:
            return []
        return [f"{layers[0]}.{i}" for i in range(len(dict(model.named_modules())[layers[0]]))]

    def _classify(self, t: torch.Tensor) -> dict:
        op, args = self._where.op[0] if self._where.op else ("", ())
        mod = self._mods[-1] if self._mods else ""
        mod_cls = ""
        for n in reversed(self._mods):
            m = self._module_by_name.get(n)
            if m is not None and fnmatchcase(type(m).__name__, "*Norm*"):
                mod_cls = "norm"
                break
        block = next((i for i, b in enumerate(self.blocks) for n in self._mods if n == b or n.startswith(b + ".")), -1)
        producer = type(t.grad_fn).__name__ if t.grad_fn is not None else ""
        is_arg = any(a is t for a in args if type(a) is torch.Tensor)
        if producer == "LogSoftmaxBackward0" or op in ("cross_entropy", "log_softmax"):
            cls = "logits"
        elif mod_cls == "norm" or op in ("layer_norm", "rms_norm", "group_norm"):
            cls = "norm"
        elif op == "scaled_dot_product_attention":
            cls = "attention" if (is_arg or t.requires_grad) else "statistic"
        elif t.is_floating_point() and not t.requires_grad and not is_arg:
            cls = "statistic"
        elif op == "linear":  # its input, or the 2-D view of it the op made
            cls = "linear_input"
        elif "rotary" in mod.lower() or (op in ("mul", "__mul__") and "self_attn" in mod and "proj" not in mod):
            cls = "rotary"
        elif op in _MLP_OPS and ("mlp" in mod.lower() or "act" in mod.lower()):
            cls = "mlp_act"
        else:
            cls = "other"
        return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
                "bytes": t.numel() * t.element_size(), "producer": producer, "consumer": op, "module": mod,
                "block": block, "cls": cls}

    def _pack(self, t):
        if type(t) is not torch.Tensor or self._skip(t, self.policy) in ("parameter", "dtype", "layout", "backward"):
            return t.detach() if type(t) is torch.Tensor else t
        row = self._classify(t)
        small = t.numel() < self.policy.min_numel
        row["stored"] = bool(self.select is not None and not small and self.select(row, self))
        self.rows.append(row)
        if not row["stored"]:
            return t.detach()
        return self.offloader.pack(t, self.fmt)

    def _unpack(self, h):
        return self.offloader.unpack(h) if not isinstance(h, torch.Tensor) else h

    def _pre(self, mod, args):
        self._mods.append(self.names.get(id(mod), ""))

    def _post(self, mod, args, out):
        if self._mods:
            self._mods.pop()

    @contextlib.contextmanager
    def __call__(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self._module_by_name = dict(self.model.named_modules())
        self._where = _Where()
        hs = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post, always_call=True)]
        try:
            with self._where, torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            for h in hs:
                h.remove()
            self._mods.clear()


def _picks(cls: str):
    """select(row, classifier) for one ablation arm: the class alone, or every class of the first and last block."""
    if cls == "first_last":
        return lambda row, c: row["block"] in (0, len(c.blocks) - 1) and row["cls"] not in ("statistic", "logits")
    if cls not in CLASSES:
        raise ValueError(f"class {cls!r} is not one of {CLASSES + ('first_last',)}")
    return lambda row, c: row["cls"] == cls


def only_class(model: torch.nn.Module, cls: str, seed: int | None = None):
    """A per-step context factory: class `cls` (or ``"first_last"``) stored in NVFP4, everything else as is.
    Each call makes a new offloader (new stochastic bits unless `seed` is given)."""
    pick = _picks(cls)
    step = [0]

    def ctx():
        step[0] += 1
        return Classifier(model, pick, seed=step[0] if seed is None else seed)()

    return ctx


# ---- one step of SmolLM2 ------------------------------------------------------------------------------------

def _batch():
    from benchmarks import accuracy_downstream as ad

    data = ad.load_data()
    works, idx = ad.batch_order([t.shape[0] for t in data["train"]], 1, ad.BATCH, 0)
    x = ad.prompts(torch.stack([data["train"][w][i] for w, i in zip(works[0].tolist(), idx[0].tolist())]),
                   data["suffix"])
    return x, torch.as_tensor(data["labels"])[works[0]]


def _grads(model, x, y, ctx) -> dict:
    import torch.nn.functional as F

    from benchmarks import accuracy_downstream as ad

    model.zero_grad(set_to_none=True)
    with ctx():
        loss = F.cross_entropy(ad.last_logits(model, x).float(), y)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def grad_error(ref: dict, g: dict) -> dict:
    """Median and max over parameters of ||g - ref|| / ||ref||."""
    e = [float((g[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)) for n in ref]
    return {"median": statistics.median(e), "max": max(e)}


def measure(model=None, seeds=(0, 1, 2)) -> dict:
    import fp4offload
    from benchmarks import accuracy_downstream as ad

    model = model if model is not None else ad.load_model()
    model.train()
    x, y = _batch()
    ref = _grads(model, x, y, contextlib.nullcontext)
    inv = Classifier(model)
    _grads(model, x, y, inv)
    rows = inv.rows
    total = sum(r["bytes"] for r in rows)
    by = defaultdict(int)
    for r in rows:
        by[r["cls"]] += r["bytes"]
    blocks = len(inv.blocks)
    out = {"tokens": int(x.numel()), "saved_bytes": total, "rows": rows, "classes": {}}
    for cls in CLASSES + ("first_last",):
        share = (sum(r["bytes"] for r in rows if r["block"] in (0, blocks - 1)) if cls == "first_last"
                 else by.get(cls, 0)) / total
        errs = []
        if cls not in ("statistic", "logits", "other", "rotary") or share > 0.01:
            for s in seeds:
                errs.append(grad_error(ref, _grads(model, x, y, only_class(model, cls, seed=s))))
        out["classes"][cls] = {"share": share, "errors": errs}
        med = [e["median"] for e in errs]
        print(f"{cls:13s} {100 * share:5.1f}% of saved bytes  grad error median "
              f"{statistics.median(med) if med else float('nan'):.3g} max {max([e['max'] for e in errs] or [0]):.3g}",
              flush=True)
    inherit = {"attention_format": "inherit", "attention_qk_format": "inherit", "mlp_format": "inherit"}
    pols = {"default": {}, "nearest": {"rounding": "nearest"}, "mxfp8": {"format": "mxfp8"},
            "mxfp4": {"format": "mxfp4"}, "MLP products NVFP4 (12-05)": {"mlp_format": "inherit"},
            "MLP products, norms MXFP8": {"norm_format": "mxfp8"}, "attention inherit (before)": inherit,
            "all nvfp4 (norms too)": {**inherit, "norm_format": "inherit"}}
    out["policies"] = {}
    for name, kw in pols.items():
        errs, snap = [], None
        for s in seeds:
            pol = fp4offload.ActivationPolicy(device="cpu", seed=s, **kw)
            holder = {}

            def ctx(pol=pol, holder=holder):
                c = fp4offload.offload_activations(pol)
                holder["c"] = c
                return c
            errs.append(grad_error(ref, _grads(model, x, y, ctx)))
            snap = holder["c"].offloader.snapshot()
        out["policies"][name] = {"errors": errs, "bytes_after": snap["saved_bytes_after"],
                                 "bytes_before": snap["saved_bytes_before"]}
        print(f"policy {name:28s} grad error median {statistics.median(e['median'] for e in errs):.3g} "
              f"max {max(e['max'] for e in errs):.3g}; kept {snap['saved_bytes_after'] / x.numel():.0f} B/token "
              f"(uncompressed {snap['saved_bytes_before'] / x.numel():.0f})", flush=True)
    return out


def step_times(model=None, reps: int = 5) -> dict:
    """Median seconds of one training step (forward, backward) of SmolLM2 on the downstream batch, arms
    interleaved: uncompressed, the op classes' mode alone (no hooks), the default policy, and attention stored
    like the rest (before)."""
    import fp4offload
    from benchmarks import accuracy_downstream as ad
    from fp4offload._offload import ops

    model = model if model is not None else ad.load_model()
    model.train()
    x, y = _batch()
    inherit = {"attention_format": "inherit", "attention_qk_format": "inherit", "mlp_format": "inherit"}
    arms = {"uncompressed": contextlib.nullcontext, "op mode only": ops.scope,
            "default": lambda: fp4offload.offload_activations(fp4offload.ActivationPolicy(seed=0)),
            "attention inherit (before)": lambda: fp4offload.offload_activations(
                fp4offload.ActivationPolicy(seed=0, **inherit))}
    times = {k: [] for k in arms}
    for _ in range(reps + 1):
        for k, ctx in arms.items():
            t0 = time.perf_counter()
            _grads(model, x, y, ctx)
            times[k].append(time.perf_counter() - t0)
    out = {k: statistics.median(v[1:]) for k, v in times.items()}
    for k, v in out.items():
        print(f"step {k:28s} {v:.3f} s ({v / out['uncompressed']:.3f}x)", flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the inventory and the errors here")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--inventory", action="store_true", help="print every saved tensor")
    ap.add_argument("--time", type=int, default=0, metavar="REPS", help="only time the step per arm, REPS rounds")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.time:
        step_times(reps=a.time)
        return
    t0 = time.time()
    out = measure()
    out["date"], out["seconds"] = time.strftime("%Y-%m-%d"), time.time() - t0
    from benchmarks import harness

    out["cpu"], out["torch"] = harness.cpu_name(), torch.__version__
    if a.inventory:
        seen = defaultdict(int)
        for r in out["rows"]:
            seen[(r["cls"], tuple(r["shape"]), r["dtype"], r["producer"], r["consumer"],
                  r["module"].split(".")[-1] if r["module"] else "")] += 1
        print("| class | shape | dtype | producer (grad_fn) | saved by | module | count |")
        print("|---|---|---|---|---|---|---|")
        for (cls, shape, dt, prod, cons, mod), n in sorted(seen.items()):
            print(f"| {cls} | {list(shape)} | {dt} | {prod or '-'} | {cons} | {mod or '-'} | {n} |")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
