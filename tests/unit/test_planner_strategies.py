"""The strategy catalogue: what it covers, its validation, and that an installed wheel carries it."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from fp4offload.errors import ConfigError
from fp4offload._planner import strategies as st

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cat():
    return st.load_catalogue()


def _find(cat, **want):
    """Strategies whose attributes match: engine, zero_stage, and class=(device, format) pairs."""
    out = []
    for s in cat.values():
        ok = True
        for k, v in want.items():
            if k in st.TENSOR_CLASSES:
                p = getattr(s, k)
                ok &= (p.device, p.format) == v
            else:
                ok &= getattr(s, k) == v
        if ok:
            out.append(s.name)
    return out


def test_catalogue_covers_the_required_strategies(cat):
    gpu_bf16, cpu = ("gpu", "bf16"), "cpu"
    assert _find(cat, engine="deepspeed", weights=gpu_bf16, master=("gpu", "fp32"))  # no offload
    assert _find(cat, zero_stage=2, optimizer_states=(cpu, "fp32"))
    assert _find(cat, zero_stage=2, optimizer_states=(cpu, "nvfp4"))
    assert _find(cat, zero_stage=3, optimizer_states=("nvme", "fp32"))
    assert _find(cat, zero_stage=3, optimizer_states=("nvme", "nvfp4"))
    assert _find(cat, zero_stage=3, weights=(cpu, "bf16"))
    assert _find(cat, zero_stage=3, weights=(cpu, "nvfp4"))
    assert _find(cat, activations=(cpu, "bf16"))  # activation offload on
    assert _find(cat, activations=(cpu, "nvfp4")) and _find(cat, activations=("gpu", "nvfp4"))  # fp4 activations
    assert _find(cat, engine="fsdp2", fsdp_cpu_offload=False)
    assert _find(cat, engine="fsdp2", fsdp_cpu_offload=True, weights=(cpu, "bf16"))
    assert _find(cat, engine="fsdp2", weights=(cpu, "nvfp4"))
    for s in cat.values():
        assert s.summary and s.title and Path(s.source).stem == s.name


def test_resources_path_of_an_installed_package(monkeypatch):
    # What an installed wheel has: the folder as the package fp4offload._strategies.
    spec = importlib.util.spec_from_file_location("fp4offload._strategies", ROOT / "strategies" / "__init__.py",
                                                  submodule_search_locations=[str(ROOT / "strategies")])
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fp4offload._strategies", mod)
    files = st.catalogue_files()
    assert [n for n, _ in files] == sorted(p.name for p in (ROOT / "strategies").glob("*.yaml"))


def test_catalogue_from_another_directory(tmp_path, cat):
    shutil.copy(ROOT / "strategies" / "zero1.yaml", tmp_path)
    assert list(st.load_catalogue(tmp_path)) == ["zero1"]
    with pytest.raises(ConfigError):
        st.load_catalogue(tmp_path / "none")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError):
        st.load_catalogue(empty)


BASE = yaml.safe_load((ROOT / "strategies" / "zero2-opt-cpu-fp4.yaml").read_text())


@pytest.mark.parametrize("mutate, key", [
    (lambda d: d.update(engine="megatron"), "engine"),
    (lambda d: d.update(zero_stage=5), "zero_stage"),
    (lambda d: d.update(colour="red"), "colour"),
    (lambda d: d.pop("tensors"), "tensors"),
    (lambda d: d["tensors"].update(weights={"device": "disk", "format": "bf16"}), "tensors.weights.device"),
    (lambda d: d["tensors"].update(master={"device": "cpu", "format": "fp8"}), "tensors.master.format"),
    (lambda d: d["tensors"]["activations"].update(checkpointing="sometimes"), "tensors.activations.checkpointing"),
    (lambda d: d["tensors"].update(kv_cache={"device": "gpu", "format": "bf16"}), "tensors.kv_cache"),
    (lambda d: d["tensors"].update(weights={"device": "cpu", "format": "bf16"}), "tensors.weights.device"),
    (lambda d: d["tensors"].update(optimizer_states={"device": "gpu", "format": "fp32"}),
     "tensors.optimizer_states.device"),
    (lambda d: d.update(fsdp={"cpu_offload": True}), "fsdp"),
])
def test_bad_strategy_files_are_refused(mutate, key):
    import copy

    doc = copy.deepcopy(BASE)
    mutate(doc)
    with pytest.raises(ConfigError) as e:
        st.parse_strategy(doc, "x.yaml")
    assert e.value.key == f"x.yaml: {key}", str(e.value)


def test_file_name_must_match_strategy_name(tmp_path):
    text = (ROOT / "strategies" / "zero1.yaml").read_text()
    (tmp_path / "other.yaml").write_text(text)
    with pytest.raises(ConfigError, match="file name"):
        st.load_catalogue(tmp_path)
    (tmp_path / "other.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="YAML"):
        st.load_catalogue(tmp_path)


def test_select(cat):
    assert [s.name for s in st.select(cat, ["zero1", "fsdp2"])] == ["zero1", "fsdp2"]
    assert all(s.engine == "fsdp2" for s in st.select(cat, None, "fsdp2"))
    with pytest.raises(ConfigError) as e:
        st.select(cat, ["zero9"])
    assert e.value.key == "--strategy"


@pytest.mark.slow
def test_built_wheel_ships_the_catalogue_and_finds_it_installed(tmp_path):
    """Build the wheel from a copy of the tree, unpack it elsewhere, load the catalogue from there."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, src)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "build")
    for name in ("fp4offload", "strategies", "csrc"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    out = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(out)], capture_output=True, text=True, cwd=str(src), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheel = next(out.glob("*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {Path(n).name for n in names if n.startswith("fp4offload/_strategies/") and n.endswith(".yaml")}
    assert shipped == {p.name for p in (ROOT / "strategies").glob("*.yaml")}
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import fp4offload._planner.strategies as s, pathlib; f = s.catalogue_files(); "
            "import importlib.resources as r; print(len(f), r.files('fp4offload._strategies'))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(tmp_path),
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    count, where = run.stdout.split()
    assert int(count) == len(shipped) and str(site) in where


SPLIT_NVME = yaml.safe_load((ROOT / "strategies" / "zero3-opt-nvme-fp4-split.yaml").read_text())


def test_split_master_with_its_residual_on_nvme(cat):
    for name, stage in (("zero3-opt-nvme-fp4-split", 3), ("zero2-opt-nvme-fp4-split", 2)):
        s = cat[name]
        assert (s.zero_stage, s.master, s.optimizer_states) == (stage, st.Placement("cpu", "split", "nvme"),
                                                                st.Placement("nvme", "nvfp4"))
        assert s.residual_on_nvme and ("master", "split") in s.compressions()
    assert not any(s.residual_on_nvme for n, s in cat.items() if "-split" not in n)
    doc = {**SPLIT_NVME, "tensors": {**SPLIT_NVME["tensors"], "master": {"device": "cpu", "format": "split",
                                                                        "residual": "cpu"}}}
    assert st.parse_strategy(doc, "x.yaml").master.residual is None  # "with the master", said out loud


def _with(doc, **tensors):
    import copy

    out = copy.deepcopy(doc)
    for cls, place in tensors.items():
        out["tensors"][cls].update(place)
    return out


@pytest.mark.parametrize("doc, key, value, fix", [
    (_with(SPLIT_NVME, master={"format": "fp32"}), "tensors.master.residual", "nvme", "only a split master"),
    (_with(SPLIT_NVME, master={"format": "bf16"}), "tensors.master.residual", "nvme", "only a split master"),
    (_with(SPLIT_NVME, optimizer_states={"device": "cpu"}), "tensors.master.residual", "nvme",
     "put optimizer_states on nvme"),
    (_with(SPLIT_NVME, master={"residual": "gpu"}), "tensors.master.residual", "gpu", "bf16 half"),
    (_with(SPLIT_NVME, master={"residual": "disk"}), "tensors.master.residual", "disk", "leave it out"),
    (_with(SPLIT_NVME, master={"residual": None}), "tensors.master.residual", None, "leave it out"),
    (_with(SPLIT_NVME, master={"residue": "nvme"}), "tensors.master.residue", "nvme", "unknown key"),
    (_with(SPLIT_NVME, optimizer_states={"residual": "nvme"}), "tensors.optimizer_states.residual", "nvme",
     "unknown key"),
])
def test_bad_residual_placements_are_refused_with_the_key_value_and_fix(doc, key, value, fix):
    with pytest.raises(ConfigError) as e:
        st.parse_strategy(doc, "x.yaml")
    assert e.value.key == f"x.yaml: {key}", str(e.value)
    assert repr(value) in str(e.value) and fix in str(e.value), str(e.value)
