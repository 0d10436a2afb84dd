"""Host memory of the DeepSpeed block: no full-size transient in FP4AdamW's step, the allocator control.

benchmarks/e2e_deepspeed.py measures the RSS; these tests guard the two mechanisms behind it, counted
from tensors (FP4AdamW) and from glibc's own counters (the allocator), so they stay fast and exact.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fp4offload._optim import FP4AdamW, StepOptions

ROOT = Path(__file__).resolve().parents[2]


class NewStorages(TorchDispatchMode):
    """Records the bytes of every storage an op creates (outputs that alias no input)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                if st.data_ptr() not in ins:
                    self.sizes.append((str(func), st.nbytes()))
        return out


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_step_on_a_zero_partition_allocates_no_fp32_copy(backend):
    """ZeRO-Offload hands FP4AdamW one flat fp32 partition with an fp32 .grad: states are created packed
    (no fp32 zeros first) and neither the first nor a later step copies the gradient or the weights."""
    seg = 1 << 20  # reference_step.SEGMENT: the reference step's temporaries are one segment's
    n = seg if backend == "auto" else 3 * seg + 4096
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    opt = FP4AdamW([p], lr=1e-3, state_device="cpu", step_options=StepOptions(backend=backend, metrics_every=0))
    with NewStorages() as first:
        opt.step()
    with NewStorages() as later:
        opt.step()
    st = opt.state[p]
    assert "master" not in st and "exp_avg" not in st  # the partition itself is the master; states packed
    packed = sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor) and t.numel() > 1)
    assert packed <= 1.2 * n
    if backend == "auto":  # the fused step: the packed states at init, then nothing but scalars
        big = [(f, b) for f, b in first.sizes if b > n // 2]  # m and v codes are n/2 bytes each
        assert not big, big
        assert sum(b for _, b in first.sizes) <= packed + 64 * 1024, first.sizes
        assert sum(b for _, b in later.sizes) <= 64 * 1024, later.sizes
    else:  # the reference step (no compiler): temporaries of one segment at a time, never of the whole tensor
        for sizes in (first.sizes, later.sizes):
            assert max(b for _, b in sizes) <= 8 * seg < 4 * n, max(sizes, key=lambda fb: fb[1])  # <= fp64 segment


_PROBE = textwrap.dedent("""
    import ctypes, json, os, torch
    from fp4offload._deepspeed import host as ds_host
    got = ds_host.control_host_allocator()
    libc = ctypes.CDLL("libc.so.6")
    class MI2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]
    libc.mallinfo2.restype = MI2
    big = torch.empty(8 << 20, dtype=torch.uint8).fill_(1)
    del big  # freeing an mmapped 8 MiB block: glibc's default now serves up to 8 MiB from its heap
    m0 = libc.mallinfo2()
    keep = [torch.ones(1 << 20, dtype=torch.uint8) for _ in range(64)]
    m = libc.mallinfo2()
    from fp4offload import host_allocator
    cache = host_allocator.stats()
    print(json.dumps({"got": got, "heap": m.arena - m0.arena, "mmapped": m.hblkhd - m0.hblkhd,
                      "cache_in_use": cache.get("in_use_bytes", 0)}))
""")


def _probe(env_value: str | None, cache: str | None = "off") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    env.pop("FP4OFFLOAD_MMAP_THRESHOLD", None)
    env.pop("FP4OFFLOAD_HOST_CACHE", None)
    if env_value is not None:
        env["FP4OFFLOAD_MMAP_THRESHOLD"] = env_value
    if cache is not None:
        env["FP4OFFLOAD_HOST_CACHE"] = cache
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
@pytest.mark.slow  # three probe processes: 5-12 s
def test_allocator_control_keeps_freed_tensors_out_of_the_heap():
    on, off = _probe(None), _probe("off")  # glibc's threshold alone (the host cache off)
    assert off["got"]["mmap_threshold"] is None
    assert on["got"]["mmap_threshold"] == 128 * 1024
    assert not on["got"]["host_cache"]["installed"]
    # 64 MiB of 1 MiB tensors: mmapped (given back on free) with the control, in glibc's heap without it
    assert on["mmapped"] >= 64 << 20 and on["heap"] < 8 << 20, on
    assert off["heap"] >= 60 << 20 and off["mmapped"] < 8 << 20, off
    # the default: the same tensors come from the host cache, which maps (and bounds) them itself
    cached = _probe(None, cache=None)
    assert cached["got"]["host_cache"]["installed"] and cached["got"]["mmap_threshold"] == 128 * 1024
    assert cached["cache_in_use"] >= 64 << 20 and cached["heap"] < 8 << 20, cached


@pytest.mark.distributed
@pytest.mark.slow
def test_bf16_staging_shared_on_the_cpu_accelerator(tmp_path):
    """On the CPU accelerator the block lets ZeRO-2 offload cast the master straight into the bf16 partition:
    DeepSpeed's staging buffers become the partitions themselves (2 B/param less), and training is the same
    bits as with the staging buffers kept (``host.share_bf16_staging: false``, or FP4OFFLOAD_SHARE_STAGING=0:
    the two ways of saying it do the same)."""
    from helpers.deepspeed import ds_config, launch

    block = {"optimizer_states": {"format": "nvfp4", "device": "cpu"}}
    cfg = ds_config(2, "cpu", block)
    res = launch({"cases": [
        {"name": "shared", "config": cfg, "steps": 4, "probe": "staging"},
        {"name": "kept", "config": cfg, "steps": 4, "probe": "staging", "env": {"FP4OFFLOAD_SHARE_STAGING": "0"}},
        {"name": "kept_by_config", "config": ds_config(2, "cpu", {**block, "host": {"share_bf16_staging": False}}),
         "steps": 4, "probe": "staging"},
        {"name": "plain", "config": ds_config(2, "cpu", None), "steps": 1, "probe": "staging"}]}, 1, tmp_path)
    shared, kept, by_config, plain = (res["cases"][k] for k in ("shared", "kept", "kept_by_config", "plain"))
    assert by_config["staging"] == kept["staging"] and by_config["losses"] == kept["losses"]
    assert shared["staging"]["aliased"] and all(shared["staging"]["aliased"])
    assert shared["staging"]["shared_bytes"] == shared["staging"]["partition_bytes"] > 0
    assert not any(kept["staging"]["aliased"]) and kept["staging"]["shared_bytes"] == 0
    assert not any(plain["staging"]["aliased"])  # without the block DeepSpeed is left as it is
    assert shared["losses"] == kept["losses"]


@pytest.mark.distributed
@pytest.mark.slow
def test_host_gradient_partition_in_bf16(tmp_path):
    """With one micro-batch per step the block keeps ZeRO-2 offload's host gradient partition in bf16 (2 B/param
    less): without clipping training is the same bits as with the fp32 partition (``host.bf16_gradient_partition:
    false``, or FP4OFFLOAD_BF16_GRADS=0);
    clipping's scale then rounds to bf16 (close losses); with gradient accumulation it stays fp32."""
    from helpers.deepspeed import ds_config, launch

    block = {"optimizer_states": {"format": "nvfp4", "device": "cpu"}}
    noclip = {**ds_config(2, "cpu", block), "gradient_clipping": 0.0}
    clip = {**ds_config(2, "cpu", block), "gradient_clipping": 0.05}  # small enough to clip every step
    accum = {**ds_config(2, "cpu", block), "gradient_accumulation_steps": 2}
    off = {"FP4OFFLOAD_BF16_GRADS": "0"}
    res = launch({"cases": [
        {"name": "bf16", "config": noclip, "steps": 5, "probe": "grads"},
        {"name": "fp32", "config": noclip, "steps": 5, "probe": "grads", "env": off},
        {"name": "fp32_by_config",
         "config": {**noclip, "fp4offload": {**block, "host": {"bf16_gradient_partition": False}}},
         "steps": 5, "probe": "grads"},
        {"name": "clip_bf16", "config": clip, "steps": 5, "probe": "grads"},
        {"name": "clip_fp32", "config": clip, "steps": 5, "probe": "grads", "env": off},
        {"name": "accum", "config": accum, "steps": 2, "probe": "grads"}]}, 1, tmp_path)
    c = res["cases"]
    assert set(c["bf16"]["grads"]["dtypes"]) == {"torch.bfloat16"}
    assert c["bf16"]["grads"]["saved_bytes"] == 2 * c["bf16"]["grads"]["numel"] > 0
    assert c["bf16"]["grads"]["at_init"]  # DeepSpeed allocated it in bf16: no fp32 partition at any time
    assert not c["fp32"]["grads"]["at_init"] and not c["accum"]["grads"]["at_init"]
    assert set(c["fp32"]["grads"]["dtypes"]) == {"torch.float32"} and c["fp32"]["grads"]["saved_bytes"] == 0
    assert c["bf16"]["losses"] == c["fp32"]["losses"]
    assert c["fp32_by_config"]["grads"] == c["fp32"]["grads"] and c["fp32_by_config"]["losses"] == c["fp32"]["losses"]
    assert set(c["clip_bf16"]["grads"]["dtypes"]) == {"torch.bfloat16"}
    assert c["clip_bf16"]["losses"] != c["clip_fp32"]["losses"]  # the clipped gradients round to bf16 ...
    for a, b in zip(c["clip_bf16"]["losses"], c["clip_fp32"]["losses"]):
        assert abs(a - b) <= 2e-3 * abs(b), (c["clip_bf16"]["losses"], c["clip_fp32"]["losses"])  # ... barely
    assert set(c["accum"]["grads"]["dtypes"]) == {"torch.float32"} and c["accum"]["grads"]["saved_bytes"] == 0


@pytest.mark.distributed
@pytest.mark.slow
def test_e2e_benchmark_runs_each_arm_with_its_own_settings():
    """benchmarks/e2e_deepspeed.py on a tiny model: each arm in its own process with the host settings it names
    (the block and the same-settings baseline through the host cache, plain DeepSpeed, DeepSpeed's bf16 mode and
    the ablation not), the block's gradient partition in bf16, DeepSpeed's bf16 mode really in bf16 (master,
    gradients and DeepSpeedCPUAdam's m and v: 8 B/param of optimizer host bytes against plain DeepSpeed's 16),
    and a jemalloc arm whose library is missing skipped with the fix named, not failed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("FP4OFFLOAD_HOST_CACHE", None)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "e2e_deepspeed.py"), "--configs", "z2_cpu", "--hidden", "64",
           "--layers", "1", "--heads", "2", "--intermediate", "128", "--seq", "32", "--steps", "2",
           "--small-layers", "0",
           "--arms", "baseline,same_allocator,ds_bf16,baseline_jemalloc,block,block_split",
           "--jemalloc", "/nonexistent/libjemalloc.so.2", "--without-host-cache", "--json"]
    out = subprocess.run(cmd, env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    arms = {r["variant"]: r for r in rows if "variant" in r}
    assert set(arms) == {"baseline", "baseline, same allocator", "ds bf16 mode", "block", "block, host cache off",
                         "block, split master"}
    cache = {name: r["host_cache"]["installed"] for name, r in arms.items()}
    assert cache == {"baseline": False, "baseline, same allocator": True, "ds bf16 mode": False, "block": True,
                     "block, host cache off": False, "block, split master": True}, cache
    assert arms["block"]["host_cache"]["allocs"] > 0
    assert "bf16 gradient partition" in arms["block"]["buffers"]
    assert "fp32 gradient partition" in arms["baseline"]["buffers"]
    assert all(r["page_faults_per_step"] >= 0 and r["s_per_step"] > 0 for r in arms.values())
    # DeepSpeed's bf16 mode, as the engine ran it (plain DeepSpeed would show fp32 and 16 B/param)
    bf, plain = arms["ds bf16 mode"], arms["baseline"]
    assert bf["bf16_config"]["bf16_master_weights_and_grads"] and bf["bf16_config"]["bf16_optimizer_states"]
    assert (bf["master_dtype"], bf["optimizer_state_dtypes"], bf["fp32_optimizer_states"], bf["inner"]) == \
        ("bfloat16", ["bfloat16"], False, "DeepSpeedCPUAdam")
    assert (plain["master_dtype"], plain["optimizer_state_dtypes"], plain["fp32_optimizer_states"]) == \
        ("float32", ["float32"], True)
    assert "bf16 master partition" in bf["buffers"] and "bf16 gradient partition" in bf["buffers"]
    assert bf["optimizer_host_B_per_param"] == pytest.approx(8.0)  # master 2 + gradient 2 + m 2 + v 2
    assert plain["optimizer_host_B_per_param"] == pytest.approx(16.0)  # 4 + 4 + 4 + 4
    assert bf["optimizer_host_split"]["states"] == 2 * bf["optimizer_host_split"]["master"]
    assert bf["allocator"] == "glibc default" and bf["jemalloc"] is None
    skipped = [r for r in rows if "skipped" in r]
    assert [(r["arm"], r["skipped"]) for r in skipped] == [("baseline_jemalloc", "baseline, jemalloc")]
    assert "libjemalloc2" in skipped[0]["why"] and "--jemalloc" in skipped[0]["why"], skipped
    ratio = next(r for r in rows if "step_time_ratio" in r)
    assert ratio["step_time_ratio"] == pytest.approx(arms["block"]["s_per_step"] / arms["baseline"]["s_per_step"])
    assert ratio["peak_rss_reduction"] == pytest.approx(1 - arms["block"]["peak_rss"] / arms["baseline"]["peak_rss"])
    vs_bf16 = ratio["against"]["ds bf16 mode"]
    assert vs_bf16["peak_rss_reduction"] == pytest.approx(1 - arms["block"]["peak_rss"] / bf["peak_rss"])
    assert vs_bf16["optimizer_host_reduction"] == pytest.approx(
        1 - arms["block"]["optimizer_host_bytes"] / bf["optimizer_host_bytes"])
    assert set(ratio["against"]) == {"baseline", "baseline, same allocator", "ds bf16 mode"}
    # the block's compact masters, counted from the tensors: below DeepSpeed's bf16 mode in the same run
    split = arms["block, split master"]  # (the bf16 master's 5.13 B/param: tests/integration/test_deepspeed_master.py)
    assert (split["master"], split["master_dtype"]) == ("split", "bfloat16")
    assert split["optimizer_host_B_per_param"] == pytest.approx(2 + 2 + 2 + 1.13, abs=0.1)  # master, grad, lo, m+v
    assert split["optimizer_host_B_per_param"] < bf["optimizer_host_B_per_param"]
    by_arm = {r["block_arm"]: r for r in rows if "block_arm" in r}
    assert set(by_arm) == {"block", "block_no_host_cache", "block_split"}
    assert by_arm["block_split"]["against"]["ds bf16 mode"]["optimizer_host_reduction"] == pytest.approx(
        1 - split["optimizer_host_bytes"] / bf["optimizer_host_bytes"])
