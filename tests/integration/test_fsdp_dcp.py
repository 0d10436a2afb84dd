"""Checkpoints of FP4AdamW over the user's own ``fully_shard`` (``ff.convert`` first), on real gloo ranks.

Two forms, both ``torch.distributed.checkpoint``:

- torch's state-dict API: ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` with ``dcp.save`` /
  ``dcp.load``. The optimizer's state dict is torch AdamW's form (fp32 ``exp_avg`` / ``exp_avg_sq`` DTensors), so DCP
  reshards it; FP4AdamW quantizes m and v once on load, so a resume continues within noise, not bit for bit.
- ``fp4offload.fsdp.save`` / ``load``: the packed bytes themselves; on the same number of ranks a resume repeats
  the uninterrupted run bit for bit, on another number the states are decoded, re-cut and quantized once.

Every run sees the same global batch per step (each rank takes its rows), so runs on 2 and 4 ranks compare; the
loss reported is the global mean.
"""

from __future__ import annotations

import pytest
import torch

from helpers.dist import run_ranks

pytestmark = pytest.mark.distributed
DIMS = dict(hidden=64, layers=2, heads=4, intermediate=172, seed=0)
SAVE_AT, STEPS, GLOBAL_BATCH = 6, 12, 8


def _model_and_opt(world, fp4=True):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import fp4offload
    import fp4offload.fsdp as ff
    from benchmarks import harness

    model = harness.small_llama(**DIMS)
    if fp4:
        model = ff.convert(model, ff.Policy(weights={"keep_bf16": ["norm"]}))
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    cls = fp4offload.FP4AdamW if fp4 else torch.optim.AdamW
    opt = cls(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, opt


def _steps(model, opt, rank, world, first, last) -> list[float]:
    import torch.distributed as dist

    from benchmarks import harness

    train, _ = harness.byte_splits()
    rows = GLOBAL_BATCH // world
    losses = []
    for step in range(first, last):
        tok = harness.batch(train, GLOBAL_BATCH, 64, torch.Generator().manual_seed(step))[rank * rows:(rank + 1) * rows]
        loss = harness.lm_loss(model, tok)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _dsd_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _uninterrupted(rank, world, tmp, ckpt):
    import torch.distributed.checkpoint as dcp

    import fp4offload.fsdp as ff

    model, opt = _model_and_opt(world)
    losses = _steps(model, opt, rank, world, 0, SAVE_AT)
    dcp.save(_dsd_state(model, opt), checkpoint_id=f"{ckpt}/dsd")
    ff.save(f"{ckpt}/ff", model, opt)
    optim_sd = _dsd_state(model, opt)["optim"]
    keys = sorted({k for v in optim_sd["state"].values() for k in v})
    kinds = sorted({type(t).__name__ for v in optim_sd["state"].values() for k, t in v.items() if k != "step"})
    losses += _steps(model, opt, rank, world, SAVE_AT, STEPS)
    return {"losses": losses, "keys": keys, "kinds": kinds, "packed": "m_codes" in next(iter(opt.state.values()))}


def _resumed(rank, world, tmp, ckpt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    import fp4offload.fsdp as ff

    out = {}
    model, opt = _model_and_opt(world)
    state = _dsd_state(model, opt)
    dcp.load(state, checkpoint_id=f"{ckpt}/dsd")
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    out["dsd"] = _steps(model, opt, rank, world, SAVE_AT, STEPS)
    out["dsd_packed"] = "m_codes" in next(iter(opt.state.values()))
    model, opt = _model_and_opt(world)
    ff.load(f"{ckpt}/ff", model, opt)
    out["ff"] = _steps(model, opt, rank, world, SAVE_AT, STEPS)
    return out


@pytest.mark.slow
def test_dcp_checkpoints_of_fp4adamw_over_your_own_fully_shard_resume_on_2_and_reshard_to_4(tmp_path):
    ckpt = str(tmp_path)
    base = run_ranks(_uninterrupted, 2, args=(ckpt,), timeout=300)[0]
    assert base["packed"] and base["keys"] == ["exp_avg", "exp_avg_sq", "step"] and base["kinds"] == ["DTensor"]
    tail = base["losses"][SAVE_AT:]
    on2 = run_ranks(_resumed, 2, args=(ckpt,), timeout=300)[0]
    on4 = run_ranks(_resumed, 4, args=(ckpt,), timeout=400)[0]
    assert on2["ff"] == tail  # the packed bytes: bit for bit
    assert on2["dsd_packed"] and on4["dsd_packed"]  # torch's form loaded back into packed states
    for name, got in (("dsd on 2", on2["dsd"]), ("dsd on 4", on4["dsd"]), ("ff on 4", on4["ff"])):
        worst = max(abs(a - b) / b for a, b in zip(got, tail))
        assert worst < 0.01, (name, got, tail)  # within noise of the uninterrupted run
    assert tail[-1] < base["losses"][0] - 1.0  # it trained


def _switch(rank, world, tmp, ckpt):
    """torch AdamW's checkpoint (plain fully_shard) resumed by FP4AdamW (convert + fully_shard), and the other way
    round: the same state-dict form, so DCP moves a run between the two."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    out = {}
    model, opt = _model_and_opt(world, fp4=False)
    _steps(model, opt, rank, world, 0, SAVE_AT)
    dcp.save(_dsd_state(model, opt), checkpoint_id=f"{ckpt}/torch")
    out["torch_then_torch"] = _steps(model, opt, rank, world, SAVE_AT, STEPS)
    for fp4, src, name in ((True, "torch", "torch_then_fp4"), (False, "dsd", "fp4_then_torch")):
        model, opt = _model_and_opt(world, fp4=fp4)
        state = _dsd_state(model, opt)
        dcp.load(state, checkpoint_id=f"{ckpt}/{src}")
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        out[name] = _steps(model, opt, rank, world, SAVE_AT, STEPS)
    return out


@pytest.mark.slow
def test_a_torch_adamw_checkpoint_moves_to_fp4adamw_and_back_through_dcp(tmp_path):
    ckpt = str(tmp_path)
    base = run_ranks(_uninterrupted, 2, args=(ckpt,), timeout=300)[0]  # FP4AdamW's checkpoint in ckpt/dsd
    r = run_ranks(_switch, 2, args=(ckpt,), timeout=300)[0]
    ref = r["torch_then_torch"]
    worst = max(abs(a - b) / b for a, b in zip(r["torch_then_fp4"], ref))
    assert worst < 0.02, (r["torch_then_fp4"], ref)  # FP4AdamW continues torch AdamW's run
    worst = max(abs(a - b) / b for a, b in zip(r["fp4_then_torch"], base["losses"][SAVE_AT:]))
    assert worst < 0.02, (r["fp4_then_torch"], base["losses"][SAVE_AT:])  # and torch AdamW FP4AdamW's
