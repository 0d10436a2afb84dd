"""FSDP2 policies: ``fp4offload.fsdp.apply(model, Policy(...))`` (see fp4offload/_fsdp/apply.py).

::

    import fp4offload.fsdp as ff

    policy = ff.policy_from_yaml("configs/fsdp_fp4.yaml")      # or ff.Policy(block_classes=["LlamaDecoderLayer"])
    model = ff.apply(model, policy)                           # fully_shard per block + root, NVFP4 all-gathers
    opt = ff.optimizer(model, policy, lr=3e-4)                # FP4AdamW over the local shards
    ...
    ff.save("ckpt/step100", model, opt)                       # torch.distributed.checkpoint, safetensors
    ff.load("ckpt/step100", model, opt)

Under Hugging Face Accelerate (FSDP2), one call shards, builds FP4AdamW and prepares both::

    model, opt = ff.prepare(accelerator, model, policy, lr=3e-4)   # policy: a Policy or a YAML path
"""

from ._fsdp.apply import (AllGatherCounter, Policy, apply, count_all_gathers, fp4_parameters, load, optimizer,
                                policy_from_yaml, refresh, reset_stats, save, state_dict, stats)
from ._fsdp.accelerate import prepare

__all__ = ["apply", "Policy", "policy_from_yaml", "optimizer", "save", "load", "refresh", "stats", "reset_stats",
           "count_all_gathers", "AllGatherCounter", "fp4_parameters", "state_dict", "prepare"]
