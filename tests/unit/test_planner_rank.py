"""Memory and time models on real model sizes, and the ranking built on them."""

from __future__ import annotations

import dataclasses

import pytest

from fp4offload._planner.hardware import build_cluster
from fp4offload._planner.memory import STATE_BYTES, TrainSetup, estimate_memory, weight_host_bytes
from fp4offload._planner.models import PRESETS
from fp4offload._planner.rank import RISK_ORDER, TIE_TOLERANCE, evaluate, make_plan
from fp4offload._planner.readings import HostReading, Readings
from fp4offload._memory.sizes import ACT_BYTES
from fp4offload._planner.strategies import load_catalogue
from fp4offload._planner.timing import estimate_time

GiB = 1 << 30
BARE = TrainSetup(host_runtime_bytes=0)  # host bytes without the per-process baseline


@pytest.fixture(scope="module")
def cat():
    return load_catalogue()


@pytest.fixture(scope="module")
def h100x8():
    return build_cluster(gpu="h100-80gb", gpus=8)


def test_zero_offload_host_bytes_per_parameter(cat, h100x8):
    m = PRESETS["llama-3.1-70b"]
    P = m.param_count()
    fp32 = estimate_memory(cat["zero3-opt-cpu"], m, h100x8, BARE, False)
    fp4 = estimate_memory(cat["zero3-opt-cpu-fp4"], m, h100x8, BARE, False)
    # master 4, bf16 gradient partition 2, m and v 8; the fp32 master's gradient one sub-group at a time
    assert fp32.host["fp32 master partition"] == fp4.host["fp32 master partition"] == pytest.approx(4 * P, rel=1e-6)
    assert fp32.host["gradient partition"] == fp4.host["gradient partition"] == pytest.approx(2 * P, rel=1e-6)
    assert fp32.host["optimizer states (fp32 m, v)"] == pytest.approx(8 * P, rel=1e-6)
    assert "fp32 master gradient" in fp32.host
    # the block: the packed states (about 1.13 B/param) and no fp32 copy of the gradient (it steps the bf16 one)
    assert fp4.host["optimizer states (nvfp4)"] == pytest.approx(STATE_BYTES["nvfp4"] * P, rel=1e-6)
    assert fp4.host["optimizer states (nvfp4)"] == pytest.approx(2 * (0.5 + 1 / 16 + 4 / 1024) * P, rel=1e-6)
    assert "fp32 master gradient" not in fp4.host
    assert fp4.host_total < fp32.host_total - 6 * P
    assert fp32.device_total == fp4.device_total


def test_nvme_optimizer_bytes(cat, h100x8):
    m = PRESETS["llama-3.1-8b"]
    P = m.param_count()
    ds = estimate_memory(cat["zero3-opt-nvme"], m, h100x8, BARE, False)
    ours = estimate_memory(cat["zero3-opt-nvme-fp4"], m, h100x8, BARE, False)
    assert ds.nvme_total == pytest.approx(12 * P, rel=1e-6)
    assert ours.nvme_total == pytest.approx(STATE_BYTES["nvfp4"] * P, rel=1e-6)
    assert ours.nvme_total == pytest.approx(2 * (0.5 + 1 / 16 + 4 / 1024) * P, rel=1e-6)  # m and sqrt(v), 1.133 B
    t_ds = estimate_time(cat["zero3-opt-nvme"], m, h100x8, BARE, ds)
    t_ours = estimate_time(cat["zero3-opt-nvme-fp4"], m, h100x8, BARE, ours)
    assert t_ds.bound == "nvme" and t_ds.terms["nvme"] > 7 * t_ours.terms["nvme"]


def test_zero_stages_shard_what_they_should(cat):
    m = PRESETS["llama-3.1-8b"]
    one, eight = build_cluster(gpu="h100-80gb", gpus=1), build_cluster(gpu="h100-80gb", gpus=8)
    static = {}
    for name in ("zero1", "zero2", "zero3"):
        for c in (one, eight):
            e = estimate_memory(cat[name], m, c, BARE, True)
            static[name, c.world] = e.device.get("weights", 0) + e.device["optimizer_states"] + e.device["master"]
    P = m.param_count()
    assert static["zero1", 1] == pytest.approx(14 * P, rel=1e-6)
    assert static["zero1", 8] == pytest.approx(2 * P + 12 * P / 8, rel=1e-6)
    assert static["zero3", 8] == pytest.approx(14 * P / 8, rel=1e-6)


