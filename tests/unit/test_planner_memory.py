"""The memory model against measurement: small models trained with plain torch on this machine.

Each scenario runs in a fresh process with glibc told to serve every allocation above 64 KiB
with mmap (so freed tensors leave the resident set at once); the measurement is the growth of the
peak resident set (VmHWM, reset just before the measured step) over the resident set before the
model was built. On a CPU-only machine the CPU plays the GPU: a plain run's bytes are the
"device" bytes of the no-offload strategy, and an emulated ZeRO-Offload run (bf16 model, fp32
master, gradients and Adam states apart) adds the "host" bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 0.15

# A Llama-shaped model: vocab, hidden, layers, heads, kv heads, ffn.
SHAPES = {
    "small": dict(vocab=4096, hidden=256, layers=4, heads=4, kv_heads=2, ffn=768),
    "wide": dict(vocab=3072, hidden=384, layers=2, heads=6, kv_heads=2, ffn=1024),
}

# name -> (shape, micro batch, seq len, dtype, checkpointing, mode)
SCENARIOS = {
    "fp32": ("small", 2, 256, "fp32", False, "plain"),
    "fp32-ckpt": ("small", 2, 256, "fp32", True, "plain"),
    "bf16-mixed": ("wide", 2, 256, "bf16", False, "mixed"),
    "offload-cpu": ("small", 2, 256, "bf16", False, "offload"),
    "host-optimizer": ("small", 1, 1, "fp32", False, "host"),
}


# ---------------------------------------------------------------------------------------------
# The worker (runs in a subprocess)


def _worker(names: list[str]) -> dict:
    """Run the scenarios one after the other in this process (one torch import for all)."""
    import gc

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    torch.set_num_threads(1)

    def status(key: str) -> int:
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        raise RuntimeError(key)

    class RMSNorm(nn.Module):  # as in Hugging Face's Llama: upcast, normalise, cast back, scale
        def __init__(self, h: int):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(h))

        def forward(self, x):
            dt = x.dtype
            x32 = x.to(torch.float32)
            var = x32.pow(2).mean(-1, keepdim=True)
            return self.weight * (x32 * torch.rsqrt(var + 1e-5)).to(dt)

    def rotate(x):
        a, b = x.chunk(2, -1)
        return torch.cat((-b, a), -1)

    ckpt = False  # set per scenario below; read by Model.forward

    class Block(nn.Module):
        def __init__(self, h, nh, nkv, ff):
            super().__init__()
            self.nh, self.nkv, self.hd = nh, nkv, h // nh
            self.n1, self.n2 = RMSNorm(h), RMSNorm(h)
            self.q = nn.Linear(h, nh * self.hd, bias=False)
            self.k = nn.Linear(h, nkv * self.hd, bias=False)
            self.v = nn.Linear(h, nkv * self.hd, bias=False)
            self.o = nn.Linear(nh * self.hd, h, bias=False)
            self.gate = nn.Linear(h, ff, bias=False)
            self.up = nn.Linear(h, ff, bias=False)
            self.down = nn.Linear(ff, h, bias=False)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            y = self.n1(x)
            q = self.q(y).view(b, t, self.nh, self.hd).transpose(1, 2)
            k = self.k(y).view(b, t, self.nkv, self.hd).transpose(1, 2)
            v = self.v(y).view(b, t, self.nkv, self.hd).transpose(1, 2)
            q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
            y = self.n2(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    class Model(nn.Module):
        def __init__(self, vocab, hidden, layers, heads, kv_heads, ffn):
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.blocks = nn.ModuleList(Block(hidden, heads, kv_heads, ffn) for _ in range(layers))
            self.norm = RMSNorm(hidden)
            self.lm_head = nn.Linear(hidden, vocab, bias=False)
            self.hd = hidden // heads

        def forward(self, ids, labels):
            t = ids.shape[1]
            inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
            f = torch.outer(torch.arange(t).float(), inv)
            emb = torch.cat((f, f), -1)
            cos, sin = emb.cos().to(self.embed.weight.dtype), emb.sin().to(self.embed.weight.dtype)
            x = self.embed(ids)
            for blk in self.blocks:
                x = checkpoint(blk, x, cos, sin, use_reentrant=False) if ckpt else blk(x, cos, sin)
            logits = self.lm_head(self.norm(x))
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))
            return loss, logits  # the caller holds the logits through backward, as with HF outputs

    # Load kernels and allocator state with a tiny model first, so the baseline includes them.
    for dtype in (torch.float32, torch.bfloat16):
        w = Model(256, 64, 2, 4, 2, 128).to(dtype)
        o = torch.optim.AdamW(w.parameters(), lr=1e-4, fused=True)
        loss, _ = w(torch.randint(0, 256, (1, 16)), torch.randint(0, 256, (1, 16)))
        loss.backward()
        o.step()
    del w, o, loss

    results = {}
    for name in names:
        torch.manual_seed(0)
        shape, mb, seq, dtype_name, ckpt, mode = SCENARIOS[name]
        dtype = torch.float32 if dtype_name == "fp32" else torch.bfloat16
        gc.collect()
        base = status("VmRSS")
        results[name] = {"measured": _scenario(torch, nn, Model, SHAPES[shape], mb, seq, dtype, mode, status) - base}
        gc.collect()
    return results


def _scenario(torch, nn, Model, dims, mb, seq, dtype, mode, status) -> int:
    """One scenario; returns the peak resident set of its measured (second) step, bytes."""
    if mode == "host":
        # The host side of ZeRO-Offload alone, for the model's parameter count: fp32 master, fp32
        # gradient partition, Adam states, and the copy of the new weights in the compute dtype that
        # goes to the device (DeepSpeed's param_buffer_of_bit16_for_cpu_offload_groups).
        n = sum(p.numel() for p in Model(**dims).parameters())
        master = nn.Parameter(torch.randn(n))
        master.grad = torch.randn(n)
        staging = torch.zeros(n, dtype=dtype)
        opt = torch.optim.AdamW([master], lr=1e-4, fused=True)
        opt.step()
        staging.copy_(master.detach())
        open("/proc/self/clear_refs", "w").write("5")
        master.grad.normal_()
        opt.step()
        staging.copy_(master.detach())
        return status("VmHWM")

    model = Model(**dims).to(dtype)
    params = list(model.parameters())
    ids = torch.randint(0, dims["vocab"], (mb, seq))
    labels = torch.randint(0, dims["vocab"], (mb, seq))

    if mode == "plain":
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

        def step():
            loss, logits = model(ids, labels)
            loss.backward()
            del loss, logits
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        # Mixed precision as ZeRO does it: bf16 weights compute, an fp32 master steps.
        masters = [nn.Parameter(p.detach().float()) for p in params]
        opt = torch.optim.AdamW(masters, lr=1e-4, fused=True)
        staging = [torch.zeros_like(p) for p in params] if mode == "offload" else []
        if mode == "offload":
            # ZeRO-Offload: each gradient goes to the host fp32 buffer as soon as it is ready.
            # The fp32 gradient partition is a persistent (pinned) host buffer, as in DeepSpeed.
            def hook(p, m=None):
                m.grad.copy_(p.grad)
                p.grad = None
            for p, m in zip(params, masters):
                m.grad = torch.zeros_like(m)
                p.register_post_accumulate_grad_hook(lambda p, m=m: hook(p, m))

        def step():
            loss, logits = model(ids, labels)
            loss.backward()
            del loss, logits
            if mode == "mixed":
                for p, m in zip(params, masters):
                    m.grad = p.grad.float()
            opt.step()
            with torch.no_grad():
                for i, (p, m) in enumerate(zip(params, masters)):
                    if mode == "offload":  # through the host copy in the compute dtype, as DeepSpeed does
                        staging[i].copy_(m)
                        p.copy_(staging[i])
                    else:
                        p.copy_(m)
                    p.grad = None
                    if mode == "mixed":
                        m.grad = None

    step()  # first step allocates the optimizer states
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak: measure a steady-state step
    step()
    return status("VmHWM")


# ---------------------------------------------------------------------------------------------
# The model side


def _predict(name: str) -> tuple[int, dict]:
    from fp4offload._planner.hardware import build_cluster
    from fp4offload._planner.memory import TrainSetup, estimate_memory
    from fp4offload._planner.models import ModelSpec
    from fp4offload._planner.strategies import load_catalogue

    shape, mb, seq, dtype_name, ckpt, mode = SCENARIOS[name]
    cat = load_catalogue()
    cluster = build_cluster(gpu="h100-80gb", gpus=1, nodes=1)
    setup = TrainSetup(micro_batch=mb, seq_len=seq, compute_bytes=4 if dtype_name == "fp32" else 2,
                       reduce_bucket=0, allgather_bucket=0, cuda_runtime_bytes=0, host_runtime_bytes=0,
                       fragmentation=0.0)
    d = SHAPES[shape]
    spec = ModelSpec(f"test-{shape}", d["hidden"], d["layers"], d["heads"], d["kv_heads"], d["ffn"], d["vocab"])
    strategy = cat["zero2-opt-cpu"] if mode in ("offload", "host") else cat["zero1"]
    est = estimate_memory(strategy, spec, cluster, setup, checkpointing=ckpt)
    # What the scenario's process holds: the device side (CPU plays the GPU), the host side, or both. The scenario
    # emulates ZeRO-Offload's tensors without DeepSpeed: what initialize itself loads and the allowance calibrated
    # on real DeepSpeed runs (host_model.INIT_BYTES, UNMODELLED) are not in it, so they are left out here
    host = est.host_total - sum(v for k, v in est.host.items() if k.startswith(("initialize's own", "unnamed terms")))
    predicted = {"plain": est.device_total, "mixed": est.device_total, "host": host,
                 "offload": est.device_total + host}[mode]
    return predicted, {"device": est.device, "host": est.host, "phase": est.peak_phase}


@pytest.fixture(scope="module")
def measurements() -> dict[str, dict]:
    """Every scenario, measured in one fresh process."""
    # One thread: OpenMP workers spinning on a shared two-core machine cost far more than they give.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, __file__, *SCENARIOS], capture_output=True, text=True, env=env,
                          cwd=str(ROOT), timeout=600)
    assert proc.returncode == 0, f"measurement process failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to read peak RSS")
@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.slow
def test_memory_model_matches_measurement(name, measurements):
    predicted, detail = _predict(name)
    measured = measurements[name]["measured"]
    err = predicted / measured - 1
    assert abs(err) <= TOLERANCE, (f"{name}: predicted {predicted / 2**20:.1f} MiB, "
                                   f"measured {measured / 2**20:.1f} MiB ({err:+.1%}); {detail}")


def test_parameter_count_of_test_model_matches_spec():
    # The spec must count what the worker builds: q, o, k, v, three MLP matrices, two norms a block.
    from fp4offload._planner.models import ModelSpec

    d = SHAPES["small"]
    spec = ModelSpec("t", d["hidden"], d["layers"], d["heads"], d["kv_heads"], d["ffn"], d["vocab"])
    hd = d["hidden"] // d["heads"]
    per_layer = (d["hidden"] * d["hidden"] * 2 + 2 * d["hidden"] * d["kv_heads"] * hd + 3 * d["hidden"] * d["ffn"]
                 + 2 * d["hidden"])
    assert spec.param_count() == 2 * d["vocab"] * d["hidden"] + d["layers"] * per_layer + d["hidden"]


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1:])))


def test_host_gradient_partition_is_bf16_only_where_the_block_makes_it_so():
    """ZeRO-1/2 offload with FP4 states and one micro-batch: the block keeps the host gradient partition in bf16
    (2 B/param); with accumulation, or DeepSpeedCPUAdam's fp32 states, it is fp32 (4 B/param)."""
    from fp4offload._planner.hardware import build_cluster
    from fp4offload._planner.memory import TrainSetup, estimate_memory
    from fp4offload._planner.models import ModelSpec
    from fp4offload._planner.strategies import load_catalogue

    cat = load_catalogue()
    cluster = build_cluster(gpu="h100-80gb", gpus=1, nodes=1)
    spec = ModelSpec("test-small", 256, 4, 4, 2, 768, 4096)
    n = spec.param_count()

    def grads(name, accum):
        setup = TrainSetup(micro_batch=1, seq_len=64, compute_bytes=2, grad_accum=accum)
        host = estimate_memory(cat[name], spec, cluster, setup, checkpointing=False).host
        return {k: round(v / n, 6) for k, v in host.items() if "gradient partition" in k}

    assert grads("zero2-opt-cpu-fp4", 1) == {"bf16 gradient partition": 2.0}
    assert grads("zero2-opt-cpu-fp4", 2) == {"fp32 gradient partition": 4.0}
    assert grads("zero2-opt-cpu", 1) == {"fp32 gradient partition": 4.0}


