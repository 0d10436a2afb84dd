"""The DeepSpeed block's compact master (``optimizer_states.master``: "split", "bf16") on real DeepSpeed.

Training runs spawn ranks with tests/scripts/deepspeed_worker.py (gloo, DS_ACCELERATOR=cpu, a small Llama on
Shakespeare bytes). ZeRO-1/2 with split must be the fp32-master run bit for bit: the same losses and the same
final weights, also through a checkpoint, a SIGKILL and a resume.
"""

import copy
import os

import pytest
from helpers.deepspeed import BLOCK, ds_config, launch

from fp4offload.errors import ConfigError
from fp4offload._deepspeed.config import prepare_config

pytestmark = pytest.mark.distributed


def _block(master: str, **states) -> dict:
    b = copy.deepcopy(BLOCK)
    b["optimizer_states"].update(master=master, **states)
    return b


def _launch(cases, nranks, tmp_path, timeout=400):
    return launch({"cases": cases}, nranks, tmp_path, timeout=timeout)


# ---- configuration ----------------------------------------------------------------------------------------

def test_prepare_turns_on_deepspeeds_bf16_master_mode():
    p = prepare_config(ds_config(2, "cpu", _block("split")))
    assert p.ds_config["bf16"]["bf16_master_weights_and_grads"] is True
    assert p.states.master == "split"
    assert any("bf16_master_weights_and_grads" in n for n in p.rewrites)
    assert "bf16_master_weights_and_grads" not in prepare_config(ds_config(2, "cpu", _block("fp32"))).ds_config["bf16"]


def _with(cfg, **top):
    cfg = copy.deepcopy(cfg)
    for k, v in top.items():
        cfg[k] = v
    return cfg


