"""Activations saved for backward, compressed and moved (fp4offload._offload): gradients, bytes, composition.

A tiny Llama (benchmarks.harness.small_llama: hidden 64, 2 layers, batch 4 x 64 tokens) with fixed seeds,
trained for one step with and without the hooks; the gradients are compared per parameter tensor.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks import harness
from fp4offload import ActivationPolicy, ConfigError, offload_activations, quantize
from fp4offload._offload import SavedTensorReleasedError
from fp4offload._offload.selection import from_parameter as _from_parameter

from helpers.activations import MIN_NUMEL, TOKENS, P, _one_thread, tiny_model  # noqa: F401

# Bounds on the per-parameter relative gradient error ||g - g_ref|| / ||g_ref||, fp32 model, one step.
# Measured on this model (max over the 21 parameter tensors), see the printed tables.
MAX_REL_ERR = {"nvfp4": 0.40, "mxfp4": 0.50, "mxfp8": 0.08, "nvfp4-nearest": 0.30}


def step(policy=None, *, ckpt=None, autocast=False, model=None):
    """One forward + backward; returns (grads, offloader or None, loss)."""
    m = model or tiny_model()
    if ckpt is not None:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt})
    m.train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if policy is None:
            off, loss = None, harness.lm_loss(m, TOKENS)
        else:
            with offload_activations(policy) as off:
                loss = harness.lm_loss(m, TOKENS)
    loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}, off, float(loss)


def rel_errors(g, ref):
    return {n: float((g[n] - ref[n]).norm() / ref[n].norm()) for n in ref}


@pytest.fixture(scope="module")
def reference():
    return step(None)[0]


@pytest.fixture(scope="module")
def per_format(reference):
    """Gradients and counters for every format (device cpu), computed once for the module."""
    out = {}
    for fmt in ("none", "mxfp8", "nvfp4", "mxfp4", "nvfp4-nearest"):
        kw = {"format": "nvfp4", "rounding": "nearest"} if fmt == "nvfp4-nearest" else {"format": fmt}
        g, off, _ = step(P(error_sample_every=1, **kw))
        out[fmt] = (g, off.snapshot())
    return out


# -- policy -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,key", [
    ({"format": "fp4"}, "ActivationPolicy.format"),
    ({"device": "gpu"}, "ActivationPolicy.device"),
    ({"min_numel": 0}, "ActivationPolicy.min_numel"),
    ({"device": "nvme"}, "ActivationPolicy.nvme_path"),
    ({"slab_bytes": 3000}, "ActivationPolicy.slab_bytes"),
    ({"max_host_bytes": -1}, "ActivationPolicy.max_host_bytes"),
    ({"module_formats": (("*.mlp", "int8"),)}, "ActivationPolicy.module_formats"),
    ({"norm_format": "fp16"}, "ActivationPolicy.norm_format"),
    ({"format": "none", "norm_format": "nvfp4"}, "ActivationPolicy.norm_format"),
    ({"rounding": "up"}, "ActivationPolicy.rounding"),
    ({"seed": -1}, "ActivationPolicy.seed"),
    ({"attention_format": "int2"}, "ActivationPolicy.attention_format"),  # harsher than nvfp4: never used
    ({"format": "mxfp8", "norm_format": "mxfp4"}, "ActivationPolicy.norm_format"),
    ({"format": "mxfp4", "mlp_format": "nvfp4"}, "ActivationPolicy.mlp_format"),  # as harsh, another format
])
def test_policy_rejects_bad_values_naming_the_key(kw, key):
    with pytest.raises(ConfigError) as e:
        ActivationPolicy(**kw)
    assert e.value.key == key and key in str(e.value)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8", "int2", "none"])
def test_class_formats_that_can_apply_are_accepted_and_used(fmt):
    """The defaults hold under every format; a class format harsher than the policy's is accepted when a module
    format it is gentler than exists, and class_format then uses it there only."""
    p = ActivationPolicy(format=fmt)
    assert p.class_format("mlp", fmt) in ("mxfp8", fmt)
    p = ActivationPolicy(format=fmt, module_formats=(("*.mlp", "int2"),), mlp_format="nvfp4")
    assert p.class_format("mlp", "int2") == ("int2" if fmt == "none" else "nvfp4")
    if fmt in ("nvfp4", "mxfp4", "mxfp8"):
        assert p.class_format("mlp", fmt) == fmt  # not gentler than the policy's own format: not used there


def test_policy_is_frozen_and_normalizes_patterns():
    p = ActivationPolicy(modules="*.mlp", exclude=["*.self_attn"])
    assert p.modules == ("*.mlp",) and p.exclude == ("*.self_attn",) and p.scoped
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.format = "mxfp8"


def test_scoped_policy_without_model_is_refused():
    with pytest.raises(ConfigError, match="model"):
        offload_activations(ActivationPolicy(modules=("*.mlp",)))


# -- gradients per format -----------------------------------------------------------------------

def test_none_gives_identical_gradients(reference, per_format):
    g, snap = per_format["none"]
    for n in reference:
        assert torch.equal(g[n], reference[n]), n
    assert snap["tensors_stored"] > 20 and snap["bytes_to_host"] == snap["bytes_in"] > 0


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8", "nvfp4-nearest"])
def test_compressed_gradients_are_bounded_per_parameter(reference, per_format, fmt):
    g, snap = per_format[fmt]
    errs = rel_errors(g, reference)
    print(f"\n{fmt}: per-parameter relative gradient error")
    for n, e in errs.items():
        print(f"  {n:48s} {e:.4f}")
    assert max(errs.values()) <= MAX_REL_ERR[fmt], max(errs.items(), key=lambda kv: kv[1])
    assert min(errs.values()) > 0  # compression did happen
    # norm layers store bf16 (norm_format): the final norm's gradient needs nothing else
    assert errs["model.norm.weight"] < 0.01
    # the sampled error of the hooks matches what the format gives on Gaussian-like data
    assert 0 < snap["rel_error_mean"] < {"nvfp4": 0.14, "mxfp4": 0.17, "mxfp8": 0.035, "nvfp4-nearest": 0.12}[fmt]


def test_mxfp8_is_much_tighter_than_nvfp4(reference, per_format):
    e8 = rel_errors(per_format["mxfp8"][0], reference)
    e4 = rel_errors(per_format["nvfp4"][0], reference)
    assert max(e8.values()) * 2.5 < max(e4.values())
    assert sum(e8.values()) * 3 < sum(e4.values())


def test_device_same_and_cpu_give_the_same_gradients(per_format):
    g, _, _ = step(P(format="nvfp4", device="same", min_numel=MIN_NUMEL))
    ref = per_format["nvfp4"][0]
    assert all(torch.equal(g[n], ref[n]) for n in ref)


# -- bytes --------------------------------------------------------------------------------------

def _candidates(autocast=False):
    """Independently of the offloader: the distinct tensors it should take, each with whether a norm layer
    saved it (those are stored as bf16, the policy's default norm_format)."""
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    seen, depth = {}, [0]

    def pack(t):
        base_is_param = t._base is not None and isinstance(t._base, torch.nn.Parameter)
        if (t.dtype.is_floating_point and t.numel() >= MIN_NUMEL and not isinstance(t, torch.nn.Parameter)
                and not base_is_param and not _from_parameter(t)
                and not (t.grad_fn is not None and type(t.grad_fn).__name__ == "LogSoftmaxBackward0")
                and not (t.grad_fn is None and not t.requires_grad and t.shape[:2] == (1, 1))):  # rotary tables
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype,
                   t.numel() if t.is_contiguous() else (tuple(t.shape), tuple(t.stride())), depth[0] > 0)
            seen[key] = (t, depth[0] > 0)  # kept alive, so no address is reused during the forward
        return t

    def pre(mod, args):
        depth[0] += type(mod).__name__ == "LlamaRMSNorm"

    def post(mod, args, out):
        depth[0] -= type(mod).__name__ == "LlamaRMSNorm"

    hooks = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
    m = tiny_model()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            harness.lm_loss(m, TOKENS)
    for h in hooks:
        h.remove()
    return list(seen.values())


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_saved_bytes_fall_at_least_3x_with_nvfp4(autocast):
    # every tensor outside the norms in NVFP4 (the MLP's products too: their MXFP8 default is tested in
    # test_activations_ops.py), so each stored tensor's bytes are known from its size alone
    _, off, _ = step(P(format="nvfp4", min_numel=MIN_NUMEL, mlp_format="inherit"), autocast=autocast)
    snap = off.snapshot()
    tensors = _candidates(autocast)
    assert sum(in_norm for _, in_norm in tensors) == 10  # 5 norms: input and output each
    # the hooks' accounting agrees with the tensor sizes
    assert snap["tensors_stored"] == len(tensors)
    assert snap["bytes_in"] == sum(t.numel() * t.element_size() for t, _ in tensors)
    assert snap["bytes_out"] == sum(t.numel() * (2 if t.dtype == torch.float32 else t.element_size()) if in_norm
                                    else quantize(t, "nvfp4").nbytes for t, in_norm in tensors)
    ratio = snap["bytes_in"] / snap["bytes_out"]
    print(f"\nnvfp4 ({'bf16' if autocast else 'fp32'}): {snap['bytes_in']} -> {snap['bytes_out']} bytes, {ratio:.2f}x; "
          f"all saved bytes {snap['saved_bytes_before']} -> {snap['saved_bytes_after']} ({snap['saved_ratio']:.2f}x)")
    assert ratio >= 3.0
    if not autocast:
        assert snap["saved_ratio"] >= 3.0  # counting what was left alone too
    assert snap["bytes_to_host"] == snap["bytes_out"] and snap["tensors_deduped"] > 0
    assert snap["live_entries"] == 0 and snap["live"]["host_bytes"] == 0  # all given back after backward


