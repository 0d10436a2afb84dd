"""int2, the 2-bit format for saved activations: the same bytes from the torch reference and the CPU kernels,
every value on its block's four levels with nothing clipped, stochastic rounding unbiased, and the activation
policy storing only the linear layers' inputs in it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.codec_data import codec_data
from helpers.plan import SEVEN_B_ON_8_H100, host_bytes_per_node, plan_with_option
from fp4offload import ActivationPolicy, ConfigError, PackedTensor, dequantize, offload_activations, quantize
from fp4offload.formats import bits as B
from fp4offload.formats import reference as R
from fp4offload.formats.layout import bytes_per_element, packed_sizes
from fp4offload._ops import cpu


def _specials(n: int, dtype) -> torch.Tensor:
    """Wide-range values with a dead (all-zero) block, -0, a block of one tiny value and a block near fp32's top."""
    x = codec_data((n,), torch.float32, n)
    if n >= 64:
        x[16:32] = 0.0
        x[33] = -0.0
        x[32:48] = 0.0
        x[40] = 1e-30
        x[48:64] = torch.linspace(-1, 1, 16) * 3e38 if dtype == torch.float32 else x[48:64]
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 64, 1000, 4099])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_cpu_kernels_give_the_reference_bytes(n, dtype, stochastic):
    x = _specials(n, dtype)
    ref = R.int2_encode(x, stochastic, 7, 3, True)
    got = cpu.int2_encode(x, stochastic, 7, 3, True)
    for a, b in zip(ref[:3], got[:3]):
        assert torch.equal(a, b)
    assert ref[3] == got[3] == 0
    for out in (torch.float32, torch.bfloat16):
        a = R.int2_decode(*ref[:3], n, out)
        b = cpu.int2_decode(*got[:3], n, out)
        assert torch.equal(a.view(torch.int16 if out == torch.bfloat16 else torch.int32),
                           b.view(torch.int16 if out == torch.bfloat16 else torch.int32))


def test_non_finite_blocks_decode_to_nan_and_are_counted():
    x = codec_data((640,), torch.float32, 1)
    x[5], x[300] = float("nan"), -float("inf")
    ref = R.int2_encode(x, True, 1, 2, True)
    got = cpu.int2_encode(x, True, 1, 2, True)
    assert ref[3] == got[3] == 2
    assert all(torch.equal(a, b) for a, b in zip(ref[:3], got[:3]))
    back = cpu.int2_decode(*got[:3], 640, torch.float32).view(-1, 16)
    nan_blocks = torch.isnan(back).all(dim=1).nonzero().flatten().tolist()
    assert nan_blocks == [0, 18]
    with pytest.raises(Exception, match="2"):
        quantize(x, "int2")  # nonfinite="raise" by default


def _blocks(x, packed):
    """The decoded tensor and each element's block step d (levels are -3d, -d, d, 3d)."""
    d = B.e4m3_table()[packed.scales.long()] * packed.tensor_scale[0]
    return dequantize(packed).float(), d.repeat_interleave(16)[: x.numel()]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_values_sit_on_the_block_levels_and_nothing_clips(rounding):
    x = codec_data((64, 80), torch.float32, 11).reshape(-1)
    packed = quantize(x, "int2", rounding=rounding, seed=5)
    y, d = _blocks(x, packed)
    level = (y / d)[d > 0]
    assert bool(torch.isin(level.round(), torch.tensor([-3.0, -1.0, 1.0, 3.0])).all())
    assert bool(((level - level.round()).abs() < 1e-5).all())
    # the block scale is rounded up: every element within the outer levels, so rounding only moves between the two
    # levels around it
    assert bool((x.abs() <= 3 * d * (1 + 2 ** -20)).all())
    assert bool(((y - x).abs() <= 2 * d * (1 + 2 ** -20)).all())
    if rounding == "nearest":
        assert bool(((y - x).abs() <= d * (1 + 2 ** -20)).all())
    # a block's scale is at most one E4M3 step above amax / 3: the outer level is at most 12.5% above the amax
    amax = x.abs().view(-1, 16).amax(dim=1)
    top = 3 * d.view(-1, 16)[:, 0]
    live = amax > amax.max() * 2 ** -6  # normal E4M3 scales (the small ones are subnormal, coarser)
    assert bool((top[live] <= amax[live] * 1.125 * (1 + 2 ** -20)).all())


