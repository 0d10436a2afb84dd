"""The host-memory preflight: the model's terms, cgroup limits (v1 and v2), the error, and the real thing
inside a memory cgroup (initialize refuses before it allocates; ``warn`` goes on)."""

from __future__ import annotations

import dataclasses

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from fp4offload._config import parse_block
from fp4offload.errors import CapacityError, ConfigError
from fp4offload._deepspeed import config as dsc
from fp4offload._deepspeed import preflight as ds_preflight
from fp4offload._memory import host_model
from fp4offload._memory.sizes import STATE_BYTES

ROOT = Path(__file__).resolve().parents[2]
P = 100_000_000
INIT = "initialize's own (modules, ops, communicator)"
UN = "unnamed terms (calibrated)"


def _unnamed(stage: int, part: int = P) -> int:
    fixed, per_param = host_model.UNMODELLED["zero3" if stage == 3 else "zero12"]
    return int(fixed + per_param * part)


def _cfg(stage=2, offload="cpu", block=None, **zero):
    z = {"stage": stage, **zero}
    if offload:
        z["offload_optimizer"] = {"device": offload, **({"nvme_path": "/tmp/x"} if offload == "nvme" else {})}
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": z}
    if block is not None:
        cfg["fp4offload"] = block
    return cfg


def _est(cfg, accel="cpu", world=1, host=True, **kw):
    settings = dsc.resolve(parse_block(cfg.get("fp4offload")).host, {}) if host else None
    x = host_model.inputs_from_config(cfg, P, world=world, accelerator=accel, host=settings, **kw)
    return host_model.estimate_host(x)


def test_zero2_cpu_offload_terms_plain_and_with_the_block():
    plain = _est(_cfg())
    assert plain.consumers == {"bf16 parameters": 2 * P, "fp32 master partition": 4 * P,
                               "fp32 gradient partition": 4 * P, "bf16 copy-back buffer": 2 * P,
                               "gradient bucket": 2 * P, "optimizer states (fp32 m, v)": 8 * P,
                               "freed, kept in glibc's heap": 2 * P,  # the bf16 gradients of backward
                               INIT: host_model.INIT_BYTES, UN: _unnamed(2)}
    block = _est(_cfg(block={"optimizer_states": {"format": "nvfp4", "device": "cpu"}}))
    held = (2 + 4 + 2 + 2 + STATE_BYTES["nvfp4"]) * P
    assert block.consumers == {"bf16 parameters": 2 * P, "fp32 master partition": 4 * P,
                               "bf16 gradient partition": 2 * P, "gradient bucket": 2 * P,
                               "optimizer states (nvfp4)": int(STATE_BYTES["nvfp4"] * P),
                               "host allocator cache (bound)": int(0.125 * held), INIT: host_model.INIT_BYTES,
                               UN: _unnamed(2)}
    # on a GPU machine the device-side buffers leave the host; the copy-back buffer stays (no sharing there)
    gpu = _est(_cfg(block={"optimizer_states": {"format": "nvfp4", "device": "cpu"}}), accel="gpu")
    assert set(gpu.consumers) == {"fp32 master partition", "bf16 gradient partition", "bf16 copy-back buffer",
                                  "optimizer states (nvfp4)", "host allocator cache (bound)", INIT, UN}
    tensors = gpu.added - host_model.INIT_BYTES - _unnamed(2)
    assert tensors == pytest.approx(1.125 * (4 + 2 + 2 + STATE_BYTES["nvfp4"]) * P, abs=2)


def test_partitions_shrink_with_the_world_and_local_ranks_add_up():
    one = _est(_cfg(block={"optimizer_states": {}}), accel="gpu")
    four = _est(_cfg(block={"optimizer_states": {}}), accel="gpu", world=4, local_ranks=4)
    init = host_model.INIT_BYTES + host_model.UNMODELLED["zero12"][0]  # per rank, whatever its partition
    assert (four.added - init) * 4 == pytest.approx(one.added - init, rel=1e-6)
    assert four.node_total == 4 * four.per_rank


