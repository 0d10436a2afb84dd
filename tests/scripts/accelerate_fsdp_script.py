"""An Accelerate training loop on FSDP2, with fp4offload's one step or with plain Accelerate
(tests/integration/test_accelerate_fsdp.py launches it).

accelerate launch --config_file acc.yaml tests/scripts/accelerate_fsdp_script.py --mode fp4 --policy p.yaml --out r.json
accelerate launch --config_file acc.yaml tests/scripts/accelerate_fsdp_script.py --mode plain --out r.json

``--mode fp4``: ``fp4offload.fsdp.prepare(accelerator, model, policy, params=groups, lr=...)`` (two param
groups: no weight decay on the norms); ``--mode plain``: torch AdamW over the same groups and
``accelerator.prepare(model, optimizer)``. Same model (a small Llama, benchmarks/harness.py), same Shakespeare
batches, same loop (``accelerator.backward``, ``accelerator.clip_grad_norm_``, step, zero_grad). Rank 0 writes
JSON: losses, the optimizer's classes, its state bytes per parameter (from the state tensors' local shards),
bytes all-gathered per step, and in fp4 mode which weights FSDP gathers as NVFP4, the policy applied, the
ConfigErrors of a few bad settings, and the losses of the same run through ``apply`` / ``optimizer`` without
Accelerate.

``--cpu``: Accelerate 1.15 turns FSDP on only for accelerator devices (``AcceleratorState`` switches
``distributed_type`` to FSDP for MULTI_GPU, MULTI_XPU, ... but not for MULTI_CPU), so on a CPU-only machine
the launched ranks come up as MULTI_CPU (gloo) with FSDP off. With ``--cpu`` the script then makes the one
decision Accelerate makes on GPU machines itself: ``distributed_type = FSDP`` (in AcceleratorState and in
PartialState's shared state, where AcceleratorState.__init__ writes it too) and ``state.fsdp_plugin =
FullyShardedDataParallelPlugin()`` (which reads the launch config from the environment, as ``Accelerator()``
does). Everything else (launcher, config, ``prepare``, ``fsdp2_prepare_model``, the optimizer wrapper,
``backward``, clipping) is Accelerate's own code.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # helpers
MODEL = dict(hidden=64, layers=2, heads=4, intermediate=172, seed=0)
BATCH, SEQ, LR = 8, 64, 3e-3


def accelerator(cpu: bool):
    import torch
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=cpu or not torch.cuda.is_available())
    native = str(acc.distributed_type.value)
    if cpu and acc.distributed_type == DistributedType.MULTI_CPU and os.environ.get("ACCELERATE_USE_FSDP") == "true":
        plugin = FullyShardedDataParallelPlugin()
        if acc.mixed_precision != "no":
            plugin.set_mixed_precision(acc.mixed_precision)  # what AcceleratorState does for FSDP
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin
        # AcceleratorState() copies PartialState's shared state on every construction (AcceleratedOptimizer
        # makes one), so Accelerate writes the type there too at the end of AcceleratorState.__init__
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return acc, native


def state_bytes(opt) -> dict:
    """Bytes of the optimizer's state tensors (local shards) per parameter element: all, and packed ones only."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    total = numel = packed_bytes = packed_numel = 0
    for g in opt.param_groups:
        for p in g["params"]:
            st = opt.state.get(p, {})
            n = local(p).numel()
            b = sum(local(t).numel() * local(t).element_size() for k, t in st.items()
                    if isinstance(t, torch.Tensor) and k != "step")
            total, numel = total + b, numel + n
            if "m_codes" in st:
                packed_bytes, packed_numel = packed_bytes + b, packed_numel + n
    return {"state_B_per_param": total / max(1, numel), "packed_B_per_param": packed_bytes / max(1, packed_numel),
            "packed_numel": packed_numel, "numel": numel}