def test_stochastic_rounding_is_unbiased():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 2
    runs = 400
    total = torch.zeros_like(x)
    for s in range(runs):
        total += dequantize(quantize(x, "int2", rounding="stochastic", seed=s))
    mean = total / runs
    _, d = _blocks(x, quantize(x, "int2"))
    # per element the decoded value has variance <= d^2, so the mean of 400 is within d/20 per sigma
    assert bool(((mean - x).abs() <= 5 * d / 20).all())
    one = dequantize(quantize(x, "int2", rounding="stochastic", seed=0))
    single, averaged = float((one - x).norm() / x.norm()), float((mean - x).norm() / x.norm())
    assert averaged < 2 * single / runs ** 0.5
    # nearest rounding is biased: its average over seeds is the same one value
    near = dequantize(quantize(x, "int2"))
    assert float((near - x).norm() / x.norm()) > 5 * averaged


def test_sizes_container_and_errors(tmp_path):
    assert bytes_per_element("int2") == 0.3125
    assert packed_sizes("int2", "1x16", (33,)) == (12, 3, 1)
    x = codec_data((7, 50), torch.bfloat16, 2)
    p = quantize(x, "int2", rounding="stochastic", seed=9)
    p.check()
    assert p.nbytes == 88 + 22 + 4 and p.dequantize().dtype == torch.bfloat16
    p.save(tmp_path / "a.fp4")
    q = PackedTensor.load(tmp_path / "a.fp4")
    assert q.format == "int2" and torch.equal(q.dequantize(), p.dequantize())
    with pytest.raises(ConfigError, match="scale_scope"):
        quantize(x, "int2", scale_scope=64)
    with pytest.raises(ConfigError, match="amax"):
        quantize(x, "int2", amax=1.0)


def test_weight_gradient_through_a_two_bit_input_is_unbiased():
    """A linear layer's weight gradient is dY^T X: with X stored in int2 and rounded stochastically, its average
    over steps is the exact gradient."""
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(256, 64, generator=g)
    r = torch.randn(256, 32, generator=g)

    def grad(policy):
        lin.zero_grad()
        inp = x * 1.0
        if policy is None:
            out = lin(inp)
        else:
            with offload_activations(policy):
                out = lin(inp)
        (out * r).sum().backward()
        return lin.weight.grad.clone()

    exact = grad(None)
    grads = [grad(ActivationPolicy(format="int2", min_numel=1, seed=s)) for s in range(64)]
    one = float((grads[0] - exact).norm() / exact.norm())
    avg = float((torch.stack(grads).mean(0) - exact).norm() / exact.norm())
    assert 0.05 < one < 1.0  # 2 bits move one step's gradient visibly ...
    assert avg < 2.5 * one / 64 ** 0.5  # ... and not on average


def _swiglu_forms(policy):
    torch.manual_seed(0)
    gate, up, down = torch.nn.Linear(64, 128), torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)
    x = torch.randn(4, 32, 64, requires_grad=True)
    with offload_activations(policy) as off:
        h = x * 1.0
        q, k, v = (h.view(4, 32, 4, 16).transpose(1, 2) * 1.0 for _ in range(3))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(4, 32, 64)
        out = down(F.silu(gate(a)) * up(a))
    forms = [(tuple(e.layout.shape), e.layout.fmt) for e in off._order if e is not None]
    out.sum().backward()
    assert gate.weight.grad is not None and x.grad is not None
    return forms


def test_the_policy_puts_only_linear_inputs_in_two_bits():
    forms = _swiglu_forms(ActivationPolicy(format="int2", min_numel=1, seed=0))
    assert sorted(f for s, f in forms if len(s) == 2) == ["int2", "int2"], forms  # the linear inputs
    others = {f for s, f in forms if len(s) != 2}
    assert others == {"bf16", "mxfp8"}, forms  # attention q, k bf16; v, output and the MLP products MXFP8
    assert ActivationPolicy(format="int2").stochastic("int2")
    assert not ActivationPolicy(format="int2", rounding="nearest").stochastic("int2")
    assert "INT2 (stochastic)" in ActivationPolicy(format="int2").describe()
    assert "experimental" in ActivationPolicy(format="int2").describe()
    assert "experimental" not in ActivationPolicy().describe()


def test_plan_counts_two_bit_activations_names_their_cost_and_emits_them(tmp_path, capsys):
    from fp4offload import cli

    four, two, emitted = plan_with_option(capsys, "zero3-params-cpu-act-fp4", ["--act-format", "int2"],
                                          tmp_path / "ds.json")
    assert host_bytes_per_node(two) < host_bytes_per_node(four)  # the activations live in host RAM
    assert any("--act-format int2 (high risk)" in n and "-1.5 +/- 1.0 points" in n for n in two["notes"]), two["notes"]
    assert emitted["fp4offload"]["activations"]["format"] == "int2"
    assert cli.main([*SEVEN_B_ON_8_H100, "--act-format", "int3"]) != 0
    assert "--act-format='int3' is not allowed" in capsys.readouterr().err