def test_zero3_nvme_terms_deepspeed_swapper_and_the_blocks_tier():
    plain = _est(_cfg(stage=3, offload="nvme"), accel="gpu")
    assert plain.nvme == {"fp32 master partition": 4 * P, "optimizer states (fp32 m, v)": 8 * P}
    assert plain.consumers == {"gradient partition": 2 * P, "fp32 master gradient": 4 * P,
                               "NVMe swap buffers": 4 * 4 * P, "freed, kept in glibc's heap": 4 * P,  # fp32 grads
                               INIT: host_model.INIT_BYTES, UN: _unnamed(3)}
    fp4 = _est(_cfg(stage=3, offload="cpu", block={"optimizer_states": {"device": "nvme", "nvme_path": "/x"}}),
               accel="gpu")
    assert fp4.nvme == {"optimizer states (nvfp4)": int(STATE_BYTES["nvfp4"] * P)}
    assert fp4.consumers["fp32 master partition"] == 4 * P
    # the master's gradient is DeepSpeed's bf16 gradient partition (_deepspeed.zero3.zero3_gradient_partition) ...
    assert fp4.consumers["gradient partition"] == 2 * P and "fp32 master gradient" not in fp4.consumers
    own = _est(_cfg(stage=3, offload="cpu", block={"optimizer_states": {"device": "nvme", "nvme_path": "/x"},
                                                   "host": {"bf16_gradient_partition": False}}), accel="gpu")
    assert own.consumers["fp32 master gradient"] == 4 * P  # ... unless host.bf16_gradient_partition is off
    seg = host_model.NVME_SEGMENTS_IN_FLIGHT * STATE_BYTES["nvfp4"] * host_model.NVME_SEGMENT
    assert fp4.consumers["NVMe state segments in flight"] == int(seg)


def test_alternatives_are_estimated_by_the_same_model():
    x = host_model.inputs_from_config(_cfg(stage=3, offload="cpu", offload_param={"device": "cpu"}), P,
                                      accelerator="gpu")
    base = host_model.estimate_host(x).added
    alts = dict(host_model.alternatives(x))
    assert any("optimizer_states" in k for k in alts)
    # packed ZeRO-3 weights add a partition beside DeepSpeed's bf16 one: never offered as a host-RAM fix
    assert not any("weights" in k for k in alts)
    for what, alt in alts.items():
        if "fp4offload" in what:  # the block's changes always lower it; DeepSpeed's own may not
            assert host_model.estimate_host(alt).added < base, what
    packed = dataclasses.replace(x, packed_weights=True)
    cons = host_model.estimate_host(packed).consumers
    assert cons["bf16 parameter partition"] == host_model.estimate_host(x).consumers["bf16 parameter partition"]
    assert "packed weight partition (NVFP4)" in cons and host_model.estimate_host(packed).added > base


def _tree(tmp: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        f = tmp / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)


def test_cgroup_v2_takes_the_tightest_limit_up_the_hierarchy(tmp_path):
    _tree(tmp_path, {"proc": "0::/pod/job\n", "cg/pod/memory.max": str(3 << 30), "cg/pod/memory.current": str(2 << 30),
                     "cg/pod/job/memory.max": "max", "cg/pod/job/memory.current": str(1 << 30)})
    lim, use, which = ds_preflight.cgroup_limit(str(tmp_path / "proc"), str(tmp_path / "cg"))
    assert (lim, use, which) == (3 << 30, 2 << 30, "v2:/pod")
    free = ds_preflight.Limits(available=8 << 30, cgroup_limit=lim, cgroup_usage=use).free
    assert free == 1 << 30


def test_cgroup_v1_memory_controller_and_no_limit(tmp_path):
    _tree(tmp_path, {"proc": "12:cpu,cpuacct:/x\n5:memory:/docker/abc\n",
                     "cg/memory/docker/abc/memory.limit_in_bytes": str(2 << 30),
                     "cg/memory/docker/abc/memory.usage_in_bytes": str(512 << 20),
                     "cg/memory/docker/memory.limit_in_bytes": str(9223372036854771712),
                     "cg/memory/memory.limit_in_bytes": str(9223372036854771712)})
    assert ds_preflight.cgroup_limit(str(tmp_path / "proc"), str(tmp_path / "cg")) == (2 << 30, 512 << 20,
                                                                                       "v1:/docker/abc")
    _tree(tmp_path, {"proc2": "5:memory:/docker\n"})
    assert ds_preflight.cgroup_limit(str(tmp_path / "proc2"), str(tmp_path / "cg")) is None


