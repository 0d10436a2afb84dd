"""`fp4offload plan` and `fp4offload bench`: output formats, emitted files, readings replay, bad input."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp4offload._deepspeed.schema import validate_deepspeed_config
from fp4offload._config import load_fsdp_policy_yaml
from fp4offload._planner.cli_plan import add_bench_parser, add_plan_parser, main
from fp4offload._planner.readings import GpuReading, HostReading, Readings

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_parsers_register_with_set_defaults():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_plan_parser(sub)
    add_bench_parser(sub)
    args = parser.parse_args(["plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb"])
    assert callable(args.func) and args.nodes == 1 and args.format == "table"
    assert callable(parser.parse_args(["bench"]).func)


def test_table_output(capsys):
    rc, out, err = run(capsys, "plan", "--model", "llama-3.1-70b", "--gpu", "h100-80gb", "--gpus", "8")
    assert rc == 0
    for text in ("model:   llama-3.1-70b", "machine: 1 node(s) x 8 x NVIDIA H100", "winner:", "runner-up 2:",
                 "runner-up 3:", "does not fit:", "GPU short by", "accuracy risk", "s/step", "bound"):
        assert text in out, text


def test_the_table_says_estimate_and_ends_with_a_next_step(capsys, tmp_path):
    rc, out, _ = run(capsys, "plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--gpus", "1")
    assert rc == 0
    assert "estimate: memory, step times and tokens/s come from a model" in out and "fp4offload bench" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("next: rerun with --emit deepspeed ds_config.json") and "zero2-opt-cpu-fp4-split" in last
    cfg = tmp_path / "ds.json"
    rc, out, _ = run(capsys, "plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--gpus", "1",
                     "--emit", "deepspeed", str(cfg))
    assert rc == 0 and cfg.exists()
    assert out.strip().splitlines()[-1].startswith(f"next: deepspeed --num_gpus 1 train.py --deepspeed {cfg}")
    assert json.loads(cfg.read_text())["fp4offload"]["optimizer_states"]["master"] == "split"


def test_json_output_and_emitted_deepspeed_config(capsys, tmp_path):
    out_json = tmp_path / "ds.json"
    rc, out, _ = run(capsys, "plan", "--model", "mixtral-8x7b", "--gpu", "a100-80gb", "--nodes", "2",
                     "--micro-batch", "2", "--seq-len", "2048", "--grad-accum", "4", "--format", "json",
                     "--emit", "deepspeed", str(out_json), "--lr", "2e-4")
    assert rc == 0
    doc = json.loads(out)
    assert doc["winner"] == doc["ranked"][0]["name"] and len(doc["runner_ups"]) == 2
    assert doc["machine"]["nodes"] == 2 and doc["setup"]["seq_len"] == 2048
    top = doc["ranked"][0]
    assert top["fits"] and top["memory"]["device_bytes"] <= doc["machine"]["gpu_memory_bytes"]
    assert top["time"]["bound"] in top["time"]["terms_s"]
    assert all(r["why_lost"] for r in doc["ranked"][1:])
    cfg = json.loads(out_json.read_text())
    validate_deepspeed_config(cfg, world_size=16, check_with_deepspeed=True)
    assert cfg["train_batch_size"] == 2 * 4 * 16 and cfg["optimizer"]["params"]["lr"] == 2e-4
    assert doc["emitted"]["strategy"] in {r["name"] for r in doc["ranked"]}


def test_emit_fsdp_policy(capsys, tmp_path):
    path = tmp_path / "fsdp.yaml"
    rc, out, _ = run(capsys, "plan", "--model", "qwen3-32b", "--gpu", "h200-141gb", "--engine", "fsdp2",
                     "--emit", "fsdp", str(path))
    assert rc == 0 and "wrote fsdp config" in out
    pol = load_fsdp_policy_yaml(path)
    assert pol.block_classes == ("Qwen3DecoderLayer",)


def test_hf_config_and_dims_as_model(capsys, tmp_path):
    cfg = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
           "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc, out, _ = run(capsys, "plan", "--model", str(tmp_path), "--gpu", "l40s-48gb", "--gpus", "1")
    assert rc == 0 and "0.49B params" in out  # Qwen2.5-0.5B
    rc, out, _ = run(capsys, "plan", "--model", "hidden=1024,layers=8,heads=8,ffn=4096,vocab=32000",
                     "--gpu", "l4-24gb", "--format", "json")
    assert rc == 0 and json.loads(out)["model"]["name"] == "custom"


def test_readings_save_and_replay_give_the_same_plan(capsys, tmp_path):
    saved = tmp_path / "here.json"
    args = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--format", "json"]
    rc1, out1, _ = run(capsys, *args, "--save-readings", str(saved), "--nvme-path", str(tmp_path))
    rc2, out2, _ = run(capsys, *args, "--readings", str(saved), "--nvme-path", str(tmp_path))
    assert rc1 == rc2 == 0 and Readings.load(saved).host is not None
    a, b = json.loads(out1), json.loads(out2)
    assert a["ranked"] == b["ranked"] and a["machine"] == b["machine"]


def test_cluster_readings_from_elsewhere(capsys, tmp_path):
    gpu = GpuReading(0, "NVIDIA H100 80GB HBM3", 85520809984, 85000000000, 520809984, (9, 0), 5, 16)
    r = Readings(gpus=(gpu,) * 8, host=HostReading(2 * 2**40, 2 * 2**40 - 2**36, 112, 224),
                 cpu_adam={"fp32": 5e9}, cpu_adam_threads=112)
    path = tmp_path / "node.json"
    r.save(path)
    rc, out, _ = run(capsys, "plan", "--model", "llama-3.1-70b", "--readings", str(path), "--nodes", "4",
                     "--format", "json")
    doc = json.loads(out)
    assert rc == 0 and doc["machine"]["source"] == "measured" and doc["machine"]["gpus_per_node"] == 8
    assert doc["machine"]["cpu_adam_params_per_s"]["fp32"] == 5e9


@pytest.mark.parametrize("argv, fragment", [
    (["--model", "llama-9000", "--gpu", "h100-80gb"], "--model"),
    (["--model", "llama-3.1-8b", "--gpu", "h100"], "--gpu"),
    (["--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--micro-batch", "0"], "--micro-batch"),
    (["--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--readings", "/nonexistent.json"], "--readings"),
    (["--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--readings", "x.json", "--measure"], "--measure"),
    (["--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--emit", "xml", "out.xml"], "--emit"),
    (["--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--strategy", "zero9"], "--strategy"),
    (["--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--nvme-path", "/no/such/dir"], "--nvme-path"),
])
def test_bad_input_exits_2_with_a_clear_message(capsys, argv, fragment):
    rc, out, err = run(capsys, "plan", *argv)
    assert rc == 2 and out == ""
    assert err.startswith("fp4offload plan: ") and fragment in err and "expected" in err


def test_no_gpu_here_and_no_arguments_plans_the_default_target(capsys):
    """The README's main job: `fp4offload plan` alone works on a machine without a GPU."""
    from fp4offload._planner.cli_plan import DEFAULT_MODEL
    from fp4offload._planner.hardware import DEFAULT_GPU

    rc, out, _ = run(capsys, "plan")
    assert rc == 0
    assert DEFAULT_MODEL in out and f"planning for a {DEFAULT_GPU} node" in out and "--gpu PRESET" in out
    assert f"no --model given: planning for {DEFAULT_MODEL}" in out  # the fallback model is always named
    rc, out, _ = run(capsys, "plan", "--model", "llama-3.2-1b", "--gpu", "h100-80gb")
    assert rc == 0 and "no --model given" not in out
    assert "winner" in out.lower() or " 1  " in out