def test_byte_sizes_are_those_of_the_packed_formats():
    """The planner's sizes are derived from fp4offload.formats: they equal the bytes the optimizer and the
    codecs allocate, and the arithmetic of the layouts (codes + E4M3 scale per block + fp32 scale per scope)."""
    import torch

    from fp4offload import quantize
    from fp4offload._optim import reference_step as R
    from fp4offload._memory.sizes import step_bytes_per_param
    from fp4offload._planner import hardware, memory, timing

    m_or_v = 0.5 + 1 / 16 + 4 / 1024  # one state: 4-bit codes, an E4M3 scale per 16, an fp32 scale per 1024
    assert memory.STATE_BYTES["nvfp4"] == 2 * m_or_v == 1.1328125
    n = 64 * R.CHUNK
    assert memory.STATE_BYTES["nvfp4"] == 2 * sum(R.packed_sizes(n)) / n  # what FP4AdamW allocates for m and v
    assert memory.STATE_BYTES["fp32"] == 8.0
    assert memory.WEIGHT_PACKED_BYTES == 0.5 + 1 / 256
    assert memory.ACT_BYTES == {"nvfp4": 0.5 + 1 / 16, "mxfp4": 0.5 + 1 / 32, "mxfp8": 1 + 1 / 32,
                                "int2": 0.25 + 1 / 16}
    x = torch.randn(256, 1024)
    for fmt, per in memory.ACT_BYTES.items():  # a large tensor: its one fp32 tensor scale is 4 bytes more
        assert quantize(x, fmt).nbytes == per * x.numel() + (4 if fmt in ("nvfp4", "int2") else 0)
    # one Adam step's memory traffic: fp32 gradient, master and states read and written, bf16 copy on the GPU
    assert hardware.CPU_ADAM_BYTES_PER_PARAM == {"fp32": 28.0, "nvfp4": 12 + 2 * 2 * m_or_v}
    assert timing.GPU_STEP_BYTES_PER_PARAM == {"fp32": 30.0, "nvfp4": 14 + 2 * 2 * m_or_v}
    v2 = 0.25 + 1 / 16 + 4 / 1024  # sqrt(v) on ue2m0: four codes a byte, an E4M3 scale per 16, fp32 per 1024
    assert step_bytes_per_param("nvfp4", bf16_copy=True, v_format="ue2m0") == 14 + 2 * (m_or_v + v2)


