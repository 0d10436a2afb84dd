"""FP4AdamW in a plain PyTorch loop on one process, with 4-bit saved activations (docs/guide.md, "FP4AdamW" and
"Activations").

    python examples/fp4adamw.py
"""
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fp4offload

torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128))
batch = torch.randint(0, 256, (4, 64))

opt = fp4offload.FP4AdamW(model.parameters(), lr=3e-4, weight_decay=0.1,
                          state_device="cpu")      # "same" | "cpu" | "nvme" (with nvme_path=...)

policy = fp4offload.ActivationPolicy(format="nvfp4", device="cpu", min_numel=65536, modules=("*.mlp",))
with fp4offload.offload_activations(policy, model=model):
    loss = model(input_ids=batch, labels=batch).loss
loss.backward()
opt.step()
opt.zero_grad()
print(f"loss {loss.item():.4f}")

# every option, with the states and split's residual on NVMe
nvme_dir = tempfile.mkdtemp(prefix="fp4offload-example-")
model = model.to(torch.bfloat16)
from fp4offload import NvmeOptions, StateFormat, StepOptions

opt = fp4offload.FP4AdamW(model.parameters(), lr=3e-4, master="split", state_device="nvme",
                          nvme_path=nvme_dir,                 # a folder on the NVMe drive
                          state_format=StateFormat(m_rounding="stochastic", v_rounding="stochastic",
                                                   v_format="ue2m2", min_numel=4096, seed=0),
                          nvme=NvmeOptions(threads=4, reserve_bytes=0, io="auto", keep=None, master_device="nvme"),
                          step_options=StepOptions(backend="auto", working_copy=None, skip_nonfinite=True,
                                                   metrics_every=100, tensor_key=None))
model(input_ids=batch, labels=batch).loss.backward()
opt.step()
print("NVMe tier:", opt.state_bytes())
opt.close()
