"""Save, kill, resume: ``engine.save_checkpoint`` / ``load_checkpoint`` keep the packed states (and, under
ZeRO-3 with packed weight shards, rebuild the shards from the loaded masters), and a run resumed in new
processes repeats the uninterrupted run's losses bit for bit on CPU (2 gloo ranks)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from helpers.deepspeed import BLOCK, ds_config, launch


def _optimizer_files(ckpt: Path) -> list[Path]:
    return sorted(ckpt.rglob("*optim_states.pt"))


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.slow
def test_save_kill_resume_repeats_the_uninterrupted_losses(tmp_path, stage):
    """Train 10 steps; separately train 5, save, SIGKILL, resume in new processes for 5: same losses, bit for bit.

    ZeRO-3 runs with offload_param and packed weight shards too, so the packed copies must be rebuilt from
    the loaded masters."""
    import torch

    block = copy.deepcopy(BLOCK)
    if stage == 3:
        block["weights"] = {"format": "nvfp4", "device": "cpu", "keep_bf16": ["embed", "lm_head", "norm"]}
    cfg = ds_config(stage, "cpu", block)
    if stage == 3:
        cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    ckpt = tmp_path / "ckpt"
    first = launch({"cases": [
        {"name": "full", "config": cfg, "steps": 10},
        {"name": "half", "config": cfg, "steps": 5, "save_dir": str(ckpt), "kill_after_save": True}]},
        2, tmp_path / "a")
    files = _optimizer_files(ckpt)
    assert len(files) == 2, files  # one optimizer shard per rank
    sd = torch.load(files[0], map_location="cpu", weights_only=False)
    dtypes = {t.dtype for t in _tensors(sd)}
    if first["factory"] == "FP4AdamW":
        assert torch.uint8 in dtypes, f"packed states were not saved packed: {dtypes}"
    second = launch({"cases": [{"name": "resumed", "config": cfg, "steps": 5, "load_dir": str(ckpt)}]}, 2,
                    tmp_path / "b")
    full, resumed = first["cases"]["full"]["losses"], second["cases"]["resumed"]["losses"]
    assert resumed == full[5:], (full, resumed)
    if stage == 3:
        assert second["cases"]["resumed"]["weights"]["packed_params"] > 0


def _tensors(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
