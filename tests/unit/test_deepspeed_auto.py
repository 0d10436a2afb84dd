"""``"fp4offload": {"auto": true}``: the candidates, the choice against a given limit, the line it logs, what it
refuses, and the errors crossing a broadcast (they pickle)."""

from __future__ import annotations

import pickle

import pytest

from fp4offload._deepspeed import auto
from fp4offload._deepspeed import preflight as ds_preflight
from fp4offload.errors import CapacityError, ConfigError, CorruptionError

P = 200_000_000
RSS = 600 << 20
AUTO = {"auto": True}  # the documented form (the string "auto" is refused: the Trainer fills it)
S = auto.SPARE_PER_RANK  # what a choice leaves unclaimed beyond its estimate (one local rank here)


def _cfg(block=AUTO, offload="cpu", stage=2, **extra):
    off = {"device": offload, **({"nvme_path": "/tmp/ds-nvme"} if offload == "nvme" else {})}
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": stage, "offload_optimizer": off}, **extra}
    if block is not None:
        cfg["fp4offload"] = block
    return cfg


def _choose(cfg, free):
    return auto.choose(cfg, (P, 0), lim=ds_preflight.Limits(available=free), rss=RSS, world=1, local_ranks=1,
                       accelerator="cpu")


def _sizes(cfg):
    """Each candidate's bytes to add, from the same estimate the choice uses."""
    opts = auto.auto_options(cfg["fp4offload"])
    base = {k: v for k, v in cfg.items() if k != "fp4offload"}
    from fp4offload._deepspeed.config import prepare_config

    out = {}
    for cand in auto.candidates(base, opts):
        prepared = prepare_config(dict(base, fp4offload=cand.block))
        est = ds_preflight.estimate(prepared.ds_config, (P, 0), prepared.host, rss=RSS, world=1, local_ranks=1,
                                    accelerator="cpu", states=prepared.states)
        out[cand.name] = est.added
    return out


def test_candidates_in_order_of_preference_and_nvme_only_with_a_folder():
    names = [c.name for c in auto.candidates(_cfg(None), {})]
    assert names == ["fp32 master, NVFP4 states in host RAM", "split master, NVFP4 states in host RAM",
                     "bf16 master, NVFP4 states in host RAM"]
    with_nvme = auto.candidates(_cfg(None), {"nvme_path": "/x"})
    assert [c.name for c in with_nvme][2] == "split master, NVFP4 states and the residual on NVMe"
    assert with_nvme[2].block["optimizer_states"] == {"format": "nvfp4", "device": "nvme", "nvme_path": "/x",
                                                      "master": "split", "master_device": "nvme"}
    # DeepSpeed's own NVMe offload gives the folder; the RAM candidates then keep the states in host RAM
    ds_nvme = auto.candidates(_cfg(None, offload="nvme"), {})
    assert ds_nvme[0].block["optimizer_states"]["device"] == "cpu"
    assert any(c.block["optimizer_states"].get("nvme_path") == "/tmp/ds-nvme" for c in ds_nvme)


def test_the_least_lossy_candidate_that_fits_is_chosen():
    sizes = _sizes(_cfg())
    fp32, split, bf16 = (sizes[n] for n in ("fp32 master, NVFP4 states in host RAM",
                                            "split master, NVFP4 states in host RAM",
                                            "bf16 master, NVFP4 states in host RAM"))
    assert fp32 > split > bf16  # each step down the list saves host RAM
    cfg, d = _choose(_cfg(), fp32 + S + (1 << 20))
    assert d.choice.name.startswith("fp32 master") and cfg["fp4offload"] == {"optimizer_states": {
        "format": "nvfp4", "device": "cpu"}}
    assert d.spare == S and f"keeping {S >> 20} MiB spare" in d.line()
    cfg, d = _choose(_cfg(), fp32 - (1 << 20))
    assert d.choice.name.startswith("split master") and cfg["fp4offload"]["optimizer_states"]["master"] == "split"
    assert [n for n, _, why in d.tried if why] == ["fp32 master, NVFP4 states in host RAM"]
    line = d.line()
    assert line.startswith("auto: chose split master") and "not taken: fp32 master" in line and "may use" in line
    cfg, d = _choose(_cfg(), split - (1 << 20))
    assert d.choice.name.startswith("bf16 master")
    # a candidate that fits by less than the spare is passed over: initialize's preflight, a moment later and a
    # few MiB on, would refuse it
    _, d = _choose(_cfg(), fp32 + S - (1 << 20))
    assert d.choice.name.startswith("split master")
    assert f"leaving under the {S >> 20} MiB spare auto keeps" in d.line()
    assert "bf16_master_weights_and_grads" not in cfg.get("bf16", {})  # the choice is the block, not its rewrite


def test_nvme_candidate_comes_between_split_and_bf16_when_a_folder_is_given(tmp_path):
    block = {"auto": True, "nvme_path": str(tmp_path)}
    sizes = _sizes(_cfg(block))
    nvme = sizes["split master, NVFP4 states and the residual on NVMe"]
    assert nvme < sizes["split master, NVFP4 states in host RAM"]
    cfg, d = _choose(_cfg(block), nvme + S + (1 << 20))
    assert d.choice.name == "split master, NVFP4 states and the residual on NVMe"
    assert cfg["fp4offload"]["optimizer_states"]["master_device"] == "nvme"