def test_packed_weights_keep_the_bf16_exceptions(cat):
    m = PRESETS["llama-3.1-8b"]
    packed = weight_host_bytes(m, "nvfp4", 2)
    P = m.param_count()
    keep = m.embed_params + m.head_params + m.layer_params(0) + m.layer_params(m.layers - 1) + (
        (m.layers - 2) * 2 * m.hidden)  # embeddings, head, first and last block, the other blocks' norms
    assert packed == pytest.approx(2 * keep + (0.5 + 1 / 256) * (P - keep), rel=1e-9)
    assert 2.4 < 2 * P / packed < 2.7
    assert weight_host_bytes(m, "bf16", 2) == 2 * m.param_count()


def test_activation_compression_and_offload(cat, h100x8):
    m = PRESETS["llama-3.1-8b"]
    plain = estimate_memory(cat["zero2"], m, h100x8, BARE, False)
    packed = estimate_memory(cat["zero2-act-fp4"], m, h100x8, BARE, False)
    # each class in the form the activation hooks store it (bf16 compute): norm inputs and attention's q, k bf16,
    # attention's v and output and the MLP's inner tensors MXFP8, the log-sum-exp as it is, the rest NVFP4; the
    # final norm bf16
    parts = m.kind_saved_classes(False, 2)
    per_token = (2 * parts["norm"][0] + 2 * parts["attention_qk"][0] + ACT_BYTES["mxfp8"] * parts["attention"][0]
                 + ACT_BYTES["mxfp8"] * parts["mlp"][0] + parts["statistic"][1] + ACT_BYTES["nvfp4"] * parts["rest"][0])
    ratio = (m.layers * per_token + m._norm_saved(2)) / (m.layers * m.kind_saved_bytes_per_token(False, 2)
                                                          + m._norm_saved(2))
    assert packed.saved_activations == pytest.approx(plain.saved_activations * ratio, rel=1e-6)
    assert 0.5625 / 2 < ratio < 0.55  # 1.93x fewer than bf16: norms, q and k in bf16, MLP products in MXFP8
    assert packed.device_total < plain.device_total
    off = estimate_memory(cat["zero3-params-cpu-act-cpu"], m, h100x8, BARE, False)
    off4 = estimate_memory(cat["zero3-params-cpu-act-fp4"], m, h100x8, BARE, False)
    assert off.host["activations"] > 1.8 * off4.host["activations"]  # attention, MLP products, norms at 8-16 bits
    assert off.pcie_activation_bytes == pytest.approx(plain.saved_activations, rel=1e-6)
    t, t4 = (estimate_time(cat[n], m, h100x8, BARE, e) for n, e in
             (("zero3-params-cpu-act-cpu", off), ("zero3-params-cpu-act-fp4", off4)))
    assert t.terms["pcie"] > 1.7 * t4.terms["pcie"]


def test_checkpointing_auto_turns_on_only_when_needed(cat, h100x8):
    small = evaluate(cat["zero2"], PRESETS["llama-3.1-8b"], h100x8, TrainSetup(seq_len=2048))
    assert small.fits and not small.memory.checkpointing
    big = evaluate(cat["zero2"], PRESETS["llama-3.1-8b"], h100x8, TrainSetup(micro_batch=4, seq_len=8192))
    assert big.memory.checkpointing
    forced = evaluate(cat["zero2"], PRESETS["llama-3.1-8b"], h100x8, TrainSetup(seq_len=2048), checkpointing=True)
    assert forced.time.terms["compute"] > 1.25 * small.time.terms["compute"]


def test_fp4_states_speed_up_a_bandwidth_bound_cpu_step(cat, h100x8):
    m = PRESETS["llama-3.1-70b"]
    a, b = (evaluate(cat[n], m, h100x8, TrainSetup()) for n in ("zero3-opt-cpu", "zero3-opt-cpu-fp4"))
    ratio = a.time.terms["cpu_optimizer"] / b.time.terms["cpu_optimizer"]
    assert ratio == pytest.approx(h100x8.cpu_adam["nvfp4"] / h100x8.cpu_adam["fp32"])
    assert ratio > 1.5 and b.risk == "low" and a.risk == "none"


def test_measured_cpu_rate_drives_the_optimizer_term(cat):
    m = PRESETS["llama-3.1-8b"]
    slow = Readings(host=HostReading(512 * GiB, 500 * GiB, 8, 16), cpu_adam={"fp32": 1e8, "nvfp4": 5e7},
                    cpu_adam_threads=8)
    c = build_cluster(readings=slow, gpu="l40s-48gb")  # the readings' host is not an L40S node: scaled by cores
    c_same = dataclasses.replace(c, cpu_adam={"fp32": 1e8, "nvfp4": 5e7})
    e = evaluate(cat["zero2-opt-cpu"], m, c_same, TrainSetup())
    assert e.time.terms["cpu_optimizer"] == pytest.approx(m.param_count() / 1e8)
    assert e.time.bound == "cpu_optimizer"


