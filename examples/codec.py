"""NVFP4 and MXFP4 tensors: quantize, size, decode, save and load (docs/guide.md, "The codec").

    python examples/codec.py            # writes x.fp4 in the working directory
"""
import torch, fp4offload

x = torch.randn(4096, 4096)
p = fp4offload.quantize(x, "nvfp4")               # 1x16 blocks, E4M3 block scales, fp32 tensor scale
w = fp4offload.quantize(x, "nvfp4", block="16x16")  # weight tiles
m = fp4offload.quantize(x, "mxfp4", scale_mode="rceil")
print(p.nbytes / x.numel())                        # 0.5625 bytes per element
y = p.dequantize(torch.bfloat16)
p.save("x.fp4")                                    # checksummed, no pickle
q = fp4offload.PackedTensor.load("x.fp4")

assert torch.equal(q.dequantize(torch.bfloat16), y)
print(f"relative error {float((y.float() - x).norm() / x.norm()):.3f}; x.fp4 read back bit for bit")
