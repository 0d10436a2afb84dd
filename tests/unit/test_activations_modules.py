"""Offloading chosen modules only: "MLP inputs yes, attention no" (fp4offload._offload.wrap_modules)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import harness
from fp4offload import ActivationPolicy, ConfigError, offload_activations
from fp4offload._offload import wrap_modules
from fp4offload._offload.modules import plan

from helpers.activations import MIN_NUMEL, TOKENS, P, _one_thread, tiny_model  # noqa: F401


def spy_saved_inside(model, pattern_names):
    """Independently of fp4offload: the float tensors >= MIN_NUMEL saved inside each named module's forward
    (not parameters or views of them), deduplicated by memory, as {module name: [shapes]}."""
    found: dict[str, dict] = {n: {} for n in pattern_names}
    mods = dict(model.named_modules())
    handles = []
    for name in pattern_names:
        def pack(t, name=name):
            if (t.dtype.is_floating_point and t.numel() >= MIN_NUMEL and not isinstance(t, torch.nn.Parameter)
                    and not (t._base is not None and isinstance(t._base, torch.nn.Parameter))):
                found[name][(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())] = t
            return t.detach()

        ctx = {}

        def pre(mod, args, pack=pack, ctx=ctx):
            ctx["h"] = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            ctx["h"].__enter__()

        def post(mod, args, out, ctx=ctx):
            ctx.pop("h").__exit__(None, None, None)

        handles += [mods[name].register_forward_pre_hook(pre), mods[name].register_forward_hook(post)]
    harness.lm_loss(model, TOKENS)
    for h in handles:
        h.remove()
    return {n: [tuple(t.shape) for t in d.values()] for n, d in found.items()}


def test_plan_matches_qualified_names_and_exclusion_wins():
    m = tiny_model()
    p = plan(m, ActivationPolicy(modules=("*.mlp", "*.self_attn"), exclude=("*.layers.1.*",)))
    assert p == {"model.layers.1.self_attn": "exclude", "model.layers.1.mlp": "exclude",
                 "model.layers.1.input_layernorm": "exclude", "model.layers.1.post_attention_layernorm": "exclude",
                 "model.layers.0.self_attn": "nvfp4", "model.layers.0.mlp": "nvfp4"}
    # "*" matches the root (""): one pair of hooks, not one per module (plus the norm layers' own)
    assert plan(m, ActivationPolicy(modules=("*",), norm_format="inherit")) == {"": "nvfp4"}
    p = plan(m, ActivationPolicy(modules=("*",), module_formats=(("*.self_attn", "mxfp8"),), norm_format="inherit"))
    assert p[""] == "nvfp4" and p["model.layers.0.self_attn"] == "mxfp8" and len(p) == 3


def test_plan_gives_norm_layers_their_format_inside_the_offloaded_part():
    m = tiny_model()
    norms = {n for n, mod in m.named_modules() if type(mod).__name__ == "LlamaRMSNorm"}
    assert len(norms) == 5
    p = plan(m, ActivationPolicy(format="mxfp8", modules=("*.mlp", "*.layers.1")))
    assert {n for n, v in p.items() if v == "bf16"} == {n for n in norms if n.startswith("model.layers.1.")}
    assert p["model.layers.1"] == "mxfp8" and p["model.layers.0.mlp"] == "mxfp8"
    assert {n for n, v in plan(m, ActivationPolicy()).items() if v == "bf16"} == norms  # whole model
    p = plan(m, ActivationPolicy(norm_format="keep"))
    assert {n for n, v in p.items() if v == "norm"} == norms
    assert set(plan(m, ActivationPolicy(norm_format="inherit")).values()) == {"nvfp4"}
    assert set(plan(m, ActivationPolicy(format="none")).values()) == {"none"}  # "none" stays exact


def test_norm_layers_without_a_model_use_the_norm_format():
    from torch.nn.modules import module as nn_module

    hooks_before = (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks))
    m = tiny_model()
    with offload_activations(P(format="mxfp8")) as off:
        assert len(nn_module._global_forward_pre_hooks) == hooks_before[0] + 1
        loss = harness.lm_loss(m, TOKENS)
    assert (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks)) == hooks_before
    fmts = {}
    for e in off._entries.values():
        fmts.setdefault(e.layout.fmt, []).append(tuple(e.layout.shape))
    # each of the 5 norms: its fp32 input (saved by pow and by mul: stored once) and its output
    assert len(fmts["bf16"]) == 10 and set(fmts["bf16"]) == {(4, 64, 64)}
    assert all(e.layout.nbytes == e.nbytes_in // 2 for e in off._entries.values() if e.layout.fmt == "bf16")
    loss.backward()
    with offload_activations(P(format="mxfp8", norm_format="keep")) as off2:
        loss2 = harness.lm_loss(m, TOKENS)  # kept, so its graph (and the stored tensors) stays
    s2 = off2.snapshot()
    assert s2["passthrough"]["norm"] >= 10 and "bf16" not in {e.layout.fmt for e in off2._entries.values()}
    with offload_activations(P(format="mxfp8", norm_format="inherit")) as off3:
        loss3 = harness.lm_loss(m, TOKENS)
    assert {e.layout.fmt for e in off3._entries.values()} == {"mxfp8"}
    del loss2, loss3


def test_patterns_that_match_nothing_are_refused():
    with pytest.raises(ConfigError, match="model.layers"):
        wrap_modules(tiny_model(), ActivationPolicy(modules=("*.feed_forward",)))


def test_mlp_yes_attention_no():
    m = tiny_model()
    mlps = [n for n, _ in m.named_modules() if n.endswith(".mlp")]
    attns = [n for n, _ in m.named_modules() if n.endswith(".self_attn")]
    expected = spy_saved_inside(m, mlps + attns)
    mlp_shapes = sorted(s for n in mlps for s in expected[n])
    assert mlp_shapes and all(expected[n] for n in attns)  # both kinds save tensors big enough

    policy = P(format="nvfp4", modules=("*.mlp",), exclude=("*.self_attn",), min_numel=MIN_NUMEL)
    ref = tiny_model()
    harness.lm_loss(ref, TOKENS).backward()
    with wrap_modules(m, policy) as w:
        loss = harness.lm_loss(m, TOKENS)
        stored = sorted(tuple(e.layout.shape) for e in w.offloader._entries.values())
        snap = w.offloader.snapshot()
        loss.backward()
    assert stored == mlp_shapes  # exactly the MLPs' saved tensors, none of attention's
    assert snap["tensors_stored"] == len(mlp_shapes)
    assert w.offloader.live_entries == 0
    errs = {n: float((p.grad - q.grad).norm() / q.grad.norm()) for (n, p), q in zip(m.named_parameters(),
                                                                                   ref.parameters())}
    # what backward computes before it reaches the last MLP uses nothing compressed: bit for bit
    assert errs["lm_head.weight"] == 0 and errs["model.norm.weight"] == 0
    assert 0 < max(errs.values()) < 0.3
    # the hooks are gone after the block: a new forward stores nothing
    before = w.offloader.snapshot()["tensors_stored"]
    harness.lm_loss(m, TOKENS)
    assert w.offloader.snapshot()["tensors_stored"] == before


def test_exclude_only_shields_attention_inside_a_whole_model_context():
    m = tiny_model()
    attn_shapes = {s for n, ss in spy_saved_inside(m, ["model.layers.0.self_attn"]).items() for s in ss}
    policy = P(format="mxfp8", exclude=("*.self_attn",), min_numel=MIN_NUMEL)
    with offload_activations(policy, model=m) as off:
        loss = harness.lm_loss(m, TOKENS)
    shapes = {tuple(e.layout.shape) for e in off._entries.values()}
    assert (4, 4, 64, 64) in attn_shapes and (4, 4, 64, 64) not in shapes  # attention probabilities stayed
    assert (4, 64, 172) in shapes  # the MLP's activations were taken
    loss.backward()
    assert off.live_entries == 0


def test_module_formats_give_attention_its_own_format():
    m = tiny_model()
    policy = ActivationPolicy(format="nvfp4", modules=("*.mlp",), module_formats=(("*.self_attn", "mxfp8"),),
                              min_numel=MIN_NUMEL)
    with offload_activations(policy, model=m) as off:
        loss = harness.lm_loss(m, TOKENS)
    fmts = {}
    for e in off._entries.values():
        fmts.setdefault(e.layout.fmt, set()).add(tuple(e.layout.shape))
    # attention's tensors and the MLP's products (SiLU's input, the gate product's operands) MXFP8; the MLP's
    # linear inputs (the down projection's: 256 tokens x 172) NVFP4
    assert (4, 4, 64, 64) in fmts["mxfp8"] and (4, 64, 172) in fmts["mxfp8"] and (256, 172) in fmts["nvfp4"], fmts
    loss.backward()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_wrapped_modules_leave_checkpointing_in_charge(reentrant):
    def build():
        m = tiny_model()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.train()
        return m

    ref = build()
    harness.lm_loss(ref, TOKENS).backward()
    m = build()
    with wrap_modules(m, P(format="none", modules=("*.mlp",), min_numel=MIN_NUMEL)) as w:
        harness.lm_loss(m, TOKENS).backward()
    for (n, p), q in zip(m.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), n
    # inside checkpointed layers nothing reaches our hooks in forward; recomputation in backward passes through
    assert w.offloader.snapshot()["tensors_stored"] == 0
