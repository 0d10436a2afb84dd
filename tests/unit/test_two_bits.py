"""The 2-bit second moment, v_format="ue2m0", end to end: its grid, its bytes in RAM, in state dicts and in the NVMe
files, conversions to and from the 4-bit grids, the DeepSpeed block and FSDP2 policy, and the planner's count.
(Bit-exactness across the reference, the CPU paths and the emulated CUDA step: test_optim_fused.py,
tests/emulation.)"""

from pathlib import Path

import pytest
import torch

from helpers.plan import host_bytes_per_node, plan_with_option
from fp4offload import FP4AdamW
from fp4offload._config import grids, parse_block, parse_fsdp_policy
from fp4offload._fsdp import optim as fsdp_optim
from fp4offload._memory import host_model
from fp4offload._memory.sizes import STATE_BYTES, state_bytes
from fp4offload._optim import StateFormat
from fp4offload._optim import reference_step as R
from fp4offload._optim.state import decode_state, packed_from_entry
from fp4offload.formats import bits as B
from fp4offload.formats import reference

N = 5003  # 313 blocks, the last one ragged; 5 chunks


def test_the_grid_is_four_powers_of_two_stored_four_a_byte():
    g = grids.BY_NAME["ue2m0"]
    assert (g.bits, g.mbits, g.binades, g.signed) == (2, 0, 4, False)
    assert B.ugrid_values(0, cbits=2).tolist() == [0.125, 0.25, 0.5, 1.0]
    assert g.bytes_per_element == 0.25 + 1 / 16 + 4 / 1024
    assert state_bytes("nvfp4", "ue2m0") == 0.8828125 and state_bytes("nvfp4") == STATE_BYTES["nvfp4"] == 1.1328125
    codes = torch.tensor([0, 1, 2, 3, 3, 2, 1, 0, 1])
    packed = reference.pack_codes(codes, 2)
    assert packed.tolist() == [0b11100100, 0b00011011, 0b00000001]
    assert torch.equal(reference.unpack_codes(packed, 2)[:9], codes.to(torch.uint8))


def test_rounding_on_the_grid():
    """Nearest: a tie between two powers of two (1.5x the lower) takes the even code; values below 1/8 take 1/8.
    Stochastic:
    unbiased inside the grid (the mean of many draws of 0.375 is 0.375)."""
    y = torch.tensor([0.0, 0.1, 0.125, 0.18, 0.1875, 0.3, 0.7, 0.75, 0.76, 1.0, 7.0])
    assert B.ugrid_encode(y, 0, 2).tolist() == [0, 0, 0, 0, 0, 1, 2, 2, 3, 3, 3]
    x = torch.full((20000,), 0.375)
    draws = B.ugrid_values(0, cbits=2)[B.ugrid_encode_sr(x, B.random_bits(5, 0, torch.arange(20000)), 0, 2).long()]
    assert set(draws.unique().tolist()) == {0.25, 0.5}
    assert abs(draws.mean().item() - 0.375) < 0.005


