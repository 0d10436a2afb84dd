"""Emitted configs: every DeepSpeed strategy gives a config that our schema and DeepSpeed's own
config parser accept, with no "auto"; every FSDP2 strategy gives a policy YAML that loads."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fp4offload._deepspeed.schema import find_auto_values, validate_deepspeed_config
from fp4offload._config import load_fsdp_policy_yaml
from fp4offload.errors import ConfigError
from fp4offload._planner.emit import (OptimizerSettings, deepspeed_config, fp4offload_block, fsdp_policy,
                                     write_deepspeed, write_fsdp)
from fp4offload._planner.hardware import build_cluster
from fp4offload._planner.memory import TrainSetup
from fp4offload._planner.models import PRESETS
from fp4offload._planner.strategies import load_catalogue

CAT = load_catalogue()
DS = sorted(n for n, s in CAT.items() if s.engine == "deepspeed")
FSDP = sorted(n for n, s in CAT.items() if s.engine == "fsdp2")
SETUP = TrainSetup(micro_batch=2, seq_len=2048, grad_accum=4)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster():
    return build_cluster(gpu="h100-80gb", gpus=8, nodes=2, nvme_path="/local_nvme/fp4offload")


@pytest.fixture(scope="module")
def ds_parse():
    """DeepSpeed's own config class, told the data-parallel world size (no process group here)."""
    pytest.importorskip("deepspeed")
    import deepspeed.runtime.config as dsc

    class MPU:
        def __init__(self, n):
            self.n = n

        def get_data_parallel_world_size(self):
            return self.n

        def get_data_parallel_rank(self):
            return 0

        def get_model_parallel_world_size(self):
            return 1

        def get_model_parallel_rank(self):
            return 0

    def parse(cfg, world):
        original = dsc.dist.get_rank
        dsc.dist.get_rank = lambda *a, **k: 0  # DeepSpeedConfig asks for a rank before it reads the mpu
        try:
            return dsc.DeepSpeedConfig(cfg, mpu=MPU(world))
        finally:
            dsc.dist.get_rank = original

    return parse


@pytest.mark.parametrize("name", DS)
def test_deepspeed_config_for_every_strategy_validates(name, cluster, ds_parse, tmp_path):
    s = CAT[name]
    ga = 4 if s.master.format == "fp32" else 1  # a compact master needs one micro-batch per step
    cfg = deepspeed_config(s, PRESETS["llama-3.1-8b"], cluster, replace(SETUP, grad_accum=ga),
                           OptimizerSettings(lr=3e-4))
    assert find_auto_values(cfg) == []
    block = validate_deepspeed_config(cfg, world_size=cluster.world, check_with_deepspeed=True)
    assert cfg["train_batch_size"] == 2 * ga * 16 and cfg["optimizer"]["params"]["lr"] == 3e-4
    parsed = ds_parse(cfg, cluster.world)
    assert parsed.zero_config.stage == s.zero_stage and parsed.train_batch_size == 32 * ga
    assert parsed.zero_config.reduce_bucket_size == SETUP.reduce_bucket  # the size the memory model assumed
    if s.master.device != "gpu":
        assert parsed.zero_config.offload_optimizer.device == s.master.device
    if s.weights.device != "gpu":
        assert parsed.zero_config.offload_param.device == s.weights.device
    assert (block.optimizer_states is not None) == (s.optimizer_states.format == "nvfp4")
    assert (block.weights is not None) == (s.weights.format == "nvfp4")
    assert (block.activations is not None) == (s.activations.device != "gpu" or s.activations.format != "bf16")
    out = tmp_path / "ds.json"
    write_deepspeed(out, cfg)
    assert json.loads(out.read_text()) == cfg


