"""Saved tensors classed by the op that saves them (fp4offload/_offload/ops.py): fused attention's query and key
in bf16, its value and output in MXFP8, statistics (log-sum-exp, mean, rstd) exact; the rule found by the op,
never harsher than the module's format, and gone when the context closes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack

from fp4offload import ActivationPolicy, ConfigError, offload_activations, wrap_modules
from fp4offload._offload import ops


def _stored(off) -> list[tuple[tuple[int, ...], str]]:
    """(shape, format) of every tensor the offloader stored, in order of saving."""
    return [(tuple(e.layout.shape), e.layout.fmt) for e in off._order if e is not None]


def _qkv(scale: float = 1.0, b=2, h=4, s=64, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, h, s, d, generator=g) * scale).requires_grad_() for _ in range(3)]


def _sdpa_grads(policy, q, k, v):
    for t in (q, k, v):
        t.grad = None
    if policy is None:  # the inputs as a model has them: outputs of earlier ops (a leaf is kept as a parameter)
        out = F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, is_causal=True)
        off = forms = None
    else:
        with offload_activations(policy) as off:
            out = F.scaled_dot_product_attention(q * 1.0, k * 1.0, v * 1.0, is_causal=True)
        forms = _stored(off)
    out.backward(torch.ones_like(out))
    return [t.grad.clone() for t in (q, k, v)], off, forms


def test_sdpa_query_key_bf16_value_output_mxfp8_statistic_kept():
    q, k, v = _qkv()
    _, off, forms = _sdpa_grads(ActivationPolicy(min_numel=1, seed=0), q, k, v)
    assert forms.count(((2, 4, 64, 32), "bf16")) == 2  # query and key
    assert forms.count(((2, 4, 64, 32), "mxfp8")) == 2  # value and output
    assert not any(f == "nvfp4" for _, f in forms)
    snap = off.snapshot()
    assert snap["passthrough"].get("statistic") == 1  # the log-sum-exp, kept exactly though min_numel=1


def test_sdpa_roles_found_when_passed_by_keyword():
    q, k, v = _qkv()
    with offload_activations(ActivationPolicy(min_numel=1, seed=0)) as off:
        out = F.scaled_dot_product_attention(query=q * 1.0, key=k * 1.0, value=v * 1.0, is_causal=True)
    forms = _stored(off)
    out.sum().backward()
    assert forms.count(((2, 4, 64, 32), "bf16")) == 2 and forms.count(((2, 4, 64, 32), "mxfp8")) == 2, forms


def test_sdpa_gradient_bounded_where_4bit_query_and_key_blow_it_up():
    """Large logits (as in a pretrained model): NVFP4 q and k against the exact log-sum-exp wreck the gradient;
    the op rule keeps it within what one tensor's rounding explains."""
    q, k, v = _qkv(scale=3.0)
    ref = _sdpa_grads(None, q, k, v)[0]

    def err(policy):
        g = _sdpa_grads(policy, q, k, v)[0]
        return max(float((a - b).norm() / b.norm()) for a, b in zip(g, ref))

    before = err(ActivationPolicy(min_numel=1, seed=0, attention_format="inherit", attention_qk_format="inherit"))
    now = err(ActivationPolicy(min_numel=1, seed=0))
    assert before > 1.0, before  # the failure the rule exists for
    assert now < 0.1, now


def test_norm_op_statistics_kept_input_in_norm_format():
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.ones(256, requires_grad=True)
    with offload_activations(ActivationPolicy(min_numel=1, seed=0)) as off:
        y = F.layer_norm(x * 2, (256,), w)
    forms = _stored(off)
    y.sum().backward()
    assert ((64, 256), "bf16") in forms  # the norm's input, in norm_format
    assert off.snapshot()["passthrough"].get("statistic") == 2  # mean and rstd


def test_rule_never_harsher_than_the_module_format():
    pol = ActivationPolicy()
    assert pol.class_format("attention", "none") == "none"
    assert pol.class_format("attention", "bf16") == "bf16"
    assert pol.class_format("attention", "nvfp4") == "mxfp8"
    assert pol.class_format("attention_qk", "mxfp8") == "bf16"
    assert pol.class_format("statistic", "none") == "keep"
    assert ActivationPolicy(attention_format="inherit").class_format("attention", "nvfp4") == "nvfp4"
    assert ActivationPolicy(attention_qk_format="keep").class_format("attention_qk", "nvfp4") == "keep"


@pytest.mark.parametrize("key", ["attention_format", "attention_qk_format"])
def test_bad_attention_format_named(key):
    with pytest.raises(ConfigError) as e:
        ActivationPolicy(**{key: "fp4"})
    assert f"ActivationPolicy.{key}" in str(e.value) and "'fp4'" in str(e.value) and "inherit" in str(e.value)


def test_custom_function_saving_after_its_op_is_classed_by_identity():
    """flash-attn's shape: an autograd.Function whose forward calls a registered custom op and saves q, k, v,
    the output and the log-sum-exp after the forward returned."""
    lib = "fp4offload_test"
    name = f"{lib}::attn"

    @torch.library.custom_op(name, mutates_args=())
    def attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = q @ k.transpose(-1, -2)
        lse = torch.logsumexp(s, -1)
        return torch.exp(s - lse[..., None]) @ v, lse

    class Attn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = torch.ops.fp4offload_test.attn(q, k, v)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, g):
            q, k, v, out, lse = ctx.saved_tensors
            p = torch.exp(q @ k.transpose(-1, -2) - lse[..., None])
            dp = g @ v.transpose(-1, -2)
            ds = p * (dp - (g * out).sum(-1, keepdim=True))
            return ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ g

    ops.register_op(name)
    try:
        q, k, v = _qkv(s=256)
        with offload_activations(ActivationPolicy(min_numel=1, seed=0)) as off:
            out = Attn.apply(q * 1.0, k * 1.0, v * 1.0)
        forms = _stored(off)
        out.sum().backward()
        assert forms.count(((2, 4, 256, 32), "bf16")) == 2 and forms.count(((2, 4, 256, 32), "mxfp8")) == 2, forms
        assert off.snapshot()["passthrough"].get("statistic") == 1
    finally:
        ops.RULES.pop(name, None)
        ops._seen.clear()


