"""The grid of sqrt(v) from the config: ``optimizer_states.v_format`` is checked where it is read and reaches
FP4AdamW through the DeepSpeed block and the FSDP2 policy."""

import pytest
import torch

from fp4offload._config import V_FORMAT_DEFAULT, parse_block, parse_fsdp_policy
from fp4offload.errors import ConfigError
from fp4offload._deepspeed import optim as ds_optim
from fp4offload._fsdp import optim as fsdp_optim


def test_default_is_ue2m2_and_ufp4_can_be_pinned():
    assert V_FORMAT_DEFAULT == "ue2m2"
    assert parse_block({"optimizer_states": {}}).optimizer_states.v_format == "ue2m2"
    assert parse_block({"optimizer_states": {"v_format": "ufp4"}}).optimizer_states.v_format == "ufp4"


@pytest.mark.parametrize("bad", ["e2m2", "UE2M2", 2, None])
def test_bad_v_format_names_the_key(bad):
    with pytest.raises(ConfigError, match=r"optimizer_states\.v_format"):
        parse_block({"optimizer_states": {"v_format": bad}})


@pytest.mark.parametrize("v_format", ["ue2m2", "ufp4"])
def test_v_format_reaches_fp4adamw(v_format):
    p = torch.nn.Parameter(torch.randn(5000))
    where = ds_optim.StatePlacement(v_format=v_format)
    opt = ds_optim.make_optimizer([p], ds_optim.AdamSettings(), where)
    assert opt.param_groups[0]["v_format"] == v_format
    p.grad = torch.randn(5000)
    opt.step()
    assert opt.state_dict()["state"][0]["v_format"] == v_format
    pol = parse_fsdp_policy({"optimizer_states": {"v_format": v_format}})
    cls, kw, _ = fsdp_optim.inner_optimizer_class(pol)
    assert kw["state_format"].v_format == v_format
    assert cls(torch.nn.Linear(4, 4).parameters(), **kw).defaults["v_format"] == v_format