def test_nothing_fits_exits_1(capsys, tmp_path):
    rc, out, err = run(capsys, "plan", "--model", "llama-3.1-405b", "--gpu", "rtx-4090-24gb", "--gpus", "1",
                       "--host-ram-gb", "64", "--emit", "deepspeed", str(tmp_path / "x.json"))
    assert rc == 1 and "no strategy fits" in out and "nothing written" in err
    assert not (tmp_path / "x.json").exists()


def fake_fp4(monkeypatch):
    """Stand in for FP4AdamW, whose first step may build a C++ extension (minutes)."""
    import torch

    from fp4offload._planner import bench

    class FakeFP4(torch.optim.AdamW):
        pass

    monkeypatch.setattr(bench, "_fp4_optimizer", lambda: (FakeFP4, None))


def test_bench_writes_readings_plan_can_replay(capsys, tmp_path, monkeypatch):
    fake_fp4(monkeypatch)
    out = tmp_path / "bench.json"
    rc, text, _ = run(capsys, "bench", "--out", str(out), "--numel", "65536", "--seconds", "0.2",
                      "--nvme-path", str(tmp_path), "--nvme-mb", "16")
    assert rc == 0 and "cpu optimizer step (fp32)" in text and "(nvfp4)" in text and "wrote" in text
    r = Readings.load(out)
    assert r.cpu_adam["fp32"] > 0 and r.cpu_adam["nvfp4"] > 0 and r.disk.write_bps > 0 and r.host is not None
    assert [p.name for p in tmp_path.iterdir()] == ["bench.json"]
    rc, text, _ = run(capsys, "plan", "--model", "llama-3.2-1b", "--readings", str(out), "--gpu", "l4-24gb")
    assert rc == 0
    rc, _, err = run(capsys, "bench", "--out", str(out), "--seconds", "0")
    assert rc == 2 and "--seconds" in err


def test_the_fp4offload_command_runs_plan():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "fp4offload.cli", "plan", "--model", "llama-3.1-8b", "--gpu",
                           "h100-80gb", "--format", "json"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["winner"]


def test_no_planner_module_imports_cli_plan():
    """cli_plan sits on top: nothing else of the planner imports it, at the top or inside a function."""
    import ast

    for f in (ROOT / "fp4offload" / "planner").glob("*.py"):
        if f.name == "cli_plan.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [a.name for a in node.names] + ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[-1] == "cli_plan" for n in names), (f.name, names)


@pytest.mark.parametrize("first", ["fp4offload._planner.hardware", "fp4offload._planner.cli_plan",
                                   "fp4offload._memory.sizes", "fp4offload._planner.memory"])
def test_each_planner_module_imports_first_in_a_fresh_interpreter(first):
    code = (f"import {first}\n"
            "from fp4offload._planner.hardware import DEFAULT_GPU, build_cluster\n"
            "from fp4offload._planner.readings import Readings\n"
            "c = build_cluster(readings=Readings())\n"
            "assert any(DEFAULT_GPU in n for n in c.notes), c.notes\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert out.returncode == 0, out.stderr[-3000:]
