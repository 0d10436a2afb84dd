"""The rank worker of tests/integration/test_deepspeed_nvme_subgroups.py: ``python
tests/scripts/deepspeed_nvme_worker.py SPEC.json``, started by ``helpers.deepspeed.launch``. It runs
tests/scripts/deepspeed_worker.py's cases with the block's own optimizer factory (the case's NVMe I/O engine) and,
after each, reports what FP4AdamW's NVMe tier held: its keys, files, elements per key, payload bytes and the
sub-groups ZeRO-3 stepped.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
for _path in (TESTS.parent, TESTS, TESTS / "scripts"):  # benchmarks, helpers and the DeepSpeed worker
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


# ------------------------------------------------------------------------------------------------
# inside a rank


def _worker(spec_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    import deepspeed

    import deepspeed_worker as W
    import fp4offload._optim.options as optim_options
    from benchmarks import harness
    from fp4offload.formats.container import read_container
    from fp4offload._deepspeed import optim as ds_optim
    from fp4offload._optim import FP4AdamW

    spec = json.loads(Path(spec_path).read_text())
    made = []
    io = {"value": "auto"}

    def factory(params, hp, where):  # the block's own factory, with the case's I/O engine; keeps the optimizer
        import dataclasses

        plain = optim_options.fp4adamw_kwargs  # the block's mapping of the section, with the case's io on top

        def with_io(states):
            kw = plain(states)
            return dict(kw, nvme=dataclasses.replace(kw["nvme"], io=io["value"]))

        optim_options.fp4adamw_kwargs = with_io
        try:
            opt = ds_optim._fp4adamw(params, hp, where)
        finally:
            optim_options.fp4adamw_kwargs = plain
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
    # skip the C++ teardown, as deepspeed_worker.py does (gloo can abort there after a pass)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
