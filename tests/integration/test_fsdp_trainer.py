"""``FP4FSDPTrainer``: the Hugging Face Trainer on a model sharded by ``fp4offload.fsdp.apply``, under a real
``torchrun --nproc_per_node 2`` (gloo, CPU).

tests/scripts/trainer_fsdp_script.py trains a small Llama on Shakespeare bytes for 20 steps twice with the same
TrainingArguments (cosine LR with warmup, ``max_grad_norm``, two micro-batches per step, a checkpoint at step 10):
with a policy YAML of NVFP4 all-gathers and FP4AdamW states, and with ``Policy(optimizer_states=None)`` (the same
sharding, torch AdamW). Then it resumes the FP4 run from its checkpoint in a new Trainer, writes the model with
``save_model`` and reads it back with ``from_pretrained``.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

from helpers.dist import free_port, launch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "trainer_fsdp_script.py"
STEPS = 20
LR = 3e-3  # the script's learning rate
TIMEOUT = 240  # seconds (measured: about 20 s on 2 cores)

# every weight but the norms gathered as NVFP4; packed Adam states from 1024 elements on
POLICY = """\
weights:
  format: nvfp4
  keep_bf16: [norm]
optimizer_states:
  format: nvfp4
  min_numel: 1024
"""


def _launch(tmp: Path) -> dict:
    policy, out, log = tmp / "policy.yaml", tmp / "result.json", tmp / "torchrun.log"
    policy.write_text(POLICY)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(SCRIPT), "--work", str(tmp / "work"), "--out", str(out),
           "--policy", str(policy), "--steps", str(STEPS)]
    return launch(cmd, log, out, TIMEOUT, "torchrun")


@pytest.mark.distributed
@pytest.mark.slow
def test_trainer_on_fsdp2_trains_with_fp4adamw_like_adamw_and_resumes_from_its_checkpoint(tmp_path):
    r = _launch(tmp_path)
    fp4, adamw = r["fp4"], r["adamw"]
    assert r["world_size"] == 2 and r["finite"]

    # the optimizer: FP4AdamW (packed m and v) inside Accelerate's wrapper; the baseline is torch AdamW
    assert "FP4AdamW" in fp4["optimizer_mro"] and fp4["optimizer_inner"] == "fp4offload.FP4AdamW"
    assert {"m_codes", "v_codes"} <= set(fp4["state_keys"]), fp4["state_keys"]
    assert "FP4AdamW" not in adamw["optimizer_mro"] and "AdamW" in adamw["optimizer_mro"]
    assert adamw["optimizer_inner"] == "torch.optim.AdamW" and adamw["state_keys"] == ["exp_avg", "exp_avg_sq", "step"]
    for arm in (fp4, adamw):  # sharded by fully_shard, never wrapped in DDP
        assert arm["wrapper"] == "AcceleratedOptimizer" and arm["model_wrapped_is_model"]
        assert arm["model_class"] == "FSDPLlamaForCausalLM"
    assert fp4["fp4_weights"] > 0

    # the Trainer's loop: a log line per step, warmup then cosine decay, clipped gradients' norms
    for arm in (fp4, adamw):
        assert arm["steps"] == list(range(1, STEPS + 1))
        assert arm["lrs"][0] == 0.0 and arm["lrs"][2] == pytest.approx(LR) and arm["lrs"][-1] < 0.05 * LR
        assert all(0 < g < 10 for g in arm["grad_norms"]), arm["grad_norms"]
        losses = arm["losses"]
        assert losses[-1] < losses[0] - 1.0, losses
        assert sum(losses[-3:]) < sum(losses[:3]), losses

    # FP4AdamW with NVFP4 gathers ends within 10% of torch AdamW's loss
    assert abs(fp4["losses"][-1] - adamw["losses"][-1]) / adamw["losses"][-1] < 0.10, (fp4["losses"], adamw["losses"])

    # the step-10 checkpoint: fp4offload.fsdp.save's shards (model and optimizer) beside the Trainer's own files
    for arm in (fp4, adamw):
        files = arm["checkpoint"]
        assert any(f.startswith("fp4offload_fsdp/") and f.endswith(".safetensors") for f in files), files
        assert {"scheduler.pt", "trainer_state.json", "rng_state_0.pth", "rng_state_1.pth"} <= set(files), files
        assert "optimizer.pt" not in files  # not the Trainer's rank-0 pickle of one rank's shards

    # resuming from it in a new Trainer over a new model repeats the uninterrupted run's steps 11-20
    resumed = r["resumed"]
    assert resumed["steps"] == list(range(1, STEPS + 1))
    half = STEPS // 2
    assert resumed["losses"][half:] == fp4["losses"][half:], (resumed["losses"], fp4["losses"])
    assert resumed["lrs"][half:] == fp4["lrs"][half:]

    # save_model: a from_pretrained folder with the full weights (fp32 masters, not the NVFP4 copies)
    reload = r["reload"]
    assert {"config.json", "model.safetensors"} <= set(reload["files"]), reload["files"]
    assert math.isfinite(reload["reloaded_loss"])
    assert abs(reload["reloaded_loss"] - reload["sharded_loss"]) < 0.05, reload

    # refused settings, each named with its value and the fix
    err = r["refused"]
    assert "TrainingArguments.fp16=True" in err["fp16"] and "--bf16" in err["fp16"]
    assert "TrainingArguments.optim='sgd'" in err["optim"] and "adamw_torch" in err["optim"]
    assert "load_best_model_at_end=True" in err["load_best_model_at_end"]
    assert "fp4offload.fsdp.load" in err["load_best_model_at_end"]
    assert "fsdp_policy" in err["policy"] and "policy YAML" in err["policy"]
    assert "resume_from_checkpoint" in err["resume"] and "fp4offload_fsdp/" in err["resume"]


def test_trainer_refuses_before_sharding(tmp_path, monkeypatch):
    """In this process (no torchrun, no process group): each refusal names the setting and the fix, and the model
    is left unsharded."""
    import torch
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from torch.distributed.tensor import DTensor
    from transformers import TrainingArguments

    from benchmarks import harness
    from fp4offload._fsdp.trainer import FP4FSDPTrainer
    from fp4offload.errors import ConfigError

    for k in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k, raising=False)
    saved = dict(os.environ)
    try:
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
        model = harness.small_llama(hidden=32, layers=1, heads=2, intermediate=64)
        with pytest.raises(ConfigError, match="optimizers") as e:
            FP4FSDPTrainer(model, args, optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
        assert "learning_rate" in str(e.value)
        with pytest.raises(ConfigError, match="model_init"):
            FP4FSDPTrainer(None, args, model_init=lambda: model)
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
        with pytest.raises(ConfigError, match="ACCELERATE_USE_FSDP") as e:
            FP4FSDPTrainer(model, args)
        assert "fp4offload.fsdp.prepare" in str(e.value)
        monkeypatch.delenv("ACCELERATE_USE_FSDP")
        with pytest.raises(ConfigError, match="torch.distributed") as e:
            FP4FSDPTrainer(model, args)
        assert "torchrun --nproc_per_node" in str(e.value)
        assert not any(isinstance(p, DTensor) for p in model.parameters())
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
        os.environ.clear()
        os.environ.update(saved)