@pytest.mark.parametrize("make, key, fix", [
    (lambda: ds_config(0, None, _block("split")), "master", "ZeRO-1, 2 or 3"),
    (lambda: ds_config(2, None, _block("split")), "offload_optimizer", "without offload"),
    (lambda: _with(ds_config(2, "cpu", _block("bf16")), bf16={"enabled": False}), "bf16.enabled", "enable bf16"),
    (lambda: _with(ds_config(2, "cpu", _block("split")), gradient_accumulation_steps=4),
     "gradient_accumulation_steps", "accumulates gradients in bf16"),
    (lambda: _with(ds_config(2, "cpu", _block("split")),
                   bf16={"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}),
     "bf16_optimizer_states", "4 bits"),
    (lambda: ds_config(2, "cpu", _block("split", format="fp32")), "master", "format 'nvfp4'"),
    (lambda: ds_config(3, "cpu", {**_block("split"), "weights": {"format": "nvfp4"}}), "master", "weights"),
    (lambda: ds_config(2, "cpu", _block("fp16")), "master", "'fp32', 'split', 'bf16'"),
])
def test_configs_that_cannot_take_a_compact_master_are_refused(make, key, fix):
    with pytest.raises(ConfigError) as e:
        prepare_config(make())
    assert key in str(e.value) and fix in str(e.value), str(e.value)


# ---- training ---------------------------------------------------------------------------------------------

def _cases(stage, steps, forms=("fp32", "split", "bf16"), offload="cpu", bf16_steps=None):
    return [{"name": f"z{stage}_{f}", "config": ds_config(stage, offload, _block(f)),
             "steps": bf16_steps if (f == "bf16" and bf16_steps) else steps, "probe": "master"} for f in forms]


#: steps of the ZeRO-3 runs and of the ZeRO-2 ones (100 in the suite; tests/unit/test_optim_master.py runs the step
#: itself 200 steps); FP4OFFLOAD_MASTER_STEPS=200 runs 200 of both
Z3_STEPS = int(os.environ.get("FP4OFFLOAD_MASTER_STEPS", "16"))
Z2_STEPS = max(100, Z3_STEPS)


@pytest.fixture(scope="module")
def long_runs(tmp_path_factory):
    """One launch for the long runs: ZeRO-2 for Z2_STEPS and ZeRO-3 for Z3_STEPS, fp32 and split (bf16 for
    40 steps, or Z3_STEPS when fewer)."""
    own = ds_config(3, "cpu", {**_block("fp32"), "host": {"bf16_gradient_partition": False}})
    own_grad = {"name": "z3_fp32_own_grad", "config": own, "steps": Z3_STEPS, "probe": "master"}
    return _launch(_cases(2, Z2_STEPS, bf16_steps=40) + _cases(3, Z3_STEPS, bf16_steps=min(40, Z3_STEPS)) + [own_grad],
                   1, tmp_path_factory.mktemp("long"), timeout=900)["cases"]


@pytest.mark.slow
def test_zero2_split_is_the_fp32_master_run_bit_for_bit_over_100_steps(long_runs):
    res = {k: v for k, v in long_runs.items() if k.startswith("z2_")}
    f32, split, bf16 = res["z2_fp32"], res["z2_split"], res["z2_bf16"]
    assert split["losses"] == f32["losses"] and len(f32["losses"]) == Z2_STEPS
    assert split["master"]["weights_sha"] == f32["master"]["weights_sha"]
    assert split["master"]["master_sha"] == f32["master"]["master_sha"]  # the rebuilt fp32 masters, bit for bit
    n = f32["master"]["numel"]
    assert f32["master"]["dtypes"] == ["torch.float32"] and split["master"]["dtypes"] == ["torch.bfloat16"]
    assert split["master"]["staging_is_master"] == [True] and bf16["master"]["staging_is_master"] == [True]
    # on the CPU accelerator the bf16 master is the model's own bf16 partition: no second bf16 copy
    assert split["master"]["master_is_partition"] == [True] and bf16["master"]["master_is_partition"] == [True]
    assert f32["master"]["master_is_partition"] == [False]
    # ... and DeepSpeed's fragments of it are relinked to that partition: after every step they read the live master
    assert split["master"]["hp_live"] and bf16["master"]["hp_live"] and f32["master"]["hp_live"]
    assert split["inner"] == "FP4AdamW" and split["master"]["form"] == "split"
    held = split["master"]["held"]["host"]
    assert 2 * n <= held < 2 * n + 8 * n // 1000  # the residual, and a few odd positions
    # host bytes per parameter counted from the tensors: master + gradient + states (+ residual)
    per = {k: v["mem"]["total"] / v["mem"]["numel"] for k, v in res.items()}
    assert per["z2_fp32"] == pytest.approx(4 + 2 + 1.13, abs=0.1)
    assert per["z2_split"] == pytest.approx(2 + 2 + 1.13 + 2, abs=0.1) and per["z2_split"] <= 7.2
    assert per["z2_bf16"] == pytest.approx(2 + 2 + 1.13, abs=0.1) and per["z2_bf16"] <= 5.2
    # bf16 with stochastic rounding trains like the others, not identically
    assert bf16["losses"] != f32["losses"][:40]
    assert abs(sum(bf16["losses"][30:40]) - sum(f32["losses"][30:40])) / 10 < 0.05
    assert f32["losses"][-1] < 0.6 * f32["losses"][0]


@pytest.mark.slow
def test_two_ranks_split_is_the_fp32_run(tmp_path):
    res = _launch(_cases(2, 8, ("fp32", "split")), 2, tmp_path)["cases"]
    assert res["z2_split"]["losses"] == res["z2_fp32"]["losses"]
    assert res["z2_split"]["master"]["weights_sha"] == res["z2_fp32"]["master"]["weights_sha"]
    assert res["z2_split"]["master"]["master_sha"] == res["z2_fp32"]["master"]["master_sha"]
    assert res["z2_split"]["master"]["master_is_partition"] == [True]
    assert res["z2_split"]["master"]["dtypes"] == ["torch.bfloat16"]
    assert res["z2_split"]["master"]["hp_live"] and res["z2_fp32"]["master"]["hp_live"]


@pytest.fixture(scope="module")
def one_rank_runs(tmp_path_factory):
    """One launch for the shorter one-rank runs: ZeRO-1 with fp32 and split, a NaN step, and ZeRO-3 with
    offload_optimizer nvme, split and its residual in the NVMe state files."""
    nan = [{"name": f"{f}_nan", "config": ds_config(2, "cpu", _block(f)), "steps": 6, "nan_at": 2,
            "probe": "master"} for f in ("fp32", "split")]
    nvme = ds_config(3, "nvme", _block("split", device="same", master_device="nvme"))
    nvme["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path_factory.mktemp("nvme"))
    z3_nvme = {"name": "z3_split_nvme", "config": nvme, "steps": Z3_STEPS, "probe": "master"}
    return _launch(_cases(1, 8, ("fp32", "split")) + nan + [z3_nvme], 1, tmp_path_factory.mktemp("one"))["cases"]


@pytest.mark.slow
def test_zero1_split_is_the_fp32_run(one_rank_runs):
    res = one_rank_runs
    assert res["z1_split"]["losses"] == res["z1_fp32"]["losses"]
    assert res["z1_split"]["master"]["weights_sha"] == res["z1_fp32"]["master"]["weights_sha"]
    assert res["z1_split"]["master"]["master_sha"] == res["z1_fp32"]["master"]["master_sha"]
    assert res["z1_split"]["master"]["dtypes"] == ["torch.bfloat16"]


@pytest.mark.slow
def test_zero2_split_survives_save_kill_and_resume(tmp_path):
    ck = str(tmp_path / "ck")
    cfg = ds_config(2, "cpu", _block("split"))
    full = _launch([{"name": "full", "config": cfg, "steps": 12, "probe": "master"}], 1, tmp_path / "a")["cases"]
    # the worker kills itself (SIGKILL) right after saving: nothing after the save runs
    _launch([{"name": "first", "config": cfg, "steps": 6, "save_dir": ck, "kill_after_save": True}], 1,
            tmp_path / "b")
    assert (tmp_path / "ck" / "latest").exists()
    rest = _launch([{"name": "rest", "config": cfg, "steps": 6, "load_dir": ck, "probe": "master"}], 1,
                   tmp_path / "c")["cases"]
    assert rest["rest"]["losses"] == full["full"]["losses"][6:]
    assert rest["rest"]["master"]["weights_sha"] == full["full"]["master"]["weights_sha"]
    assert rest["rest"]["master"]["master_sha"] == full["full"]["master"]["master_sha"]


@pytest.mark.slow
def test_zero3_split_is_the_fp32_run_with_bf16_master_partitions(long_runs):
    """ZeRO-3: DeepSpeed's bf16 master mode keeps the gradient partition in bf16 as well (2 B/param), and its
    clipping would round each clipped gradient to bf16. The block hands the clipping factor to FP4AdamW, which
    applies it in fp32 (_deepspeed.zero3.fp32_clip): split is the fp32-master run bit for bit; bf16 trains close
    to it."""
    res = long_runs
    f32 = res["z3_fp32"]
    assert len(f32["losses"]) == Z3_STEPS and f32["losses"][-1] < 0.85 * f32["losses"][0]
    for form in ("split", "bf16"):
        r = res[f"z3_{form}"]
        assert r["master"]["form"] == form
        assert r["mem"]["master"] == 2 * r["mem"]["numel"] and r["mem"]["grad"] == 2 * r["mem"]["numel"]
    n = len(res["z3_bf16"]["losses"])
    assert abs(sum(res["z3_bf16"]["losses"][n - 6:n]) - sum(f32["losses"][n - 6:n])) / 6 < 0.05
    assert res["z3_split"]["losses"] == f32["losses"]
    assert res["z3_split"]["master"]["weights_sha"] == f32["master"]["weights_sha"]  # each parameter's partition
    assert res["z3_split"]["master"]["master_sha"] == f32["master"]["master_sha"]
    assert res["z3_split"]["master"]["master_is_partition"] == [True]
    assert f32["master"]["master_is_partition"] == [False]
    assert res["z3_bf16"]["losses"] != f32["losses"][:n]
    assert f32["mem"]["master"] == 4 * f32["mem"]["numel"]


@pytest.mark.slow
def test_zero3_master_gradient_is_deepspeeds_gradient_partition(long_runs):
    """ZeRO-3 offload keeps a flat gradient partition and, before this, a second host copy of it as the master's
    gradient. The master's gradient is now its slice of the partition (_deepspeed.zero3.zero3_gradient_partition): for
    a compact master the same bf16 numbers once, for the fp32 master a bf16 gradient (4 B/param less) whose
    clipping FP4AdamW applies in fp32. Training is the run with its own fp32 gradient buffer, bit for bit."""
    res = long_runs
    f32, own = res["z3_fp32"], res["z3_fp32_own_grad"]
    for name in ("z3_fp32", "z3_split", "z3_bf16", "z3_fp32_own_grad"):
        # initialize allocated the master gradients without zero-filling them (_deepspeed.zero3.zero3_grads_at_init);
        # the run that keeps its own fp32 gradient had them zero-filled afterwards, and is still the same run
        assert res[name]["master"]["grads_at_init"] is True and res[name]["grads_zero_at_start"] is True, name
    for name in ("z3_fp32", "z3_split", "z3_bf16"):
        assert res[name]["master"]["grad_in_partition"] == [True], name
        assert res[name]["master"]["grad_dtypes"] == ["torch.bfloat16"], name
    assert own["master"]["grad_in_partition"] == [False] and own["master"]["grad_dtypes"] == ["torch.float32"]
    n = f32["mem"]["numel"]
    assert own["mem"]["grad"] == 4 * n and f32["mem"]["grad"] == 2 * n
    assert f32["losses"] == own["losses"] and len(own["losses"]) == Z3_STEPS
    assert f32["master"]["master_sha"] == own["master"]["master_sha"]
    assert f32["master"]["weights_sha"] == own["master"]["weights_sha"]


@pytest.mark.slow
def test_nonfinite_step_is_skipped_from_deepspeeds_norm(one_rank_runs):
    """ZeRO-2 computes the global gradient norm before the step; FP4AdamW's non-finite check reads it (no
    pass over the gradients). A NaN step is skipped (by DeepSpeed's overflow check, or by FP4AdamW from the
    norm) and training goes on finite, split still the fp32 run."""
    res = one_rank_runs
    for f in ("fp32", "split"):
        m = res[f"{f}_nan"]["master"]
        assert m["norm_source"] and m["skipped"] in (0, 1), m
        losses = res[f"{f}_nan"]["losses"]
        assert losses[2] != losses[2] and all(x == x for i, x in enumerate(losses) if i != 2)  # NaN only there
    assert res["split_nan"]["losses"][3:] == res["fp32_nan"]["losses"][3:]
    assert res["split_nan"]["master"]["weights_sha"] == res["fp32_nan"]["master"]["weights_sha"]
    assert res["split_nan"]["master"]["master_sha"] == res["fp32_nan"]["master"]["master_sha"]


@pytest.mark.slow
def test_zero3_split_with_the_residual_on_nvme_is_the_fp32_run(one_rank_runs, long_runs):
    """ZeRO-3, offload_optimizer nvme, master split with master_device nvme: the packed states and the
    residual live in the NVMe state files (nothing of the residual in host RAM), and training is still the
    fp32-master run with its states in RAM, bit for bit."""
    r, f32 = one_rank_runs["z3_split_nvme"], long_runs["z3_fp32"]
    held = r["master"]["held"]
    n = r["master"]["numel"]
    assert held["host"] < n // 100 and held["nvme"] >= 2 * n  # only tensors under min_numel keep theirs in RAM
    assert any("residual" in w for w in r["master"]["rewrites"])
    assert r["losses"] == f32["losses"]
    assert r["master"]["master_sha"] == f32["master"]["master_sha"]
    assert r["master"]["weights_sha"] == f32["master"]["weights_sha"]