# -- composition --------------------------------------------------------------------------------

@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpointing(reentrant):
    ref, _, _ = step(None, ckpt=reentrant)
    g, off, _ = step(P(format="none", min_numel=MIN_NUMEL), ckpt=reentrant)
    assert all(torch.equal(g[n], ref[n]) for n in ref)
    stored_ckpt = off.snapshot()["tensors_stored"]
    _, off_plain, _ = step(P(format="none", min_numel=MIN_NUMEL))
    # only what checkpointing still saves reaches the hooks
    assert 0 < stored_ckpt < off_plain.snapshot()["tensors_stored"] / 3
    g4, off4, _ = step(P(format="nvfp4", min_numel=MIN_NUMEL), ckpt=reentrant)
    errs = rel_errors(g4, ref)
    assert 0 < max(errs.values()) <= MAX_REL_ERR["nvfp4"]
    assert off4.snapshot()["passthrough"].get("backward", 0) == 0  # recomputation ran outside the context


def test_bf16_autocast():
    ref, _, _ = step(None, autocast=True)
    g, off, _ = step(P(format="none", min_numel=MIN_NUMEL), autocast=True)
    assert all(torch.equal(g[n], ref[n]) for n in ref)
    assert off.snapshot()["passthrough"]["parameter"] > 0  # the bf16 weight casts were left alone
    g8, _, _ = step(P(format="mxfp8", min_numel=MIN_NUMEL), autocast=True)
    assert 0 < max(rel_errors(g8, ref).values()) <= MAX_REL_ERR["mxfp8"]


