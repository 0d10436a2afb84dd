"""``fp4offload.fsdp.prepare`` under a real ``accelerate launch`` (FSDP2 config, 2 CPU ranks, gloo).

The test writes an Accelerate config (``distributed_type: FSDP``, ``fsdp_config: {fsdp_version: 2, ...}``,
``num_processes: 2``, ``use_cpu: true``) and launches tests/scripts/accelerate_fsdp_script.py twice: through
``ff.prepare`` with a policy YAML, and as plain Accelerate FSDP2 with torch AdamW. Same model and data.

Accelerate 1.15 turns FSDP on only on accelerator devices, so on a CPU-only machine the launched ranks come
up as MULTI_CPU; the script (``--cpu``) then sets the accelerator's state to FSDP with the plugin Accelerate
builds from the launch config, the one decision Accelerate would make on GPUs (see the script's docstring).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from helpers.dist import free_port, launch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "accelerate_fsdp_script.py"
STEPS = 8
TIMEOUT = 240  # seconds per launch (measured: 25-30 s on 2 cores)

ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_reshard_after_forward: true
  fsdp_offload_params: false
  fsdp_cpu_ram_efficient_loading: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_activation_checkpointing: false
mixed_precision: bf16
num_machines: 1
num_processes: 2
machine_rank: 0
main_training_function: main
use_cpu: true
rdzv_backend: static
same_network: true
"""

# every weight but the norms gathered as NVFP4 (the default keeps the first and last block, i.e. all of
# this 2-block model); packed Adam states from 1024 elements on, so nearly every parameter has them
POLICY = """\
weights:
  format: nvfp4
  keep_bf16: [norm]
optimizer_states:
  format: nvfp4
  min_numel: 1024
"""


def _launch(tmp: Path, mode: str) -> dict:
    cfg = tmp / "accelerate_fsdp2.yaml"
    cfg.write_text(ACCELERATE_CONFIG)
    policy = tmp / "policy.yaml"
    policy.write_text(POLICY)
    out, log = tmp / f"{mode}.json", tmp / f"{mode}.log"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg),
           "--main_process_port", str(free_port()), str(SCRIPT), "--mode", mode, "--out", str(out),
           "--steps", str(STEPS), "--cpu"]
    if mode == "fp4":
        cmd += ["--policy", str(policy)]
    return launch(cmd, log, out, TIMEOUT, f"accelerate launch ({mode})")


@pytest.mark.slow
@pytest.mark.distributed
def test_accelerate_launch_fsdp2_prepare_trains_with_fp4adamw_and_nvfp4_gathers(tmp_path):
    fp4 = _launch(tmp_path, "fp4")
    plain = _launch(tmp_path, "plain")

    for r in (fp4, plain):  # both ran on Accelerate's FSDP2 path with two ranks
        assert r["distributed_type"] == r["distributed_type_after"] == "FSDP", r
        assert r["is_fsdp2"] and r["num_processes"] == 2, r
        assert r["mixed_precision"] == "bf16" and r["wrapper"] == "AcceleratedOptimizer" and r["registered"]
        assert r["finite"] and len(r["losses"]) == STEPS

    # the optimizer: FP4AdamW over the local shards, ~1.13 B of state per packed element
    assert fp4["is_fp4adamw"] and fp4["inner_name"] == "fp4offload.FP4AdamW", fp4["inner"]
    n_norms = sum("norm" in n for n in fp4["names"])
    assert fp4["group_sizes"] == [len(fp4["names"]) - n_norms, n_norms] and fp4["group_decay"] == [1e-2, 0.0]
    assert abs(fp4["packed_B_per_param"] - 1.13) < 0.02, fp4["packed_B_per_param"]
    assert fp4["packed_numel"] > 0.99 * fp4["numel"] and fp4["state_B_per_param"] < 1.2, fp4
    assert not plain["is_fp4adamw"] and plain["inner"] == "AdamW"
    assert plain["state_B_per_param"] == 8.0  # exp_avg + exp_avg_sq, fp32

    # the all-gathers: every weight but the norms (keep_bf16: [norm]) gathered as NVFP4
    assert fp4["fp4"] == [n for n in fp4["names"] if "norm" not in n]
    assert fp4["stats"]["gathers"] > 0 and fp4["stats"]["packed_bytes"] > 0
    ratio = plain["allgather_bytes_per_step"] / fp4["allgather_bytes_per_step"]
    assert ratio > 3.0, ratio  # measured 4.0

    # what the Accelerate config decided: bf16 compute and reduce, the layer class, no offload
    assert fp4["policy"] == {"param_dtype": "torch.bfloat16", "reduce_dtype": "torch.bfloat16", "cpu_offload": False,
                             "reshard_after_forward": True, "block_classes": ["LlamaDecoderLayer"]}

    # the losses: same start as plain Accelerate (same model and batches; NVFP4 weights), both train
    assert abs(fp4["losses"][0] - plain["losses"][0]) < 1e-2, (fp4["losses"][0], plain["losses"][0])
    for r in (fp4, plain):
        assert r["losses"][-1] < r["losses"][0] - 1.0, r["losses"]
        assert sum(r["losses"][-3:]) < sum(r["losses"][:3]), r["losses"]
    assert abs(fp4["losses"][-1] - plain["losses"][-1]) / plain["losses"][-1] < 0.05
    # and exactly the losses of apply + optimizer without Accelerate: its wrapping changes nothing
    assert fp4["direct_losses"] == fp4["losses"]

    # settings prepare refuses, before anything changes, each named with its fix
    err = fp4["errors"]
    assert "policy.cpu_offload" in err["cpu_offload"] and "fsdp_offload_params" in err["cpu_offload"]
    assert "fsdp_version" in err["fsdp_version_1"] and "fsdp_version: 2" in err["fsdp_version_1"]
    assert "LlamaMLP" in err["block_classes"] and "fsdp_transformer_layer_cls_to_wrap" in err["block_classes"]
    assert all(math.isfinite(x) for x in plain["losses"])


def test_prepare_refuses_an_accelerator_that_is_not_on_fsdp2(monkeypatch):
    """A plain Accelerator() in this process (distributed_type NO): ConfigError naming the config to use."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    import fp4offload.fsdp as ff
    from fp4offload.errors import ConfigError

    for k in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(k, raising=False)
    saved = dict(os.environ)
    try:
        acc = accelerate.Accelerator(cpu=True)
        with pytest.raises(ConfigError) as e:
            ff.prepare(acc, torch.nn.Linear(4, 4))
        msg = str(e.value)
        assert "accelerator.distributed_type" in msg and "fsdp_version: 2" in msg and "CPU-only" in msg, msg
        with pytest.raises(ConfigError, match="an accelerate.Accelerator"):
            ff.prepare(object(), torch.nn.Linear(4, 4))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        os.environ.clear()
        os.environ.update(saved)