def groups(model) -> list[dict]:
    """Two param groups, as training scripts write them: no weight decay on the norms."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if "norm" not in n]},
            {"params": [p for n, p in named if "norm" in n], "weight_decay": 0.0}]


def train(model, opt, acc, steps: int, counter, rank: int) -> list[float]:
    import fp4offload.fsdp as ff
    import torch

    from benchmarks import harness

    data, _ = harness.byte_splits()
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(steps):
        if step == 1:  # whole steps after the first (lazy init)
            counter.reset()
            ff.reset_stats()
        loss = harness.lm_loss(model, harness.batch(data, BATCH, SEQ, g))
        if acc is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        else:
            acc.backward(loss)
            acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def bad_settings(acc) -> dict[str, str]:
    """ConfigError messages of ``prepare`` for settings it refuses (raised before anything changes)."""
    import fp4offload.fsdp as ff
    from helpers.fsdp import config_errors

    from benchmarks import harness

    plugin = acc.state.fsdp_plugin

    def llama():
        return harness.small_llama(**MODEL)

    cases = {
        "fsdp_version_1": lambda: _with(plugin, "fsdp_version", 1, lambda: ff.prepare(acc, llama())),
        "block_classes": lambda: ff.prepare(acc, llama(), ff.Policy(block_classes=["LlamaMLP"])),
    }
    if type(plugin.cpu_offload).__name__ != "CPUOffloadPolicy":  # a policy that offloads, Accelerate does not
        cases["cpu_offload"] = lambda: ff.prepare(acc, llama(), ff.Policy(cpu_offload=True))
    return config_errors(cases)


def _with(obj, attr, value, fn):
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        return fn()
    finally:
        setattr(obj, attr, old)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("fp4", "plain"), required=True)
    ap.add_argument("--policy", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cpu", action="store_true")
    a = ap.parse_args()

    import fp4offload
    import fp4offload.fsdp as ff
    import torch

    from benchmarks import harness

    acc, native = accelerator(a.cpu)
    rank = acc.process_index
    res = {"native_distributed_type": native, "distributed_type": str(acc.distributed_type.value),
           "is_fsdp2": bool(acc.is_fsdp2), "num_processes": acc.num_processes, "mixed_precision": acc.mixed_precision}
    model = harness.small_llama(**MODEL)
    if a.mode == "fp4":
        res["errors"] = bad_settings(acc)
        model, opt = ff.prepare(acc, model, a.policy, params=groups, lr=LR)
        counter = model._fp4offload_all_gather
        pol = model._fp4offload_policy
        res["policy"] = {"param_dtype": str(pol.param_dtype), "reduce_dtype": str(pol.reduce_dtype),
                         "cpu_offload": pol.cpu_offload, "reshard_after_forward": pol.reshard_after_forward,
                         "block_classes": sorted(c if isinstance(c, str) else c.__name__ for c in pol.block_classes)}
        res["fp4"] = sorted(n for n, _ in ff.fp4_parameters(model))
        fp4 = isinstance(opt.optimizer, fp4offload.FP4AdamW)
        res["inner_name"] = "fp4offload.FP4AdamW" if fp4 else "torch.optim.AdamW"
        res["group_sizes"] = [len(g["params"]) for g in opt.param_groups]
        res["group_decay"] = [g["weight_decay"] for g in opt.param_groups]
    else:
        opt = torch.optim.AdamW(groups(model), lr=LR)
        model, opt = acc.prepare(model, opt)
        counter = ff.count_all_gathers(model)
        res["fp4"] = []
    from fp4offload._optim import FP4AdamW

    res["names"] = sorted(n for n, _ in model.named_parameters())
    res["wrapper"] = type(opt).__name__
    res["inner"] = type(opt.optimizer).__name__
    res["is_fp4adamw"] = isinstance(opt.optimizer, FP4AdamW)
    res["registered"] = any(o is opt for o in acc._optimizers) and any(m is model for m in acc._models)
    res["losses"] = train(model, opt, acc, a.steps, counter, rank)
    res["allgather_bytes_per_step"] = counter.bytes / (a.steps - 1)
    res["stats"] = ff.stats() if a.mode == "fp4" else {}
    res["stats"].pop("per_param", None)
    res.update(state_bytes(opt.optimizer))
    if a.mode == "fp4":  # the same run without Accelerate: apply + optimizer with the policy prepare applied
        direct = ff.apply(harness.small_llama(**MODEL), pol)
        dopt = ff.optimizer(direct, pol, params=groups(direct), lr=LR)
        res["direct_losses"] = train(direct, dopt, None, a.steps, direct._fp4offload_all_gather, rank)
    res["finite"] = all(math.isfinite(x) for x in res["losses"])
    res["distributed_type_after"] = str(acc.distributed_type.value)
    acc.wait_for_everyone()
    if rank == 0:
        Path(a.out).write_text(json.dumps(res))
    acc.end_training()


if __name__ == "__main__":
    main()