def test_nested_contexts_innermost_wins():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 64, generator=gen)
    w1 = (torch.randn(64, 64, generator=gen) / 8).requires_grad_()
    w2 = (torch.randn(64, 64, generator=gen) / 8).requires_grad_()

    def f():
        h = torch.tanh(x @ w1)
        with offload_activations(P(format="mxfp8", device="same", min_numel=1024)) as inner:
            y = torch.sigmoid(h @ w2)
        return (y * torch.exp(h)).sum(), inner

    # (products and activation functions as the rest: one form per tensor, so the dedup below is what is counted)
    with offload_activations(P(format="nvfp4", rounding="nearest", min_numel=1024, mlp_format="inherit")) as outer:
        loss, inner = f()
    s_out, s_in = outer.snapshot(), inner.snapshot()
    # inner: h as the input of h @ w2, the sigmoid output y; w2 is a leaf that requires grad, left alone
    assert s_in["tensors_stored"] == 2 and s_in["bytes_on_device"] > 0 and s_in["bytes_to_host"] == 0
    # outer: x (input of x @ w1), tanh output h, and for y * exp(h): y and exp(h) (saved by exp and mul: once)
    assert s_out["tensors_stored"] == 4 and s_out["tensors_deduped"] == 1 and s_out["bytes_to_host"] > 0
    loss.backward()
    ref_w1, ref_w2 = w1.grad.clone(), w2.grad.clone()
    w1.grad = w2.grad = None
    h = torch.tanh(x @ w1)
    (torch.sigmoid(h @ w2) * torch.exp(h)).sum().backward()
    assert 0 < float((ref_w1 - w1.grad).norm() / w1.grad.norm()) < 0.3
    assert 0 < float((ref_w2 - w2.grad).norm() / w2.grad.norm()) < 0.1
    assert outer.live_entries == 0 and inner.live_entries == 0


