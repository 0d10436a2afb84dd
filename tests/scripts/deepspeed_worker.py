"""The rank worker of the DeepSpeed tests: ``python tests/scripts/deepspeed_worker.py SPEC.json``, one process per
rank, started by ``helpers.deepspeed.launch`` (which sets RANK, WORLD_SIZE, MASTER_ADDR/PORT and the spec's
``out`` path). Each rank trains the cases in the spec with real DeepSpeed (gloo, DS_ACCELERATOR=cpu) on a small
Llama and Shakespeare bytes; rank 0 writes the JSON result after every case.

A case: ``{"name", "config" (DeepSpeed dict, with or without the block), "steps", "seed",
"save_dir"/"save_after" (save a checkpoint after that many steps), "kill_after_save" (SIGKILL
itself right after saving), "load_dir" (resume from it first), "fds" (go through
fp4offload.deepspeed.initialize; default: when the config has the block), "install" (go through a
plain deepspeed.initialize after install())}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
for _path in (TESTS.parent, TESTS):  # the repository (benchmarks) and tests/ (helpers), also when run by hand
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

BATCH, SEQ = 4, 64


# ------------------------------------------------------------------------------------------------
# inside a rank


def _batch(train, step: int, seed: int, rank: int):
    import torch

    from benchmarks import harness

    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    return harness.batch(train, BATCH, SEQ, g)


def _run_case(case: dict, spec: dict, train) -> dict:
    import deepspeed
    import torch

    import fp4offload.deepspeed as fds
    from benchmarks import harness
    from fp4offload._deepspeed import monitor as ds_monitor
    from helpers.deepspeed import MODEL

    rank = int(os.environ["RANK"])
    model = harness.small_llama(**{**MODEL, **spec.get("model", {})})
    cfg = case["config"]
    use_fds = case.get("fds", "fp4offload" in cfg)
    if case.get("install"):
        fds.install()
        init = deepspeed.initialize
    else:
        init = fds.initialize if use_fds else deepspeed.initialize
    t0 = time.perf_counter()
    saved_env = {k: os.environ.get(k) for k in case.get("env", {})}
    os.environ.update(case.get("env", {}))
    try:
        engine, opt, _, _ = init(model=model, model_parameters=[p for p in model.parameters()], config=cfg)
    finally:
        for k, v in saved_env.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    init_s = time.perf_counter() - t0
    # ZeRO-3: the master gradients start at zero, as DeepSpeed's initialize leaves them, shared or not
    z3_flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None) or []
    grads_zero_at_start = all(m.grad is None or not bool(m.grad.any()) for m in z3_flats) if z3_flats else None
    if case.get("install"):
        fds.uninstall()
    start = 0
    print(f"[worker] {case['name']}: initialize took {init_s:.1f}s", flush=True)
    if case.get("load_dir"):
        _, client = engine.load_checkpoint(case["load_dir"])
        start = int(client["next_step"])
    losses = []
    steps = int(case["steps"])
    seed = int(case.get("seed", 0))
    t0 = time.perf_counter()
    for step in range(start, start + steps):
        tokens = _batch(train, step, seed, rank)
        loss = harness.lm_loss(engine, tokens)
        if case.get("nan_at") == step:  # every gradient of this step NaN
            loss = loss * float("nan")
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
        if case.get("save_dir") and step + 1 == start + int(case.get("save_after", steps)):
            engine.save_checkpoint(case["save_dir"], client_state={"next_step": step + 1})
            if case.get("kill_after_save"):
                torch.distributed.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
    step_s = (time.perf_counter() - t0) / max(1, steps)
    print(f"[worker] {case['name']}: {steps} steps, {step_s:.3f}s/step", flush=True)
    mem = ds_monitor.optimizer_host_bytes(engine)
    out = {"losses": losses, "mem": mem, "init_s": init_s, "step_s": step_s, "grads_zero_at_start": grads_zero_at_start,
           "inner": type(engine.basic_optimizer).__name__, "zero": type(engine.optimizer).__name__,
           "config_seen": {k: engine._config._param_dict.get(k)
                           for k in ("zero_force_ds_cpu_optimizer", "zero_allow_untested_optimizer")}}
    att = getattr(engine, "fp4offload", None)
    if att is not None:
        out["rewrites"] = list(att.prepared.rewrites)
        if att.weights is not None:
            out["weights"] = att.weights.counters()
        if att.activations is not None:
            snap = att.activations.offloader.snapshot()
            out["activations"] = {k: snap.get(k) for k in ("bytes_in", "bytes_out", "compression_ratio")}
        if att.monitor is not None:
            out["monitor_written"] = att.monitor.written
            out["monitor_last"] = att.monitor.last
    if case.get("probe") == "states":
        out["state_dtypes"] = sorted({str(v.dtype) for s in engine.basic_optimizer.state.values()
                                      for v in s.values() if isinstance(v, torch.Tensor)})
    if case.get("probe") == "staging":  # ZeRO-1/2 offload's bf16 staging buffers against the bf16 partitions
        zo = engine.optimizer
        bufs = getattr(zo, "param_buffer_of_bit16_for_cpu_offload_groups", [])
        parts = [zo.parallel_partitioned_bit16_groups[i][torch.distributed.get_rank()] for i in range(len(bufs))]
        out["staging"] = {"shared_bytes": att.staging_shared_bytes if att is not None else 0,
                          "partition_bytes": sum(p.numel() * p.element_size() for p in parts),
                          "aliased": [b.data_ptr() == p.data_ptr() for b, p in zip(bufs, parts)]}
    if case.get("probe") == "grads":  # ZeRO-1/2 offload's host gradient partitions
        zo = engine.optimizer
        out["grads"] = {"dtypes": [str(m.grad.dtype) for m in zo.single_partition_of_fp32_groups],
                        "saved_bytes": att.bf16_grad_bytes_saved if att is not None else 0,
                        "at_init": att.bf16_grads_at_init if att is not None else False,
                        "numel": sum(m.numel() for m in zo.single_partition_of_fp32_groups)}
    if case.get("probe") == "master":  # the master partitions, what the optimizer holds for them, the weights
        out["master"] = _probe_master(engine, att)
    if case.get("probe") == "weights" and att is not None and att.weights is not None:
        out["weight_probe"] = _probe_weights(engine, att.weights)
    engine.destroy() if hasattr(engine, "destroy") else None
    del engine, opt, model
    return out


def _probe_master(engine, att) -> dict:
    """The master partitions (ZeRO-1/2's or ZeRO-3's), what the optimizer holds for them, hashes of the rebuilt
    fp32 masters and of the weights the model computes with (ZeRO-3: each parameter's partition)."""
    import hashlib

    import torch

    from fp4offload._optim import master as MW

    zo, inner = engine.optimizer, engine.basic_optimizer
    z3 = not getattr(zo, "single_partition_of_fp32_groups", None)
    masters = getattr(zo, "fp32_partitioned_groups_flat" if z3 else "single_partition_of_fp32_groups", [])
    if z3:
        device = list(zo.fp16_partitioned_groups_flat)
    else:
        rank = torch.distributed.get_rank()
        device = [g[rank] for g in zo.parallel_partitioned_bit16_groups]
    bufs = getattr(zo, "param_buffer_of_bit16_for_cpu_offload_groups", [])
    hm, hw = hashlib.sha256(), hashlib.sha256()
    for m in masters:
        st = inner.state.get(m, {})
        res = inner.placement.states_and_residual(st, m)[2] if "v_format" in st else None  # in the NVMe files
        lo, odd = res if res is not None else (st.get("master_lo"), st.get("master_odd"))
        x = MW.join(m.view(-1), lo, odd) if lo is not None else m.float()
        hm.update(x.detach().contiguous().numpy().tobytes())
    for prm in engine.module.parameters():
        hw.update((prm.ds_tensor if z3 else prm).detach().float().contiguous().numpy().tobytes())
    # ZeRO-1/2: DeepSpeed's own view of each master fragment (what safe_get_full_fp32_param and checkpoint
    # conversion read) is the master the steps update, so rounded to bf16 it is the model's weight
    hp_live = None
    if not z3:
        from deepspeed.utils import safe_get_full_fp32_param

        hp_live = all(torch.equal(safe_get_full_fp32_param(prm).to(prm.dtype), prm.detach())
                      for prm in engine.module.parameters())
    # ZeRO-3: whether each master's gradient lies inside DeepSpeed's flat gradient partition (one copy, not two)
    gbuf = getattr(zo, "grad_partitions_flat_buffer", None) if z3 else None
    grad_in_partition = None
    if gbuf is not None:
        lo, hi = gbuf.data_ptr(), gbuf.data_ptr() + gbuf.numel() * gbuf.element_size()
        grad_in_partition = [m.grad is not None and lo <= m.grad.data_ptr() < hi for m in masters]
    return {"dtypes": [str(m.dtype) for m in masters], "numel": sum(m.numel() for m in masters),
            "grad_dtypes": [str(m.grad.dtype) if m.grad is not None else None for m in masters],
            "grad_in_partition": grad_in_partition,
            "grads_at_init": getattr(att, "zero3_grads_at_init", None),
            "form": getattr(inner, "master", None),
            "held": inner.master_bytes() if hasattr(inner, "master_bytes") else None,
            "staging_is_master": [b.data_ptr() == m.data_ptr() for b, m in zip(bufs, masters)],
            "master_is_partition": [d is not None and d.data_ptr() == m.data_ptr() for d, m in zip(device, masters)],
            "master_sha": hm.hexdigest(), "weights_sha": hw.hexdigest(), "hp_live": hp_live,
            "rewrites": list(att.prepared.rewrites) if att else [],
            "skipped": getattr(inner, "skipped_steps", None),
            "norm_source": getattr(getattr(inner, "hooks", None), "norm_source", None) is not None}


def _probe_weights(engine, pw) -> dict:
    """Gather one packed weight through the hook; compare it with the NVFP4 image of the fp32 master and of
    DeepSpeed's bf16 partitions.

    The hook packs the fp32 master with its tensor-wide amax rounded up to a power of two (FP4AdamW.copy_amax,
    ds_weights._after_step); the shard records it. The bf16
    copy's own amax is the master's amax rounded to bf16, a different tensor scale whenever the largest
    master element is not a bf16 value (any element the optimizer has moved off the bf16 grid, e.g. with
    stochastic rounding of m): then every block scale can round differently and most codes shift. So the
    bf16 reference is quantized with the master's amax; the codes then differ only where the bf16 rounding
    of an element crosses an FP4 rounding boundary. ``*_own_amax`` keeps the comparison with the bf16
    copy's own amax, for the record.
    """
    import deepspeed
    import torch

    from fp4offload import dequantize, quantize

    def gather(t: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(parts, t.contiguous())
        return torch.cat(parts)[: p.ds_numel].float().reshape(p.ds_shape)

    def nvfp4_image(x: torch.Tensor, amax=None) -> torch.Tensor:
        return dequantize(quantize(x, "nvfp4", block="16x16", amax=amax), torch.float32).to(p.dtype).float()

    p = next(q for q in engine.module.parameters() if id(q) in pw.shards)
    ref = gather(p.ds_tensor.data)  # DeepSpeed's bf16 partitions
    sg, off, n = pw.offsets[id(p)]
    master = gather(engine.optimizer.fp32_partitioned_groups_flat[sg].data.narrow(0, off, n))
    with deepspeed.zero.GatheredParameters([p]):
        got = p.data.float().clone()
    amax = torch.tensor(pw.shards[id(p)].amax)  # what the copy was encoded with (max-reduced over the partitions)
    want = nvfp4_image(ref, amax)
    want_own = nvfp4_image(ref)
    want_master = nvfp4_image(master, amax)
    return {"rel_err_vs_bf16": float((got - ref).norm() / ref.norm()),
            "rel_diff_vs_nvfp4_of_bf16": float((got - want).norm() / ref.norm()),
            "frac_equal_to_nvfp4_of_bf16": float((got == want).float().mean()),
            "frac_equal_to_nvfp4_of_master": float((got == want_master).float().mean()),
            "frac_equal_to_nvfp4_of_bf16_own_amax": float((got == want_own).float().mean()),
            "amax_master": float(master.abs().max()), "amax_encoded": float(amax),
            "amax_bf16": float(ref.abs().max()),
            "amax_master_is_bf16": bool(float(amax.to(torch.bfloat16).float()) == float(amax))}


def _run_trainer(spec: dict, train) -> dict:
    """A Hugging Face Trainer run with ``--deepspeed <json>`` after ``fp4offload.deepspeed.install()``."""
    import torch
    from transformers import HfArgumentParser, Trainer, TrainingArguments

    import fp4offload.deepspeed as fds
    from benchmarks import harness
    from helpers.deepspeed import MODEL

    fds.install()
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(spec["argv"])
    model = harness.small_llama(**MODEL)
    g = torch.Generator().manual_seed(0)
    rows = [harness.batch(train, 1, SEQ, g)[0] for _ in range(64)]
    data = [{"input_ids": r[:-1], "labels": r[:-1]} for r in rows]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    engine = trainer.model_wrapped
    att = getattr(engine, "fp4offload", None)
    out = {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
           "engine": type(engine).__name__, "inner": type(engine.basic_optimizer).__name__,
           "has_block": att is not None, "global_steps": int(engine.global_steps),
           "monitor_written": att.monitor.written if att is not None and att.monitor is not None else 0,
           "repr": repr(att)}
    fds.uninstall()
    return out


def main(spec_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    import deepspeed

    from benchmarks import harness
    from fp4offload._deepspeed import optim as ds_optim

    if spec.get("factory", "auto") == "adamw" or (spec.get("factory", "auto") == "auto"
                                                   and not ds_optim.fp4adamw_available()):
        ds_optim.set_optimizer_factory(lambda params, hp, where: torch.optim.AdamW(params, **hp.as_dict()))
        factory = "torch.optim.AdamW"
    else:
        factory = "FP4AdamW"
    deepspeed.init_distributed(dist_backend="gloo")
    train, _ = harness.byte_splits()
    results = {"factory": factory, "cases": {}}

    def write() -> None:  # after every case, so a later kill cannot lose earlier results
        if int(os.environ["RANK"]) == 0:
            Path(spec["out"] + ".tmp").write_text(json.dumps(results))
            os.replace(spec["out"] + ".tmp", spec["out"])

    if spec.get("trainer"):
        results["trainer"] = _run_trainer(spec, train)
        write()
    for case in spec.get("cases", []):
        results["cases"][case["name"]] = _run_case(case, spec, train)
        write()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # Results are written and the process group is destroyed. Leave without the interpreter's C++ teardown, where
    # gloo work objects that ZeRO-3 leaves behind can abort the process ("terminate called without an active
    # exception") after everything has passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
