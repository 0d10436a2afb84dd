"""ZeRO-3 with several optimizer sub-groups and FP4AdamW's states on NVMe (real DeepSpeed, CPU accelerator).

ZeRO-3 steps the inner optimizer once per sub-group, each time with that sub-group's fp32 flat partition
alone in the param group. FP4AdamW names its NVMe files per tensor (the DeepSpeed block passes the
partition's ``ds_id``), so each sub-group keeps its own files. The run with the block must follow the same
config without it (DeepSpeedCPUAdam) within the tolerance of tests/helpers/deepspeed.py.

The ranks run tests/scripts/deepspeed_nvme_worker.py: tests/scripts/deepspeed_worker.py's cases and, after each,
what FP4AdamW's NVMe tier held.
"""

from __future__ import annotations

import os

import pytest
from helpers.deepspeed import BLOCK, MODEL, STEPS, TESTS, assert_close_curves, ds_config, launch

SUB_GROUP = 20_000  # elements per rank-count: the worker's small Llama (132k parameters) makes ~6 sub-groups per rank


def _expected_sub_groups(world: int, sub_group: int) -> list[int]:
    """The element counts of ZeRO-3's sub-groups on one rank (stage3._create_fp16_sub_groups, one param group)."""
    from benchmarks import harness

    model = harness.small_llama(**MODEL)
    sizes, cur = [], 0
    params = [p for p in model.parameters() if p.requires_grad]
    for i, p in enumerate(params):
        cur += -(-p.numel() // world)
        if cur >= sub_group or i == len(params) - 1:
            sizes.append(cur)
            cur = 0
    return sizes


@pytest.mark.distributed
@pytest.mark.parametrize("nranks", [1, 2])
@pytest.mark.slow
def test_zero3_nvme_states_with_several_sub_groups_train_like_the_baseline(tmp_path, nranks):
    from fp4offload._optim import nvme as nvme_mod

    if nranks == 2 and (os.cpu_count() or 1) < 2:
        pytest.skip("two ranks need two cores")
    engines = ["threads"] + (["aio"] if nvme_mod.aio_op()[0] is not None else [])
    # one engine per rank count keeps each launch short; the 1-rank run takes aio when it loads
    io = engines[-1] if nranks == 1 else engines[0]
    sub = SUB_GROUP // nranks
    block = dict(BLOCK, optimizer_states={"format": "nvfp4", "device": "nvme", "nvme_path": str(tmp_path / "nv")})
    cases = [{"name": "base", "config": ds_config(3, "cpu", sub_group_size=sub), "steps": STEPS},
             {"name": "fp4", "config": ds_config(3, "cpu", block, sub_group_size=sub), "steps": STEPS,
              "nvme_io": io}]
    res = launch({"cases": cases}, nranks, tmp_path, script=TESTS / "scripts" / "deepspeed_nvme_worker.py")
    base, fp4 = res["cases"]["base"], res["cases"]["fp4"]
    assert base["inner"] == "DeepSpeedCPUAdam" and fp4["inner"] == "FP4AdamW"
    assert_close_curves(base["losses"], fp4["losses"])

    tier = fp4["nvme"]
    expect = _expected_sub_groups(nranks, sub)
    packed = [n for n in expect if n >= 4096]  # smaller sub-groups keep fp32 states in RAM
    assert len(expect) >= 4 and len(packed) >= 3, expect
    assert tier["io"] == io
    assert tier["sub_groups"] == len(expect)
    # one key per packed sub-group, named by DeepSpeed's ds_id, each with its own file(s)
    assert len(tier["keys"]) == len(packed) and all(k.startswith("kds") for k in tier["keys"]), tier
    assert sorted({f.split(".")[0] for f in tier["files"]}) == sorted(tier["keys"])
    assert sorted(tier["key_numel"].values()) == sorted(packed)
    # all of every packed sub-group's m and v is on disk: 2 x 0.5625 B/element plus headers
    assert tier["payload_bytes"] >= 1.125 * sum(packed), tier