def test_block_maps_placements(cluster):
    b = fp4offload_block(CAT["zero3-opt-nvme-fp4"], "/nvme")
    assert b.optimizer_states.device == "nvme" and b.optimizer_states.nvme_path == "/nvme"
    assert fp4offload_block(CAT["zero2-opt-cpu-fp4"]).optimizer_states.device == "same"  # the host partition
    act = fp4offload_block(CAT["zero3-params-cpu-act-cpu"]).activations
    assert (act.format, act.device) == ("none", "cpu")
    assert fp4offload_block(CAT["zero2-act-fp4"]).activations.device == "same"
    plain = fp4offload_block(CAT["zero1"])
    assert plain.monitor is not None and plain.to_dict() == {"monitor": {"every": 10}}
    with pytest.raises(ConfigError) as e:
        fp4offload_block(CAT["zero3-opt-nvme-fp4"], None)
    assert e.value.key == "--nvme-path"


def test_fp16_on_gpus_without_bf16():
    c = build_cluster(gpu="v100-32gb", gpus=8)
    cfg = deepspeed_config(CAT["zero2-opt-cpu-fp4"], PRESETS["llama-3.2-1b"], c, SETUP)
    assert cfg["fp16"]["enabled"] and "bf16" not in cfg
    validate_deepspeed_config(cfg, world_size=8)


@pytest.mark.parametrize("name", FSDP)
def test_fsdp_policy_for_every_strategy_loads(name, tmp_path):
    s = CAT[name]
    pol = fsdp_policy(s, PRESETS["qwen3-32b"])
    assert pol.cpu_offload == s.fsdp_cpu_offload and pol.block_classes == ("Qwen3DecoderLayer",)
    assert (pol.weights is not None) == (s.weights.format == "nvfp4")
    path = tmp_path / "policy.yaml"
    write_fsdp(path, pol, header="plan: " + name)
    assert path.read_text().startswith("# plan: ")
    assert load_fsdp_policy_yaml(path) == pol


def test_wrong_engine_is_refused(cluster):
    with pytest.raises(ConfigError) as e:
        deepspeed_config(CAT["fsdp2"], PRESETS["llama-3.1-8b"], cluster, SETUP)
    assert e.value.key == "--emit"
    with pytest.raises(ConfigError):
        fsdp_policy(CAT["zero2"], PRESETS["llama-3.1-8b"])


@pytest.mark.parametrize("name", DS)
def test_the_deepspeed_integration_takes_emitted_configs_as_they_are(name, cluster):
    """What the planner writes is what fp4offload.deepspeed hands DeepSpeed: nothing to rewrite."""
    try:
        from fp4offload.deepspeed import prepare_config
    except ImportError:
        pytest.skip("fp4offload.deepspeed is not importable")
    setup = SETUP if CAT[name].master.format == "fp32" else replace(SETUP, grad_accum=1)  # compact masters: 1
    cfg = deepspeed_config(CAT[name], PRESETS["llama-3.1-8b"], cluster, setup)
    prepared = prepare_config(cfg, world_size=cluster.world)
    # a rewrite reads "key: old -> new"; ZeRO-3 with a compact master also gets a note that changes nothing
    assert [r for r in prepared.rewrites if " -> " in r] == []
    if CAT[name].optimizer_states.format == "nvfp4":
        assert prepared.states.device == {"gpu": "same", "cpu": "same", "nvme": "nvme"}[
            CAT[name].optimizer_states.device]


