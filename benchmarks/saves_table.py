"""The README's "What it saves" table, from the one host-memory model, through ``fp4offload plan --check``.

Each cell is ``plan --check <config> --model <preset> --gpu <preset> --format json``'s node total (the same code,
called in process): DeepSpeed alone is the config without its block; the block's columns are the shipped ZeRO-2
and ZeRO-3 configs with the master form changed. A named GPU node counts each rank's process before initialize
as ``plan`` does (4 GiB), so ``plan``'s "host GiB/node" for the same model, strategy and node is the same number.
tests/unit/test_readme_tables.py holds the README to this script's output.

    python benchmarks/saves_table.py                  # the README's table (8 x H100 80GB nodes)
    python benchmarks/saves_table.py --gpu h200-141gb --models llama-3.1-8b
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("llama-2-7b", "llama-2-13b")
LABELS = {"llama-2-7b": "7B (llama-2-7b)", "llama-2-13b": "13B (llama-2-13b)"}
CONFIGS = {2: ROOT / "configs" / "deepspeed_zero2_offload_cpu.json",
           3: ROOT / "configs" / "deepspeed_zero3_offload_cpu.json"}
MASTERS = ("fp32", "split", "bf16")
GiB = 1 << 30


def node_gib(config: dict, model: str, gpu: str) -> dict[str, float]:
    """{"without the block": GiB, "with the block": GiB} per node, as plan --check prints them."""
    from fp4offload._planner import check, cli_plan

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ds.json"
        path.write_text(json.dumps(config))
        parser = argparse.ArgumentParser()
        cli_plan.add_plan_parser(parser.add_subparsers())
        args = parser.parse_args(["plan", "--check", str(path), "--model", model, "--gpu", gpu, "--format", "json"])
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            check.run_check(args)
    doc = json.loads(out.getvalue())
    return {a["arm"]: a["node_bytes"] / GiB for a in doc["arms"]}


def rows(models=MODELS, gpu: str = "h100-80gb") -> list[list[str]]:
    out = []
    for model in models:
        for stage, cfg_path in CONFIGS.items():
            base = json.loads(cfg_path.read_text())
            cells = []
            for master in MASTERS:
                cfg = copy.deepcopy(base)
                cfg["fp4offload"] = {"optimizer_states": dict(cfg["fp4offload"]["optimizer_states"], master=master)}
                got = node_gib(cfg, model, gpu)
                if not cells:
                    cells.append(f"{got['without the block']:.0f} GiB")
                cells.append(f"{got['with the block']:.0f} GiB")
            out.append([LABELS.get(model, model), str(stage), *cells])
    return out


def table(models=MODELS, gpu: str = "h100-80gb") -> str:
    head = ["model", "ZeRO stage", "DeepSpeed alone", "+ block, fp32 master", "+ block, split master",
            "+ block, bf16 master"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(models, gpu)]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="h100-80gb", help="GPU preset of the node (default h100-80gb, 8 per node)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated model presets")
    a = ap.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the checks name their accelerator; DeepSpeed need not probe
    print(table(tuple(a.models.split(",")), a.gpu))


if __name__ == "__main__":
    main()
