"""What the block does to DeepSpeed around ``deepspeed.initialize`` is one table (surgeries.SURGERIES): the
features checked against DeepSpeed's private names, the steps ``initialize`` runs and what ``engine.fp4offload``
holds all come from it."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import types

import pytest

pytest.importorskip("deepspeed")

from fp4offload._deepspeed import engine
from fp4offload._deepspeed import internals as dsi
from fp4offload._deepspeed import surgeries
from fp4offload._deepspeed.config import _zero, prepare_config
from fp4offload._deepspeed.surgeries import SURGERIES, Attached, Surgery, features


def _config(stage=2, master="fp32", states=True, weights=False, monitor=False, activations=False, host=None):
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    block = {}
    if states:
        block["optimizer_states"] = {"format": "nvfp4", "device": "cpu", "master": master}
    if weights:
        zero["offload_param"] = {"device": "cpu"}
        block["weights"] = {"format": "nvfp4"}
    if monitor:
        block["monitor"] = {"every": 5}
    if activations:
        block["activations"] = {"modules": ["mlp"]}
    if host:
        block["host"] = host
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "zero_optimization": zero, "fp4offload": block}


_HOSTS = (None, {"bf16_gradient_partition": False}, {"share_bf16_staging": False},
          {"bf16_gradient_partition": False, "share_bf16_staging": False})
CONFIGS = [
    *(_config(stage, master, monitor=monitor, host=host) for stage, master, monitor, host
      in itertools.product((1, 2, 3), ("fp32", "split", "bf16"), (False, True), _HOSTS)),
    _config(3, weights=True), _config(3, weights=True, monitor=True, activations=True),
    _config(2, activations=True), _config(2, states=False, monitor=True), _config(2, states=False, activations=True),
]


def _features_by_hand(prepared) -> tuple[str, ...]:
    """The features each one written out by hand: what the table must give."""
    block, out = prepared.block, []
    stage = _zero(prepared.ds_config).get("stage", 0)
    if block.optimizer_states is not None:
        out.append("optimizer_states")
        if stage in (1, 2, 3) and (prepared.host.bf16_gradient_partition.value or stage == 3):
            out.append("bf16_gradient_partition")
        if stage in (1, 2) and prepared.host.share_bf16_staging.value:
            out.append("share_bf16_staging")
        if prepared.states is not None and prepared.states.master != "fp32":
            out.append("compact_master")
    if block.weights is not None and block.weights.format == "nvfp4":
        out.append("weights")
    if block.monitor is not None:
        out.append("monitor")
    return tuple(out)


def _rows(names) -> set[tuple[str, str]]:
    return {(r.owner, r.name) for r in dsi.TABLE if set(names) & set(r.features)}


def test_every_feature_of_the_internals_table_is_a_surgery():
    names = [s.name for s in SURGERIES]
    assert len(set(names)) == len(names), names
    assert set(dsi.FEATURES) <= {s.feature for s in SURGERIES}
    for s in SURGERIES:
        assert s.before is not None or s.at_init is not None or s.after is not None, s.name
        assert s.before is None or s.at_init is None, s.name
        assert s.needs == tuple(r for r in dsi.TABLE if s.feature in r.features)
        assert bool(s.needs) == (s.feature in dsi.FEATURES), s.name


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: str(c["fp4offload"]) + f" stage {_zero(c)['stage']}")
def test_the_features_checked_are_those_of_the_surgeries_that_apply(cfg):
    prepared = prepare_config(cfg)
    on = [s for s in SURGERIES if s.applies(prepared)]
    assert features(prepared) == tuple(dict.fromkeys(s.feature for s in on if s.needs))
    by_hand = _features_by_hand(prepared)
    # the staging buffers are shared only without a compact master, which makes them the master instead
    compact = prepared.states is not None and prepared.states.master != "fp32"
    assert features(prepared) == tuple(f for f in by_hand if not (compact and f == "share_bf16_staging"))
    assert _rows(features(prepared)) == _rows(by_hand)  # the same private names checked either way
    dsi.check(features(prepared))


def test_every_field_of_attached_but_the_config_s_is_filled_by_a_surgery():
    filled = {s.field for s in SURGERIES if s.field is not None}
    fields = {f.name for f in dataclasses.fields(Attached)}
    assert filled <= fields
    assert fields - filled == {"prepared", "preflight", "preflight_free", "auto", "block", "surgeries"}


def _steps_of(surgery: Surgery) -> set[str]:
    """The names of the block's own functions and classes a surgery's steps call."""
    names = set()
    for fn in (surgery.before, surgery.at_init, surgery.after, surgery.on_engine):
        code = getattr(fn, "__code__", None)
        for name in (code.co_names if code is not None else ()) + ((fn.__name__,) if code is not None else ()):
            obj = vars(surgeries).get(name)
            if callable(obj) and getattr(obj, "__module__", "").startswith("fp4offload._deepspeed."):
                names.add(name)
    return names


def test_initialize_names_no_surgery():
    body = inspect.getsource(engine.initialize)
    steps = set().union(*(_steps_of(s) for s in SURGERIES))
    assert {"control_host_allocator", "share_bf16_staging", "zero3_grads_at_init", "close_on_destroy"} <= steps
    for name in {s.name for s in SURGERIES} | steps:
        assert name not in body, name


def test_initialize_runs_the_table_in_order(monkeypatch):
    import torch

    log = []

    @contextlib.contextmanager
    def held(name):
        log.append(f"enter {name}")
        yield name
        log.append(f"exit {name}")

    def step(text, value=None):
        return lambda *a: log.append(text) or value

    table = (
        Surgery("a", "optimizer_states", lambda p: True, before=step("before a", {"mmap_threshold": None}),
                field="allocator"),
        Surgery("b", "x", lambda p: False, before=step("before b")),
        Surgery("c", "x", lambda p: True, at_init=lambda run: held("c"), after=step("after c", 3),
                field="staging_shared_bytes"),
        Surgery("d", "x", lambda p: True, at_init=lambda run: held("d"), field="activations"),
        Surgery("e", "x", lambda p: True, after=step("after e", 4), field="staging_shared_bytes"),
        Surgery("f", "x", lambda p: False, after=step("after f", "m"), field="monitor", on_engine=lambda e: e.flag),
        Surgery("g", "x", lambda p: False, after=step("after g"), on_engine=lambda e: False),
    )
    monkeypatch.setattr(engine, "SURGERIES", table)
    fake = types.SimpleNamespace(flag=True)
    args = types.SimpleNamespace(deepspeed_config="ds.json", deepscale_config=None)

    def deepspeed_initialize(config, **kwargs):
        assert kwargs["args"].deepspeed_config is None
        log.append("deepspeed.initialize")
        return fake, None, None, None

    monkeypatch.setattr(engine, "_original_initialize", lambda: deepspeed_initialize)
    cfg = _config(2, host={"preflight": "off"})
    result = engine.initialize(args=args, model=torch.nn.Linear(2, 2), config=cfg)
    assert result[0] is fake and args.deepspeed_config == "ds.json"
    assert log == ["before a", "enter c", "enter d", "deepspeed.initialize", "exit d", "exit c", "after c",
                   "after e", "after f"]
    att = fake.fp4offload
    assert att.surgeries == ("a", "c", "d", "e", "f")
    assert att.allocator == {"mmap_threshold": None} and att.activations == "d" and att.monitor == "m"
    assert att.staging_shared_bytes == 7 and att.block == cfg["fp4offload"] and att.preflight is None