def test_compact_master_strategies_emit_the_bf16_master_mode_and_need_one_micro_batch(cluster):
    from fp4offload._planner.rank import evaluate

    s = CAT["zero2-opt-cpu-fp4-split"]
    cfg = deepspeed_config(s, PRESETS["llama-3.1-8b"], cluster, replace(SETUP, grad_accum=1))
    assert cfg["bf16"]["bf16_master_weights_and_grads"] is True
    assert cfg["fp4offload"]["optimizer_states"]["master"] == "split"
    with pytest.raises(ConfigError) as e:
        deepspeed_config(s, PRESETS["llama-3.1-8b"], cluster, SETUP)
    assert e.value.key == "--grad-accum"
    assert any("one micro-batch" in x for x in evaluate(s, PRESETS["llama-3.1-8b"], cluster, SETUP).shortfalls)
    one = replace(SETUP, grad_accum=1)
    host = {n: evaluate(CAT[n], PRESETS["llama-3.1-8b"], cluster, one).memory.host_total
            for n in ("zero2-opt-cpu-fp4", "zero2-opt-cpu-fp4-split", "zero2-opt-cpu-fp4-bf16master")}
    P = PRESETS["llama-3.1-8b"].param_count() * cluster.gpus_per_node / cluster.world
    # fp32 master 4 + its bf16 copy to the GPU 2 -> split 2 + 2 (its bf16 half is that copy) or bf16 2; the host
    # allocator cache's bound (1/8 of the bytes in use) shrinks with them
    assert host["zero2-opt-cpu-fp4"] - host["zero2-opt-cpu-fp4-split"] == pytest.approx(1.125 * 2 * P, rel=0.02)
    assert host["zero2-opt-cpu-fp4"] - host["zero2-opt-cpu-fp4-bf16master"] == pytest.approx(1.125 * 4 * P, rel=0.02)


@pytest.mark.parametrize("name", ["zero3-opt-nvme-fp4-split", "zero2-opt-nvme-fp4-split"])
def test_residual_on_nvme_emits_master_device_nvme_and_prepare_config_takes_it(name, cluster):
    from fp4offload._deepspeed.config import prepare_config

    one = replace(SETUP, grad_accum=1)
    cfg = deepspeed_config(CAT[name], PRESETS["llama-3.1-8b"], cluster, one)
    st = cfg["fp4offload"]["optimizer_states"]
    assert (st["master"], st["master_device"], st["device"]) == ("split", "nvme", "nvme")
    assert st["nvme_path"] == cluster.nvme_path
    # every other key as the split strategy with the states in host RAM writes it
    ram = deepspeed_config(CAT["zero2-opt-cpu-fp4-split"], PRESETS["llama-3.1-8b"], cluster, one)
    ram_st = ram["fp4offload"]["optimizer_states"]
    assert {k: v for k, v in st.items() if k not in ("device", "nvme_path", "master_device")} == \
        {k: v for k, v in ram_st.items() if k not in ("device", "nvme_path", "master_device")}
    assert ram_st["master_device"] == "same" and cfg["bf16"] == ram["bf16"]
    assert cfg["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    prepared = prepare_config(json.loads(json.dumps(cfg)), world_size=cluster.world)
    assert (prepared.states.master, prepared.states.master_device, prepared.states.device) == ("split", "nvme", "nvme")
    assert prepared.block.optimizer_states.master_device == "nvme"


def test_fsdp2_policy_takes_the_residual_on_nvme(tmp_path):
    """No FSDP2 strategy of the catalogue puts the states on NVMe; one that does writes master_device into the
    policy's optimizer_states the same way."""
    import yaml

    from fp4offload._planner.strategies import parse_strategy

    doc = yaml.safe_load((ROOT / "strategies" / "fsdp2-cpu-fp4.yaml").read_text())
    doc["tensors"].update(weights={"device": "cpu", "format": "bf16"},
                          master={"device": "cpu", "format": "split", "residual": "nvme"},
                          optimizer_states={"device": "nvme", "format": "nvfp4"})
    s = parse_strategy({**doc, "name": "fsdp2-cpu-nvme-split"}, "fsdp2-cpu-nvme-split.yaml")
    pol = fsdp_policy(s, PRESETS["qwen3-32b"], nvme_path=str(tmp_path))
    st = pol.optimizer_states
    assert (st.master, st.master_device, st.device, st.nvme_path) == ("split", "nvme", "nvme", str(tmp_path))
    path = tmp_path / "policy.yaml"
    write_fsdp(path, pol)
    assert load_fsdp_policy_yaml(path) == pol
