"""torch's private FSDP2 names the policies read (fsdp_internals): present on this torch, and they give what
the policies expect: a unit's sharded parameters in FSDP's order, and each one's local tensor."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fp4offload._fsdp import internals as fsdp_internals


def test_this_torch_has_every_name():
    assert fsdp_internals.check() == {"AllGather": True, "FSDPState._fsdp_param_groups": True,
                                      "DTensor._local_tensor": True}


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_unit_parameters_and_local_tensors(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    params = fsdp_internals.unit_parameters(model)
    assert params is not None and [id(p) for p in params] == [id(p) for p in model.parameters()]
    for p in params:
        local = fsdp_internals.local_tensor(p)
        assert isinstance(local, torch.Tensor) and local.shape == p.shape  # one rank: the whole tensor
        assert local.data_ptr() == p.to_local().data_ptr()
    plain = torch.nn.Linear(2, 2)
    assert fsdp_internals.unit_parameters(plain) is None  # not a fully_shard unit: the fallback path
    assert fsdp_internals.local_tensor(plain.weight) is None
    assert fsdp_internals.local_tensor(plain.weight, plain.weight) is plain.weight


def test_a_sharded_step_reads_the_gradients_once_for_the_vote(one_rank, monkeypatch):
    """Over a sharded model the all-rank vote tests the gradients with FP4AdamW's own test (finite and bounded) and
    FP4AdamW does not test them again; a gradient past the bound skips the step on the vote alone."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fp4offload import FP4AdamW
    from fp4offload._fsdp.optim import ShardedAdamW
    from fp4offload._optim.step import GRAD_LIMIT

    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    opt = FP4AdamW(model.parameters(), lr=1e-3)
    assert opt.local_shards is not None
    calls = []
    real = opt.stepper.grads_finite
    monkeypatch.setattr(opt.stepper, "grads_finite", lambda grads: calls.append(len(grads)) or real(grads))
    model(torch.randn(4, 64)).sum().backward()
    before = [p.detach().to_local().clone() for p in model.parameters()]
    opt.step()
    assert calls == [4] and opt.skipped_steps == 0  # one pass, in the vote, over the 4 shards
    assert any(not torch.equal(b, p.detach().to_local()) for b, p in zip(before, model.parameters()))
    opt.zero_grad()
    model(torch.randn(4, 64)).sum().backward()
    next(model.parameters()).grad.to_local()[0, 0] = 2 * GRAD_LIMIT  # finite, but g*g would overflow
    stepped = [p.detach().to_local().clone() for p in model.parameters()]
    opt.step()
    assert opt.skipped_steps == 1 and len(calls) == 2
    assert all(torch.equal(b, p.detach().to_local()) for b, p in zip(stepped, model.parameters()))
    # the shared entry points (shards.ShardedEntryPoints): torch AdamW's form out of both optimizers
    fp32 = ShardedAdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64)).sum().backward()
    fp32.step()
    for o in (opt, fp32):
        sd = o.state_dict()
        assert set(sd["state"][0]) >= {"step", "exp_avg", "exp_avg_sq"}
        with o.packed_form():
            assert "exp_avg" not in o.state_dict()["state"][0] or o is fp32
        o.load_state_dict(sd)


def test_all_reduce_keeps_its_tensor_alive_past_the_collective(one_rank):
    """gloo's worker thread drops a finished all-reduce after the caller's wait(); a tensor Python still holds
    then needs no GIL there, so a program that exits right after a step cannot abort (fp4offload._dtensor)."""
    import weakref

    import torch

    from fp4offload import _dtensor

    t = torch.ones(3)
    alive = weakref.ref(t)
    out = _dtensor.all_reduce(t, dist.ReduceOp.SUM)
    assert out is t and torch.equal(out, torch.ones(3))
    del t, out
    assert alive() is not None, "the caller's last reference is gone; the helper must still hold the tensor"
    for _ in range(_dtensor._RECENT.maxlen):
        _dtensor.all_reduce(torch.zeros(1), dist.ReduceOp.MAX)
    assert alive() is None, "only the last few collectives' tensors are kept"


def test_a_gloo_program_waits_for_the_worker_threads_once_at_exit(one_rank, monkeypatch):
    import atexit

    from fp4offload import _dtensor

    registered = []
    monkeypatch.setattr(atexit, "register", lambda f, *a: registered.append((f, a)))
    monkeypatch.setattr(_dtensor, "_settling", [])
    _dtensor.settle_gloo_at_exit()
    _dtensor.all_reduce(torch.ones(1), dist.ReduceOp.SUM)  # every collective helper asks; registered once
    assert len(registered) == 1 and registered[0][1] == (_dtensor.GLOO_EXIT_GRACE_S,)
