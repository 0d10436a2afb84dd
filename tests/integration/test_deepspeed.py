"""The DeepSpeed "fp4offload" block: validation, and real ZeRO 1/2/3 training on the CPU accelerator.

Training tests spawn ranks with tests/scripts/deepspeed_worker.py (real DeepSpeed, gloo, a small Llama on
Shakespeare bytes) and compare the loss curve of each config with the block against the same config
without it (DeepSpeed's own optimizer: DeepSpeedCPUAdam under offload), within the tolerance stated in
tests/helpers/deepspeed.py (``assert_close_curves``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from helpers.deepspeed import BLOCK, STEPS, assert_close_curves, ds_config, launch

from fp4offload.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------
# validation: nothing is built


@pytest.mark.parametrize("mutate, key, value", [
    (lambda c: c["fp4offload"].update(optimiser_states={}), "fp4offload.optimiser_states", {}),
    (lambda c: c["fp4offload"]["optimizer_states"].update(colour="red"), "fp4offload.optimizer_states.colour", "red"),
    (lambda c: c["fp4offload"]["optimizer_states"].update(format="nvfp5"), "fp4offload.optimizer_states.format",
     "nvfp5"),
    (lambda c: c["fp4offload"]["optimizer_states"].update(device="gpu"), "fp4offload.optimizer_states.device", "gpu"),
    (lambda c: c["fp4offload"]["optimizer_states"].update(device="nvme"), "fp4offload.optimizer_states.nvme_path",
     None),
    (lambda c: c["fp4offload"].update(monitor={"every": "10"}), "fp4offload.monitor.every", "10"),
    (lambda c: c["fp4offload"].update(activations={"modules": "*.mlp", "format": "nvfp4"}),
     "fp4offload.activations.modules", "*.mlp"),
    (lambda c: c["fp4offload"].update(weights={"format": "nvfp4"}), "fp4offload.weights", None),
    (lambda c: c["optimizer"].update(type="Lamb"), "optimizer.type", "Lamb"),
    (lambda c: c["optimizer"]["params"].update(amsgrad=True), "optimizer.params.amsgrad", True),
    (lambda c: c["zero_optimization"].update(stage=3, offload_param={"device": "cpu"}, zero_quantized_weights=True)
     or c["fp4offload"].update(weights={"format": "nvfp4"}), "zero_optimization.zero_quantized_weights", True),
    (lambda c: c["zero_optimization"].update(stage=3, offload_param={"device": "nvme", "nvme_path": "/x"})
     or c["fp4offload"].update(weights={"device": "cpu"}), "zero_optimization.offload_param.device", "nvme"),
    (lambda c: c["zero_optimization"].update(offload_optimizer={"device": "nvme"})
     or c["fp4offload"]["optimizer_states"].pop("device"), "zero_optimization.offload_optimizer.nvme_path", None),
    (lambda c: c["zero_optimization"].update(stage=0, offload_optimizer={"device": "cpu"}),
     "zero_optimization.stage", 0),
    (lambda c: c["zero_optimization"].update(stage=5), "zero_optimization.stage", 5),
    (lambda c: c["zero_optimization"].update(overlap_com=True), "zero_optimization", None),
    (lambda c: c.update(train_micro_batch_size_per_gpu="auto"), "train_micro_batch_size_per_gpu", "auto"),
])
def test_bad_block_raises_config_error_naming_key_value_allowed(mutate, key, value):
    from fp4offload.deepspeed import prepare_config

    cfg = ds_config(2, block=BLOCK)
    mutate(cfg)
    with pytest.raises(ConfigError) as ei:
        prepare_config(cfg)
    e = ei.value
    assert e.key == key, str(e)
    if value is not None:
        assert e.value == value, str(e)
    assert e.allowed and "expected" in str(e) and key in str(e)


def test_prepare_sets_client_optimizer_keys_and_moves_nvme_to_fp4adamw(tmp_path):
    from fp4offload.deepspeed import prepare_config

    cfg = ds_config(3, offload="nvme", block={"optimizer_states": {"format": "nvfp4"}})
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path)
    original = copy.deepcopy(cfg)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    p = prepare_config(str(path))
    assert cfg == original, "the caller's dict must not change"
    assert p.ds_config["zero_force_ds_cpu_optimizer"] is False
    assert p.ds_config["zero_allow_untested_optimizer"] is True
    assert p.ds_config["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert p.states.device == "nvme" and p.states.nvme_path.startswith(str(tmp_path))
    assert any("offload_optimizer" in n for n in p.rewrites)
    # an explicit block device wins over DeepSpeed's own
    cfg["fp4offload"]["optimizer_states"]["device"] = "cpu"
    assert prepare_config(cfg).states.device == "cpu"


def test_initialize_rejects_before_anything_is_built():
    """A bad block fails in initialize before DeepSpeed starts a process group or touches the model."""
    import torch

    import fp4offload.deepspeed as fds
    from benchmarks import harness

    model = harness.small_llama(hidden=32, layers=1, heads=2, intermediate=64)
    before = [p.data_ptr() for p in model.parameters()]
    cfg = ds_config(2, block={"optimizer_states": {"device": "nvme"}})
    with pytest.raises(ConfigError, match="optimizer_states.nvme_path"):
        fds.initialize(model=model, config=cfg)
    assert not torch.distributed.is_initialized()
    assert [p.data_ptr() for p in model.parameters()] == before
    assert not hasattr(model, "ds_id") and not any(hasattr(p, "ds_id") for p in model.parameters())


SHIPPED = sorted((ROOT / "configs").glob("deepspeed_*.json"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_config_loads_and_validates(path):
    from fp4offload.deepspeed import prepare_config

    p = prepare_config(str(path))
    assert p.block.optimizer_states is not None
    assert not p.rewrites, f"{path.name} should already be what DeepSpeed gets: {p.rewrites}"
    z = p.ds_config["zero_optimization"]
    assert (p.block.weights is not None) == ("offload_param" in z)


def test_every_supported_combination_has_a_config():
    names = {p.name for p in SHIPPED}
    for want in ("zero1_offload_cpu", "zero1_states_nvme", "zero2_offload_cpu", "zero2_states_nvme",
                 "zero3_offload_cpu", "zero3_states_nvme", "zero3_offload_param_fp4_weights"):
        assert f"deepspeed_{want}.json" in names


# ------------------------------------------------------------------------------------------------
# training with real DeepSpeed


def _launch(cases, nranks, tmp_path, timeout=240):
    return launch({"cases": cases}, nranks, tmp_path, timeout=timeout)


ACTS = {"format": "nvfp4", "device": "cpu", "min_numel": 4096, "modules": ["*.mlp"]}


def _pairs(stages, offload="cpu", block=BLOCK, acts_stage=None, **zero):
    """Baseline and block runs per stage; at ``acts_stage`` the block also packs the MLPs' saved activations."""
    cases = []
    for s in stages:
        b = copy.deepcopy(block)
        if s == acts_stage:
            b["activations"] = dict(ACTS)
        cases.append({"name": f"z{s}_base", "config": ds_config(s, offload, **zero), "steps": STEPS})
        cases.append({"name": f"z{s}_fp4", "config": ds_config(s, offload, b, **zero), "steps": STEPS})
    return cases


