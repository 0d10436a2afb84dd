"""A plain DeepSpeed training script over a stack of square Linear layers; it never imports fp4offload.

    python tests/scripts/linear_deepspeed_script.py --dim 4096 --layers 8 --block split --steps 3

The model is ``layers`` x ``Linear(dim, dim, bias=False)`` built in fp32 (8 x 4096 x 4096 = 134.2M parameters),
trained with ZeRO-2, ``offload_optimizer`` on the CPU and bf16, on random inputs. ``--block`` picks the
``"fp4offload"`` block of its config: ``none`` (plain DeepSpeed), ``fp32``, ``split`` or ``bf16`` (NVFP4 states
with that master form), or ``auto`` (``"fp4offload": {"auto": true}``). Whatever applies the block is the installed
package's start-up hook. The last stdout line is ``RESULT {json}``: whether it trained, the error if initialize
raised, the inner optimizer, the block the engine ran and the preflight's estimate, need and free bytes (from
``engine.fp4offload``), and the RSS before initialize and its peak from initialize on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

BLOCKS = {
    "none": None,
    "fp32": {"optimizer_states": {"format": "nvfp4"}},
    "split": {"optimizer_states": {"format": "nvfp4", "master": "split"}},
    "bf16": {"optimizer_states": {"format": "nvfp4", "master": "bf16"}},
    "auto": {"auto": True},
}


def config(block: str, stage: int = 2) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
           "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}, "steps_per_print": 10 ** 9}
    if BLOCKS[block] is not None:
        cfg["fp4offload"] = BLOCKS[block]
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--block", choices=sorted(BLOCKS), default="none")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    for k, v in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))

    import psutil
    import torch
    import deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(a.dim, a.dim, bias=False) for _ in range(a.layers)])
    import threading

    proc, peak, stop = psutil.Process(), [0], threading.Event()

    def sample() -> None:  # the RSS peak from initialize on
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(0.005)

    threading.Thread(target=sample, daemon=True).start()
    held = sum(p.numel() * p.element_size() for p in model.parameters())  # the model as built, in host RAM
    out: dict = {"params": sum(p.numel() for p in model.parameters()),
                 "rss_before": psutil.Process().memory_info().rss,
                 "fp4offload_imported_before": "fp4offload" in sys.modules}
    try:
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=config(a.block, a.stage))[0]
    except Exception as e:  # the preflight's CapacityError, or anything else initialize raised
        out["error"] = f"{type(e).__name__}: {e}"
        print("RESULT " + json.dumps(out), flush=True)
        return
    del model
    attached = getattr(engine, "fp4offload", None)
    inner = getattr(engine, "basic_optimizer", None)
    out["inner"] = type(inner).__name__
    if attached is not None:
        out["block"] = getattr(attached, "block", None)
        est = getattr(attached, "preflight", None)
        out["estimate_per_rank"] = getattr(est, "per_rank", None)
        # what the preflight weighed: the bytes initialize adds beyond the model as built, against what was free
        out["preflight_need"] = None if est is None else max(0, est.added - held)
        out["preflight_free"] = getattr(attached, "preflight_free", None)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(a.steps):
        x = torch.randn(4, a.dim, generator=g).to(torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    out["losses"] = losses
    out["trained"] = True
    out["rss_after"] = psutil.Process().memory_info().rss
    stop.set()
    out["peak_rss"] = max(peak[0], out["rss_after"])
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