def test_nothing_fits_names_the_smallest_estimate_and_the_limit():
    sizes = _sizes(_cfg())
    with pytest.raises(CapacityError) as e:
        _choose(_cfg(), 64 << 20)
    msg = str(e.value)
    assert e.value.need == min(sizes.values()) + S and e.value.have == 64 << 20
    assert "smallest candidate is bf16 master" in msg and "64 MiB" in msg


def test_candidates_this_config_cannot_run_are_named_with_the_reason():
    # compact masters need bf16 and an offloaded optimizer; the fp32 candidate needs nothing, so it is tried first
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "fp4offload": AUTO}
    _, d = _choose(cfg, 1 << 50)
    assert d.choice.name == "fp32 master, NVFP4 states"  # states on the device: no offload in this config
    with pytest.raises(CapacityError) as e:
        _choose(cfg, 1 << 20)
    assert "not for this config" in str(e.value)  # split and bf16 named with the reason they cannot run


@pytest.mark.parametrize("block, key", [({"auto": False}, "fp4offload.auto"),
                                        ({"auto": True, "weights": {}}, "fp4offload.weights"),
                                        ({"auto": True, "nvme_path": 3}, "fp4offload.nvme_path")])
def test_the_object_form_is_checked(block, key):
    with pytest.raises(ConfigError) as e:
        _choose(_cfg(block), 1 << 50)
    assert e.value.key == key


def test_the_string_form_is_refused_with_the_form_every_launcher_passes():
    """Accelerate fills every "auto" string of a DeepSpeed config itself and stops on ours before DeepSpeed runs; the
    block refuses the string everywhere, so a config that trains under deepspeed also trains under the Trainer."""
    with pytest.raises(ConfigError) as e:
        _choose(_cfg("auto"), 1 << 50)
    assert e.value.key == "fp4offload" and e.value.value == "auto"
    assert '{"auto": true}' in str(e.value) and "Trainer" in str(e.value)


def test_host_and_monitor_are_kept_in_the_chosen_block():
    cfg, _ = _choose(_cfg({"auto": True, "host": {"preflight": "warn"}}), 1 << 50)
    assert cfg["fp4offload"]["host"] == {"preflight": "warn"}


def test_decide_without_a_process_group_is_choose(monkeypatch):
    monkeypatch.setattr(ds_preflight, "limits", lambda: ds_preflight.Limits(available=1 << 50))
    cfg, d = auto.decide(_cfg(), (P, 0))
    assert d.choice.name.startswith("fp32 master")


@pytest.mark.parametrize("err", [CapacityError("host RAM", 5 << 30, 1 << 30, "hint"),
                                 ConfigError("fp4offload.auto", "x", "true", "fix"),
                                 CorruptionError("/f", "bad header", offset=8)])
def test_errors_pickle_with_class_message_and_fields(err):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and back.__dict__ == err.__dict__


def test_plan_check_prints_what_auto_would_pick_here(tmp_path):
    import json
    import os
    import subprocess
    import sys

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_cfg()))

    def check(model):
        return subprocess.run([sys.executable, "-m", "fp4offload.cli", "plan", "--check", str(path), "--model", model,
                               "--format", "json"], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, DS_ACCELERATOR="cpu"))

    small = check("hidden=512,layers=8,heads=8,kv_heads=8,ffn=1408,vocab=256")
    assert small.returncode == 0, small.stderr
    doc = json.loads(small.stdout)
    assert doc["auto"]["choice"] == "fp32 master, NVFP4 states in host RAM"
    assert doc["auto"]["block"] == {"optimizer_states": {"format": "nvfp4", "device": "cpu"}}
    assert [a["arm"] for a in doc["arms"]] == ["without the block", "with the block"]
    huge = check("llama-3.1-405b")  # nothing fits on one host: exit 1, the smallest candidate named
    assert huge.returncode == 1 and "smallest candidate is bf16 master" in huge.stderr


def _rank_decides(rank, world_size, tmp, tight_rank):
    """Each rank reads its own limit; ``tight_rank``'s is 1 MiB, which fits no candidate."""
    from fp4offload._deepspeed import auto as ds_auto
    from fp4offload._deepspeed import preflight as pf
    from fp4offload.errors import CapacityError as Cap

    pf.limits = lambda: pf.Limits(available=(1 << 20) if rank == tight_rank else (1 << 50))
    try:
        cfg, d = ds_auto.decide(_cfg(), (P, 0))
    except Cap as exc:
        return {"error": type(exc).__name__, "need": exc.need, "have": exc.have}
    return {"block": cfg["fp4offload"], "choice": d.choice.name}


@pytest.mark.slow
def test_rank_0_decides_for_every_rank():
    from helpers.dist import run_ranks

    # rank 1 alone would find nothing that fits: it takes rank 0's choice
    r = run_ranks(_rank_decides, world_size=2, args=(1,), timeout=120)
    assert r[0] == r[1] and r[0]["choice"].startswith("fp32 master"), r
    # rank 0 finds nothing: every rank raises its CapacityError, with the same figures
    r = run_ranks(_rank_decides, world_size=2, args=(0,), timeout=120)
    assert r[0] == r[1] and r[0]["error"] == "CapacityError" and r[0]["have"] == 1 << 20, r
