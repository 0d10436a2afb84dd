"""One training step of a real pretrained transformer (SmolLM2-135M, torch's SDPA attention) with its saved
activations compressed: under the default policy and under every shipped config's ``activations`` block the
gradient stays within what 4-bit rounding of single tensors explains, where storing fused attention's tensors
in 4 bits (the defaults before the op rule) put the median parameter's gradient off by orders of magnitude.

Also the short version of the per-class table (benchmarks/activation_classes.py): attention alone in NVFP4 is
the class that wrecks the gradient, and the default stores each class in the form the table chose."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import activation_classes as ac  # noqa: E402
from fp4offload import ActivationPolicy, offload_activations  # noqa: E402
from fp4offload._config.block import parse_block  # noqa: E402
from fp4offload._config.fsdp import load_fsdp_policy_yaml  # noqa: E402
from helpers.pretrained import load_smollm2  # noqa: E402

# median / max over parameters of ||g - g_ref|| / ||g_ref||, one step. Measured 2026-12-05/06 (3 seeds): default
# 0.085 / 0.24; MLP products in NVFP4 too (the default of 2026-12-05) 0.175 / 0.53; NVFP4 with attention stored as
# the rest 3.9 / 1,300, attention alone in NVFP4 6.3 / 1,100.
MEDIAN_BOUND, MAX_BOUND = 0.35, 2.0
MLP_MEDIAN = 0.125  # between the default with the MLP products in MXFP8 and in NVFP4: the per-class choice

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    model = load_smollm2()
    assert model.config._attn_implementation == "sdpa"
    x, y = ac._batch()
    ref = ac._grads(model, x, y, contextlib.nullcontext)
    yield model, x, y, ref
    torch.set_num_threads(n)


def _err(smollm2, ctx) -> dict:
    model, x, y, ref = smollm2
    return ac.grad_error(ref, ac._grads(model, x, y, ctx))


def _shipped_policies() -> dict[str, ActivationPolicy]:
    out = {}
    for path in sorted((ROOT / "configs").glob("*.json")):
        block = parse_block(json.loads(path.read_text()).get("fp4offload"))
        if block.activations is not None:
            out[path.name] = ActivationPolicy.from_config(block.activations)
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_fsdp_policy_yaml(path)
        if cfg.activations is not None:
            out[path.name] = ActivationPolicy.from_config(cfg.activations)
    return out


def test_shipped_configs_with_activations_are_found():
    """One shipped config stores activations (each file does one thing), NVFP4 under the default policy (the
    form the fine-tune and the long run measured); the check below would run any that are added."""
    found = _shipped_policies()
    assert set(found) == {"deepspeed_zero2_offload_cpu_activations.json"}, sorted(found)
    assert found["deepspeed_zero2_offload_cpu_activations.json"] == ActivationPolicy(device="cpu")


def test_default_policy_keeps_the_gradient(smollm2):
    e = _err(smollm2, lambda: offload_activations(ActivationPolicy(seed=0)))
    assert e["median"] < MEDIAN_BOUND and e["max"] < MAX_BOUND, e
    before = _err(smollm2, lambda: offload_activations(
        ActivationPolicy(seed=0, attention_format="inherit", attention_qk_format="inherit")))
    # what the op rule fixes, still there when asked for
    assert before["median"] > 3 * MEDIAN_BOUND and before["max"] > 100 * MAX_BOUND, before
    # the MLP's products in MXFP8 halve what is left
    assert e["median"] < MLP_MEDIAN, e
    mlp4 = _err(smollm2, lambda: offload_activations(ActivationPolicy(seed=0, mlp_format="inherit")))
    assert mlp4["median"] > MLP_MEDIAN, mlp4


def test_every_shipped_config_keeps_the_gradient(smollm2):
    seen = {}
    for name, policy in _shipped_policies().items():
        # the same forms in host RAM: NVMe folders and the GPU are not what this checks; configs that store
        # alike are run once
        pol = dataclasses.replace(policy, device="cpu", nvme_path=None, seed=0, max_host_bytes=None)
        if pol in seen:
            continue
        seen[pol] = name
        ctx = (lambda p=pol: offload_activations(p, model=smollm2[0])) if pol.scoped else (
            lambda p=pol: offload_activations(p))
        e = _err(smollm2, ctx)
        assert e["median"] < MEDIAN_BOUND and e["max"] < MAX_BOUND, (name, e)


def test_attention_is_the_class_that_breaks_and_each_class_gets_its_form(smollm2):
    model = smollm2[0]
    e = statistics.median(_err(smollm2, ac.only_class(model, c, seed=0))["median"] for c in ("attention",))
    assert e > 1.0, e  # attention alone in NVFP4
    lin = _err(smollm2, ac.only_class(model, "linear_input", seed=0))
    assert lin["median"] < MEDIAN_BOUND, lin  # linear-layer inputs hold 4 bits
    # the forms the default gives one step's saved tensors, by shape
    x, y = smollm2[1], smollm2[2]
    held = {}

    @contextlib.contextmanager
    def ctx():
        with offload_activations(ActivationPolicy(seed=0)) as off:
            yield
        held["forms"] = Counter((len(e.layout.shape), e.layout.fmt) for e in off._order if e is not None)
        held["pass"] = off.snapshot()["passthrough"]

    ac._grads(model, x, y, ctx)
    layers = model.config.num_hidden_layers
    forms = held["forms"]
    assert forms[(4, "bf16")] == 2 * layers and forms[(4, "mxfp8")] == 2 * layers, forms  # q, k / v, output
    assert forms[(4, "nvfp4")] == 0
    assert forms[(2, "nvfp4")] >= 4 * layers  # linear-layer inputs
    assert forms[(3, "bf16")] >= 2 * layers  # norm inputs
    assert forms[(3, "mxfp8")] == 3 * layers  # SiLU's input, SiLU(gate), up
    assert forms[(3, "nvfp4")] == 0, forms
