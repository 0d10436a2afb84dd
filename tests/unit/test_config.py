"""fp4offload._config: the "fp4offload" block of a DeepSpeed config and the FSDP2 policy YAML."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest

from fp4offload._deepspeed.schema import find_auto_values, validate_deepspeed_config
from fp4offload._config import (ActivationsConfig, Fp4OffloadConfig, FsdpPolicyConfig, MonitorConfig,
                               OptimizerStatesConfig, WeightsConfig, dump_fsdp_policy_yaml, load_fsdp_policy_yaml,
                               parse_block, parse_fsdp_policy, prepare_path)
from fp4offload.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

FULL_BLOCK = {
    "optimizer_states": {"format": "nvfp4", "device": "nvme", "nvme_path": "/nvme", "rounding": "stochastic",
                         "min_numel": 1024},
    "activations": {"format": "mxfp8", "device": "cpu", "nvme_path": None, "min_numel": 1, "modules": ["*.mlp"],
                    "exclude": ["*.lm_head"]},
    "weights": {"format": "nvfp4", "device": "cpu", "keep_bf16": ["embed", "first:2", "last:0"]},
    "monitor": {"every": 5},
}


def ds_config(**overrides) -> dict:
    cfg = {
        "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
        "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True,
        "fp4offload": copy.deepcopy(FULL_BLOCK),
    }
    cfg.update(overrides)
    return cfg


# -- the block ---------------------------------------------------------------------------------


def test_defaults_are_the_documented_values():
    o, a, w, m = OptimizerStatesConfig(), ActivationsConfig(), WeightsConfig(), MonitorConfig()
    assert (o.format, o.device, o.nvme_path, o.rounding, o.min_numel) == ("nvfp4", "same", None, "stochastic", 4096)
    assert (a.format, a.device, a.min_numel, a.modules, a.exclude) == ("nvfp4", "cpu", 65536, (), ())
    assert (w.format, w.device) == ("nvfp4", "cpu")
    assert w.keep_bf16 == ("embed", "lm_head", "norm", "bias", "first:1", "last:1")
    assert m.every == 10
    for cls in (OptimizerStatesConfig, ActivationsConfig, WeightsConfig, MonitorConfig, Fp4OffloadConfig,
                FsdpPolicyConfig):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen and cls.__doc__


def test_every_sub_block_is_optional():
    for block in (None, {}):
        cfg = parse_block(block)
        assert cfg == Fp4OffloadConfig() and not cfg.enabled and cfg.to_dict() == {}
    cfg = parse_block({"monitor": {}})
    assert cfg.monitor == MonitorConfig() and cfg.optimizer_states is None and cfg.enabled
    assert parse_block({"weights": None}).weights is None


def test_full_block_round_trips():
    cfg = parse_block(FULL_BLOCK)
    assert cfg.optimizer_states.rounding == "stochastic" and cfg.activations.modules == ("*.mlp",)
    assert cfg.weights.keep_bf16 == ("embed", "first:2", "last:0")
    assert parse_block(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.monitor = None  # type: ignore[misc]


def test_lists_given_to_the_dataclasses_become_tuples():
    a = ActivationsConfig(modules=["*.attn"], exclude=["x"])
    assert a.modules == ("*.attn",) and a.exclude == ("x",) and hash(a)


@pytest.mark.parametrize("block, key, fragment", [
    ({"optimizer_states": {"device": "nvm"}}, "optimizer_states.device", "did you mean 'nvme'"),
    ({"optimizer_states": {"format": "fp4"}}, "optimizer_states.format", "'nvfp4', 'fp32'"),
    ({"optimizer_states": {"device": "nvme"}}, "optimizer_states.nvme_path", "nvme_path"),
    ({"optimizer_states": {"rounding": "up"}}, "optimizer_states.rounding", "stochastic"),
    ({"optimizer_states": {"min_numel": -1}}, "optimizer_states.min_numel", ">= 0"),
    ({"optimizer_states": {"min_numel": "4096"}}, "optimizer_states.min_numel", "integer"),
    ({"optimizer_states": {"min_numel": True}}, "optimizer_states.min_numel", "integer"),
    ({"optimizer_states": {"nvme_path": ""}}, "optimizer_states.nvme_path", "path"),
    ({"optimizer_states": {"colour": 1}}, "optimizer_states.colour", "unknown key"),
    ({"optimizer_states": "nvfp4"}, "optimizer_states", "mapping"),
    ({"activations": {"format": "int8"}}, "activations.format", "mxfp8"),
    ({"activations": {"device": "gpu"}}, "activations.device", "'same'"),
    ({"activations": {"device": "nvme"}}, "activations.nvme_path", "nvme_path"),
    ({"activations": {"modules": "*.mlp"}}, "activations.modules", "list"),
    ({"activations": {"modules": [""]}}, "activations.modules", "non-empty"),
    ({"activations": {"exclude": [1]}}, "activations.exclude", "list"),
    ({"activations": {"format": "none", "device": "same"}}, "activations.device", "does nothing"),
    # an op class's format harsher than the module's would never be used (an op rule only makes storage gentler)
    ({"activations": {"attention_format": "int2"}}, "activations.attention_format", "gentler than format 'nvfp4'"),
    ({"activations": {"format": "mxfp8", "mlp_format": "nvfp4"}}, "activations.mlp_format", "'inherit'"),
    ({"activations": {"format": "mxfp4", "attention_qk_format": "nvfp4"}}, "activations.attention_qk_format",
     "gentler"),
    ({"weights": {"format": "mxfp4"}}, "weights.format", "'nvfp4', 'bf16'"),
    ({"weights": {"device": "same"}}, "weights.device", "'cpu'"),
    ({"weights": {"device": "nvme"}}, "weights.device", "'cpu'"),  # no engine keeps packed shards on NVMe
    ({"weights": {"keep_bf16": ["first:one"]}}, "weights.keep_bf16", "first:N"),
    ({"weights": {"keep_bf16": "embed"}}, "weights.keep_bf16", "list"),
    ({"monitor": {"every": 0}}, "monitor.every", ">= 1"),
    ({"monitr": {}}, "monitr", "did you mean 'monitor'"),
])
def test_bad_values_name_the_key_path(block, key, fragment):
    with pytest.raises(ConfigError) as e:
        parse_block(block, prefix="fp4offload.")
    assert e.value.key == "fp4offload." + key, str(e.value)
    assert fragment in str(e.value)
    assert isinstance(e.value, ValueError)  # callers may catch ValueError


def test_block_must_be_a_mapping():
    with pytest.raises(ConfigError) as e:
        parse_block(["optimizer_states"], prefix="fp4offload.")
    assert e.value.key == "fp4offload"


def test_direct_construction_validates_too():
    with pytest.raises(ConfigError) as e:
        OptimizerStatesConfig(device="disk")
    assert e.value.key == "optimizer_states.device"
    with pytest.raises(ConfigError):
        Fp4OffloadConfig(weights={"format": "nvfp4"})  # a dict where a WeightsConfig belongs


# -- the whole DeepSpeed config ----------------------------------------------------------------------


def test_valid_deepspeed_config_passes_and_returns_the_block():
    cfg = validate_deepspeed_config(ds_config(), world_size=4)
    assert cfg.weights.format == "nvfp4" and cfg.optimizer_states.device == "nvme"
    assert validate_deepspeed_config({"train_batch_size": 8}) == Fp4OffloadConfig()  # no block: all off


def test_auto_is_refused_anywhere_in_deepspeeds_keys():
    assert find_auto_values({"a": {"b": ["x", "auto"]}, "c": "AUTO"}) == ["a.b[1]", "c"]
    for path, cfg in [("train_micro_batch_size_per_gpu", ds_config(train_micro_batch_size_per_gpu="auto")),
                      ("zero_optimization.reduce_bucket_size",
                       ds_config(zero_optimization={"stage": 3, "reduce_bucket_size": "auto",
                                                    "offload_param": {"device": "cpu"}}))]:
        with pytest.raises(ConfigError) as e:
            validate_deepspeed_config(cfg)
        assert e.value.key == path and "auto" in str(e.value)


@pytest.mark.parametrize("mutate, key", [
    (lambda c: c["zero_optimization"].update(stage=2), "fp4offload.weights"),
    (lambda c: c["zero_optimization"].pop("offload_param"), "zero_optimization.offload_param.device"),
    (lambda c: c["zero_optimization"].update(offload_param={"device": "nvme"}),
     "zero_optimization.offload_param.device"),
    (lambda c: (c["zero_optimization"].update(offload_param={"device": "nvme"}),
                c["fp4offload"]["weights"].update(device="nvme")), "fp4offload.weights.device"),
    (lambda c: c.pop("zero_force_ds_cpu_optimizer"), "zero_force_ds_cpu_optimizer"),
    (lambda c: c.update(zero_allow_untested_optimizer=False), "zero_allow_untested_optimizer"),
    (lambda c: c["zero_optimization"].update(offload_optimizer={"device": "nvme", "nvme_path": "/x"}),
     "zero_optimization.offload_optimizer.device"),
    (lambda c: c["zero_optimization"].update(stage=4), "zero_optimization.stage"),
    (lambda c: c.update(fp16={"enabled": True}), "fp16.enabled"),
    (lambda c: c.update(train_batch_size=3), "train_batch_size"),
    (lambda c: c.update(gradient_accumulation_steps=0), "gradient_accumulation_steps"),
    (lambda c: c["fp4offload"]["activations"].update(device="elsewhere"), "fp4offload.activations.device"),
])
def test_bad_combinations_are_refused(mutate, key):
    cfg = ds_config()
    mutate(cfg)
    with pytest.raises(ConfigError) as e:
        validate_deepspeed_config(cfg, world_size=4)
    assert e.value.key == key, str(e.value)


def test_deepspeeds_own_schema_check_is_optional_and_catches_unknown_zero_keys():
    cfg = ds_config()
    cfg["zero_optimization"]["stage3_prefetch_bucket"] = 5  # misspelt
    validate_deepspeed_config(cfg)  # not checked without the flag
    with pytest.raises(ConfigError) as e:
        validate_deepspeed_config(cfg, check_with_deepspeed=True)
    assert e.value.key == "zero_optimization"


def test_not_a_dict():
    with pytest.raises(ConfigError):
        validate_deepspeed_config(["stage", 3])


# -- FSDP2 policy YAML --------------------------------------------------------------------------


def test_fsdp_policy_round_trips_through_yaml(tmp_path):
    pol = FsdpPolicyConfig(weights=WeightsConfig(), optimizer_states=OptimizerStatesConfig(),
                           activations=ActivationsConfig(format="mxfp8", device="same"), cpu_offload=True,
                           reshard_after_forward=False, block_classes=["LlamaDecoderLayer"])
    path = tmp_path / "p.yaml"
    text = dump_fsdp_policy_yaml(pol, path, header="example")
    assert text.startswith("# example\n")
    assert load_fsdp_policy_yaml(path) == pol
    assert parse_fsdp_policy(None) == FsdpPolicyConfig() and FsdpPolicyConfig().block_classes == ()


@pytest.mark.parametrize("text, key", [
    ("cpu_offload: yes please\n", "cpu_offload"),
    ("reshard_after_forward: 1\n", "reshard_after_forward"),
    ("block_classes: LlamaDecoderLayer\n", "block_classes"),
    ("block_clases: [A]\n", "block_clases"),
    ("weights: {device: nvme}\ncpu_offload: true\n", "weights.device"),
    ("optimizer_states: {rounding: up}\n", "optimizer_states.rounding"),
    ("activations: {device: nvme}\n", "activations.nvme_path"),
])
def test_fsdp_policy_errors_name_the_key(tmp_path, text, key):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_fsdp_policy_yaml(path)
    assert e.value.key == key, str(e.value)


def test_fsdp_policy_file_problems(tmp_path):
    with pytest.raises(ConfigError):
        load_fsdp_policy_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("weights: [unclosed\n")
    with pytest.raises(ConfigError) as e:
        load_fsdp_policy_yaml(bad)
    assert "YAML" in str(e.value)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError):
        load_fsdp_policy_yaml(bad)


# -- the shipped examples ----------------------------------------------------------------------------


def test_example_configs_cover_every_zero_stage_and_state_device():
    names = {p.name for p in (ROOT / "configs").glob("*.json")}
    for stage in (1, 2, 3):
        assert f"deepspeed_zero{stage}_offload_cpu.json" in names
        assert f"deepspeed_zero{stage}_states_nvme.json" in names
    assert {p.name for p in (ROOT / "configs").glob("*.yaml")} >= {"fsdp_fp4.yaml", "fsdp_states_nvme.yaml"}


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.json")), ids=lambda p: p.name)
def test_example_deepspeed_configs_validate(path):
    cfg = json.loads(path.read_text())
    block = validate_deepspeed_config(cfg, check_with_deepspeed=True)
    assert block.enabled


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_example_fsdp_policies_validate(path):
    assert isinstance(load_fsdp_policy_yaml(path), FsdpPolicyConfig)


def test_each_shipped_config_does_one_thing():
    """Configs that store states keep states only (offload_cpu, states_nvme, the FSDP2 states files); activation
    offload has its own file, NVFP4 under the default policy over the whole model (what the fine-tune and the long
    run measured); the weights files
    add the gathers only; configs/README.md names every file."""
    for stage in (1, 2, 3):
        for kind in ("offload_cpu", "states_nvme"):
            cfg = json.loads((ROOT / "configs" / f"deepspeed_zero{stage}_{kind}.json").read_text())
            assert set(cfg["fp4offload"]) <= {"optimizer_states", "monitor"}, (kind, cfg["fp4offload"])
    acts = json.loads((ROOT / "configs" / "deepspeed_zero2_offload_cpu_activations.json").read_text())
    assert set(acts["fp4offload"]) <= {"optimizer_states", "activations", "monitor"}
    assert acts["fp4offload"]["activations"] == {"format": "nvfp4", "device": "cpu", "min_numel": 65536}
    weights = json.loads((ROOT / "configs" / "deepspeed_zero3_offload_param_fp4_weights.json").read_text())
    assert set(weights["fp4offload"]) <= {"optimizer_states", "weights", "monitor"}
    import yaml

    for name, extra in (("fsdp_fp4.yaml", {"weights"}), ("fsdp_gpu_fp4_states.yaml", set()),
                        ("fsdp_states_nvme.yaml", set())):
        doc = yaml.safe_load((ROOT / "configs" / name).read_text())
        assert {k for k in ("weights", "activations") if k in doc} == extra, (name, doc)
    readme = (ROOT / "configs" / "README.md").read_text()
    for p in (ROOT / "configs").iterdir():
        if p.suffix in (".json", ".yaml"):
            family = re.sub(r"zero[123]", "zero{1,2,3}", p.name)
            assert p.name in readme or family in readme, p.name


def test_example_state_devices_match_their_names():
    for stage in (1, 2, 3):
        for kind, dev in (("offload_cpu", "cpu"), ("states_nvme", "nvme")):
            cfg = json.loads((ROOT / "configs" / f"deepspeed_zero{stage}_{kind}.json").read_text())
            assert cfg["zero_optimization"]["stage"] == stage
            assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
            states = cfg["fp4offload"]["optimizer_states"]
            assert states["device"] == dev
            assert bool(states["nvme_path"]) == (dev == "nvme")


def test_activation_defaults_are_one_set():
    """The schema's activations defaults and ActivationPolicy's are the same values (config.py's vocabulary);
    an empty ``modules`` list means every module in both."""
    from fp4offload._offload import ActivationPolicy

    cfg, pol = ActivationsConfig(), ActivationPolicy()
    for name in ("format", "device", "nvme_path", "min_numel", "modules", "exclude"):
        assert getattr(cfg, name) == getattr(pol, name), name
    assert ActivationPolicy.from_config(cfg) == pol
    assert ActivationPolicy.from_config(ActivationsConfig(modules=["*.mlp"], min_numel=0)).modules == ("*.mlp",)


def test_building_every_schema_with_a_missing_nvme_folder_touches_no_disk(tmp_path, monkeypatch):
    """Schemas check a path's text only: no folder is created, looked up or probed for writability (that is
    fp4offload._config.prepare_path's, where the folder is first used)."""
    import builtins
    import os

    import fp4offload.deepspeed as fds
    import fp4offload.fsdp as ff
    from fp4offload._config import HostConfig

    marker = "fp4-nvme-missing"
    paths = [str(tmp_path / marker / "deeper" / "states"), f"~/{marker}/states", f"${{FP4_UNSET_{marker[4:8]}}}/x",
             f"relative/{marker}"]
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(f"optimizer_states: {{device: nvme, nvme_path: '{paths[0]}'}}\n"
                           f"activations: {{device: nvme, nvme_path: '{paths[1]}'}}\nweights: null\n")
    before = sorted(tmp_path.rglob("*"))
    touched = []

    def refuse(name, real):
        def call(*args, **kwargs):
            touched.append((name, args))
            raise AssertionError(f"{name}{args} during schema validation")
        return call

    def watch(name, real):
        def call(path, *args, **kwargs):
            if isinstance(path, (str, bytes, os.PathLike)) and marker in os.fsdecode(path):
                touched.append((name, path))
            return real(path, *args, **kwargs)
        return call

    real_open = builtins.open

    def guarded_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            touched.append(("open", file, mode))
        return real_open(file, mode, *args, **kwargs)

    for name in ("mkdir", "makedirs", "access", "rmdir"):
        monkeypatch.setattr(os, name, refuse(f"os.{name}", getattr(os, name)))
    for name in ("stat", "lstat", "listdir", "scandir"):
        monkeypatch.setattr(os, name, watch(f"os.{name}", getattr(os, name)))
    monkeypatch.setattr(builtins, "open", guarded_open)

    zero = {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": paths[2]}}
    for path in paths:
        states = {"device": "nvme", "nvme_path": path}
        acts = {"device": "nvme", "nvme_path": path}
        OptimizerStatesConfig(**states)
        ActivationsConfig(**acts)
        WeightsConfig()
        MonitorConfig()
        HostConfig(mmap_threshold="off")
        Fp4OffloadConfig(optimizer_states=OptimizerStatesConfig(**states), activations=ActivationsConfig(**acts))
        block = {"optimizer_states": states, "activations": acts, "host": {"preflight": "warn"}}
        parse_block(block, prefix="fp4offload.")
        validate_deepspeed_config(ds_config(fp4offload=block))
        fds.prepare_config(ds_config(fp4offload=block))
        fds.prepare_config(ds_config(fp4offload={"optimizer_states": {}}, zero_optimization=zero))
        doc = {"optimizer_states": states, "activations": acts, "weights": None}
        FsdpPolicyConfig(optimizer_states=OptimizerStatesConfig(**states))
        dump_fsdp_policy_yaml(parse_fsdp_policy(doc))
        ff.Policy(**doc)
    load_fsdp_policy_yaml(policy_file)
    ff.policy_from_yaml(policy_file)
    assert touched == []
    assert sorted(tmp_path.rglob("*")) == before
    with pytest.raises(AssertionError, match="os.access"):  # the guard sees what the machine's side does
        prepare_path("nvme_path", str(tmp_path / marker))
    monkeypatch.undo()
    assert sorted(tmp_path.rglob("*")) == before
    assert not (Path.home() / marker).exists() and not Path("relative").exists()


def test_prepare_path_creates_one_level_where_the_folder_is_first_used(tmp_path, monkeypatch):
    monkeypatch.setenv("FP4_PREPARE_ROOT", str(tmp_path))
    got = prepare_path("optimizer_states.nvme_path", "$FP4_PREPARE_ROOT/states")
    assert got == tmp_path / "states" and got.is_dir() and (got.stat().st_mode & 0o777) == 0o700
    assert prepare_path("optimizer_states.nvme_path", got) == got  # an existing folder is taken as it is
    with pytest.raises(ConfigError, match="mistyped mount point") as e:
        prepare_path("optimizer_states.nvme_path", str(tmp_path / "gone" / "states"))
    assert e.value.key == "optimizer_states.nvme_path" and not (tmp_path / "gone").exists()


def test_one_mapping_from_the_states_section_to_fp4adamw_serves_both_engines():
    """DeepSpeed's block and the FSDP2 policy build FP4AdamW from the same section through one function."""
    from fp4offload._config.block import OptimizerStatesConfig
    from fp4offload._deepspeed import optim as ds_optim
    from fp4offload._fsdp import optim as fsdp_optim
    from fp4offload._fsdp.policy import Policy
    from fp4offload._optim.options import fp4adamw_kwargs

    st = OptimizerStatesConfig(device="cpu", rounding="nearest", v_rounding="nearest", v_format="ufp4",
                               min_numel=0, master="split")
    kw = fp4adamw_kwargs(st)
    assert kw["state_device"] == "cpu" and kw["master"] == "split"
    sf = kw["state_format"]
    assert (sf.m_rounding, sf.v_rounding, sf.v_format, sf.min_numel) == ("nearest", "nearest", "ufp4", 1)
    _, extra, _ = fsdp_optim.inner_optimizer_class(Policy(optimizer_states=dataclasses.asdict(st)))
    assert extra == kw
    import torch

    p = torch.nn.Parameter(torch.zeros(64))
    opt = ds_optim.make_optimizer([p], ds_optim.AdamSettings(), st)
    assert opt.param_groups[0]["v_format"] == "ufp4" and opt.state_format == sf and opt.master == "split"