class _Prepared:
    def __init__(self, cfg, mode="error"):
        self.ds_config = cfg
        self.host = dsc.resolve(parse_block(cfg.get("fp4offload")).host, {"FP4OFFLOAD_PREFLIGHT": mode})


def test_check_raises_capacity_error_naming_estimate_limit_consumers_and_fixes(caplog):
    import torch

    model = torch.nn.Linear(8192, 4096, bias=False).to(torch.bfloat16)  # 33.6M parameters
    cfg = _cfg(stage=3, offload="cpu", offload_param={"device": "cpu"}, block={"optimizer_states": {}})
    need = ds_preflight.estimate(cfg, model, _Prepared(cfg).host).added - ds_preflight.model_bytes(model)[1]
    lim = ds_preflight.Limits(available=need - (10 << 20))  # the states on NVMe save 33 MiB
    with pytest.raises(CapacityError) as e:
        ds_preflight.check(_Prepared(cfg), model, lim=lim)
    msg = str(e.value)
    assert "33.6M parameters" in msg and "largest: " in msg and "fp32 master partition" in msg
    assert 'optimizer_states.device "nvme"' in msg and "fp4offload.weights" not in msg  # packing adds host RAM
    assert 'preflight "warn"' in msg
    assert ds_preflight.check(_Prepared(cfg, "warn"), model, lim=lim) is not None  # warn: logged, goes on
    assert "host-memory preflight" in caplog.text
    assert ds_preflight.check(_Prepared(cfg, "off"), model, lim=ds_preflight.Limits(available=0)) is None


@pytest.mark.parametrize("value", ["fail", "", 1, True, None])
def test_bad_preflight_value_is_a_config_error(value):
    with pytest.raises(ConfigError, match="host.preflight"):
        parse_block({"optimizer_states": {}, "host": {"preflight": value}}, prefix="fp4offload.")


def test_preflight_is_the_one_host_key_without_optimizer_states():
    assert parse_block({"activations": {}, "host": {"preflight": "warn"}}).host.preflight == "warn"
    with pytest.raises(ConfigError, match="only host.preflight"):
        parse_block({"activations": {}, "host": {"mmap_threshold": "off"}}, prefix="fp4offload.")


# ------------------------------------------------------------------------------------------------
# for real, inside a memory cgroup

CG_ROOT = Path("/sys/fs/cgroup/memory")

_CHILD = r"""
import json, os, resource, sys, logging, threading
import psutil, torch, deepspeed
logging.basicConfig(level=logging.WARNING)

def anon():  # anonymous resident bytes: what allocations add (RSS also counts the code pages first touched)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))

peak_anon, stop = [0], threading.Event()
def sample():
    while not stop.is_set():
        peak_anon[0] = max(peak_anon[0], anon())
        stop.wait(0.001)
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)  # no fp32 transient while building
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048, bias=False) for _ in range(6)]).to(torch.bfloat16)
before = psutil.Process().memory_info().rss
cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
       "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
       "fp4offload": {"optimizer_states": {"format": "fp32", "device": "cpu"}, "host": {"preflight": sys.argv[1]}}}
out = {"before": before, "anon_before": anon()}
sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
try:
    engine = deepspeed.initialize(model=model, config=cfg)[0]  # plain DeepSpeed: the start-up hook applies the block
    out["initialized"] = True
    out["inner"] = type(engine.basic_optimizer).__name__
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
stop.set()
sampler.join()
out["anon_peak"] = max(peak_anon[0], anon())
out["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out["rss"] = psutil.Process().memory_info().rss
print("RESULT " + json.dumps(out))
"""


def _cgroup_or_skip() -> Path:
    if sys.platform != "linux" or not (CG_ROOT / "memory.limit_in_bytes").exists() or not os.access(CG_ROOT,
                                                                                                     os.W_OK):
        pytest.skip("needs a writable cgroup v1 memory hierarchy at /sys/fs/cgroup/memory (root on Linux)")
    cg = CG_ROOT / f"fp4offload-test-{uuid.uuid4().hex[:8]}"
    cg.mkdir()
    return cg


