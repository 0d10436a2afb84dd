"""fp4offload.fsdp with a compact master (``optimizer_states.master``): bf16 shards, the residual in FP4AdamW.

Two real gloo ranks (tests/helpers/dist.py). With the same gradient values on both sides (reduce_dtype bf16: the
fp32-master run's gradients are then bf16 values too; with reduce_dtype fp32 the bf16 shards' gradients are
the fp32 reduction rounded to bf16), split trains bit for bit as the fp32 master does, from the same fp32
initial values (apply keeps their residual for the optimizer).
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

from helpers.dist import run_ranks
from helpers.fsdp import inner_name

pytestmark = pytest.mark.distributed


def _run(rank: int, master: str, steps: int, reduce_dtype) -> dict:
    import fp4offload.fsdp as ff
    from benchmarks import harness

    train, _ = harness.byte_splits()
    model = harness.small_llama(hidden=64, layers=2, heads=4, intermediate=172, seed=0)
    policy = ff.Policy(weights=None, optimizer_states={"format": "nvfp4", "master": master},
                       block_classes=["LlamaDecoderLayer"], reduce_dtype=reduce_dtype)
    model = ff.apply(model, policy)
    opt = ff.optimizer(model, policy, lr=3e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        loss = harness.lm_loss(model, harness.batch(train, 8, 64, g))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    from fp4offload._optim import master as MW

    h = hashlib.sha256()  # of the fp32 masters: the fp32 shards themselves, or split's rebuilt from its halves
    for p, proxy in opt.local_shards.pairs:
        st = opt.state.get(proxy, {})
        x = p.to_local().detach().reshape(-1)
        if "master_lo" in st:
            x = MW.join(x, st["master_lo"], st["master_odd"])
        h.update(x.float().numpy().tobytes())
    shard_dtypes = sorted({str(p.to_local().dtype) for p in model.parameters()})
    held = opt.master_bytes() if hasattr(opt, "master_bytes") else None
    numel = sum(p.to_local().numel() for p in model.parameters())
    return {"losses": losses, "sha": h.hexdigest(), "dtypes": shard_dtypes, "held": held, "numel": numel,
            "inner": inner_name(opt)}


def _worker(rank, world, tmp, steps, reduce_dtype):
    return {m: _run(rank, m, steps if m != "bf16" else 16, reduce_dtype) for m in ("fp32", "split", "bf16")}


#: steps of the fp32 and split runs; FP4OFFLOAD_MASTER_STEPS=200 runs 200 (about 7 minutes here)
STEPS = int(os.environ.get("FP4OFFLOAD_MASTER_STEPS", "16"))


@pytest.mark.slow
def test_split_is_the_fp32_master_run_and_bf16_trains(tmp_path):
    res = run_ranks(_worker, world_size=2, args=(STEPS, torch.bfloat16), timeout=400 + 3 * STEPS)
    for r in res:
        f32, split, bf16 = r["fp32"], r["split"], r["bf16"]
        assert len(f32["losses"]) == STEPS and len(bf16["losses"]) == 16
        assert split["losses"] == f32["losses"] and split["sha"] == f32["sha"]
        assert f32["dtypes"] == ["torch.float32"] and split["dtypes"] == bf16["dtypes"] == ["torch.bfloat16"]
        assert 2 * split["numel"] <= split["held"]["host"] < 2 * split["numel"] + 8 * split["numel"] // 1000
        assert bf16["held"]["host"] == 0 and f32["held"]["host"] == 0  # fp32 shards are their own master
        assert bf16["losses"] != f32["losses"][:16]
        assert abs(sum(bf16["losses"][-6:]) - sum(f32["losses"][10:16])) / 6 < 0.05
        assert f32["losses"][15] < 0.85 * f32["losses"][0]


def test_compact_master_policy_checks_and_yaml(tmp_path):
    import fp4offload.fsdp as ff
    from fp4offload.errors import ConfigError

    with pytest.raises(ConfigError, match=r"optimizer_states.master.*weights"):
        ff.Policy(weights={}, optimizer_states={"master": "split"})  # NVFP4 weights pack from an fp32 master
    with pytest.raises(ConfigError, match="param_dtype"):
        ff.Policy(weights=None, optimizer_states={"master": "bf16"}, param_dtype=torch.float32)
    with pytest.raises(ConfigError, match="master"):
        ff.Policy(weights=None, optimizer_states={"master": "fp8"})
    y = tmp_path / "p.yaml"
    y.write_text("weights: null\noptimizer_states:\n  format: nvfp4\n  master: split\nblock_classes: "
                 "[LlamaDecoderLayer]\n")
    pol = ff.policy_from_yaml(y)
    assert pol.compact_master == "split" and pol.optimizer_states.master == "split"
    assert ff.Policy(weights=None).compact_master is None
