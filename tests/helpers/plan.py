"""``fp4offload plan`` runs the tests compare: one strategy for Llama-2-7B on 8 H100s, as is and with one option."""

from __future__ import annotations

import json
from pathlib import Path

SEVEN_B_ON_8_H100 = ["plan", "--gpu", "h100-80gb", "--gpus", "8", "--model", "llama-2-7b", "--host-ram-gb", "512",
                     "--format", "json"]


def host_bytes_per_node(plan: dict) -> float:
    """The best-ranked strategy's host RAM per node, from a JSON plan."""
    return plan["ranked"][0]["memory"]["host_bytes_per_node"]


def plan_with_option(capsys, strategy: str, option: list[str], emit: Path) -> tuple[dict, dict, dict]:
    """(the plan as is, the plan with ``option`` added, the DeepSpeed config that second run emitted to ``emit``)."""
    from fp4offload import cli

    base = [*SEVEN_B_ON_8_H100, "--strategy", strategy]
    assert cli.main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli.main([*base, *option, "--emit", "deepspeed", str(emit)]) == 0
    out = capsys.readouterr().out
    return plain, json.loads(out[out.index("{"):]), json.loads(emit.read_text())