def _in_cgroup(cg: Path, limit: int, mode: str) -> dict:
    (cg / "memory.limit_in_bytes").write_text(str(limit))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getpid() % 20000))
    env.pop("FP4OFFLOAD_PREFLIGHT", None)
    env.pop("FP4OFFLOAD_AUTO", None)
    # the shell enters the cgroup, then becomes the child: everything the child allocates counts
    cmd = f'echo $$ > {cg}/cgroup.procs && exec "{sys.executable}" -c "$0" "$1"'
    p = subprocess.run(["sh", "-c", cmd, _CHILD, mode], capture_output=True, text=True, env=env, timeout=300,
                       cwd=str(ROOT))
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, f"exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    r = json.loads(line[7:])
    r["stderr"] = p.stderr
    return r


@pytest.mark.slow
def test_initialize_inside_a_tight_cgroup_refuses_before_allocating_and_warn_goes_on():
    cg = _cgroup_or_skip()
    try:
        # 25.2M parameters with fp32 states: the estimate adds about 24 B/param (610 MiB, its allowance for unnamed
        # memory included) to the process; initialize itself allocates about a third (m and v come at the first step)
        probe = _in_cgroup(cg, 8 << 30, "off")
        assert probe.get("initialized"), probe
        base = probe["before"]
        limit = base + (450 << 20)  # under the fp32 states' estimate, over the packed states' (about 420 MiB)
        err = _in_cgroup(cg, limit, "error")
        assert "CapacityError" in err.get("error", ""), err
        assert "cgroup v1:/" + cg.name in err["error"] and "limit" in err["error"]
        assert "optimizer_states" in err["error"]  # a change that fits: packed states (format nvfp4)
        # it stopped before DeepSpeed allocated: the full initialize (the probe) adds the bf16 flat parameters,
        # the fp32 master and the gradient partition, about 8 B/param (200 MB) of anonymous memory, sampled
        # every millisecond; the refused one only what reading the config and importing fp4offload take
        grown, full = err["anon_peak"] - err["anon_before"], probe["anon_peak"] - probe["anon_before"]
        assert full > (150 << 20) and grown < (48 << 20), (grown, full)
        warn = _in_cgroup(cg, limit, "warn")
        assert warn.get("initialized") and warn["inner"] == "AdamW", warn  # the block's fp32 states: torch AdamW
        assert "host-memory preflight" in warn["stderr"]
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                import time

                time.sleep(0.1)


# ------------------------------------------------------------------------------------------------
# fp4offload plan --check


def _plan_check(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    return subprocess.run([sys.executable, "-m", "fp4offload.cli", "plan", *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=str(ROOT))


def test_plan_check_prints_the_preflight_estimate_with_and_without_the_block(tmp_path):
    cfg = _cfg(block={"optimizer_states": {"format": "nvfp4", "device": "cpu"}})
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    dims = "hidden=512,layers=8,heads=8,kv_heads=8,ffn=1408,vocab=256"
    out = _plan_check("--check", str(path), "--model", dims, "--format", "json")
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    plain, block = doc["arms"]
    assert (plain["arm"], block["arm"]) == ("without the block", "with the block") and doc["accelerator"] == "cpu"
    # the same model the preflight uses, fed the same inputs
    from fp4offload._planner.models import resolve_model

    params = resolve_model(dims).param_count()
    assert doc["params"] == params
    for arm, c, host in ((plain, {k: v for k, v in cfg.items() if k != "fp4offload"}, None),
                         (block, cfg, dsc.resolve(None))):
        from fp4offload._deepspeed.config import prepare_config

        ds = prepare_config(c).ds_config if host is not None else c
        x = host_model.inputs_from_config(ds, params, accelerator="cpu", host=host)
        assert arm["consumers"] == host_model.estimate_host(x, arm["runtime_bytes"]).consumers
    assert block["per_rank_bytes"] < plain["per_rank_bytes"]
    text = _plan_check("--check", str(path), "--model", dims)
    assert text.returncode == 0 and "with the block: fits" in text.stdout and "optimizer states (nvfp4)" in text.stdout


@pytest.mark.slow  # a CLI process that reads transformers: ~5 s
def test_plan_check_takes_a_hugging_face_config_full_of_auto(tmp_path):
    """The Trainer writes "auto" where TrainingArguments decides; --check estimates with the block's defaults
    and says which values it filled."""
    cfg = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                    "weight_decay": "auto"}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                        "warmup_num_steps": "auto"}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True,
           "fp4offload": {"optimizer_states": {"master": "split"}}}
    path = tmp_path / "hf.json"
    path.write_text(json.dumps(cfg))
    dims = "hidden=512,layers=8,heads=8,kv_heads=8,ffn=1408,vocab=256"
    out = _plan_check("--check", str(path), "--model", dims, "--gpus", "2")
    assert out.returncode in (0, 1), out.stderr[-2000:]
    assert 'fills the "auto" values' in out.stdout and "optimizer.params.lr=0.001" in out.stdout
    assert "train_batch_size=2" in out.stdout and "with the block:" in out.stdout
    doc = json.loads(_plan_check("--check", str(path), "--model", dims, "--format", "json").stdout)
    filled = doc["hf_auto_filled"]
    assert "bf16.enabled=True" in filled and "scheduler.params.warmup_num_steps=0" in filled
    bad = json.loads(json.dumps(cfg))  # only "auto" is filled: any other string is still refused
    bad["optimizer"]["params"]["lr"] = "sometimes"
    path.write_text(json.dumps(bad))
    out = _plan_check("--check", str(path), "--model", dims)
    assert out.returncode == 2 and "optimizer.params.lr='sometimes'" in out.stderr