LLAMA_412M = "hidden=2048,layers=8,heads=16,kv_heads=16,ffn=5632,vocab=256"  # benchmarks/RESULTS.md's 412.1M


@pytest.mark.parametrize("name", ["zero3-opt-nvme-fp4-split", "zero2-opt-nvme-fp4-split"])
def test_split_master_with_the_residual_on_nvme_bytes_by_hand(name):
    """Split's residual in the NVMe state files: host RAM keeps the bf16 half (2 B/param) and the bf16 gradient
    partition (2), nothing of the residual; NVMe the packed m and v (1.1328125) and the residual's 16 bits with a
    bit of tie positions (2.125). One node of 8 GPUs, so per node is the whole model."""
    from fp4offload._planner.hardware import build_cluster
    from fp4offload._planner.memory import TrainSetup, estimate_memory
    from fp4offload._planner.models import resolve_model
    from fp4offload._planner.strategies import load_catalogue
    from fp4offload._planner.timing import estimate_time

    cat = load_catalogue()
    cluster = build_cluster(gpu="h100-80gb", gpus=8, nodes=1, nvme_path="/local_nvme", nvme_gb=1000)
    spec = resolve_model(LLAMA_412M)
    P = spec.param_count()
    assert P == pytest.approx(412.1e6, rel=1e-3)
    setup = TrainSetup(host_runtime_bytes=0)
    est = estimate_memory(cat[name], spec, cluster, setup, checkpointing=False)
    # three segments of 2**20 elements in flight per rank, each with its m, v and residual
    staging = 8 * 3 * (1.1328125 + 2.125) * 2**20
    grads = "gradient partition" if "zero3" in name else "bf16 gradient partition"
    assert est.host["bf16 master partition"] == pytest.approx(2 * P, abs=8)
    assert est.host[grads] == pytest.approx(2 * P, abs=8)
    assert est.host["NVMe state segments in flight"] == pytest.approx(staging, abs=8)
    assert not any("residual" in k or "optimizer states" in k for k in est.host)
    assert est.nvme == {"optimizer states (nvfp4)": pytest.approx(1.1328125 * P, abs=8),
                        "split master residual": pytest.approx(2.125 * P, abs=8)}
    # against the fp32-master strategy on the same tier: the master 4 -> 2 B/param, 2.125 more on NVMe
    fp32 = estimate_memory(cat[name.replace("-split", "")], spec, cluster, setup, checkpointing=False)
    assert fp32.host["fp32 master partition"] - est.host["bf16 master partition"] == pytest.approx(2 * P, abs=8)
    assert est.nvme_total - fp32.nvme_total == pytest.approx(2.125 * P, abs=8)
    # the step reads and writes the residual with the states: 3.2578125 B/param each way instead of 1.1328125
    t, t32 = (estimate_time(cat[n], spec, cluster, setup, e) for n, e in ((name, est), (name.replace("-split", ""),
                                                                                      fp32)))
    each_way = P * (1 / cluster.nvme_read_bps + 1 / cluster.nvme_write_bps)
    assert t.terms["nvme"] == pytest.approx((1.1328125 + 2.125) * each_way, rel=1e-9)
    assert t.terms["nvme"] - t32.terms["nvme"] == pytest.approx(2.125 * each_way, rel=1e-9)