def test_mode_pushed_once_and_popped_with_the_context():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Sequential(torch.nn.Linear(64, 64)))
    assert not _get_current_function_mode_stack()
    seen = []

    def probe(mod, args):
        seen.append(sum(isinstance(m, ops.OpClasses) for m in _get_current_function_mode_stack()))

    h = model[1][0].register_forward_pre_hook(probe)
    with wrap_modules(model, ActivationPolicy(modules=("*",), min_numel=1)):
        model(torch.randn(8, 64, requires_grad=True)).sum().backward()
    h.remove()
    assert seen == [1]  # nested offloaded modules share one mode
    assert not _get_current_function_mode_stack()
    with pytest.raises(RuntimeError):
        with offload_activations(ActivationPolicy()):
            raise RuntimeError("boom")
    assert not _get_current_function_mode_stack() and ops._state.depth == 0


def test_a_norm_output_a_linear_layer_saves_keeps_the_module_format():
    """Only custom ops inside a Function are matched after they return: a 2-D LayerNorm output that the next
    linear layer saves as its input is a linear input (NVFP4), not a norm tensor."""
    x = torch.randn(128, 512, requires_grad=True)
    lin = torch.nn.Linear(512, 512)
    with offload_activations(ActivationPolicy(min_numel=1, seed=0)) as off:
        y = lin(F.layer_norm(x * 1.0, (512,)))
    forms = _stored(off)
    y.sum().backward()
    assert forms.count(((128, 512), "nvfp4")) == 1 and forms.count(((128, 512), "bf16")) == 1, forms


def test_rotary_tables_are_kept_exactly_at_any_length():
    """cos/sin of shape (1, 1, S, d), saved by the rotary products of every layer: past min_numel at S >= 1024
    they were rounded to 4 bits once and multiplied into every layer's q and k gradient."""
    cos = torch.randn(1, 1, 2048, 64)
    q = torch.randn(2, 4, 2048, 64, requires_grad=True)
    with offload_activations(ActivationPolicy(seed=0)) as off:
        y = (q * 1.0) * cos
    forms = _stored(off)
    y.sum().backward()
    assert forms == [] and off.snapshot()["passthrough"].get("table") == 1
    assert torch.equal(q.grad, cos.expand_as(q))


def _swiglu_forms(policy, gated=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, 64, generator=g).requires_grad_()
    gate, up, down = (torch.nn.Linear(64, 128), torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    with offload_activations(policy) as off:
        h = x * 1.0  # an activation with history, as a block's norm output is
        inner = F.silu(gate(h)) * up(h) if gated else F.gelu(gate(h))
        out = down(inner)
    forms = _stored(off)
    out.sum().backward()
    return forms


def test_mlp_products_in_mlp_format_linear_inputs_in_the_module_format():
    """What the activation function saves (SiLU's or GELU's input) and the gate product's operands go to
    ``mlp_format`` (MXFP8); the linear layers' inputs, the down projection's included, stay NVFP4."""
    forms = _swiglu_forms(ActivationPolicy(min_numel=1, seed=0))
    assert forms.count(((4, 32, 128), "mxfp8")) == 3, forms  # gate output (SiLU's input), SiLU(gate), up
    # a linear layer saves its input flattened to rows: the one gate and up share (stored once), and the
    # down projection's, the product
    assert forms.count(((128, 64), "nvfp4")) == 1 and forms.count(((128, 128), "nvfp4")) == 1, forms
    assert len(forms) == 5, forms
    forms = _swiglu_forms(ActivationPolicy(min_numel=1, seed=0), gated=False)
    assert sorted(forms) == [((4, 32, 128), "mxfp8"), ((128, 64), "nvfp4"), ((128, 128), "nvfp4")], forms
    inherit = _swiglu_forms(ActivationPolicy(min_numel=1, seed=0, mlp_format="inherit"))
    assert {f for _, f in inherit} == {"nvfp4"}, inherit  # the form before the MLP rule


def test_a_product_with_a_tensor_without_history_keeps_it_exactly():
    """A mask or a rotary table multiplied in is a statistic of the product: kept as it is, never rounded."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, 64, generator=g).requires_grad_()
    table = torch.randn(8, 64, 64, generator=g)
    with offload_activations(ActivationPolicy(min_numel=1, seed=0)) as off:
        y = (x * 1.0) * table
    assert _stored(off) == [] and off.snapshot()["passthrough"].get("statistic") == 1
    y.sum().backward()
    assert torch.equal(x.grad, table)


def test_bad_mlp_format_named():
    with pytest.raises(ConfigError, match="mlp_format"):
        ActivationPolicy(mlp_format="fp3")
    from fp4offload._config import ActivationsConfig

    with pytest.raises(ConfigError, match="activations.mlp_format"):
        ActivationsConfig(mlp_format="int4")
    assert ActivationPolicy.from_config(ActivationsConfig(mlp_format="bf16")).mlp_format == "bf16"
