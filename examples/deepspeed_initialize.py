"""The DeepSpeed block from Python: fp4offload.deepspeed.initialize with a shipped config (docs/guide.md,
"Entry points").

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 examples/deepspeed_initialize.py     # CPU ranks, gloo
    deepspeed --num_gpus 8 examples/deepspeed_initialize.py                             # a GPU node
"""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128))

import fp4offload.deepspeed as fds
engine, optimizer, _, _ = fds.initialize(model=model, model_parameters=model.parameters(),
                                         config="configs/deepspeed_zero2_offload_cpu.json")
fds.install()   # or: route every later deepspeed.initialize through it (what the hook does)

g = torch.Generator().manual_seed(engine.global_rank)
for step in range(3):
    batch = torch.randint(0, 256, (engine.train_micro_batch_size_per_gpu(), 64), generator=g).to(engine.device)
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    if engine.global_rank == 0:
        print(f"step {step}: loss {loss.item():.4f}")
if engine.global_rank == 0:
    print(engine.fp4offload)
torch.distributed.destroy_process_group()