def test_residual_bytes_on_nvme_are_what_the_state_files_hold():
    from fp4offload._optim import SEGMENT
    from fp4offload._optim.nvme import segment_file_bytes
    from fp4offload._memory.sizes import RESIDUAL_NVME_BYTES

    assert RESIDUAL_NVME_BYTES == 2 + 1 / 8
    assert segment_file_bytes(SEGMENT, True) - segment_file_bytes(SEGMENT, False) == RESIDUAL_NVME_BYTES * SEGMENT


def test_saved_activations_counted_in_the_forms_the_hooks_store():
    """The planner's stored activations per token against what the hooks keep for one step of a Llama with
    torch's SDPA attention (fp32, min_numel 1): attention's q and k in bf16, v and output in MXFP8, the
    log-sum-exp exact, norms in bf16, the rest NVFP4. Counted by class, not as one 4-bit ratio."""
    import torch

    from benchmarks import harness
    from fp4offload import ActivationPolicy, offload_activations
    from fp4offload._planner import memory
    from fp4offload._planner.models import resolve_model

    model = harness.small_llama(hidden=128, layers=2, heads=4, intermediate=344, attn="sdpa")
    m = resolve_model("hidden=128,layers=2,heads=4,kv_heads=4,ffn=344,vocab=256")
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
    with offload_activations(ActivationPolicy(min_numel=1, seed=0)) as off:
        loss = harness.lm_loss(model, tokens)
    snap = off.snapshot()
    loss.backward()
    n_tok = 4 * 64
    # what the hooks stored plus the statistics they kept (the loss's log-probabilities, also kept as they are,
    # the planner counts with the logits)
    measured = (snap["bytes_out"] + 2 * 4 * 4 * 64 * 4) / n_tok
    planned = 2 * memory._stored_per_token(m, False, "nvfp4", 4) + m._norm_saved(4) / 2
    assert measured <= planned < 1.1 * measured, (planned, measured)  # on the safe side, within 10%
    flat = m.saved_bytes_per_token(4) * memory.ACT_BYTES["nvfp4"] / 4  # one 4-bit ratio for everything
    assert planned > 1.3 * flat
