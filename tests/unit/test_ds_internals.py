"""The room for DeepSpeed's private names: the table matches the installed DeepSpeed, a missing name or an
unsupported version fails at initialize before DeepSpeed builds anything, the supported range is written once,
and no other module of fp4offload reaches DeepSpeed's private names around it."""

from __future__ import annotations

import io
import re
import textwrap
import tokenize
from pathlib import Path

import pytest

from fp4offload.errors import ConfigError
from fp4offload._deepspeed import internals as dsi

ROOT = Path(__file__).resolve().parents[2]
deepspeed = pytest.importorskip("deepspeed")


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def test_pyproject_bound_is_the_supported_range():
    text = (ROOT / "pyproject.toml").read_text()
    bounds = re.findall(r'"(deepspeed[^"]*)"', text)
    assert bounds == [dsi.requirement()], (bounds, dsi.requirement())
    lo, hi = dsi.SUPPORTED
    assert dsi.supported(deepspeed.__version__)
    assert dsi.supported(".".join(map(str, lo))) and not dsi.supported(".".join(map(str, hi)))
    below = (lo[0], lo[1] - 1, 99) if lo[2] == 0 else (lo[0], lo[1], lo[2] - 1)  # the release just before
    assert not dsi.supported(".".join(map(str, below))) and dsi.supported(f"{_dotted(lo)}+cpu")


def test_every_name_of_the_table_is_in_the_installed_deepspeed():
    assert dsi.missing(dsi.FEATURES) == []
    dsi.check(dsi.FEATURES)  # no error
    for row in dsi.TABLE:
        assert row.features and set(row.features) <= set(dsi.FEATURES), row
        assert row.kind in ("callable", "attribute", "param"), row


def test_a_renamed_attribute_is_found_missing():
    """The static check of instance attributes reads the class's source: a name it does not assign is missing."""
    real = next(r for r in dsi.TABLE if r.name == "param_buffer_of_bit16_for_cpu_offload_groups")
    renamed = dsi.Internal(real.owner, "param_buffer_of_bit16_groups_renamed", "attribute", "test", real.features)
    assert dsi._present(real) and not dsi._present(renamed)
    param = next(r for r in dsi.TABLE if r.kind == "param")
    assert not dsi._present(dsi.Internal(param.owner, "ds_no_such_attribute", "param", "test", param.features))


def test_unknown_names_are_refused_by_the_accessors():
    class Opt:
        cpu_offload = True

    assert dsi.read(Opt(), "cpu_offload") is True
    with pytest.raises(KeyError, match="not in internals.TABLE"):
        dsi.read(Opt(), "some_private_name")
    with pytest.raises(RuntimeError, match="is gone in DeepSpeed"):
        dsi.require(object(), "real_dp_process_group")


def _tiny_engine_args():
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "fp4offload": {"optimizer_states": {"format": "nvfp4", "device": "cpu"}}}
    return model, cfg


@pytest.fixture
def no_engine(monkeypatch):
    """Fails the test if DeepSpeed starts building an engine (or anything is handed to deepspeed.initialize)."""
    import deepspeed.runtime.engine as engine_mod

    built = []

    def refuse(self, *a, **k):
        built.append(True)
        raise AssertionError("DeepSpeedEngine was constructed before the internals check")

    monkeypatch.setattr(engine_mod.DeepSpeedEngine, "__init__", refuse)
    monkeypatch.setattr(deepspeed, "initialize", lambda *a, **k: built.append(True))
    return built


def test_a_missing_private_name_fails_at_initialize_before_anything_is_built(monkeypatch, no_engine):
    import fp4offload.deepspeed as fds
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    monkeypatch.delattr(DeepSpeedZeroOptimizer, "initialize_optimizer_states")
    model, cfg = _tiny_engine_args()
    with pytest.raises(ConfigError) as e:
        fds.initialize(model=model, config=cfg)
    msg = str(e.value)
    assert e.value.key == "fp4offload.bf16_gradient_partition"
    assert "DeepSpeedZeroOptimizer.initialize_optimizer_states" in msg
    assert f"deepspeed {deepspeed.__version__}" in msg and dsi.requirement() in msg
    assert no_engine == []
    # the feature that needs the name can be turned off in the config, and then the check passes
    cfg["fp4offload"]["host"] = {"bf16_gradient_partition": False}
    prepared = fds.prepare_config(cfg)
    from fp4offload._deepspeed.surgeries import features

    assert "bf16_gradient_partition" not in features(prepared)
    dsi.check(features(prepared))


