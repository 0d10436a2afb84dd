"""``plan --check`` for a named node agrees with ``plan`` and with the README; it honours every machine flag,
fills the Trainer's "auto" values, exits non-zero on a config that does not fit, and refuses what initialize
would refuse."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from fp4offload._planner import cli_plan

ROOT = Path(__file__).resolve().parents[2]
Z2 = ROOT / "configs" / "deepspeed_zero2_offload_cpu.json"


@pytest.fixture(autouse=True)
def _cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # this machine's answer, which a named node must not take


def _check(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli_plan.main(["plan", "--check", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _json(capsys, *argv: str) -> dict:
    rc, out, err = _check(capsys, *argv, "--format", "json")
    assert rc in (0, 1), err
    return json.loads(out)


def test_a_named_node_prints_what_plans_table_prints(capsys):
    """The same model, config and node: plan --check's node totals are plan's "host GiB/node" cells."""
    doc = _json(capsys, str(Z2), "--model", "llama-2-7b", "--gpu", "h100-80gb")
    assert not doc["here"] and doc["accelerator"] == "gpu" and doc["local_ranks"] == 8
    check = {a["arm"]: a["node_bytes"] for a in doc["arms"]}
    rc = cli_plan.main(["plan", "--model", "llama-2-7b", "--gpu", "h100-80gb", "--strategy", "zero2-opt-cpu",
                        "--strategy", "zero2-opt-cpu-fp4", "--format", "json"])
    plan = json.loads(capsys.readouterr().out)
    assert rc == 0
    host = {c["name"]: c["memory"]["host_bytes_per_node"] for c in plan["ranked"]}
    assert host["zero2-opt-cpu"] == pytest.approx(check["without the block"], rel=1e-6)
    assert host["zero2-opt-cpu-fp4"] == pytest.approx(check["with the block"], rel=1e-6)


def test_the_readme_saves_table_is_the_commands_output():
    from benchmarks import saves_table

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## What it saves"):readme.index("## What it costs")]
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert "\n".join(table) == saves_table.table()


def test_host_ram_and_the_gpu_preset_are_honoured_and_named_on_the_first_line(capsys):
    rc, out, _ = _check(capsys, str(Z2), "--model", "llama-2-7b", "--gpu", "h100-80gb", "--host-ram-gb", "100")
    first = out.splitlines()[0]
    assert first.startswith("checking for: ") and "--gpu" in first and "--host-ram-gb" in first and "100 GiB" in first
    assert rc == 1 and "with the block: does NOT fit" in out  # 105 GiB on a 100 GiB node
    rc, out, _ = _check(capsys, str(Z2), "--model", "llama-2-7b", "--gpu", "h100-80gb", "--host-ram-gb", "2000")
    assert rc == 0 and "with the block: fits" in out
    doc = _json(capsys, str(Z2), "--model", "llama-2-7b", "--gpu", "h100-80gb", "--host-ram-gb", "2000")
    assert doc["free_bytes"] == 2000 << 30
    # --accelerator cpu on the same node: the bf16 model's device buffers are host RAM too
    cpu = _json(capsys, str(Z2), "--model", "llama-2-7b", "--gpu", "h100-80gb", "--accelerator", "cpu")
    assert cpu["accelerator"] == "cpu" and cpu["arms"][1]["node_bytes"] > doc["arms"][1]["node_bytes"]


def test_this_machine_is_the_default_and_says_how_to_name_a_node(capsys):
    rc, out, _ = _check(capsys, str(Z2), "--model", "hidden=256,layers=2,heads=4,kv_heads=4,ffn=704,vocab=256")
    assert rc == 0
    assert re.match(r"checking for: this machine as it is \(1 rank\(s\), accelerator cpu", out.splitlines()[0])
    assert "--gpu PRESET" in out.splitlines()[0]


def test_a_config_without_the_block_that_does_not_fit_exits_1(tmp_path, capsys):
    cfg = json.loads(Z2.read_text())
    del cfg["fp4offload"]
    path = tmp_path / "plain.json"
    path.write_text(json.dumps(cfg))
    rc, out, _ = _check(capsys, str(path), "--model", "llama-2-7b", "--gpu", "h100-80gb", "--host-ram-gb", "100")
    assert rc == 1 and "without the block: does NOT fit" in out
    rc, _, _ = _check(capsys, str(path), "--model", "llama-2-7b", "--gpu", "h100-80gb")
    assert rc == 0


def test_the_trainers_own_template_never_exits_2(tmp_path, capsys):
    """transformers' ZeRO-3 template: every value "auto", the bucket sizes filled from the model's hidden size."""
    cfg = {"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
           "optimizer": {"type": "AdamW", "params": {k: "auto" for k in ("lr", "betas", "eps", "weight_decay")}},
           "scheduler": {"type": "WarmupDecayLR", "params": {k: "auto" for k in (
               "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                 "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                                 "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                                 "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                                 "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                                 "stage3_gather_16bit_weights_on_model_save": True},
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
           "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
           "fp4offload": {"optimizer_states": {"format": "nvfp4"}}}
    path = tmp_path / "zero3_template.json"
    path.write_text(json.dumps(cfg))
    doc = _json(capsys, str(path), "--model", "llama-2-7b", "--gpu", "h100-80gb")
    filled = doc["hf_auto_filled"]
    assert "zero_optimization.reduce_bucket_size=16777216" in filled  # 4096 ** 2
    assert "zero_optimization.stage3_param_persistence_threshold=40960" in filled
    for cfg_stage2 in (copy.deepcopy(cfg),):
        cfg_stage2["zero_optimization"] = {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                           "reduce_bucket_size": "auto", "allgather_bucket_size": "auto"}
        path.write_text(json.dumps(cfg_stage2))
        rc, out, err = _check(capsys, str(path), "--model", "llama-2-7b", "--gpus", "2")
        assert rc in (0, 1), err
        assert "zero_optimization.allgather_bucket_size=(DeepSpeed's default)" in out


def test_an_nvme_path_initialize_would_refuse_is_refused_here(tmp_path, capsys):
    cfg = json.loads((ROOT / "configs" / "deepspeed_zero2_states_nvme.json").read_text())
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg["fp4offload"]["optimizer_states"]["nvme_path"] = str(blocker / "states")  # under a file: no folder there
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    dims = "hidden=256,layers=2,heads=4,kv_heads=4,ffn=704,vocab=256"
    rc, _, err = _check(capsys, str(path), "--model", dims)
    assert rc == 2 and "nvme_path" in err
    cfg["fp4offload"]["optimizer_states"]["nvme_path"] = str(tmp_path / "new")  # initialize would make it
    path.write_text(json.dumps(cfg))
    rc, _, err = _check(capsys, str(path), "--model", dims)
    assert rc in (0, 1), err
    assert not (tmp_path / "new").exists()  # checked, not created


def test_accelerator_is_a_check_flag(capsys):
    assert cli_plan.main(["plan", "--model", "llama-2-7b", "--accelerator", "cpu"]) == 2
    assert "only with --check" in capsys.readouterr().err


def test_the_table_says_what_each_strategy_packs_and_what_its_columns_mean(capsys):
    assert cli_plan.main(["plan", "--model", "llama-2-7b", "--gpu", "h100-80gb"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[1]: line for line in out.splitlines() if re.match(r"\s*\d+\s+\S+\s+(on|off)\s", line)}
    assert rows["zero2-opt-cpu"].split()[-2:] == ["-", "none"]
    assert rows["zero2-opt-cpu-fp4-split"].split()[-2:] == ["states+split", "low"]
    assert "states+weights+acts" in rows["zero3-all-fp4"]
    assert "columns: ckpt = activation checkpointing" in out and "risk = accuracy risk" in out
    doc = _json_plan(capsys)
    assert {c["name"]: c["packs"] for c in doc["ranked"]}["zero2-opt-cpu-fp4-bf16master"] == "states+bf16 master"


def _json_plan(capsys) -> dict:
    assert cli_plan.main(["plan", "--model", "llama-2-7b", "--gpu", "h100-80gb", "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)
