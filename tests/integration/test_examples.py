"""Every Python block of the README and the user guide is an exact excerpt of a program under examples/, and each
program runs: on 2 gloo CPU ranks where it is distributed (torchrun, accelerate launch), in a fresh folder with the
shipped configs beside it."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from helpers.dist import free_port, run_group

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DOCS = (ROOT / "README.md", ROOT / "docs" / "guide.md")

# program -> (how it is launched, a line its output must hold)
RUNS = {
    "codec.py": ("python", "read back bit for bit"),
    "fp4adamw.py": ("python", "NVMe tier:"),
    "deepspeed_initialize.py": ("torchrun", "fp4offload block on this engine:"),
    "fsdp2_fully_shard.py": ("torchrun", "saved and loaded ckpt/step100"),
    "fsdp2_apply.py": ("torchrun", "saved and loaded ckpt/step100"),
    "fsdp2_meta.py": ("torchrun", "step 2: loss"),
    "fsdp2_trainer.py": ("torchrun", "train loss:"),
    "accelerate_fsdp2.py": ("accelerate", "over FP4AdamW"),
}


def _blocks(path: Path) -> list[tuple[int, list[str]]]:
    text = path.read_text()
    return [(text[:m.start()].count("\n") + 1, m.group(1).rstrip("\n").split("\n"))
            for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


def _contains(program: list[str], block: list[str]) -> bool:
    n = len(block)
    return any(program[i:i + n] == block for i in range(len(program) - n + 1))


def test_every_python_block_in_the_docs_is_an_excerpt_of_an_example():
    programs = {p.name: [line.rstrip() for line in p.read_text().split("\n")] for p in EXAMPLES.glob("*.py")}
    assert set(programs) == set(RUNS), "every example runs in the suite"
    missing = []
    for doc in DOCS:
        for line, block in _blocks(doc):
            block = [b.rstrip() for b in block]
            if not any(_contains(prog, block) for prog in programs.values()):
                missing.append(f"{doc.relative_to(ROOT)}:{line}")
    assert not missing, f"code blocks that no program under examples/ contains verbatim: {missing}"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(RUNS))
def test_the_example_runs(name, tmp_path):
    how, expect = RUNS[name]
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    script = str(EXAMPLES / name)
    port = str(free_port())
    cmd = {"python": [sys.executable, script],
           "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port,
                        script],
           "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                          str(EXAMPLES / "accelerate_fsdp2.yaml"), "--main_process_port", port, script]}[how]
    log = tmp_path / "log.txt"
    rc = run_group(cmd, log, 300, cwd=tmp_path, MAX_STEPS="2", TORCH_EXTENSIONS_DIR=os.environ.get(
        "TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/fp4offload/torch_extensions")))
    for shm in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"):
        shm.unlink(missing_ok=True)
    out = log.read_text()
    assert rc == 0 and expect in out, f"{name} exited {rc}:\n{out[-5000:]}"
    # the losses it prints are finite, and no step was skipped for non-finite gradients
    assert not re.search(r"loss:? nan|non-finite", out), f"{name} trained on non-finite values:\n{out[-5000:]}"
