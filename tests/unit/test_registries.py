"""One table per axis: the grids of FP4AdamW's second moment (fp4offload/_config/grids.py) and the host kernels'
CPU paths (fp4offload/_config/isas.py). Every other list of them derives from those rows, the C++ ones through the
generated headers csrc/grids.h and csrc/cpu/isas.h; adding a grid on the unsigned-grid kernels, or a CPU path, is
one row."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers.optim_cases import run_fused

from fp4offload._config import vocab
from fp4offload._config import grids, isas
from fp4offload._ops import build, cpu_isa
from fp4offload._optim import reference_step as R
from fp4offload._planner.hardware import CPU_FP4_PER_CORE
from fp4offload.formats import layout

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
REGISTRIES = {ROOT / "fp4offload" / "formats" / "grids.py", ROOT / "fp4offload" / "_ops" / "isas.py",
              CSRC / grids.HEADER, CSRC / isas.HEADER}
GRID_NAMES = {g.name for g in grids.V_GRIDS}
V_ONLY = GRID_NAMES - set(layout.FORMATS)  # grid names that are not also codec formats (nvfp4, ufp4)
ISA_NAMES = {i.name for i in isas.ISAS}


@pytest.mark.parametrize("registry", [grids, isas], ids=["grids", "isas"])
def test_the_generated_headers_are_current(registry):
    path = CSRC / registry.HEADER
    assert path.read_text() == registry.header(), (
        f"{path.relative_to(ROOT)} is stale: python -c 'from {registry.__package__} import "
        f"{registry.__name__.rsplit('.', 1)[1]} as r; r.write_header()'")


def test_every_list_derives_from_the_rows():
    assert vocab.V_FORMATS == tuple(g.name for g in grids.V_GRIDS) and vocab.V_FORMAT_DEFAULT == vocab.V_FORMATS[0]
    assert R.V_GRID == {g.name: g for g in grids.V_GRIDS} and R.V_KIND == {g.name: g.kid for g in grids.V_GRIDS}
    assert vocab.CPU_ISAS == tuple(i.name for i in isas.ISAS) and vocab.CPU_ISAS[-1] == "scalar"
    assert list(CPU_FP4_PER_CORE) == list(vocab.CPU_ISAS)
    assert all(f"-DFP4_CPU_ISA_ID={i.id}" in cpu_isa.flags(i.name) for i in isas.ISAS)
    grids.check()
    isas.check()


def test_the_numbers_stay():
    """Kernel ids of the grids and CPU paths are for good: states, checkpoints and build caches hold them."""
    assert R.V_KIND == {"ufp4": 0, "nvfp4": 1, "ue2m2": 2, "ue2m0": 3}
    assert {i.name: i.id for i in isas.ISAS} == {"scalar": 0, "avx512": 1, "avx2": 2, "neon": 3, "sve": 4}


def _py_tables(path: Path, root: Path = ROOT) -> list[str]:
    """The dict keys and tuple/list/set members of `path` that name a v grid (one only a v grid has) or two CPU
    paths: a table of its own."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Dict):
            items = node.keys
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        else:
            continue
        words = {k.value for k in items if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        if words & V_ONLY or len(words & ISA_NAMES) >= 2:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {sorted(words)}")
    return found


def _cpp_code(text: str) -> str:
    """C/C++ source with its comments removed."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def test_no_other_table_of_grids_or_cpu_paths():
    """Outside the registries and their generated headers, no Python table holds a v grid name or CPU path names,
    and no C++ code names a v grid (in an identifier or a string) or a CPU path (in a string): dispatch and checks
    expand FP4_V_GRIDS / FP4_CPU_ISAS. Prose (docstrings, comments) is free to name them."""
    found = []
    for path in sorted((ROOT / "fp4offload").rglob("*.py")):
        if path not in REGISTRIES:
            found += _py_tables(path)
    v_ident = re.compile(rf"\w*(?:{'|'.join(sorted(V_ONLY))})\w*", re.I)
    quoted = re.compile(rf"\"({'|'.join(sorted(ISA_NAMES | GRID_NAMES))})\"")
    for path in sorted(p for p in CSRC.rglob("*") if p.suffix in (".h", ".cpp", ".cu", ".cuh")):
        if path in REGISTRIES:
            continue
        code = _cpp_code(path.read_text())
        found += [f"{path.relative_to(ROOT)}: {m}" for m in {*v_ident.findall(code), *quoted.findall(code)}]
    assert not found, found


def test_the_scan_sees_a_table(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('RATE = {"avx2": 1, "sve": 2}\nKINDS = ("ue2m2", "x")\nOK = ("nvfp4", "ufp4", "scalar")\n')
    assert _py_tables(bad, tmp_path) == ["bad.py:1: ['avx2', 'sve']", "bad.py:2: ['ue2m2', 'x']"]
    assert _cpp_code('int a; // "avx2" ue2m2\n/* ue2m2 */ int b;') == "int a; \n int b;"


# A throwaway unsigned grid with 3 mantissa bits (2 binades, 0.5 .. 1.875) and a second name for a CPU path with
# flags of its own, each one row added to the tables.
NEW_GRID = grids.VGrid("ue1m3", 4, 3)


def _new_path() -> isas.Isa:
    base = cpu_isa.row(cpu_isa.available()[0])
    return base._replace(name=f"{base.name}_again", id=9, flags=(*base.flags, "-fno-unroll-loops"))


@pytest.mark.slow  # builds the fused CPU step once (~60 s on one core)
def test_a_new_grid_and_a_new_cpu_path_are_one_row_each(tmp_path, monkeypatch):
    """The rows added, the headers generated into a copy of csrc/, the fused CPU step built from it for the new path:
    the build knows its name, and on the new grid its vector and scalar paths give the reference step's bytes."""
    path = _new_path()
    monkeypatch.setattr(isas, "ISAS", (*isas.ISAS[:-1], path, isas.ISAS[-1]))
    for table, value in ((R.V_GRID, NEW_GRID), (R.V_KIND, NEW_GRID.kid)):
        monkeypatch.setitem(table, NEW_GRID.name, value)
    src = tmp_path / "csrc"
    shutil.copytree(build.csrc_dir(), src, ignore=shutil.ignore_patterns("__pycache__"))
    grids.write_header(src, (*grids.V_GRIDS, NEW_GRID))
    isas.write_header(src, isas.ISAS)
    assert "X(ue1m3, 4, 3, 16, 4)" in (src / grids.HEADER).read_text()
    assert path.name in cpu_isa.available() and cpu_isa.flags(path.name)[-1] == "-DFP4_CPU_ISA_ID=9"

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    ext = build.build(cpu_isa.module_name("fp4offload_cpu_adam_registry", path.name), ["cpu/adam_cpu.cpp"],
                      extra_cflags=[*cpu_isa.flags(path.name), "-fopenmp"], root=src)
    assert ext.isa() == path.name
    n, sc = 16, R.StepScalars.make(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    kinds = r"2 \(ue2m2\) 0 \(ufp4\) 1 \(nvfp4\) 3 \(ue2m0\) 4 \(ue1m3\)"
    with pytest.raises(RuntimeError, match="v_kind must be one of " + kinds):
        ext.fused_step(torch.zeros(n), torch.zeros(n), *R.empty_packed(n, "cpu"), *R.empty_packed(n, "cpu"), sc.b1,
                       sc.omb1, sc.b2, sc.omb2, sc.eps, sc.decay, sc.step_size, sc.rsbc2, False, False, 5, False, 0, 0,
                       None)
    for simd in (True, False):
        ext.set_simd(simd)
        for n, m_sr, v_sr, gdt in ((5003, False, False, torch.float32), (3 * 1024, True, True, torch.bfloat16)):
            run_fused(ext, n, NEW_GRID.name, m_sr, gdt, v_stochastic=v_sr)