class _Reentrant(torch.autograd.Function):
    """Saves its input; its backward runs a backward of its own (a reentrant backward)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xx = x.detach().requires_grad_()
            inner = (xx.cos() * xx.exp()).sum()  # saved while backward runs: left alone
            (gx,) = torch.autograd.grad(inner, xx)
        return g * gx


def test_reentrant_backward_inside_the_context():
    torch.manual_seed(0)
    a = torch.randn(128, 64, requires_grad=True)

    def run():
        h = a * 2
        return (_Reentrant.apply(h) ** 2).sum()

    ref = torch.autograd.grad(run(), a)[0]
    with offload_activations(P(format="none", min_numel=1024)) as off:
        got = torch.autograd.grad(run(), a)[0]
        snap = off.snapshot()
    assert torch.equal(got, ref)
    assert snap["tensors_stored"] >= 2 and snap["passthrough"].get("backward", 0) >= 2


def test_retain_graph_backward_twice():
    m = tiny_model()
    with offload_activations(P(format="nvfp4", min_numel=MIN_NUMEL)) as off:
        loss = harness.lm_loss(m, TOKENS)
    loss.backward(retain_graph=True)
    g1 = {n: p.grad.clone() for n, p in m.named_parameters()}
    assert off.live_entries > 0  # the retained graph keeps its stored copies
    loss.backward()
    for n, p in m.named_parameters():
        assert torch.equal(p.grad, 2 * g1[n]), n
    assert off.live_entries == 0  # the second backward freed the graph, and with it every copy
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()  # torch's own guard still speaks


def test_backward_after_close_raises_a_clear_error():
    m = tiny_model()
    with offload_activations(P(format="nvfp4", min_numel=MIN_NUMEL)) as off:
        loss = harness.lm_loss(m, TOKENS)
    off.close()
    with pytest.raises(SavedTensorReleasedError) as e:
        loss.backward()
    msg = str(e.value)
    assert "shape (" in msg and "retain_graph=True" in msg and isinstance(e.value, RuntimeError)
    assert off.snapshot()["live"]["host_bytes"] == 0


def test_exception_in_context_releases_everything():
    m = tiny_model()
    with pytest.raises(ZeroDivisionError):
        with offload_activations(P(format="nvfp4", min_numel=MIN_NUMEL)) as off:
            loss = harness.lm_loss(m, TOKENS)
            _ = 1 / 0  # the error raised inside the context
    assert off.live_entries == 0 and off.snapshot()["live"]["host_bytes"] == 0
    with pytest.raises(SavedTensorReleasedError, match="exception"):
        loss.backward()


def test_skipped_tensors_pass_through_untouched():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(256, 256))
    idx = torch.arange(4096)
    x = torch.randn(4096, 256, requires_grad=True)
    small = torch.randn(8, 8, requires_grad=True)
    with offload_activations(P(min_numel=1024)) as off:
        y = (x @ w).relu()  # saves x (a leaf that requires grad), w (a parameter), the relu output (taken)
        s2 = small * 2  # not a leaf: left alone for its size
        z = y[idx % 7].sum() + (s2 * s2).sum()  # indexing saves the int64 index: left alone for its dtype
    snap = off.snapshot()
    reasons = snap["passthrough"]
    assert snap["tensors_stored"] == 1 and snap["bytes_in"] == 4096 * 256 * 4
    assert reasons.get("parameter", 0) == 2 and reasons.get("dtype", 0) >= 1 and reasons.get("small", 0) >= 1
    z.backward()
    assert w.grad is not None and small.grad is not None and x.grad is not None


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packing_without_count_readback_matches_quantize(fmt, dtype):
    """The hooks call the codec extension directly (no device sync); the bytes must be quantize()'s."""
    import warnings

    from fp4offload._offload import packing

    x = torch.randn(3, 100, 48, generator=torch.Generator().manual_seed(5)).to(dtype)
    x[0, 0, :40] = float("nan")  # non-finite blocks propagate as NaN, as quantize(nonfinite="propagate")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        fast = packing.quantize_async(x, fmt)
    ref = quantize(x, fmt, nonfinite="propagate")
    assert packing._fast_ok
    assert fast.header() == ref.header()
    for k, v in ref.tensors().items():
        assert torch.equal(fast.tensors()[k], v), k


