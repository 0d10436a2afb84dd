"""The repository keeps its promises: CI runs the README's test command; the CLI's doctor works."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_has_two_quickstart_commands_and_ci_runs_the_test_one():
    cmds = _readme_commands()
    assert len(cmds) >= 2
    install_run, install_test = cmds[0], cmds[1]
    assert "torch==2.13.0" in install_run and "torch==2.13.0" in install_test
    assert "pytest" in install_test
    assert install_test in (ROOT / ".ci" / "run").read_text()


def test_doctor_json_reports_active_backend():
    out = subprocess.run([sys.executable, "-m", "fp4offload.cli", "doctor", "--json"], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["active"]["cpu_tensors"]["backend"] in ("cpu", "reference")
    assert r["backends"]["reference"]["builds"] is True
    assert r["cuda_available"] is False or r["gpu"]["available"] is True
    assert "deepspeed" in r and "torch" in r
    if sys.platform.startswith("linux"):  # the host allocator cache is a small C++ extension: it builds here
        assert r["host"]["host_cache"]["builds"] is True, r["host"]
        assert r["host"]["transparent_hugepages"] in ("always", "madvise", "never", "unknown")
    if r["deepspeed"]["usable"]:  # the block's private DeepSpeed names, checked against this install
        assert r["deepspeed"]["missing_names"] == [] and r["deepspeed"]["in_range"], r["deepspeed"]
    assert set(r["host"]["settings"]) == {"mmap_threshold", "allocator_cache", "share_bf16_staging",
                                          "bf16_gradient_partition", "preflight"}
    assert r["deepspeed"]["auto"]["active"], r["deepspeed"]["auto"]  # the zero-code hook, as installed


def test_docs_link_only_to_files_in_the_repository():
    """README and docs/ link to files that exist inside the repository (nothing under ../)."""
    bad = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+://", target) or target.startswith("#"):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            if ROOT not in path.parents and path != ROOT or not path.exists():
                bad.append(f"{doc.relative_to(ROOT)}: {target}")
    assert bad == [], bad
    code = [p for p in (ROOT / "fp4offload").rglob("*.py")] + [p for p in (ROOT / "csrc").rglob("*") if p.is_file()]
    cites = [f"{p.relative_to(ROOT)}" for p in code if "shared/DESIGN" in p.read_text(errors="replace")]
    assert cites == [], cites


def test_ruff_is_clean():
    """The lint configured in pyproject.toml ([tool.ruff]) passes on the whole tree."""
    import shutil

    ruff = shutil.which("ruff")
    if ruff is None:
        import pytest

        pytest.skip("ruff is not installed: pip install -e '.[test]'")
    out = subprocess.run([ruff, "check", "--no-cache", str(ROOT)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]


def test_a_missing_system_library_skips_with_the_fix_and_fails_under_ci(monkeypatch):
    """Outside CI a test that needs libaio skips and names the fix; with CI set it fails instead."""
    import pytest
    from _pytest.outcomes import Failed, Skipped
    from helpers.extensions import LIBAIO_FIX, skip_or_fail

    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(Skipped, match="libaio-dev"):
        skip_or_fail(f"no async_io; install it: {LIBAIO_FIX}")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(Failed, match="CI installs it"):
        skip_or_fail(f"no async_io; install it: {LIBAIO_FIX}")


def test_the_design_layout_table_matches_the_disk():
    """docs/design.md section 2 names every module of the package in its room, and names no file that is gone."""
    import re

    text = (ROOT / "docs" / "design.md").read_text()
    table = text[text.index("| room | file | job |"):text.index("## 3. Numerics")]
    named, room = set(), None
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("room", "---"):
            continue
        room = cells[0].strip("`") or room
        for f in re.findall(r"`([\w.]+\.py)`", cells[1]):
            named.add(f"{room}{f}")
    on_disk = {str(p.relative_to(ROOT / "fp4offload")) for p in (ROOT / "fp4offload").glob("*/*.py")}
    on_disk -= {f for f in on_disk if f.endswith("__init__.py") and f not in named}
    assert not named - on_disk, f"named in docs/design.md section 2 but not on disk: {sorted(named - on_disk)}"
    assert not on_disk - named, f"on disk but not in docs/design.md section 2: {sorted(on_disk - named)}"
    tree = text[text.index("## 2. Layout"):text.index("| room | file | job |")]
    top = {p.name for p in (ROOT / "fp4offload").iterdir()
           if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))}
    missing = {n for n in top if not re.search(rf"^\s+{re.escape(n)}/?\s", tree, re.M)}
    assert not missing, f"not in docs/design.md section 2's tree: {sorted(missing)}"
