"""Each change the block makes to the user's config or to the process is printed once, on rank 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fp4offload import _announce


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(_announce, "_said", set())


def test_a_line_prints_once_on_rank_0(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    assert _announce.announce("config: x -> y")
    assert not _announce.announce("config: x -> y")  # the same change again: not repeated
    assert _announce.announce("process: z")
    assert capsys.readouterr().err.splitlines() == ["fp4offload: config: x -> y", "fp4offload: process: z"]


def test_other_ranks_stay_quiet(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert not _announce.announce("config: x -> y")
    assert capsys.readouterr().err == ""


def test_the_host_settings_announce_what_they_change():
    """glibc's threshold and the allocator cache, in a fresh process: one line each, naming the change."""
    code = ("from fp4offload._deepspeed import host, config; "
            "host.control_host_allocator(config.resolve(None)); host.control_host_allocator(config.resolve(None))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "RANK": "0"})
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("fp4offload: process:")]
    assert len(lines) == len(set(lines)) >= 1, out.stderr
    assert any("mmap threshold fixed at 131072 bytes" in ln for ln in lines), out.stderr


def test_the_optimizer_replacement_says_what_it_keeps_and_where(capsys, monkeypatch):
    import torch

    from fp4offload._config import OptimizerStatesConfig
    from fp4offload._deepspeed.optim import convert_optimizer

    monkeypatch.setenv("RANK", "0")
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(64))], lr=1e-3)
    convert_optimizer(opt, OptimizerStatesConfig(device="cpu", master="split"))
    # the step-threads line comes once per process, with the first host-state FP4AdamW: not this test's subject
    err = [ln for ln in capsys.readouterr().err.splitlines() if not ln.startswith("fp4offload: host optimizer step")]
    assert err == ["fp4offload: replaced the client AdamW with FP4AdamW over 1 param group(s): m in NVFP4, sqrt(v) "
                   "on ue2m2, in host RAM (1.13 B/param instead of 8), master split"], err


def test_the_activation_policy_says_each_form():
    from fp4offload import ActivationPolicy

    assert ActivationPolicy().describe() == ("saved activations in NVFP4 (stochastic) to host RAM, every module; "
                                             "attention q/k bf16; attention v/output MXFP8; MLP products MXFP8; "
                                             "norms bf16; statistics exact")
    line = ActivationPolicy(format="mxfp8", modules=("*.mlp",), attention_format="inherit",
                            attention_qk_format="inherit", mlp_format="inherit", norm_format="keep").describe()
    assert line == "saved activations in MXFP8 (nearest) to host RAM, modules *.mlp; norms keep; statistics exact"