def _train(opt, params, steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def test_fp4adamw_holds_v_in_half_the_bytes_and_round_trips_its_state_dict():
    params = [torch.nn.Parameter(torch.randn(N)) for _ in range(2)]
    opt = FP4AdamW(params, lr=1e-2, state_format=StateFormat(v_format="ue2m0"))
    _train(opt, params)
    st = opt.state[params[0]]
    assert st["v_format"] == "ue2m0"
    assert st["v_codes"].numel() == R.packed_sizes(N)[0] // 2 == st["m_codes"].numel() // 2
    sd = opt.state_dict()
    assert sd["state"][0]["v_format"] == "ue2m0"
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = FP4AdamW(twin_params, lr=1e-2, state_format=StateFormat(v_format="ue2m0"))
    twin.load_state_dict(sd)
    _train(opt, params, seed=1)
    _train(twin, twin_params, seed=1)
    for a, b in zip(params, twin_params):
        assert torch.equal(a, b)  # the loaded state steps exactly as the original


def test_a_state_dict_converts_between_grids_and_a_wrong_size_is_named():
    p = torch.nn.Parameter(torch.randn(N))
    four = FP4AdamW([p], lr=1e-2)  # the default, ue2m2
    _train(four, [p])
    sd = four.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    two = FP4AdamW([q], lr=1e-2, state_format=StateFormat(v_format="ue2m0"))
    two.load_state_dict(sd)  # torch restores the saved group's options, ue2m2 among them
    assert two.param_groups[0]["v_format"] == "ue2m2"
    two.param_groups[0]["v_format"] = "ue2m0"  # the group's grid changed: its states are re-encoded once
    q.grad = torch.zeros(N)
    two.param_groups[0]["lr"] = 0.0
    two.step()
    st = two.state[q]
    assert st["v_format"] == "ue2m0" and st["v_codes"].numel() == R.packed_sizes(N, 2)[0]
    _, v_before = decode_state(*packed_from_entry(sd["state"][0], N), N, "ue2m2")
    _, v_after = decode_state(*packed_from_entry(two.state_dict()["state"][0], N), N, "ue2m0")
    u_b, u_a = v_before.sqrt(), v_after.sqrt()
    live = u_b > u_b.max() * 1e-2
    assert (u_a[live] / u_b[live]).sub(1).abs().max() < 1.0  # within the 2-bit grid's factor-2 steps
    bad = dict(sd["state"][0])
    bad["v_format"] = "ue2m0"  # 4-bit codes labelled as the 2-bit grid (the load's checksum refuses it first)
    with pytest.raises(Exception, match=f"v_codes.*{R.packed_sizes(N, 2)[0]}"):
        packed_from_entry(bad, N)


def test_nvme_files_carry_the_smaller_v_and_train_as_ram(tmp_path):
    torch.manual_seed(0)
    n = 1 << 16  # files are padded to whole pages: a size where v's codes are many pages
    init = [torch.randn(n) for _ in range(2)]
    ram_p = [torch.nn.Parameter(x.clone()) for x in init]
    nvme_p = [torch.nn.Parameter(x.clone()) for x in init]
    fmt = StateFormat(v_format="ue2m0")
    ram = FP4AdamW(ram_p, lr=1e-2, state_format=fmt)
    nvme = FP4AdamW(nvme_p, lr=1e-2, state_format=fmt, state_device="nvme", nvme_path=tmp_path)
    _train(ram, ram_p)
    _train(nvme, nvme_p)
    for a, b in zip(ram_p, nvme_p):
        assert torch.equal(a, b)
    four_p = [torch.nn.Parameter(x.clone()) for x in init]
    four = FP4AdamW(four_p, lr=1e-2, state_device="nvme", nvme_path=tmp_path / "four")
    _train(four, four_p)
    size = lambda d: sum(f.stat().st_size for f in Path(d).rglob("*") if f.is_file())  # noqa: E731
    two_bytes, four_bytes = size(tmp_path) - size(tmp_path / "four"), size(tmp_path / "four")
    saved = 2 * (R.packed_sizes(n)[0] - R.packed_sizes(n, 2)[0])  # two tensors, v's codes halved
    assert four_bytes - two_bytes >= saved * 0.9, (four_bytes, two_bytes, saved)
    # what a transaction reserves follows v's format, and still bounds what was written
    from fp4offload._optim.nvme import tensor_disk_bytes

    assert tensor_disk_bytes(n, False, 4) - tensor_disk_bytes(n, False, 2) >= saved / 2 * 0.9
    def segment_files(d, skip=None):  # the state files (the store's small records left out)
        return [f.stat().st_size for f in Path(d).rglob("*")
                if f.is_file() and f.stat().st_size > 4096 and (skip is None or skip not in f.parents)]

    two_files, four_files = segment_files(tmp_path, skip=tmp_path / "four"), segment_files(tmp_path / "four")
    assert len(two_files) == len(four_files) == 2
    assert max(two_files) <= tensor_disk_bytes(n, False, 2) < min(four_files)
    assert max(four_files) <= tensor_disk_bytes(n, False, 4)


def test_the_block_and_the_policy_take_it():
    assert parse_block({"optimizer_states": {"v_format": "ue2m0"}}).optimizer_states.v_format == "ue2m0"
    pol = parse_fsdp_policy({"optimizer_states": {"v_format": "ue2m0"}})
    cls, kw, _ = fsdp_optim.inner_optimizer_class(pol)
    assert kw["state_format"].v_format == "ue2m0"
    from fp4offload._deepspeed.optim import describe_states  # what the block's startup line says it keeps

    assert "(0.88 B/param" in describe_states(parse_block({"optimizer_states": {"v_format": "ue2m0"}}).optimizer_states)
    assert "(1.13 B/param" in describe_states(parse_block({"optimizer_states": {}}).optimizer_states)


def test_the_block_preflight_counts_its_bytes():
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "bf16": {"enabled": True},
          "fp4offload": {"optimizer_states": {"format": "nvfp4"}}}
    P = 100_000_000
    four = host_model.estimate_host(host_model.inputs_from_config(ds, P, free_bytes=1 << 34))
    ds["fp4offload"]["optimizer_states"]["v_format"] = "ue2m0"
    two = host_model.estimate_host(host_model.inputs_from_config(ds, P, free_bytes=1 << 34))
    assert four.added - two.added == pytest.approx((1.1328125 - 0.8828125) * P, rel=1e-6)


def test_plan_counts_prints_and_emits_it(tmp_path, capsys):
    four, two, emitted = plan_with_option(capsys, "zero2-opt-cpu-fp4", ["--v-format", "ue2m0"], tmp_path / "ds.json")
    saved = 0.25 * 6_738_415_616  # B/param of v less, over the node's ranks; the allocator cache adds up to 1/8
    assert saved <= host_bytes_per_node(four) - host_bytes_per_node(two) <= saved * 1.125 * 1.001
    assert any("ue2m0" in n and "0.883 B/param" in n for n in two["notes"])
    assert emitted["fp4offload"]["optimizer_states"]["v_format"] == "ue2m0"
