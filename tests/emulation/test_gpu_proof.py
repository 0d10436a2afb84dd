"""The GPU proof's pieces that do not need a GPU: its arms map to real catalogue strategies and valid
DeepSpeed blocks, its model is the size the proof promises, its summary computes the ratios it reports, and
its scripts parse. The whole dry run (GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh) runs in .ci/run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from benchmarks import gpu_e2e

ROOT = Path(__file__).resolve().parents[2]


def test_arms_name_real_strategies_and_peers():
    from fp4offload._planner import strategies

    cat = strategies.load_catalogue()
    for arm, (family, strategy, _) in gpu_e2e.ARMS.items():
        assert family in ("torch", "fsdp", "deepspeed"), arm
        assert strategy is None or strategy in cat, (arm, strategy)
    for arm, (peer, _) in gpu_e2e.PEERS.items():
        assert arm in gpu_e2e.ARMS and peer in gpu_e2e.ARMS and arm != peer


def test_gpu_model_is_one_to_three_billion_parameters():
    from fp4offload._planner import models

    n = models.from_hf_config(gpu_e2e.hf_config(gpu_e2e.dims(dry=False))).param_count()
    assert 1e9 <= n <= 3e9, n
    assert gpu_e2e.dims(dry=False)["seq"] == 2048
    torch = pytest.importorskip("torch")
    from benchmarks import harness

    d = gpu_e2e.dims(dry=True)  # the planner's count is the model's own (checked on the dry model)
    m = harness.small_llama(hidden=d["hidden"], layers=d["layers"], heads=d["heads"], intermediate=d["intermediate"],
                            max_seq=d["seq"])
    assert sum(p.numel() for p in m.parameters()) == models.from_hf_config(gpu_e2e.hf_config(d)).param_count()
    del torch


@pytest.mark.parametrize("arm", [a for a in gpu_e2e.ARMS if a.startswith("ds_")])
def test_deepspeed_arms_are_valid_configs(arm):
    import fp4offload.deepspeed as fds

    cfg = gpu_e2e._ds_config(arm, cuda=True)
    assert ("fp4offload" in cfg) == arm.endswith("_block")
    assert cfg["zero_optimization"]["stage"] == (2 if "z2" in arm else 3)
    if "fp4offload" in cfg:
        prepared = fds.prepare_config(cfg)  # validation and the block's rewrites, nothing built
        assert prepared.ds_config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_summary_ratios():
    rows = [{"kind": "e2e", "arm": "baseline", "params": 1e9, "peak_gpu_bytes": 10 * 2**30, "tokens_per_s": 1000.0,
             "losses": [5.5, 5.0]},
            {"kind": "e2e", "arm": "fp4adamw", "params": 1e9, "peak_gpu_bytes": 7 * 2**30, "tokens_per_s": 960.0,
             "losses": [5.5, 5.01]},
            {"kind": "planner", "arm": "baseline", "strategy": "zero2", "predicted_gpu_bytes": 11 * 2**30,
             "measured_gpu_bytes": 10 * 2**30, "error": 0.1}]
    text = gpu_e2e.summary(rows)
    line = next(x for x in text.splitlines() if x.startswith("| fp4adamw "))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == "7.00" and cells[5] == "baseline" and cells[6] == "0.700" and cells[7] == "0.960"
    assert "| baseline | zero2 | 11.00 | 10.00 | +10.0% |" in text


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_wheels.sh"])
def test_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_torch_compat_finds_missing_names_and_keywords(tmp_path):
    """benchmarks/torch_compat.py (the check behind pyproject's torch claim) flags a keyword the older torch's
    source lacks and a module that is absent there, and nothing that both have."""
    import torch

    from benchmarks import torch_compat

    src = tmp_path / "src"
    src.mkdir()
    (src / "use.py").write_text("import torch\nfrom torch.distributed.fsdp import MixedPrecisionPolicy\n"
                                "MixedPrecisionPolicy(param_dtype=torch.bfloat16, no_such_keyword=1)\n"
                                "torch.distributed.fsdp.fully_shard\n")
    here = Path(torch.__file__).parent
    same = torch_compat.check(here, [src])  # the installed torch against itself: only the invented keyword
    assert len(same) == 1 and "no_such_keyword" in same[0], same
    empty = tmp_path / "old" / "torch"  # an "older torch" without those files
    empty.mkdir(parents=True)
    gone = torch_compat.check(empty, [src])
    assert any("fully_shard" in m for m in gone) and any("param_dtype" in m for m in gone), gone
