"""fp4offload.fsdp on two real gloo ranks: training, bytes all-gathered, odd shapes.

Each test spawns two CPU ranks (tests/helpers/dist.py: hard timeout, process groups destroyed, temp dirs
removed) and runs both the policy and plain ``fully_shard`` in the same processes, same data.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from helpers.dist import run_ranks
from helpers.fsdp import expected_unsharded, inner_name, OddModel

pytestmark = pytest.mark.distributed

STEPS = 30
LOSS_TOL = 0.05  # |mean of the last 10 losses, policy - plain| / plain (measured: 0.016 with FP4AdamW)
STEP_TOL = 0.15  # |loss, policy - plain| at every step (measured: <= 0.06)


# ------------------------------------------------------------------------------------------------ helpers


def packed_bytes_from_shape(shape, world: int) -> int:
    """Bytes one NVFP4 all-gather of a weight of `shape` delivers to each rank (codes + E4M3 scales)."""
    rows0 = -(-shape[0] // world)
    local = rows0 * math.prod(shape[1:])
    cols = shape[-1]
    local_rows = local // cols
    if len(shape) >= 2 and local_rows % 16 == 0:
        cp = -(-cols // 16) * 16
        return world * (local_rows * cp // 2 + (local_rows // 16) * (cp // 16))
    nb = -(-local // 16)
    return world * (nb * 8 + nb)


def plain_bytes_from_shape(shape, world: int, itemsize: int = 2) -> int:
    rows0 = -(-shape[0] // world)
    return world * rows0 * math.prod(shape[1:]) * itemsize


def _llama():
    from benchmarks import harness

    return harness.small_llama(hidden=64, layers=2, heads=4, intermediate=172, seed=0)


def _run_llama(rank: int, use_policy: bool, steps: int) -> dict:
    import fp4offload.fsdp as ff
    from benchmarks import harness
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    train, _ = harness.byte_splits()
    model = _llama()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if use_policy:
        policy = ff.Policy(weights={"keep_bf16": ["norm"]}, block_classes=["LlamaDecoderLayer"])
        model = ff.apply(model, policy)
        opt = ff.optimizer(model, policy, lr=3e-3)
        counter = model._fp4offload_all_gather
        inner = inner_name(opt)
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        counter = ff.count_all_gathers(model)
        inner = "torch.optim.AdamW"
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for step in range(steps):
        if step == 1:  # count whole steps after the first (lazy init)
            counter.reset()
            ff.reset_stats()
        loss = harness.lm_loss(model, harness.batch(train, 8, 64, g))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    out = {"losses": losses, "bytes_per_step": counter.bytes / (steps - 1), "inner": inner, "shapes": shapes}
    if use_policy:
        st = ff.stats()
        out["stats"] = {k: (v / (steps - 1) if isinstance(v, (int, float)) else v) for k, v in st.items()}
        out["fp4"] = sorted(n for n, _ in ff.fp4_parameters(model))
        # the gathered weight is exactly the NVFP4 copy of the whole fp32 master
        masters = ff.state_dict(model)
        checked = []
        for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                     "model.embed_tokens.weight"):
            full = masters[name].full_tensor()
            unit = model.model.layers[int(name.split(".")[2])] if ".layers." in name else model
            unit.unshard()
            got = model.get_parameter(name).detach().clone()
            unit.reshard()
            want = expected_unsharded(full, 2, got.dtype)
            checked.append((name, got.dtype == torch.bfloat16 and torch.equal(got, want)))
        out["exact"] = checked
    return out


def _worker_train(rank, world, tmp, steps):
    return {"policy": _run_llama(rank, True, steps), "plain": _run_llama(rank, False, steps)}


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.slow
def test_small_llama_trains_like_plain_fsdp_with_4x_fewer_gathered_bytes():
    res = run_ranks(_worker_train, 2, args=(STEPS,), timeout=240, pg_timeout=60)
    pol, plain = res[0]["policy"], res[0]["plain"]
    world = 2

    # the loss curve: same start, trains, ends within LOSS_TOL of plain fully_shard + torch AdamW
    assert abs(pol["losses"][0] - plain["losses"][0]) < 1e-2
    tail_p, tail_b = (sum(x[-10:]) / 10 for x in (pol["losses"], plain["losses"]))
    assert tail_b < pol["losses"][0] - 1.5 and tail_p < pol["losses"][0] - 1.5
    assert abs(tail_p - tail_b) / tail_b < LOSS_TOL, (tail_p, tail_b, pol["inner"])
    assert max(abs(p - b) for p, b in zip(pol["losses"], plain["losses"])) < STEP_TOL
    assert pol["inner"] in ("fp4offload.FP4AdamW", "torch.optim.AdamW (FP4AdamW unavailable)")
    assert all(math.isfinite(x) for x in pol["losses"])

    # what is packed: every weight but the norms (keep_bf16=["norm"])
    shapes = pol["shapes"]
    assert pol["fp4"] == sorted(n for n in shapes if "norm" not in n)
    assert all(ok for _, ok in pol["exact"]), pol["exact"]

    # bytes: counted in the all-gather itself, checked against the tensor sizes
    gathers = {n: (2 if ".layers." in n else 1) for n in shapes}  # blocks re-gather for backward, the root not
    fp4_bytes = sum(packed_bytes_from_shape(s, world) * gathers[n] for n, s in shapes.items() if n in pol["fp4"])
    plain_in_policy = sum(plain_bytes_from_shape(s, world) * gathers[n] for n, s in shapes.items()
                          if n not in pol["fp4"])
    bf16_bytes = sum(plain_bytes_from_shape(s, world) * gathers[n] for n, s in shapes.items())
    assert plain["bytes_per_step"] == bf16_bytes
    assert pol["stats"]["packed_bytes"] == fp4_bytes
    assert pol["bytes_per_step"] == fp4_bytes + plain_in_policy
    for n in pol["fp4"]:
        assert pol["stats"]["per_param"][n] == packed_bytes_from_shape(shapes[n], world)
    ratio = plain["bytes_per_step"] / pol["bytes_per_step"]
    assert ratio >= 3.0, ratio
    # one amax all-reduce per unit and gather: 2 blocks x 2 gathers + the root once
    assert pol["stats"]["amax_allreduces"] == 5


def _worker_odd(rank, world, tmp):
    runs = [_odd_run(rank, world, cpu_offload, reshard) for cpu_offload, reshard in
            ((False, True), (True, True), (False, False))]
    acts = {"format": "nvfp4", "device": "same", "min_numel": 64, "modules": ["blocks.*"]}
    runs.append(_odd_run(rank, world, False, True, acts))
    return runs, _nan_on_one_rank(rank), _nan_grad_on_one_rank(rank)


def _nan_grad_on_one_rank(rank):
    """A NaN in rank 1's gradient shard only: FP4AdamW skips the step on both ranks, not on rank 1 alone."""
    import fp4offload.fsdp as ff

    policy = ff.Policy(weights={"keep_bf16": []})
    model = ff.apply(OddModel(), policy)
    opt = ff.optimizer(model, policy, lr=1e-2)
    tok = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(3))
    out = []
    for step in range(2):
        model(tok[:, :-1]).float().logsumexp(-1).mean().backward()
        if step == 1 and rank == 1:
            model.blocks[0].down.weight.grad._local_tensor[0, 0] = float("nan")
        before = {n: t.full_tensor().clone() for n, t in ff.state_dict(model).items()}
        opt.step()
        opt.zero_grad()
        after = ff.state_dict(model)
        out.append(all(torch.equal(before[n], after[n].full_tensor()) for n in before))
    return {"unchanged": out, "skipped": opt.skipped_steps, "inner": inner_name(opt)}