def test_counters_reach_fp4offload_metrics():
    from fp4offload import _metrics as metrics

    metrics.reset("offload.activations.")
    _, off, _ = step(P(format="nvfp4", min_numel=MIN_NUMEL, error_sample_every=4))
    snap = off.snapshot()
    got = metrics.snapshot("offload.activations.")
    for k in ("bytes_in", "bytes_out", "bytes_to_host", "bytes_from_host", "tensors_stored", "unpacks"):
        assert got["offload.activations." + k] == snap[k] > 0, k
    assert got["offload.activations.pack_seconds"] == pytest.approx(snap["pack_seconds"])
    assert got["offload.activations.rel_error_count"] == snap["error_samples"] > 0
    assert got["offload.activations.live.host_bytes"] == 0  # all given back after backward


def test_rounding_policy():
    with pytest.raises(ConfigError, match="rounding"):
        ActivationPolicy(format="mxfp8", rounding="stochastic")
    auto = ActivationPolicy()
    assert auto.stochastic("nvfp4") and auto.stochastic("mxfp4") and not auto.stochastic("mxfp8")
    assert not ActivationPolicy(rounding="nearest").stochastic("nvfp4")
    # seed=None: new random bits for every offloader (every step); a fixed seed repeats them
    g1, _, _ = step(P(format="nvfp4", seed=None))
    g2, _, _ = step(P(format="nvfp4", seed=None))
    assert any(not torch.equal(g1[n], g2[n]) for n in g1)
    g3, _, _ = step(P(format="nvfp4", seed=7))
    g4, _, _ = step(P(format="nvfp4", seed=7))
    assert all(torch.equal(g3[n], g4[n]) for n in g3)


def test_the_default_pool_cap_is_shared_by_the_local_ranks(monkeypatch):
    """8 ranks of a node must not each pin half of its RAM: the default cap is half the available RAM over the
    node's local ranks (LOCAL_WORLD_SIZE)."""
    import psutil

    from fp4offload._offload import pinned_pool

    class Mem:
        available = 64 << 30

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Mem)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert pinned_pool.default_max_host_bytes() == 32 << 30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert pinned_pool.default_max_host_bytes() == 4 << 30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "junk")
    assert pinned_pool.default_max_host_bytes() == 32 << 30


def test_the_block_sets_the_pool_cap():
    from fp4offload._deepspeed.schema import validate_deepspeed_config

    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
           "fp4offload": {"activations": {"format": "nvfp4", "device": "cpu", "max_host_bytes": 1 << 30}}}
    block = validate_deepspeed_config(cfg)
    assert ActivationPolicy.from_config(block.activations).max_host_bytes == 1 << 30
    cfg["fp4offload"]["activations"]["max_host_bytes"] = -5
    with pytest.raises(ConfigError, match="activations.max_host_bytes=-5"):
        validate_deepspeed_config(cfg)
    cfg["fp4offload"]["activations"].pop("max_host_bytes")
    assert ActivationPolicy.from_config(validate_deepspeed_config(cfg).activations).max_host_bytes is None


def test_a_tensor_kept_as_it_is_and_saved_by_two_ops_holds_its_bytes_once():
    """x (too small to pack) is saved by both products: the bytes kept as they are count it once."""
    from fp4offload._offload import ActivationOffloader

    off = ActivationOffloader(P(format="nvfp4", min_numel=1 << 20))
    x = torch.randn(64, 64, requires_grad=True)
    w1, w2 = (torch.randn(64, 64, requires_grad=True) for _ in range(2))
    with off.hooks():
        h = torch.tanh(x)
        y = (h * w1).sum() + (h * w2).sum()  # each product saves h (for its weight's gradient) and its weight
    snap = off.snapshot()
    y.backward()
    # h (saved twice, held once), tanh's own output is h itself; w1 and w2 are parameters of this graph's leaves
    assert snap["bytes_passthrough"] == h.numel() * h.element_size(), snap
