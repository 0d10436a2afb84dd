"""FSDP2 policies: ``fp4offload.fsdp.apply(model, Policy(...))`` (see fp4offload/_fsdp/apply.py).

::

    import fp4offload.fsdp as ff

    policy = ff.policy_from_yaml("configs/fsdp_fp4.yaml")      # or ff.Policy(block_classes=["LlamaDecoderLayer"])
    model = ff.apply(model, policy)                           # fully_shard per block + root, NVFP4 all-gathers
    opt = ff.optimizer(model, policy, lr=3e-4)                # FP4AdamW over the local shards
    ...
    ff.save("ckpt/step100", model, opt)                       # torch.distributed.checkpoint, safetensors
    ff.load("ckpt/step100", model, opt)

Sharding it yourself (torchtitan-style): convert, then your own ``fully_shard`` and FP4AdamW::

    model = ff.convert(model, ff.Policy(weights={}))          # NVFP4 all-gathers; shards nothing
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(torch.bfloat16, torch.float32))
    fully_shard(model, mesh=mesh, mp_policy=...)              # 1-D mesh, or 2-D (replicate, shard) for HSDP
    opt = fp4offload.FP4AdamW(model.parameters(), lr=3e-4)    # states over the local shards

The Hugging Face Trainer (torchrun): ``ff.FP4FSDPTrainer(model=..., args=..., fsdp_policy=policy)``.

Under Hugging Face Accelerate (FSDP2), one call shards, builds FP4AdamW and prepares both::

    model, opt = ff.prepare(accelerator, model, policy, lr=3e-4)   # policy: a Policy or a YAML path
"""

from ._fsdp.apply import (AllGatherCounter, Policy, apply, count_all_gathers, fp4_parameters, load, optimizer,
                                policy_from_yaml, refresh, reset_stats, save, state_dict, stats)
from ._fsdp.convert import convert
from ._fsdp.accelerate import prepare

__all__ = ["convert", "apply", "Policy", "policy_from_yaml", "optimizer", "save", "load", "refresh", "stats",
           "reset_stats", "count_all_gathers", "AllGatherCounter", "fp4_parameters", "state_dict", "prepare",
           "FP4FSDPTrainer"]  # noqa: F822 (module __getattr__)


def __getattr__(name):  # FP4FSDPTrainer imports transformers: only on first use
    if name == "FP4FSDPTrainer":
        from ._fsdp.trainer import FP4FSDPTrainer

        return FP4FSDPTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