def _check_pairs(res, stages):
    report = {}
    for s in stages:
        base, fp4 = res["cases"][f"z{s}_base"], res["cases"][f"z{s}_fp4"]
        assert base["inner"] == "DeepSpeedCPUAdam"
        assert fp4["inner"] == ("FP4AdamW" if res["factory"] == "FP4AdamW" else "AdamW")
        assert fp4["config_seen"] == {"zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True}
        assert_close_curves(base["losses"], fp4["losses"])
        mb, mf = base["mem"], fp4["mem"]
        assert mb["numel"] == mf["numel"] > 0
        report[s] = (mb["total"] / mb["numel"], mf["total"] / mf["numel"])
        # docs/design.md section 1: 16 B/param (master, grad, m, v in fp32) -> 4 + 4 + 2 x 0.5625 = 9.125 B/param;
        # with one micro-batch per step ZeRO-1/2 keep the host gradient partition in bf16 (bf16_gradient_partition),
        # and ZeRO-3's master gradient is DeepSpeed's bf16 gradient partition: 2 less
        assert abs(mb["total"] / mb["numel"] - 16.0) < 0.05, mb
        if res["factory"] == "FP4AdamW":
            expect = 9.125 - 2.0
            assert abs(mf["total"] / mf["numel"] - expect) < 0.1, (s, mf)
            assert mb["states"] / mf["states"] > 6.5
    return report


@pytest.mark.distributed
@pytest.mark.slow
def test_zero_1_2_3_one_rank_train_like_the_baseline(tmp_path):
    res = _launch(_pairs((1, 2, 3), acts_stage=2), 1, tmp_path)
    print("B/param (baseline, fp4):", _check_pairs(res, (1, 2, 3)), "optimizer:", res["factory"])
    acts = res["cases"]["z2_fp4"]["activations"]
    # the MLP's activations went through the hooks: its linear inputs NVFP4 (7.1x from fp32), the activation
    # function's input and the gate product's operands MXFP8 (3.9x): 2.3x on what was stored
    assert acts["bytes_in"] > 0 and acts["compression_ratio"] > 2, acts


@pytest.mark.distributed
@pytest.mark.slow
def test_zero_1_2_3_two_ranks_train_like_the_baseline(tmp_path):
    res = _launch(_pairs((1, 2, 3)), 2, tmp_path)
    print("B/param (baseline, fp4):", _check_pairs(res, (1, 2, 3)), "optimizer:", res["factory"])


@pytest.mark.distributed
@pytest.mark.slow
def test_nvme_states_through_fp4adamw_tier(tmp_path):
    """ZeRO-2 with packed states on NVMe (DeepSpeed itself cannot offload ZeRO-2 to NVMe), and a ZeRO-3 config
    written for DeepSpeed's NVMe swapper: with the block the states go to FP4AdamW's tier instead."""
    from helpers.extensions import require_libaio

    require_libaio()  # the ZeRO-3 baseline is DeepSpeed's own NVMe swapper
    nv = {"optimizer_states": {"format": "nvfp4", "device": "nvme", "nvme_path": str(tmp_path / "nvme2")}}
    z3 = ds_config(3, "nvme")
    z3["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / "ds_nvme")
    z3_fp4 = {**copy.deepcopy(z3), "fp4offload": {"optimizer_states": {"format": "nvfp4"}}}
    res = _launch([{"name": "z2_base", "config": ds_config(2, "cpu"), "steps": STEPS},
                   {"name": "z2_fp4", "config": ds_config(2, "cpu", nv), "steps": STEPS},
                   {"name": "z3_base", "config": z3, "steps": STEPS},
                   {"name": "z3_fp4", "config": z3_fp4, "steps": STEPS}], 1, tmp_path)
    for s in (2, 3):
        base, fp4 = res["cases"][f"z{s}_base"], res["cases"][f"z{s}_fp4"]
        assert_close_curves(base["losses"], fp4["losses"])
        if res["factory"] == "FP4AdamW":
            n = fp4["mem"]["numel"]
            # m and v packed on disk: 2 x 0.5625 B/param (plus fp32 tensor scales)
            assert 1.12 * n <= fp4["mem"]["nvme"] <= 1.2 * n, fp4["mem"]
            assert fp4["mem"]["states"] < 0.2 * n, "packed states should not also stay in host RAM"
    assert any("offload_optimizer" in r for r in res["cases"]["z3_fp4"]["rewrites"])


@pytest.mark.distributed
@pytest.mark.slow
def test_two_bit_v_through_the_block_on_nvme(tmp_path):
    """``optimizer_states.v_format: "ue2m0"`` through the block, states in FP4AdamW's NVMe tier: trains like DeepSpeed's
    own ZeRO-2 offload, and its files hold m and v in about 0.88 B/param (v's codes half of 4-bit ones)."""
    nv = {"optimizer_states": {"format": "nvfp4", "device": "nvme", "nvme_path": str(tmp_path / "nvme2"),
                               "v_format": "ue2m0"}}
    res = _launch([{"name": "z2_base", "config": ds_config(2, "cpu"), "steps": STEPS},
                   {"name": "z2_fp4", "config": ds_config(2, "cpu", nv), "steps": STEPS}], 1, tmp_path)
    base, fp4 = res["cases"]["z2_base"], res["cases"]["z2_fp4"]
    assert_close_curves(base["losses"], fp4["losses"])
    if res["factory"] == "FP4AdamW":
        n = fp4["mem"]["numel"]
        # 0.5664 + 0.3164, and each file's page padding: 0.93 on this model (4-bit v: 1.12-1.2)
        assert 0.88 * n <= fp4["mem"]["nvme"] <= 0.98 * n, fp4["mem"]


# ------------------------------------------------------------------------------------------------
# client optimizers handed to initialize (what the Trainer/Accelerate pass when the config has no "optimizer")


@pytest.mark.filterwarnings("ignore:Seems like .optimizer.step")
def test_client_adamw_becomes_fp4adamw_with_its_groups_and_scheduler():
    import torch

    from fp4offload._deepspeed import optim as ds_optim
    from fp4offload._optim import FP4AdamW

    a, b = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64))
    opt = torch.optim.AdamW([{"params": [a], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0, "lr": 1e-4}],
                            lr=3e-4, betas=(0.9, 0.95), eps=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    new = ds_optim.convert_optimizer(opt, ds_optim.StatePlacement(device="cpu"))
    ds_optim.rebind_scheduler(sched, opt, new)
    assert isinstance(new, FP4AdamW) and new.state_device == "cpu"
    g0, g1 = new.param_groups
    assert g0["params"][0] is a and g1["params"][0] is b
    assert (g0["weight_decay"], g1["weight_decay"], g1["lr"], g0["betas"], g0["eps"]) == (0.1, 0.0, 5e-5, (0.9, 0.95),
                                                                                          1e-6)
    assert g0["lr"] == 1.5e-4  # the scheduler's current factor carried over
    sched.step()
    assert new.param_groups[0]["lr"] == 1.5e-4 and sched.optimizer is new


@pytest.mark.parametrize("make, key", [
    (lambda ps: __import__("torch").optim.SGD(ps, lr=0.1), "optimizer"),
    (lambda ps: __import__("torch").optim.Adam(ps, lr=0.1, weight_decay=0.1), "optimizer.defaults.weight_decay"),
    (lambda ps: __import__("torch").optim.AdamW(ps, lr=0.1, amsgrad=True), "optimizer.defaults.amsgrad"),
])
def test_client_optimizers_fp4adamw_cannot_replace_are_refused(make, key):
    import torch

    from fp4offload._deepspeed import optim as ds_optim

    opt = make([torch.nn.Parameter(torch.randn(8))])
    with pytest.raises(ConfigError) as ei:
        ds_optim.convert_optimizer(opt, ds_optim.StatePlacement())
    assert ei.value.key == key
