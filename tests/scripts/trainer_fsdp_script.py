"""``FP4FSDPTrainer`` (fp4offload/_fsdp/trainer.py) under torchrun, on gloo CPU ranks
(tests/integration/test_fsdp_trainer.py launches it).

torchrun --nproc_per_node 2 tests/scripts/trainer_fsdp_script.py --work DIR --out result.json --steps 20

Two arms, same model (a small Llama, benchmarks/harness.py), same Shakespeare windows, same TrainingArguments
(cosine LR with warmup, max_grad_norm, two micro-batches per step, logging every step, a checkpoint at half way):

- ``fp4``: the policy YAML given with ``--policy`` (NVFP4 weight all-gathers and FP4AdamW states);
- ``adamw``: ``Policy(optimizer_states=None)``: the same sharding with torch AdamW (fp32 states, plain gathers).

Then the fp4 arm resumes from its half-way checkpoint in a new Trainer over a new model, and ``save_model`` writes
a from_pretrained folder that rank 0 reads back. Rank 0 writes JSON: per arm the logged losses, gradient norms and
learning rates, the optimizer's classes and state keys, the checkpoint's files; the resumed run's log; the reloaded
model's loss beside the sharded one's; and the ConfigError messages of a few refused settings.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # helpers
MODEL = dict(hidden=64, layers=2, heads=4, intermediate=172, seed=0)
SEQ, BATCH, ACCUM, LR = 64, 4, 2, 3e-3


class Windows:
    """Fixed random windows of a byte stream, as causal-LM examples (the model shifts the labels)."""

    def __init__(self, data, n: int, seed: int = 0):
        import torch

        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, data.numel() - SEQ - 1, (n,), generator=g)
        self.rows = data[starts[:, None] + torch.arange(SEQ)].long()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def training_args(work: Path, steps: int, **over):
    from transformers import TrainingArguments

    kw = dict(output_dir=str(work), max_steps=steps, per_device_train_batch_size=BATCH,
              gradient_accumulation_steps=ACCUM, learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=2,
              weight_decay=0.01, max_grad_norm=1.0, logging_steps=1, save_strategy="steps", save_steps=steps // 2,
              report_to="none", use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=True)
    kw.update(over)
    return TrainingArguments(**kw)


def history(trainer) -> dict:
    rows = [r for r in trainer.state.log_history if "loss" in r]
    return {"steps": [r["step"] for r in rows], "losses": [r["loss"] for r in rows],
            "grad_norms": [r["grad_norm"] for r in rows], "lrs": [r["learning_rate"] for r in rows]}


def run_arm(policy, work: Path, data, steps: int) -> tuple[dict, object]:
    import fp4offload
    from fp4offload._fsdp.trainer import FP4FSDPTrainer

    from benchmarks import harness

    ds = Windows(data, steps * BATCH * ACCUM * 2)
    trainer = FP4FSDPTrainer(model=harness.small_llama(**MODEL), args=training_args(work, steps),
                             train_dataset=ds, fsdp_policy=policy)
    t0 = time.perf_counter()
    trainer.train()
    res = {"seconds": time.perf_counter() - t0, **history(trainer)}
    opt = trainer.fp4_optimizer
    res["optimizer_mro"] = [c.__name__ for c in type(opt).__mro__]
    res["optimizer_inner"] = "fp4offload.FP4AdamW" if isinstance(opt, fp4offload.FP4AdamW) else "torch.optim.AdamW"
    res["wrapper"] = type(trainer.optimizer).__name__
    res["model_class"] = type(trainer.model).__name__
    res["model_wrapped_is_model"] = trainer.model_wrapped is trainer.model
    res["state_keys"] = sorted({k for st in opt.state.values() for k in st})
    ckpt = work / f"checkpoint-{steps // 2}"
    res["checkpoint"] = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
    return res, trainer


def resume(policy, work: Path, data, steps: int) -> dict:
    """A new model and Trainer, resumed from the half-way checkpoint of ``work``."""
    from fp4offload._fsdp.trainer import FP4FSDPTrainer

    from benchmarks import harness

    ds = Windows(data, steps * BATCH * ACCUM * 2)
    trainer = FP4FSDPTrainer(model=harness.small_llama(**MODEL), args=training_args(work, steps),
                             train_dataset=ds, fsdp_policy=policy)
    trainer.train(resume_from_checkpoint=str(work / f"checkpoint-{steps // 2}"))
    return history(trainer)


def reload_check(trainer, out_dir: Path, data) -> dict:
    """save_model (a gathered from_pretrained folder), read back on rank 0; losses on one fixed batch."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from benchmarks import harness

    trainer.save_model(str(out_dir))
    tokens = harness.batch(data, 8, SEQ, torch.Generator().manual_seed(7))
    with torch.no_grad():
        sharded = float(harness.lm_loss(trainer.model, tokens))
    res = {"sharded_loss": sharded}
    if dist.get_rank() == 0:
        model = LlamaForCausalLM.from_pretrained(str(out_dir))
        with torch.no_grad():
            res["reloaded_loss"] = float(harness.lm_loss(model, tokens))
        res["files"] = sorted(p.name for p in out_dir.iterdir())
    dist.barrier()
    return res


def refusals(work: Path) -> dict[str, str]:
    """ConfigError messages for settings FP4FSDPTrainer refuses (raised before anything is sharded)."""
    from fp4offload._fsdp.trainer import FP4FSDPTrainer
    from helpers.fsdp import config_errors

    from benchmarks import harness

    def make(**over):
        args = training_args(work / "refused", 4)
        for k, v in over.items():
            setattr(args, k, v)
        return lambda: FP4FSDPTrainer(model=harness.small_llama(**MODEL), args=args, fsdp_policy=None)

    cases = {"fp16": make(fp16=True), "optim": make(optim="sgd"),
             "load_best_model_at_end": make(load_best_model_at_end=True),
             "policy": lambda: FP4FSDPTrainer(model=harness.small_llama(**MODEL), args=training_args(work, 4),
                                              fsdp_policy=3)}
    return config_errors(cases)


def refused_resume(trainer, folder: Path) -> str:
    """The ConfigError of resuming from a folder that is not an FP4FSDPTrainer checkpoint (before any step)."""
    from fp4offload.errors import ConfigError

    folder.mkdir(parents=True, exist_ok=True)
    try:
        trainer.train(resume_from_checkpoint=str(folder))
    except ConfigError as e:
        return str(e)
    return "no error"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--steps", type=int, default=20)
    a = ap.parse_args()

    import torch
    import torch.distributed as dist

    import fp4offload.fsdp as ff
    from benchmarks import harness

    torch.set_num_threads(1)
    work = Path(a.work)
    data, _ = harness.byte_splits()
    res: dict = {"refused": refusals(work)}
    res["adamw"], adamw = run_arm(ff.Policy(optimizer_states=None), work / "adamw", data, a.steps)
    res["refused"]["resume"] = refused_resume(adamw, work / "not_a_checkpoint")
    res["fp4"], trainer = run_arm(a.policy, work / "fp4", data, a.steps)
    res["fp4"]["fp4_weights"] = len(ff.fp4_parameters(trainer.model))
    res["reload"] = reload_check(trainer, work / "final", data)
    res["resumed"] = resume(a.policy, work / "fp4", data, a.steps)
    res["world_size"] = dist.get_world_size()
    res["finite"] = all(math.isfinite(x) for arm in ("adamw", "fp4") for x in res[arm]["losses"])
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
