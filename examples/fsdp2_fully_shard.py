"""Your own FSDP2 sharding, the torch way: convert, your own fully_shard, FP4AdamW, a DCP checkpoint (README
"FSDP2", docs/guide.md "FSDP2 policies").

    torchrun --nproc_per_node 2 examples/fsdp2_fully_shard.py      # gloo on CPU ranks, NCCL on GPUs
"""
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

cuda = torch.cuda.is_available()
device_type = "cuda" if cuda else "cpu"
dist.init_process_group("nccl" if cuda else "gloo")
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
world, rank = dist.get_world_size(), dist.get_rank()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128))

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
import fp4offload, fp4offload.fsdp as ff

model = ff.convert(model, ff.Policy(weights={"keep_bf16": ["norm"]}))   # ff.Policy(): nothing to convert
mesh = init_device_mesh(device_type, (world,))           # or (replicas, shards) with ("replicate", "shard"): HSDP
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for block in model.model.layers:
    fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)   # offload_policy=CPUOffloadPolicy()
fully_shard(model, mesh=mesh, mp_policy=mp)
opt = fp4offload.FP4AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

g = torch.Generator().manual_seed(rank)
for step in range(3):
    batch = torch.randint(0, 256, (4, 64), generator=g).to(device_type)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f}")

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
dcp.save(state, checkpoint_id="ckpt/step100")
...                                       # any number of ranks later, same model and optimizer built anew
state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
dcp.load(state, checkpoint_id="ckpt/step100")
set_model_state_dict(model, state["model"]); set_optimizer_state_dict(model, opt, state["optim"])

if rank == 0:
    print("saved and loaded ckpt/step100")
dist.destroy_process_group()