def test_plan_check_bad_inputs_exit_2_naming_them(tmp_path):
    out = _plan_check("--check", str(tmp_path / "missing.json"), "--model", "llama-3.1-8b")
    assert out.returncode == 2 and "missing.json" in out.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_cfg(block={"optimizer_states": {"format": "int3"}})))
    out = _plan_check("--check", str(bad), "--model", "llama-3.1-8b")
    assert out.returncode == 2 and "optimizer_states.format" in out.stderr


def test_preflight_environment_override_is_checked_like_the_key():
    assert dsc.resolve(None, {"FP4OFFLOAD_PREFLIGHT": " Warn "}).preflight.value == "warn"
    with pytest.raises(ConfigError,
                       match="FP4OFFLOAD_PREFLIGHT='sometimes'.*error, warn, off.*fp4offload.host.preflight"):
        dsc.resolve(None, {"FP4OFFLOAD_PREFLIGHT": "sometimes"})


# ------------------------------------------------------------------------------------------------
# split's residual in the NVMe state files (optimizer_states.master_device "nvme")

RESIDUAL_NVME = 2 + 1 / 8  # the residual's 16 bits and one bit of tie positions per parameter, in the files


def _split_cfg(master_device, stage=3, ds_nvme=False):
    st = {"master": "split", "master_device": master_device}
    if not ds_nvme:
        st.update(device="nvme", nvme_path="/tmp/x")
    return _cfg(stage=stage, offload="nvme" if ds_nvme else "cpu", block={"optimizer_states": st})


def _host_saving(params):
    """Host bytes the residual on NVMe saves: its 2 B/param, less the residual of the segments in flight (three
    of 2**20 elements), both under the block's host cache bound (1/8 of the bytes in use)."""
    return (2 * params - 3 * RESIDUAL_NVME * min(2**20, params)) * (1 + 0.125)


@pytest.mark.parametrize("stage", [2, 3])
def test_residual_on_nvme_takes_2_bytes_per_param_out_of_host_ram(stage):
    same, nvme = (_est(_split_cfg(md, stage), accel="gpu") for md in ("same", "nvme"))
    assert "split master residual" in same.consumers and "split master residual" not in nvme.consumers
    assert same.consumers["split master residual"] == 2 * P and same.consumers["bf16 master partition"] == 2 * P
    assert nvme.consumers["bf16 master partition"] == 2 * P  # the half DeepSpeed sends to the GPU stays
    assert nvme.nvme == {"optimizer states (nvfp4)": int(STATE_BYTES["nvfp4"] * P),
                         "split master residual": int(RESIDUAL_NVME * P)}
    seg = host_model.NVME_SEGMENTS_IN_FLIGHT * host_model.NVME_SEGMENT
    assert nvme.consumers["NVMe state segments in flight"] == int(seg * (STATE_BYTES["nvfp4"] + RESIDUAL_NVME))
    assert same.added - nvme.added == pytest.approx(_host_saving(P), abs=4)
    assert same.added - nvme.added == pytest.approx(217_479_744, abs=4)  # (2e8 - 6_684_672) * 1.125, 100M params


