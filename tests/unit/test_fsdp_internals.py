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
