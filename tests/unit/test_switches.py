"""The FP4OFFLOAD_* environment variables: one table, one reading of their values, and doctor naming the source."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fp4offload import _switches as switches
from fp4offload._config import HostConfig
from fp4offload.errors import ConfigError
from fp4offload._switches import BY_NAME, OFF_WORDS, ON_WORDS, SWITCHES

ROOT = Path(__file__).resolve().parents[2]
ON_OFF = [s.name for s in SWITCHES if s.kind == "on/off"]
CHOICES = [s for s in SWITCHES if s.kind == "choice"]
#: each word as written, in other cases and with spaces around it
SPELLINGS = [(w, True) for w in ON_WORDS] + [(w, False) for w in OFF_WORDS]
SPELLINGS += [(f" {w.upper()} ", on) for w, on in SPELLINGS] + [(w.capitalize(), on) for w, on in SPELLINGS]
#: a value that is no variable's word, and one per kind that is close to a word
STRAYS = {"on/off": ["of", "2", "enabled", "y"], "choice": ["avx1024", "gpu", "strict", "automatic"],
          "number": ["lots", "2", "-1", "nan", "1e400"], "count": ["lots", "0", "-1", "2.5", "5000"],
          "list": ["9.0", "sm90x", "ninety"]}


def test_every_variable_the_code_reads_is_in_the_table():
    names = set()
    for path in [*(ROOT / "fp4offload").rglob("*.py"), ROOT / "_fp4offload_auto.py", ROOT / "fp4offload-auto.pth"]:
        names |= set(re.findall(r"FP4OFFLOAD_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert names == set(BY_NAME), names ^ set(BY_NAME)


def test_the_table_is_well_formed():
    host_keys = set(HostConfig.__dataclass_fields__)
    for sw in SWITCHES:
        assert sw.kind in switches.KINDS and sw.does.strip() and sw.accepted()
        assert (sw.kind == "choice") == bool(sw.words)
        assert sw.json_key is None or sw.json_key.split(".", 1)[1] in host_keys
        assert switches.parse(sw.name, None) == switches.parse(sw.name, "  ") == sw.default
    overrides = {sw.json_key.split(".", 1)[1] for sw in SWITCHES if sw.json_key}
    assert overrides == host_keys  # every host key has its override, and no variable doubles another JSON key


@pytest.mark.parametrize("name", ON_OFF)
@pytest.mark.parametrize("raw, on", SPELLINGS)
def test_every_on_off_variable_takes_the_same_words(name, raw, on):
    assert switches.parse(name, raw) is on
    assert switches.on_off(name, raw) is on
    assert switches.get(name, {name: raw}) is on


@pytest.mark.parametrize("sw", CHOICES, ids=lambda s: s.name)
def test_a_choice_takes_its_words_in_any_case(sw):
    for word in sw.words:
        assert switches.parse(sw.name, f" {word.upper()} ") == word


@pytest.mark.parametrize("name", list(BY_NAME))
def test_an_unknown_word_is_one_line_naming_the_variable(name):
    sw = BY_NAME[name]
    for raw in STRAYS[sw.kind]:
        with pytest.raises(ConfigError) as e:
            switches.get(name, {name: raw})
        msg = str(e.value)
        assert e.value.key == name and f"{name}={raw!r}" in msg and "\n" not in msg, msg
        if sw.kind == "on/off":
            assert all(w in msg for w in ON_WORDS + OFF_WORDS), msg
        if sw.kind == "choice":
            assert all(w in msg for w in sw.words), msg


def test_numbers_are_checked_as_their_json_key_is():
    assert switches.parse("FP4OFFLOAD_HOST_CACHE", "0.25") == 0.25
    assert switches.parse("FP4OFFLOAD_MMAP_THRESHOLD", str(1 << 20)) == 1 << 20
    for off in OFF_WORDS:
        assert switches.parse("FP4OFFLOAD_HOST_CACHE", off) == "off"
        assert switches.parse("FP4OFFLOAD_MMAP_THRESHOLD", off.upper()) == "off"
    with pytest.raises(ConfigError, match="FP4OFFLOAD_MMAP_THRESHOLD.*fp4offload.host.mmap_threshold"):
        switches.parse("FP4OFFLOAD_MMAP_THRESHOLD", str(1 << 30))
    assert switches.parse("FP4OFFLOAD_CUDA_ARCH", " 90, sm_100a ,") == ("90", "100a")


def test_fp4offload_auto_none_turns_the_hook_off():
    """The .pth line as the repository ships it, run at start-up (``-S``: without the installed copy)."""
    line = (ROOT / "fp4offload-auto.pth").read_text()
    probe = ("import sys; exec(sys.argv[1]); "
             "print(any(getattr(f, 'fp4offload_auto', False) for f in sys.meta_path))")
    env = {k: v for k, v in os.environ.items() if k != "FP4OFFLOAD_AUTO"}

    def hooked(value):
        e = dict(env, **({"FP4OFFLOAD_AUTO": value} if value is not None else {}))
        out = subprocess.run([sys.executable, "-S", "-c", probe, line], capture_output=True, text=True, env=e,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip() == "True"

    assert not hooked("none") and not hooked(" None ")
    assert hooked(None) and hooked("1")
    assert switches.get("FP4OFFLOAD_AUTO", {"FP4OFFLOAD_AUTO": "none"}) is False
    assert f"in {OFF_WORDS!r}".replace("'", '"') in line  # the line can import nothing: it spells the words out


def test_the_patched_initialize_reads_fp4offload_auto_with_the_parser(monkeypatch):
    import types

    import _fp4offload_auto as hook

    calls = []
    fake = types.SimpleNamespace(initialize=lambda *a, **k: calls.append(k) or "deepspeed's own")
    monkeypatch.setattr(hook, "state", hook.state)
    hook._patch(fake)
    monkeypatch.setenv("FP4OFFLOAD_AUTO", "of")
    with pytest.raises(ConfigError, match="FP4OFFLOAD_AUTO='of'"):
        fake.initialize(config={})
    monkeypatch.setenv("FP4OFFLOAD_AUTO", "NONE")
    assert fake.initialize(config={}) == "deepspeed's own" and calls == [{"config": {}}]


def test_fp4offload_verbose_build_false_is_off(monkeypatch):
    from torch.utils import cpp_extension

    from fp4offload._ops import build

    seen = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.append(kw["verbose"]))
    for raw, want in (("false", False), ("0", False), (" Off", False), ("yes", True), ("", False)):
        monkeypatch.setenv("FP4OFFLOAD_VERBOSE_BUILD", raw)
        build.build("fp4offload_probe", [])
        assert seen[-1] is want, raw
    monkeypatch.setenv("FP4OFFLOAD_VERBOSE_BUILD", "loud")
    with pytest.raises(ConfigError, match="FP4OFFLOAD_VERBOSE_BUILD"):
        build.build("fp4offload_probe", [])


def test_the_codec_backend_and_the_host_cache_read_the_same_words(monkeypatch):
    from fp4offload import _ops as ops, host_allocator

    for raw, want in (("", None), ("auto", None), (" CPU ", "cpu"), ("reference", "reference")):
        monkeypatch.setenv("FP4OFFLOAD_BACKEND", raw)
        assert ops.forced_backend() == want
    monkeypatch.setenv("FP4OFFLOAD_BACKEND", "gpu")
    with pytest.raises(ConfigError, match="FP4OFFLOAD_BACKEND='gpu'"):
        ops.forced_backend()
    for off in OFF_WORDS:
        monkeypatch.setenv(host_allocator.ENV, f" {off.upper()} ")
        assert host_allocator.install()["installed"] is False


def test_host_settings_name_the_source_that_won():
    block = {"optimizer_states": {}, "host": {"allocator_cache": 0.5, "preflight": "error"}}
    got = switches.host_settings(block, {"FP4OFFLOAD_BF16_GRADS": "no", "FP4OFFLOAD_PREFLIGHT": " "})
    assert got["allocator_cache"] == switches.Setting(0.5, "fp4offload.host.allocator_cache")
    assert got["preflight"] == switches.Setting("error", "fp4offload.host.preflight")  # written, even as the default
    assert got["bf16_gradient_partition"] == switches.Setting(False, "FP4OFFLOAD_BF16_GRADS")
    assert got["mmap_threshold"] == switches.Setting(131072, "default")
    over = switches.host_settings(block, {"FP4OFFLOAD_HOST_CACHE": "off"})
    assert over["allocator_cache"] == switches.Setting("off", "FP4OFFLOAD_HOST_CACHE")  # the variable wins


def test_the_guide_holds_the_table_of_the_code():
    guide = (ROOT / "docs" / "guide.md").read_text()
    table = switches.markdown_table()
    assert table in guide, "docs/guide.md's table of variables differs from fp4offload._switches.markdown_table()"
    rows = [line for line in guide.splitlines() if line.startswith("| `FP4OFFLOAD_")]
    assert len(rows) == len(SWITCHES)


def test_doctor_config_shows_each_value_and_its_source(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"fp4offload": {"optimizer_states": {}, "host": {"allocator_cache": 0.5}}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP4OFFLOAD_")}
    env.update(DS_ACCELERATOR="cpu", FP4OFFLOAD_BF16_GRADS="off", FP4OFFLOAD_BACKEND="Reference")
    out = subprocess.run([sys.executable, "-m", "fp4offload.cli", "doctor", "--json", "--config", str(cfg)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    s = r["settings"]
    assert set(s) == {f"fp4offload.{sw.json_key}" if sw.json_key else sw.name for sw in SWITCHES}
    assert s["fp4offload.host.allocator_cache"] == {"value": 0.5, "source": "fp4offload.host.allocator_cache",
                                                    "variable": "FP4OFFLOAD_HOST_CACHE"}
    assert s["fp4offload.host.bf16_gradient_partition"]["source"] == "FP4OFFLOAD_BF16_GRADS"
    assert s["fp4offload.host.mmap_threshold"]["source"] == "default"
    assert s["FP4OFFLOAD_BACKEND"] == {"value": "reference", "source": "FP4OFFLOAD_BACKEND",
                                       "variable": "FP4OFFLOAD_BACKEND"}
    assert s["FP4OFFLOAD_CPU_ISA"] == {"value": r["cpu_isa"], "source": "default", "variable": "FP4OFFLOAD_CPU_ISA"}
    assert r["active"]["cpu_tensors"]["backend"] == "reference"
    assert r["host"]["settings"]["allocator_cache"]["source"] == "fp4offload.host.allocator_cache"

    from fp4offload._doctor import render

    text = render(r)
    assert re.search(r"fp4offload\.host\.allocator_cache +0\.5 +fp4offload\.host\.allocator_cache", text), text
    assert re.search(r"fp4offload\.host\.mmap_threshold +131072 +default +\(override: FP4OFFLOAD_MMAP", text), text
    assert re.search(r"FP4OFFLOAD_BACKEND +reference +FP4OFFLOAD_BACKEND", text), text
