"""A real Hugging Face Trainer run with ``--deepspeed <config with the block>`` after ``install()``.

The Trainer (through Accelerate) calls a plain ``deepspeed.initialize``; after
``fp4offload.deepspeed.install()`` that call applies the block: ZeRO's inner optimizer is FP4AdamW and
the monitor writes the block's counters to DeepSpeed's csv_monitor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.deepspeed import launch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
@pytest.mark.slow
def test_hf_trainer_with_deepspeed_flag_honours_the_block(tmp_path):
    """The README's configuration: the shipped block and a DeepSpeed csv_monitor, no monitor key of the block's
    own. Over 20 steps every metric the README names is written, from the first write on."""
    cfg = json.loads((ROOT / "configs" / "deepspeed_zero2_offload_cpu.json").read_text())
    cfg["fp4offload"].pop("monitor", None)  # DeepSpeed's monitor alone is enough
    cfg["csv_monitor"] = {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "fp4"}
    path = tmp_path / "ds_zero2.json"
    path.write_text(json.dumps(cfg))
    # TrainingArguments that agree with the JSON (the Trainer refuses values that disagree)
    argv = ["--output_dir", str(tmp_path / "out"), "--deepspeed", str(path), "--max_steps", "20",
            "--per_device_train_batch_size", "4", "--learning_rate", "3e-4", "--weight_decay", "0.1",
            "--adam_beta2", "0.95", "--max_grad_norm", "1.0", "--bf16", "true", "--logging_steps", "1",
            "--save_strategy", "no", "--report_to", "none", "--dataloader_num_workers", "0", "--use_cpu", "true"]
    res = launch({"trainer": True, "argv": argv, "cases": []}, 1, tmp_path, timeout=240)
    tr = res["trainer"]
    assert tr["has_block"], "deepspeed.initialize inside the Trainer did not go through fp4offload"
    assert tr["inner"] == "FP4AdamW"
    assert tr["global_steps"] == 20 and len(tr["losses"]) == 20
    assert tr["losses"][-1] < tr["losses"][0]
    assert tr["monitor_written"] == 2  # monitor.every's default, 10
    # "to see it working": the replacement said once, on rank 0, by default (no logging setup)
    log = next(tmp_path.glob("rank0_spec_*.log")).read_text()
    replaced = [x for x in log.splitlines() if x.startswith("fp4offload: replaced ")]
    assert len(replaced) == 1 and "with FP4AdamW: m in NVFP4" in replaced[0], replaced
    # print(engine.fp4offload): a few lines for a person, not the dataclass's field dump
    summary = tr["repr"].splitlines()
    assert summary[0] == "fp4offload block on this engine:" and len(summary) <= 8 and len(tr["repr"]) < 800
    assert "m in NVFP4" in summary[1] and "1.13 B/param" in summary[1]
    assert any("every 10 steps" in x for x in summary) and any("per rank" in x for x in summary)
    csvs = sorted((tmp_path / "csv").rglob("*.csv"))
    names = {p.name for p in csvs}
    assert any("optimizer_host_bytes" in n for n in names), names
    rows = [line.split(",") for line in next(p for p in csvs if "per_param" in p.name).read_text().split()[1:]]
    assert [int(float(r[0])) for r in rows] == [10, 20]
    # the README's metrics: host bytes per parameter, quantization error of m and v, skipped steps
    for name in ("optimizer_host_bytes_per_param", "optim.qerr.m", "optim.qerr.v", "optimizer_skipped_steps"):
        hit = [p for p in csvs if name in p.name.replace("/", "_")]
        assert hit, (name, sorted(names))
        steps = [int(float(line.split(",")[0])) for line in hit[0].read_text().split()[1:]]
        assert steps == [10, 20], (name, steps)
    qerr = [float(line.split(",")[1]) for line in next(p for p in csvs if "optim.qerr.v" in p.name)
            .read_text().split()[1:]]
    assert all(0 < q < 0.5 for q in qerr), qerr
    # fp32 master 4 + bf16 gradient partition 2 (one micro-batch per step) + packed m, v 1.13
    assert all(abs(float(r[1]) - 7.13) < 0.1 for r in rows), rows
