"""Hugging Face Accelerate on FSDP2 with the policy: ff.prepare gives NVFP4 all-gathers and FP4AdamW, the rest of
the loop is Accelerate's (docs/guide.md, "FSDP2 policies").

    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/accelerate_fsdp2.py
"""
import os

import torch
from accelerate import Accelerator as _Accelerator
from transformers import LlamaConfig, LlamaForCausalLM


def Accelerator():
    """Accelerate's, plus on CPU ranks the one decision Accelerate makes only on GPUs: FSDP on, as the launch
    config asks (Accelerate 1.x keeps MULTI_CPU ranks off FSDP)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    acc = _Accelerator(cpu=not torch.cuda.is_available())
    if acc.distributed_type == DistributedType.MULTI_CPU and os.environ.get("ACCELERATE_USE_FSDP") == "true":
        plugin = FullyShardedDataParallelPlugin()
        if acc.mixed_precision != "no":
            plugin.set_mixed_precision(acc.mixed_precision)
        acc.state.distributed_type = DistributedType.FSDP
        acc.state.fsdp_plugin = plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return acc


torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128))
rows = torch.randint(0, 256, (32, 64), generator=torch.Generator().manual_seed(0))
loader = torch.utils.data.DataLoader(rows, batch_size=4)

import fp4offload.fsdp as ff
accelerator = Accelerator()
model, opt = ff.prepare(accelerator, model, "configs/fsdp_fp4.yaml", lr=3e-4)  # NVFP4 gathers, FP4AdamW
scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)           # the rest as usual
loader, scheduler = accelerator.prepare(loader, scheduler)

for step, batch in zip(range(3), loader):
    loss = model(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    opt.step()
    scheduler.step()
    opt.zero_grad()
    accelerator.print(f"step {step}: loss {loss.item():.4f}")
accelerator.print("optimizer:", type(opt).__name__, "over", type(getattr(opt, "optimizer", opt)).__name__)
accelerator.end_training()   # destroys the process group before the interpreter exits
