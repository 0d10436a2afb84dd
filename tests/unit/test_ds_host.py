"""The block's ``host`` sub-block: validation with the key path, environment overrides, where each effective
value came from, and the same allocator setup from the config as from the environment variables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fp4offload._config import HostConfig, parse_block
from fp4offload.errors import ConfigError
from fp4offload._deepspeed import config as dsc

ROOT = Path(__file__).resolve().parents[2]
STATES = {"optimizer_states": {"format": "nvfp4", "device": "cpu"}}


@pytest.mark.parametrize("host, key, fragment", [
    ({"mmap_threshold": 100}, "host.mmap_threshold", ">= 4096"),
    ({"mmap_threshold": "128k"}, "host.mmap_threshold", "bytes"),
    ({"mmap_threshold": True}, "host.mmap_threshold", "bytes"),
    ({"allocator_cache": 0}, "host.allocator_cache", "(0, 1]"),
    ({"allocator_cache": 1.5}, "host.allocator_cache", "(0, 1]"),
    ({"allocator_cache": "half"}, "host.allocator_cache", "fraction"),
    ({"share_bf16_staging": "yes"}, "host.share_bf16_staging", "true or false"),
    ({"bf16_gradient_partition": 1}, "host.bf16_gradient_partition", "true or false"),
    ({"bf16_gradients": False}, "host.bf16_gradients", "bf16_gradient_partition"),
])
def test_bad_host_values_name_the_key_path(host, key, fragment):
    with pytest.raises(ConfigError) as e:
        parse_block({**STATES, "host": host}, prefix="fp4offload.")
    assert e.value.key == "fp4offload." + key, str(e.value)
    assert fragment in str(e.value)


def test_host_needs_optimizer_states():
    with pytest.raises(ConfigError) as e:
        parse_block({"host": {"allocator_cache": "off"}}, prefix="fp4offload.")
    assert e.value.key == "fp4offload.host" and "optimizer_states" in str(e.value)


def test_defaults_and_round_trip():
    cfg = parse_block({**STATES, "host": {}})
    assert cfg.host == HostConfig(131072, 0.125, True, True)
    back = parse_block(cfg.to_dict())
    assert back == cfg
    off = parse_block({**STATES, "host": {"mmap_threshold": "OFF", "allocator_cache": "off"}}).host
    assert off.mmap_threshold == "off" and off.allocator_cache == "off"


def test_effective_values_say_where_they_came_from():
    host = HostConfig(mmap_threshold=1 << 20, share_bf16_staging=False)
    got = dsc.resolve(host, environ={"FP4OFFLOAD_HOST_CACHE": "0.25"}).as_dict()
    assert got == {"mmap_threshold": {"value": 1 << 20, "source": "fp4offload.host.mmap_threshold"},
                   "allocator_cache": {"value": 0.25, "source": "FP4OFFLOAD_HOST_CACHE"},
                   "share_bf16_staging": {"value": False, "source": "fp4offload.host.share_bf16_staging"},
                   "bf16_gradient_partition": {"value": True, "source": "default"},
                   "preflight": {"value": "error", "source": "default"}}
    # the environment wins over the config
    env = {"FP4OFFLOAD_MMAP_THRESHOLD": "off", "FP4OFFLOAD_SHARE_STAGING": "1", "FP4OFFLOAD_BF16_GRADS": "0"}
    got = dsc.resolve(host, environ=env)
    assert got.mmap_threshold.value == "off" and got.mmap_threshold.source == "FP4OFFLOAD_MMAP_THRESHOLD"
    assert got.share_bf16_staging.value is True and got.bf16_gradient_partition.value is False
    assert dsc.resolve(None, environ={}).as_dict() == {
        k: {"value": v, "source": "default"} for k, v in
        {"mmap_threshold": 131072, "allocator_cache": 0.125, "share_bf16_staging": True,
         "bf16_gradient_partition": True, "preflight": "error"}.items()}


@pytest.mark.parametrize("var, raw", [("FP4OFFLOAD_MMAP_THRESHOLD", "lots"), ("FP4OFFLOAD_MMAP_THRESHOLD", "12"),
                                      ("FP4OFFLOAD_HOST_CACHE", "2"), ("FP4OFFLOAD_HOST_CACHE", "x"),
                                      ("FP4OFFLOAD_SHARE_STAGING", "maybe"), ("FP4OFFLOAD_BF16_GRADS", "2"),
                                      ("FP4OFFLOAD_PREFLIGHT", "strict")])
def test_bad_environment_overrides_name_the_variable(var, raw):
    with pytest.raises(ConfigError) as e:
        dsc.resolve(None, environ={var: raw})
    assert e.value.key == var and "fp4offload.host." in str(e.value)


def test_doctor_reports_the_settings_of_a_config(tmp_path, monkeypatch):
    from fp4offload import _doctor as doctor

    for var in dsc.ENV.values():
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FP4OFFLOAD_BF16_GRADS", "0")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"fp4offload": {**STATES, "host": {"allocator_cache": 0.5}}}))
    got = doctor.host_settings(str(path))
    assert got["allocator_cache"] == {"value": 0.5, "source": "fp4offload.host.allocator_cache"}
    assert got["bf16_gradient_partition"] == {"value": False, "source": "FP4OFFLOAD_BF16_GRADS"}
    assert got["mmap_threshold"]["source"] == "default"


_PROBE = textwrap.dedent("""
    import json, sys
    from fp4offload._config import HostConfig
    from fp4offload._deepspeed.config import resolve
    from fp4offload._deepspeed.host import control_host_allocator
    host = HostConfig(**json.loads(sys.argv[1])) if sys.argv[1] != "null" else None
    got = control_host_allocator(resolve(host))
    got["host_cache"] = {k: got["host_cache"].get(k) for k in ("installed", "fraction", "reason") if k != "reason"}
    print(json.dumps(got))
""")


def _probe(host: dict | None, env: dict) -> dict:
    full = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")
            and k not in dsc.ENV.values()}
    full.update(env, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(host)], env=full, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
@pytest.mark.parametrize("host, env", [
    ({"mmap_threshold": "off", "allocator_cache": "off"},
     {"FP4OFFLOAD_MMAP_THRESHOLD": "off", "FP4OFFLOAD_HOST_CACHE": "off"}),
    ({"mmap_threshold": 1 << 20, "allocator_cache": 0.25},
     {"FP4OFFLOAD_MMAP_THRESHOLD": str(1 << 20), "FP4OFFLOAD_HOST_CACHE": "0.25"}),
])
def test_the_config_sets_the_allocator_up_as_the_environment_did(host, env):
    by_config, by_env = _probe(host, {}), _probe(None, env)
    assert by_config["mmap_threshold"] == by_env["mmap_threshold"] == (None if host["mmap_threshold"] == "off"
                                                                        else host["mmap_threshold"])
    assert by_config["host_cache"] == by_env["host_cache"]
    assert by_config["host_cache"]["installed"] is (host["allocator_cache"] != "off")
    if host["allocator_cache"] != "off":
        assert by_config["host_cache"]["fraction"] == pytest.approx(host["allocator_cache"])