def test_multi_node_zero3_is_bound_by_collectives_and_fp4_weights_help(cat):
    m = PRESETS["llama-3.1-405b"]
    c = build_cluster(gpu="h100-80gb", gpus=8, nodes=4)
    bf16, fp4 = (evaluate(cat[n], m, c, TrainSetup()) for n in ("zero3-params-cpu", "zero3-params-cpu-fp4"))
    assert bf16.time.bound == "collectives"
    assert fp4.time.terms["collectives"] < 0.7 * bf16.time.terms["collectives"]
    assert fp4.time.terms["pcie"] < 0.6 * bf16.time.terms["pcie"]  # gradients still leave in bf16


def test_small_model_plan_prefers_no_offload(cat, h100x8):
    plan = make_plan(cat.values(), PRESETS["llama-3.1-8b"], h100x8, TrainSetup())
    w = plan.winner
    assert w.fits and not w.strategy.optimizer_on_host and w.risk == "none" and w.time.bound == "compute"
    assert len(plan.runner_ups) == 2 and all(r.name in plan.why_lost for r in plan.runner_ups)


def test_big_model_plan_offloads(cat, h100x8):
    plan = make_plan(cat.values(), PRESETS["llama-3.1-70b"], h100x8, TrainSetup())
    assert plan.winner.strategy.optimizer_on_host
    rejected = {c.name: c for c in plan.rejected}
    assert "zero1" in rejected and rejected["zero1"].shortfalls[0].startswith("GPU short by")
    for c in plan.ranked:
        assert c.memory.device_total <= h100x8.gpu_memory and c.memory.host_total <= h100x8.host_ram


def test_ranking_is_fastest_first_with_lower_risk_winning_near_ties(cat, h100x8):
    for model in ("llama-3.1-8b", "llama-3.1-70b", "mixtral-8x7b"):
        plan = make_plan(cat.values(), PRESETS[model], h100x8, TrainSetup())
        for a, b in zip(plan.ranked, plan.ranked[1:]):
            near = a.time.step_s <= b.time.step_s * (1 + TIE_TOLERANCE) and b.time.step_s <= a.time.step_s * (
                1 + TIE_TOLERANCE)
            assert a.time.step_s <= b.time.step_s or (near and RISK_ORDER[a.risk] <= RISK_ORDER[b.risk]), model
        for r in plan.runner_ups:
            reason = plan.why_lost[r.name]
            assert "slower" in reason or "risk" in reason or "as fast" in reason
        for c in plan.ranked:
            assert (c.risk == "none") == (not c.strategy.compressions())
            assert all(": " in n for n in c.risk_notes)


def test_nvme_strategies_need_a_path(cat):
    c = build_cluster(readings=Readings(), gpu="h100-80gb", nvme_path=None)
    c = dataclasses.replace(c, nvme_path=None, nvme_free=None)
    e = evaluate(cat["zero3-opt-nvme-fp4"], PRESETS["llama-3.1-8b"], c, TrainSetup())
    assert "needs an NVMe path (--nvme-path)" in e.shortfalls


def test_nothing_fits(cat):
    c = build_cluster(gpu="rtx-4090-24gb", gpus=1, host_ram_gb=32)
    plan = make_plan(cat.values(), PRESETS["llama-3.1-405b"], c, TrainSetup())
    assert plan.winner is None and plan.ranked == () and any("nothing fits" in n for n in plan.notes)


def test_the_exact_master_wins_a_tie():
    """llama-3.1-8b on one H100: the split, fp32 and bf16 masters run at the same estimated speed and all fit; the
    exact forms outrank the lossy bf16 master, and split (less host RAM) the fp32 master."""
    from fp4offload._planner.rank import risk_profile

    cat = load_catalogue()
    c = build_cluster(gpu="h100-80gb", gpus=1)
    plan = make_plan(cat.values(), PRESETS["llama-3.1-8b"], c, TrainSetup())
    names = [x.name for x in plan.ranked]
    split, bf16 = "zero2-opt-cpu-fp4-split", "zero2-opt-cpu-fp4-bf16master"
    assert plan.winner.name == split, names[:5]
    assert names.index(split) < names.index("zero2-opt-cpu-fp4") < names.index(bf16)
    assert risk_profile(cat[split]) < risk_profile(cat[bf16])
    assert risk_profile(cat[split]) == risk_profile(cat["zero2-opt-cpu-fp4"])
