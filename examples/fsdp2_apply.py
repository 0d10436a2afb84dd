"""The FSDP2 policy shards the model: ff.apply, ff.optimizer, ff.save / ff.load (README "FSDP2", docs/guide.md
"FSDP2 policies").

    torchrun --nproc_per_node 2 examples/fsdp2_apply.py      # gloo on CPU ranks, NCCL on GPUs
"""
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
rank = dist.get_rank()
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128))

def train(model, opt, steps=3):
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        batch = torch.randint(0, 256, (4, 64), generator=g)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step}: loss {loss.item():.4f}")


import fp4offload.fsdp as ff

policy = ff.policy_from_yaml("configs/fsdp_fp4.yaml")   # or ff.Policy(block_classes=[LlamaDecoderLayer], ...)
model = ff.apply(model, policy)                         # convert + fully_shard per block and root
opt = ff.optimizer(model, policy, lr=3e-4)              # FP4AdamW over the local shards
train(model, opt)                                       # your loop: forward, backward, opt.step()
ff.save("ckpt/step100", model, opt)                     # torch.distributed.checkpoint, no pickle
ff.load("ckpt/step100", model, opt)

if rank == 0:
    print("saved and loaded ckpt/step100 (packed states and weights)")
dist.destroy_process_group()