def test_residual_on_nvme_through_deepspeeds_nvme_offload():
    """offload_optimizer.device "nvme" becomes the block's tier over a host master: the rewritten config says
    "cpu", so the placement prepare_config resolved tells the model where the states and the residual are."""
    from fp4offload._deepspeed.config import prepare_config

    raw = _split_cfg("nvme", ds_nvme=True)
    prepared = prepare_config(raw)
    assert prepared.ds_config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    resolved = host_model.inputs_from_config(prepared.ds_config, P, host=prepared.host, states=prepared.states)
    unrewritten = host_model.inputs_from_config(raw, P, host=prepared.host)
    assert resolved == unrewritten
    assert resolved.states == ("nvfp4", "nvme") and resolved.offload_optimizer == "cpu" and resolved.residual_on_nvme
    same = host_model.inputs_from_config(_split_cfg("same", ds_nvme=True), P, host=prepared.host)
    assert host_model.estimate_host(same).added - host_model.estimate_host(resolved).added == pytest.approx(
        _host_saving(P), abs=4)


def test_alternatives_offer_the_residual_on_nvme():
    x = host_model.inputs_from_config(_cfg(block={"optimizer_states": {"master": "split"}}), P, accelerator="gpu")
    alts = dict(host_model.alternatives(x))
    what = next(k for k in alts if "master_device" in k)
    assert 'device "nvme"' in what and alts[what].residual_on_nvme
    assert host_model.estimate_host(alts[what]).added < host_model.estimate_host(x).added


def test_plan_check_counts_the_residual_on_nvme(tmp_path):
    dims = "hidden=512,layers=8,heads=8,kv_heads=8,ffn=1408,vocab=256"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_split_cfg("nvme", ds_nvme=True)))
    out = _plan_check("--check", str(path), "--model", dims, "--format", "json")
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    block = doc["arms"][1]
    params = doc["params"]
    assert "split master residual" not in block["consumers"]
    assert block["nvme"]["split master residual"] == int(RESIDUAL_NVME * params)
    # the same config with the residual in host RAM, through the same model
    from fp4offload._deepspeed.config import prepare_config

    same = prepare_config(_split_cfg("same", ds_nvme=True))
    x = host_model.inputs_from_config(same.ds_config, params, accelerator=doc["accelerator"], host=same.host,
                                      states=same.states)
    held = host_model.estimate_host(x).consumers
    assert held["split master residual"] == 2 * params
    assert sum(held.values()) - sum(block["consumers"].values()) == pytest.approx(_host_saving(params), abs=4)


def test_the_activation_pool_is_counted():
    """Offloaded activations take pinned host RAM up to the pool's cap: the estimate counts the cap given in the
    block, or the default one (half of what is left per local rank), and nothing without activations."""
    base = _cfg(stage=2, offload="cpu", block={"optimizer_states": {}})
    acts = json.loads(json.dumps(base))
    acts["fp4offload"]["activations"] = {"format": "nvfp4", "device": "cpu", "max_host_bytes": 3 << 30}
    key = "activation pool (pinned, at most)"
    x0 = host_model.inputs_from_config(base, P, free_bytes=64 << 30)
    assert key not in host_model.estimate_host(x0).consumers
    x1 = host_model.inputs_from_config(acts, P, free_bytes=64 << 30)
    assert host_model.estimate_host(x1).consumers[key] == 3 << 30
    acts["fp4offload"]["activations"].pop("max_host_bytes")
    x2 = host_model.inputs_from_config(acts, P, local_ranks=4, free_bytes=64 << 30)
    est = host_model.estimate_host(x2, runtime_bytes=1 << 30)
    rest = sum(v for k, v in est.consumers.items() if k != key and "cache" not in k and "freed" not in k and k != UN)
    assert est.consumers[key] == ((16 << 30) - (1 << 30) - rest) // 2
    acts["fp4offload"]["activations"]["device"] = "nvme"
    acts["fp4offload"]["activations"]["nvme_path"] = "/tmp"
    assert key not in host_model.estimate_host(host_model.inputs_from_config(acts, P, free_bytes=1 << 40)).consumers
