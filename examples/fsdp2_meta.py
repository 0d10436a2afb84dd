"""A model built on the meta device: convert and shard before any memory is allocated, then each rank allocates
its shards only (docs/guide.md, "FSDP2 policies").

    torchrun --nproc_per_node 2 examples/fsdp2_meta.py      # gloo on CPU ranks, NCCL on GPUs
"""
import os

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import fp4offload
import fp4offload.fsdp as ff

cuda = torch.cuda.is_available()
device_type = "cuda" if cuda else "cpu"
dist.init_process_group("nccl" if cuda else "gloo")
if cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
rank = dist.get_rank()
policy = ff.policy_from_yaml("configs/fsdp_fp4.yaml")


def build_model():
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128))


@torch.no_grad()
def init_weights(model):
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02)
    # buffers too: to_empty left them unset, and the rotary tables are not in the state dict
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(rotary.config).to(device_type)


with torch.device("meta"):
    model = build_model()
model = ff.apply(model, policy)            # convert + fully_shard (or ff.convert, then your fully_shard loop)
model.to_empty(device=device_type)         # each rank allocates its shards only
init_weights(model)                        # your initialization (or DCP / distribute_tensor of a full state dict)
opt = fp4offload.FP4AdamW(model.parameters(), lr=3e-4)

g = torch.Generator().manual_seed(rank)
for step in range(3):
    batch = torch.randint(0, 256, (4, 64), generator=g).to(device_type)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f}")
dist.destroy_process_group()
