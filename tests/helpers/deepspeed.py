"""What the DeepSpeed tests share: the configs they train, the loss-curve tolerance, and ``launch``.

``launch(spec, nranks, tmp)`` starts ``nranks`` processes of tests/scripts/deepspeed_worker.py (gloo over
localhost, DS_ACCELERATOR=cpu), each training the cases in ``spec`` with real DeepSpeed on a small Llama and
Shakespeare bytes, and returns rank 0's JSON result. Every process leads its own process group and is killed when the
timeout passes; its log and the spec stay in the caller's tmp folder. The worker's docstring describes a case.

Tolerance (stated once, used everywhere): every step's loss within LOSS_ABS of the baseline's, and the mean of the
last 5 steps within LOSS_REL of it. The first step (before any update) must match to 1e-5.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.dist import free_port

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
WORKER = TESTS / "scripts" / "deepspeed_worker.py"

#: the worker's model (benchmarks.harness.small_llama); a spec's "model" overrides keys of it
MODEL = dict(hidden=64, layers=2, heads=4, intermediate=172, vocab=256, seed=0)

LOSS_ABS = 0.15
LOSS_REL = 0.02
STEPS = 16

BASE = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}, "steps_per_print": 10_000}
BLOCK = {"optimizer_states": {"format": "nvfp4", "device": "cpu", "nvme_path": None}}


def ds_config(stage: int, offload: str | None = "cpu", block: dict | None = None, **zero) -> dict:
    z = {"stage": stage, **zero}
    if offload:
        z["offload_optimizer"] = {"device": offload}
    cfg = {**copy.deepcopy(BASE), "zero_optimization": z}
    if block is not None:
        cfg["fp4offload"] = copy.deepcopy(block)
    return cfg


def assert_close_curves(base: list[float], fp4: list[float]) -> None:
    assert len(base) == len(fp4) > 5
    assert abs(base[0] - fp4[0]) < 1e-5, (base[0], fp4[0])
    worst = max(abs(a - b) for a, b in zip(base, fp4))
    assert worst <= LOSS_ABS, f"a step differs by {worst:.3f} > {LOSS_ABS}: {base} vs {fp4}"
    tail_b, tail_f = sum(base[-5:]) / 5, sum(fp4[-5:]) / 5
    assert abs(tail_f - tail_b) <= LOSS_REL * tail_b, (tail_b, tail_f)
    assert fp4[-1] < fp4[0] - 1.0, "the model did not train"


def launch(spec: dict, nranks: int, tmp: Path, timeout: float = 240.0, script: str | Path | None = None) -> dict:
    """Run the worker (tests/scripts/deepspeed_worker.py, or `script` taking the same spec) on ``nranks`` ranks;
    return rank 0's result (raises with the logs on failure). The ranks import the repository and tests/ (for
    ``helpers``) through PYTHONPATH."""
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    spec_path = tmp / f"spec_{time.monotonic_ns()}.json"
    out_path = spec_path.with_suffix(".out.json")
    spec = dict(spec, out=str(out_path))
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    procs, logs = [], []
    for r in range(nranks):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), LOCAL_RANK=str(r),
                   WORLD_SIZE=str(nranks), LOCAL_WORLD_SIZE=str(nranks), DS_ACCELERATOR="cpu",
                   OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), os.environ.get("PYTHONPATH", "")]),
                   TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR",
                                                       os.path.expanduser("~/.cache/fp4offload/torch_extensions")))
        log = open(tmp / f"rank{r}_{spec_path.stem}.log", "w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(script or WORKER), str(spec_path)], cwd=str(ROOT),
                                      env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            left = max(1.0, deadline - time.monotonic())
            try:
                p.wait(timeout=left)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        # DeepSpeed's CPU shared-memory all-reduce leaves /dev/shm files named by uid, address and port
        # when a rank is killed; remove this launch's so a later run on the same port cannot open them.
        for f in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"):
            f.unlink(missing_ok=True)
    codes = [p.returncode for p in procs]
    result = json.loads(out_path.read_text()) if out_path.exists() else None
    expect_kill = any(c.get("kill_after_save") for c in spec.get("cases", []))
    ok = (result is not None or expect_kill) and all(c == 0 or (expect_kill and c == -signal.SIGKILL) for c in codes)
    if not ok:
        tails = []
        for r, log in enumerate(logs):
            log.seek(0)
            tails.append(f"--- rank {r} (exit {codes[r]}) ---\n" + log.read()[-6000:])
        raise RuntimeError("DeepSpeed worker failed:\n" + "\n".join(tails))
    for log in logs:
        log.close()
    return result
