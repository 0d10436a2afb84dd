"""``fp4offload.fsdp.Policy.auto()``: the candidates and their bytes, the choice against a given limit, and on two
real gloo ranks rank 0's choice trains on both (tests/helpers/dist.py), with the host RAM it estimated at or
above what each rank's process grew by."""

from __future__ import annotations

import pytest
import torch

import fp4offload.fsdp as ff
from fp4offload._fsdp import auto as fa
from fp4offload._config import parse_fsdp_policy
from fp4offload.errors import CapacityError
from helpers.dist import run_ranks
from helpers.fsdp import train_lm

MODEL = dict(hidden=256, layers=4, heads=4, intermediate=688, seed=0)


def _llama():
    from benchmarks import harness

    return harness.small_llama(**MODEL)


def _blocks(model):
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ == "LlamaDecoderLayer"]


def _hosts(model, world=2, policy=None):
    """Host bytes per rank of each candidate on the CPU, by name."""
    policy = policy or ff.Policy.auto(block_classes=["LlamaDecoderLayer"])
    params = sum(p.numel() for p in model.parameters())
    gathered = fa._gathered(model, _blocks(model))
    return {c.name: fa.estimate(policy, c.block["optimizer_states"], params, world, gathered, False)[1]
            for c, why in fa.candidates(policy, False) if not why}


def test_candidates_and_their_bytes():
    model = _llama()
    host = _hosts(model)
    assert list(host) == ["fp32 master, NVFP4 states beside the shards", "split master, NVFP4 states beside the shards",
                          "bf16 master, NVFP4 states beside the shards"]
    local = -(-sum(p.numel() for p in model.parameters()) // 2)
    fp32, split, bf16 = host.values()
    assert fp32 - split == pytest.approx(2 * local, abs=2)  # bf16 gradients; the shard's 4 B are 2 + 2 of residual
    assert split - bf16 == pytest.approx(2 * local, abs=2)  # no residual
    # on a GPU each master form can also keep its states in host RAM; packed weights leave only fp32
    gpu = fa.candidates(ff.Policy.auto(), True)
    assert [c.name for c, _ in gpu][:2] == ["fp32 master, NVFP4 states beside the shards",
                                           "fp32 master, NVFP4 states in host RAM"]
    packed = fa.candidates(ff.Policy.auto(weights={}), False)
    assert [bool(why) for _, why in packed] == [False, True, True]


def test_the_least_lossy_candidate_that_fits_is_chosen_and_nothing_fitting_is_a_capacity_error():
    model = _llama()
    policy = ff.Policy.auto(block_classes=["LlamaDecoderLayer"])
    fp32, split, bf16 = _hosts(model).values()

    def choose(free):
        return fa.choose(model, policy, _blocks(model), 2, False, host_free=free, host_source="test", local_ranks=1)

    assert choose(fp32).choice.name.startswith("fp32 master")
    d = choose(fp32 - 1)
    assert d.choice.name.startswith("split master") and d.choice.block["optimizer_states"].master == "split"
    assert "not taken: fp32 master" in d.line()
    assert choose(split - 1).choice.name.startswith("bf16 master")
    with pytest.raises(CapacityError, match="smallest candidate is bf16 master"):
        choose(bf16 - 1)


def test_yaml_auto_true_is_policy_auto():
    p = ff.Policy.from_config(parse_fsdp_policy({"auto": True, "block_classes": ["LlamaDecoderLayer"]}))
    assert p.automatic and p == ff.Policy.auto(block_classes=("LlamaDecoderLayer",))
    assert parse_fsdp_policy(p.to_config().to_dict()).auto is True
    with pytest.raises(Exception, match="auto"):
        parse_fsdp_policy({"auto": "yes"})


def _train_auto(rank, world, tmp, tight_rank, free):
    import psutil

    from fp4offload import _machine

    real = _machine.limits
    _machine.limits = lambda: real().__class__(available=(1 << 20) if rank == tight_rank else free)
    model = _llama()
    rss0 = psutil.Process().memory_info().rss
    model = ff.apply(model, ff.Policy.auto(block_classes=["LlamaDecoderLayer"]))
    policy = model._fp4offload_policy
    opt = ff.optimizer(model, policy, lr=3e-3)
    g = torch.Generator().manual_seed(rank)
    losses = train_lm(model, opt, 3, g, batch=2)
    grown = psutil.Process().memory_info().rss - rss0
    return {"master": policy.optimizer_states.master, "automatic": policy.automatic, "losses": losses,
            "dtypes": sorted({str(p.to_local().dtype) for p in model.parameters()}), "grown": grown,
            "estimate": model._fp4offload_auto.estimate, "line": model._fp4offload_auto.line()}


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_train_rank_0s_choice():
    fp32, split, _ = _hosts(_llama()).values()
    free = 2 * (fp32 + split) // 2  # the node's 2 local ranks: the fp32 master does not fit, split does
    # rank 1 alone would fit nothing: it takes rank 0's choice
    r = run_ranks(_train_auto, world_size=2, args=(1, free), timeout=300, env={"LOCAL_WORLD_SIZE": "2"})
    assert r[0]["master"] == r[1]["master"] == "split" and not r[0]["automatic"], r
    assert r[0]["dtypes"] == ["torch.bfloat16"] and r[0]["line"].startswith("auto: chose split master")
    assert r[0]["losses"][-1] < r[0]["losses"][0]
    for x in r:  # the estimate bounds what each rank's process grew by
        assert x["grown"] <= x["estimate"], x
