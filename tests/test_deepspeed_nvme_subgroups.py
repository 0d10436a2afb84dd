"""ZeRO-3 with several optimizer sub-groups and FP4AdamW's states on NVMe (real DeepSpeed, CPU accelerator).

ZeRO-3 steps the inner optimizer once per sub-group, each time with that sub-group's fp32 flat partition
alone in the param group. FP4AdamW names its NVMe files per tensor (the DeepSpeed block passes the
partition's ``ds_id``), so each sub-group keeps its own files. The run with the block must follow the same
config without it (DeepSpeedCPUAdam) within tests/test_deepspeed.py's tolerance.

This file is also the rank worker of its test (``python tests/test_deepspeed_nvme_subgroups.py SPEC``): it
runs tests/test_deepspeed_worker.py's cases and, after each, reports what FP4AdamW's NVMe tier held.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SUB_GROUP = 20_000  # elements per rank-count: the worker's small Llama (132k parameters) makes ~6 sub-groups per rank


def _expected_sub_groups(world: int, sub_group: int) -> list[int]:
    """The element counts of ZeRO-3's sub-groups on one rank (stage3._create_fp16_sub_groups, one param group)."""
    from benchmarks import harness
    from test_deepspeed_worker import MODEL

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
def test_zero3_nvme_states_with_several_sub_groups_train_like_the_baseline(tmp_path, nranks):
    from fp4offload._optim import nvme as nvme_mod
    from test_deepspeed import BLOCK, STEPS, assert_close_curves, ds_config

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
    from test_deepspeed_worker import launch

    res = launch({"cases": cases}, nranks, tmp_path, script=__file__)
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


# ------------------------------------------------------------------------------------------------
# inside a rank


def _worker(spec_path: str) -> None:
    import dataclasses

    import torch

    torch.set_num_threads(1)
    import deepspeed

    import test_deepspeed_worker as W
    from benchmarks import harness
    from fp4offload.formats.container import read_container
    from fp4offload._deepspeed import optim as ds_optim
    from fp4offload._optim import FP4AdamW

    spec = json.loads(Path(spec_path).read_text())
    made = []
    io = {"value": "auto"}

    def factory(params, hp, where):  # the block's own factory, with the case's I/O engine; keeps the optimizer
        opt = ds_optim._fp4adamw(params, hp, dataclasses.replace(where, nvme_io=io["value"]))
        made.append(opt)
        return opt

    ds_optim.set_optimizer_factory(factory)
    deepspeed.init_distributed(dist_backend="gloo")
    train, _ = harness.byte_splits()
    results = {"cases": {}}
    for case in spec["cases"]:
        made.clear()
        io["value"] = case.get("nvme_io", "auto")
        subs = []
        orig_step = FP4AdamW.step

        def step(self, *a, **k):  # count the sub-groups ZeRO-3 hands over (distinct flat tensors)
            for g in self.param_groups:
                for p in g["params"]:
                    if all(p is not q for q in subs):
                        subs.append(p)
            return orig_step(self, *a, **k)

        FP4AdamW.step = step
        orig_close = FP4AdamW.close  # engine.destroy() closes FP4AdamW; its files are looked at below first
        FP4AdamW.close = lambda self: None
        try:
            out = W._run_case(case, spec, train)
        finally:
            FP4AdamW.step, FP4AdamW.close = orig_step, orig_close
        opt = made[-1] if made else None
        if isinstance(opt, FP4AdamW) and opt.placement.store is not None:
            files = sorted(opt.placement.store.dir.glob("*.fp4s"))
            key_numel = {}
            payload = 0
            for f in files:
                meta, t = read_container(f)
                key_numel[meta["key"]] = key_numel.get(meta["key"], 0) + meta["numel"]
                payload += sum(v.numel() for k, v in t.items() if k != "_pad")
            out["nvme"] = {"io": opt.nvme_io, "keys": sorted(set(opt.placement.keys.values())),
                           "files": [f.name for f in files], "key_numel": key_numel, "payload_bytes": payload,
                           "sub_groups": len(subs)}
            opt.close()
        results["cases"][case["name"]] = out
    if int(os.environ["RANK"]) == 0:
        Path(spec["out"] + ".tmp").write_text(json.dumps(results))
        os.replace(spec["out"] + ".tmp", spec["out"])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