def test_an_unsupported_version_fails_at_initialize_before_anything_is_built(monkeypatch, no_engine):
    import fp4offload.deepspeed as fds

    monkeypatch.setattr(deepspeed, "__version__", "0.14.2")
    model, cfg = _tiny_engine_args()
    with pytest.raises(ConfigError) as e:
        fds.initialize(model=model, config=cfg)
    assert "deepspeed 0.14.2" in str(e.value) and "outside the releases" in str(e.value)
    assert dsi.requirement() in str(e.value)
    assert no_engine == []


#: names of the table too common to search for as reads (``device``, ``partition_size``, ...): left out of the scan
_COMMON = {"device", "cpu_offload", "partition_size", "bit16_groups", "gradient_accumulation_steps", "fp16_groups",
           "offload_optimizer", "optimizer"}
#: ZeRO-3's fetch functions share their names with torch.distributed.all_gather and str.partition: writes only
_WRITES_ONLY = {"all_gather", "partition"}


def _raw_accesses(text: str, where: str) -> list[str]:
    """Reads and writes of the table's names that bypass the accessors: ``obj.<name>`` (for ``_WRITES_ONLY``
    names, ``obj.<name> =``) and ``getattr``/``hasattr``/``setattr`` with the name as a string. ZeRO-3's parameter
    attributes (``ds_tensor``, ``ds_status``, ...) and the fetch functions it binds on every parameter count."""
    names = {r.name for r in dsi.TABLE if not r.name.isupper()} - _COMMON
    out = []
    toks = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
            if t.type not in (tokenize.NL, tokenize.COMMENT)]
    for prev, tok, nxt in zip(toks, toks[1:], toks[2:] + [toks[-1]]):
        at = f"{where}:{tok.start[0]}"
        if tok.type == tokenize.NAME and tok.string in names and prev.string == ".":
            if tok.string not in _WRITES_ONLY or nxt.string == "=":
                out.append(f"{at}: .{tok.string}")
        if tok.type == tokenize.STRING and tok.string.strip("\"'") in names:
            if re.search(rf"\b(getattr|hasattr|setattr)\([^()]*{re.escape(tok.string)}", tok.line):
                out.append(f"{at}: {tok.line.strip()}")
    return out


def test_the_scan_finds_raw_reads_and_writes_of_zero3_parameter_attributes():
    """The scan (_raw_accesses) flags a raw access of each kind, ZeRO-3's parameter attributes included, and leaves the
    accessors and torch's own all_gather alone."""
    raw = textwrap.dedent("""
        n = p.ds_tensor.numel()
        p.ds_status = st.INFLIGHT
        shape = getattr(p, "ds_shape", p.shape)
        key = q.ds_id
        p.all_gather = fetch
        p.partition = repack
        opt.param_buffer_of_bit16_for_cpu_offload_groups[0] = buf
    """)
    found = _raw_accesses(raw, "x.py")
    assert [f.split(":")[1] for f in found] == [str(i) for i in range(2, 9)], found
    clean = textwrap.dedent("""
        n = dsi.require(p, "ds_tensor").numel()
        dsi.write(p, "ds_status", st.INFLIGHT)
        shape = dsi.read(p, "ds_shape", p.shape)
        dsi.write(p, "all_gather", fetch)
        torch.distributed.all_gather(datas, data, group=group)
        which, _, count = rule.partition(":")
        if p.partition == other: pass
    """)
    assert _raw_accesses(clean, "y.py") == []


def test_no_module_reaches_deepspeed_private_names_around_the_room():
    """Every name of the table, ZeRO-3's parameter attributes (``param.ds_tensor``, ``ds_status``, ``ds_id``, ...)
    included, is read and written only through the internals module (read/require/write/patch_class/
    wrap_instance); see _raw_accesses for what counts and which common names are left out."""
    offenders = []
    for path in (ROOT / "fp4offload").rglob("*.py"):
        if path == ROOT / "fp4offload" / "_deepspeed" / "internals.py":
            continue
        offenders += _raw_accesses(path.read_text(), str(path.relative_to(ROOT)))
    assert offenders == [], offenders
