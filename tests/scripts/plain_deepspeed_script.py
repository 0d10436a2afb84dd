"""A user's DeepSpeed training script that never imports fp4offload (tests/integration/test_auto_hook.py launches it).

    deepspeed --num_gpus 2 tests/scripts/plain_deepspeed_script.py --mode engine --deepspeed_config ds.json --out r.json
    torchrun --nproc_per_node 1 tests/scripts/plain_deepspeed_script.py --mode engine ...
    python tests/scripts/plain_deepspeed_script.py --mode trainer --deepspeed ds.json --out r.json   (HF Trainer flags)
    accelerate launch --config_file acc.yaml tests/scripts/plain_deepspeed_script.py --mode accelerate --out r.json

Whatever the launcher, the only thing that can apply an ``"fp4offload"`` block in the JSON is the start-up
hook of the installed package. Rank 0 writes what it saw: the inner optimizer's class, the bytes per parameter
of its state tensors (counted here, from the tensors), whether fp4offload had been imported before
``deepspeed.initialize`` ran, and the losses (a small Llama on Shakespeare bytes, benchmarks/harness.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
MODEL = dict(hidden=64, layers=2, heads=4, intermediate=128, vocab=256)
SEQ = 64


def state_bytes(opt) -> tuple[int, int]:
    """(bytes of every tensor in the optimizer's state, parameters it steps)."""
    import torch

    seen, nbytes = set(), 0
    for st in opt.state.values():
        for t in st.values():
            if isinstance(t, torch.Tensor) and t.numel() > 1:
                key = t.untyped_storage().data_ptr()
                if key not in seen:
                    seen.add(key)
                    nbytes += t.untyped_storage().nbytes()
    numel = sum(p.numel() for g in opt.param_groups for p in g["params"])
    return nbytes, numel


def report(out: str, engine, losses: list[float], imported_before: bool) -> None:
    import torch.distributed as dist

    inner = getattr(engine, "basic_optimizer", None) or engine.optimizer.optimizer
    nbytes, numel = state_bytes(inner)
    result = {"inner": type(inner).__name__, "state_bytes": nbytes, "state_numel": numel,
              "state_B_per_param": nbytes / max(1, numel), "losses": losses,
              "fp4offload_imported_before_initialize": imported_before,
              "fp4offload_imported_after": "fp4offload" in sys.modules,
              "has_block": getattr(engine, "fp4offload", None) is not None,
              "world_size": dist.get_world_size() if dist.is_initialized() else 1}
    if int(os.environ.get("RANK", "0")) == 0:
        Path(out).write_text(json.dumps(result))


def run_engine(a) -> None:
    import deepspeed
    import torch

    from benchmarks import harness

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = harness.small_llama(**MODEL)
    before = "fp4offload" in sys.modules
    engine, _, _, _ = deepspeed.initialize(args=a, model=model, model_parameters=model.parameters())
    train, _ = harness.byte_splits()
    g = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
    losses = []
    for _ in range(a.steps):
        loss = harness.lm_loss(engine, harness.batch(train, 2, SEQ, g))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    report(a.out, engine, losses, before)


def _rows(n: int = 64):
    import torch

    from benchmarks import harness

    train, _ = harness.byte_splits()
    g = torch.Generator().manual_seed(0)
    return [harness.batch(train, 1, SEQ, g)[0] for _ in range(n)]


def run_trainer(a, rest: list[str]) -> None:
    import torch
    from transformers import HfArgumentParser, Trainer, TrainingArguments

    from benchmarks import harness

    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(rest)
    torch.manual_seed(0)
    model = harness.small_llama(**MODEL)
    data = [{"input_ids": r[:-1], "labels": r[:-1]} for r in _rows()]
    before = "fp4offload" in sys.modules
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    report(a.out, trainer.model_wrapped, losses, before)


def run_accelerate(a) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DummyOptim

    from benchmarks import harness

    acc = Accelerator()
    torch.manual_seed(0)
    model = harness.small_llama(**MODEL)
    loader = torch.utils.data.DataLoader(torch.stack(_rows()), batch_size=2)
    before = "fp4offload" in sys.modules
    model, opt, loader = acc.prepare(model, DummyOptim(model.parameters()), loader)
    losses = []
    for step, tokens in enumerate(loader):
        if step == a.steps:
            break
        loss = harness.lm_loss(model, tokens)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    report(a.out, model, losses, before)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)  # --deepspeed (the Trainer's) is not --deepspeed_config
    ap.add_argument("--mode", choices=("engine", "trainer", "accelerate"), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
    ap.add_argument("--deepspeed_config", default=None)
    a, rest = ap.parse_known_args()
    if a.mode == "engine":
        run_engine(a)
    elif a.mode == "trainer":
        run_trainer(a, rest)
    else:
        run_accelerate(a)
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # skip the C++ teardown, as deepspeed_worker.py does (gloo can abort there after a pass)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
