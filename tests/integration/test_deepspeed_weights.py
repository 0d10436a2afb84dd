"""ZeRO-3 ``offload_param`` with the block's ``weights``: the fetched host partitions are NVFP4 16x16.

Counts the bytes that cross host->device for parameters against DeepSpeed's bf16 offload in the same
fetches, checks the gathered weight is the NVFP4 image of the master, and that training follows the
same config without the block (tolerances as in tests/helpers/deepspeed.py, except the first step: the forward
already sees FP4 weights there).
"""

from __future__ import annotations

import copy

import pytest
from helpers.deepspeed import LOSS_ABS, LOSS_REL, ds_config, launch

MODEL = {"hidden": 128, "layers": 4, "heads": 4, "intermediate": 384}
WEIGHTS = {"format": "nvfp4", "device": "cpu", "keep_bf16": ["embed", "lm_head", "norm", "first:0"]}


def _cfg(block: dict | None, persistence: int = 0) -> dict:
    """ZeRO-3 with offload_param. persistence=0: no parameter stays gathered, every module fetches its weights
    through the coordinator's all_gather_coalesced (DeepSpeed's default keeps tensors under 1e5 elements
    gathered and re-gathers them after each step through all_gather: the other hooked entry point)."""
    cfg = ds_config(3, "cpu", block)
    cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = persistence
    # release every module's weights after use and prefetch nothing: forward and backward each fetch them
    cfg["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_max_live_parameters=0,
                                    stage3_prefetch_bucket_size=0)
    return cfg


@pytest.mark.distributed
@pytest.mark.slow
def test_fp4_weight_shards_cut_host_to_device_bytes_and_train(tmp_path):
    block = {"optimizer_states": {"format": "nvfp4", "device": "cpu"}, "weights": copy.deepcopy(WEIGHTS)}
    res = launch({"model": MODEL, "cases": [
        {"name": "base", "config": _cfg(None), "steps": 12},
        {"name": "fp4", "config": _cfg(block), "steps": 12, "probe": "weights"}]}, 2, tmp_path, timeout=300)
    base, fp4 = res["cases"]["base"], res["cases"]["fp4"]
    w = fp4["weights"]
    print("weights counters:", w, "probe:", fp4["weight_probe"])
    assert w["packed_params"] == 4 * 7 and w["kept_params"] == 4 * 2 + 3  # projections packed; norms, embed, head kept
    assert w["fetches_all_gather_coalesced"] >= 2 * 12 * w["packed_params"]  # forward and backward, every step
    assert w["encodes"] >= 12 * w["packed_params"]  # re-packed from the master after every step
    # mostly inside FP4AdamW's fused step (not the first step, nor where a rounded amax moved)
    assert w["fused_encodes"] >= 9 * w["packed_params"]
    # 16x16 NVFP4: 0.5 B codes + 1/256 B scales per element against 2 B of bf16
    assert w["h2d_reduction"] > 3.9
    assert w["h2d_all_reduction"] >= 3.0, "all parameter bytes host->device must fall at least 3x"
    probe = fp4["weight_probe"]
    assert 0.01 < probe["rel_err_vs_bf16"] < 0.2  # the fetched weight is a 4-bit image, not the bf16 copy
    # the copy is the fp32 master packed with its amax, max-reduced and rounded up to a power of two (as
    # FP4AdamW's fused step encodes it): the gathered weight is exactly that NVFP4 image of the master, and
    # the NVFP4 image of the bf16 copy taken with that amax differs only where bf16 rounding crosses an FP4
    # rounding boundary (with the bf16 copy's own amax the tensor scale moves by up to 2^-9 and shifts every
    # decoded value: see _probe_weights)
    assert probe["frac_equal_to_nvfp4_of_master"] > 0.999
    from fp4offload import FP4AdamW

    assert probe["amax_encoded"] == FP4AdamW.copy_amax(probe["amax_master"])  # rounded up to a power of two
    assert probe["frac_equal_to_nvfp4_of_bf16"] > 0.95
    b, f = base["losses"], fp4["losses"]
    assert max(abs(x - y) for x, y in zip(b, f)) <= LOSS_ABS
    assert abs(sum(f[-5:]) - sum(b[-5:])) / 5 <= LOSS_REL * sum(b[-5:]) / 5
    assert f[-1] < f[0] - 1.0
