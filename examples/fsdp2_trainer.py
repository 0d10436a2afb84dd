"""The Hugging Face Trainer on FSDP2 with the policy: FP4FSDPTrainer shards an unsharded model itself (README
"FSDP2", docs/guide.md "FSDP2 policies").

    torchrun --nproc_per_node 8 examples/fsdp2_trainer.py              # a GPU node
    MAX_STEPS=2 torchrun --nproc_per_node 2 examples/fsdp2_trainer.py  # CPU ranks, gloo
"""
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128))
rows = torch.randint(0, 256, (64, 64), generator=torch.Generator().manual_seed(0))
ds = [{"input_ids": r, "labels": r} for r in rows]
max_steps = int(os.environ.get("MAX_STEPS", 1000))

from fp4offload.fsdp import FP4FSDPTrainer

args = TrainingArguments(output_dir="out", max_steps=max_steps, learning_rate=3e-4, weight_decay=0.1,
                         lr_scheduler_type="cosine", warmup_steps=100, max_grad_norm=1.0,
                         gradient_accumulation_steps=4, save_steps=200, bf16=True,
                         use_cpu=not torch.cuda.is_available())    # CPU ranks need saying so
trainer = FP4FSDPTrainer(model=model, args=args, train_dataset=ds,
                         fsdp_policy="configs/fsdp_fp4.yaml")    # or ff.Policy(...); None: ff.Policy()
trainer.train()                            # torchrun --nproc_per_node 8 train.py
trainer.save_model("final")                # every rank: gathers the fp32 weights, rank 0 writes from_pretrained

import fp4offload.fsdp as ff
ff.save("ckpt/trainer", trainer.model, trainer.optimizer)   # packed states; the Trainer's wrapper is unwrapped

if trainer.is_world_process_zero():
    print("train loss:", trainer.state.log_history[-1].get("train_loss"))
    print("wrote", sorted(os.listdir("final")))
torch.distributed.destroy_process_group()   # the Trainer leaves the group open; gloo can abort at exit without this