def _nan_on_one_rank(rank):
    """A NaN in rank 1's shard only: the all-reduced amax is inf on both ranks, so both raise at once."""
    import fp4offload.fsdp as ff
    from fp4offload.errors import NonFiniteError

    model = ff.apply(OddModel(), ff.Policy(weights={"keep_bf16": []}, optimizer_states=None))
    if rank == 1:
        with torch.no_grad():
            model.blocks[0].up.weight._local_tensor[0, 0] = float("nan")
    try:
        model(torch.zeros(1, 4, dtype=torch.long))
    except NonFiniteError as e:
        return str(e)
    return "no error"


def _odd_run(rank, world, cpu_offload, reshard, activations=None):
    import fp4offload.fsdp as ff

    model = OddModel()
    full0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    policy = ff.Policy(weights={"keep_bf16": []}, cpu_offload=cpu_offload, reshard_after_forward=reshard,
                       optimizer_states=None, activations=activations)
    model = ff.apply(model, policy)
    tied = model.head.weight is model.embed.weight
    opt = ff.optimizer(model, policy, lr=1e-2)
    g = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(8):
        tok = torch.randint(0, 37, (4, 12), generator=g)
        logits = model(tok[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, 37), tok[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    masters = ff.state_dict(model)
    exact = {}
    for name in ("blocks.0.up.weight", "blocks.0.up.bias", "blocks.1.tiny.weight", "blocks.1.tiny.bias",
                 "blocks.0.gain", "blocks.1.wide.weight", "embed.weight"):
        full = masters[name].full_tensor()
        unit = model.blocks[int(name.split(".")[1])] if name.startswith("blocks") else model
        unit.unshard()
        got = model.get_parameter(name).detach().clone()
        unit.reshard()
        exact[name] = torch.equal(got, expected_unsharded(full, world, got.dtype))
    moved = {n: not torch.equal(masters[n].full_tensor(), full0[n]) for n in full0}
    acts = getattr(model, "_fp4offload_activations", None)
    return {"losses": losses, "exact": exact, "tied": tied, "moved": moved,
            "fp4": sorted(n for n, _ in ff.fp4_parameters(model)), "n_params": len(full0),
            "acts": None if acts is None else acts.offloader.snapshot()["tensors_stored"]}


@pytest.mark.slow
def test_odd_shapes_tiny_params_biases_and_tied_embeddings_train():
    """Plain, with CPUOffloadPolicy (on CPU ranks the offload copy is a no-op, the path still runs),
    without resharding after forward (one gather per step instead of two), and with NVFP4 activations."""
    res = run_ranks(_worker_odd, 2, timeout=180, pg_timeout=60)
    skip = [r[2] for r in res]
    assert skip[0]["inner"] == "fp4offload.FP4AdamW"
    assert all(r["unchanged"] == [False, True] and r["skipped"] == 1 for r in skip), skip
    nan = [r[1] for r in res]
    assert all("blocks.0.up.weight" in m and "non-finite" in m for m in nan), nan
    res = [r[0] for r in res]
    for offload in (0, 1, 2, 3):
        r = res[0][offload]
        assert res[0][offload]["losses"] == res[1][offload]["losses"]  # the ranks agree
        assert all(math.isfinite(x) for x in r["losses"]) and r["losses"][-1] < r["losses"][0]
        assert r["tied"]
        assert len(r["fp4"]) == r["n_params"]  # keep_bf16=[]: every parameter, the tied one too, is NVFP4
        assert all(r["exact"].values()), r["exact"]
        assert all(r["moved"].values()), r["moved"]  # every parameter got gradients and was updated
    assert res[0][0]["losses"] == res[0][1]["losses"] == res[0][2]["losses"]  # where and when, not what
    # with NVFP4 activations of the blocks (ActivationPolicy through the policy): stored, and close
    assert res[0][3]["acts"] > 0 and res[0][0]["acts"] is None
    with_acts, without = res[0][3]["losses"], res[0][0]["losses"]
    assert with_acts[0] == without[0]  # forward is untouched; only what backward reads is compressed
    assert all(abs(a - b) / b < 0.05 for a, b in zip(with_acts, without)), (with_acts, without)
