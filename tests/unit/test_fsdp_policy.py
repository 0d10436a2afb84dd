"""fp4offload.fsdp without spawning ranks: the Policy, its YAML, the shard layouts, early ConfigErrors.

The layout tests cut tensors into shards exactly as FSDP2 does (dim 0 in chunks of ceil(d0/world)
rows, the last ranks zero-padded), encode each shard the way the all-gather hook does, concatenate
what an all-gather would deliver, and check the decoded whole against an independent encoding.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fp4offload
import fp4offload.fsdp as ff
from fp4offload._config import FsdpPolicyConfig, OptimizerStatesConfig, WeightsConfig
from fp4offload.errors import ConfigError
from fp4offload._fsdp import weight as fw

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------ Policy


def test_policy_defaults_are_documented_values():
    p = ff.Policy()
    # NVFP4 optimizer states only: weights and activations change the forward pass, so they are opted into
    assert p.weights is None and not p.packs_weights
    assert p.optimizer_states == OptimizerStatesConfig()
    assert p.activations is None and p.cpu_offload is False and p.reshard_after_forward is True
    assert p.param_dtype == torch.bfloat16 and p.reduce_dtype == torch.float32
    assert ff.Policy(weights=WeightsConfig()).packs_weights
    with pytest.raises(dataclasses.FrozenInstanceError):  # frozen
        p.cpu_offload = True  # type: ignore[misc]


@pytest.mark.parametrize("doc", [None, {}, {"block_classes": ["Block"]}])
def test_an_empty_policy_yaml_means_what_policy_means(doc):
    from fp4offload._config import parse_fsdp_policy

    cfg = parse_fsdp_policy(doc)
    p = ff.Policy.from_config(cfg)
    assert (p.weights, p.optimizer_states, p.activations) == (ff.Policy().weights, ff.Policy().optimizer_states, None)
    off = parse_fsdp_policy({"optimizer_states": None})  # null turns the states off, and survives a round trip
    assert off.optimizer_states is None and parse_fsdp_policy(off.to_dict()).optimizer_states is None
    assert parse_fsdp_policy(cfg.to_dict()) == cfg


def test_policy_accepts_mappings_and_names():
    p = ff.Policy(weights={"keep_bf16": ["norm"]}, block_classes="Block", param_dtype="float32")
    assert p.weights.keep_bf16 == ("norm",) and p.block_classes == ("Block",) and p.param_dtype == torch.float32
    assert not ff.Policy(weights={"format": "bf16"}).packs_weights
    assert not ff.Policy(weights=None).packs_weights


def test_policy_takes_module_classes_as_well_as_names():
    """Policy(block_classes=(MyBlock,)) as torchtitan passes them; names and classes pick the same blocks and
    the same keep_bf16 first/last blocks, and the YAML form writes names."""
    from fp4offload import _keep_bf16 as keep_bf16
    from fp4offload._fsdp.apply import _blocks

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 16)
            self.layers = nn.ModuleList(Block() for _ in range(4))

    net = Net()
    by_class, by_name = ff.Policy(block_classes=Block), ff.Policy(block_classes=("Block",))
    assert by_class.block_classes == (Block,) and ff.Policy(block_classes=[Block, "Other"]).block_classes == \
        (Block, "Other")
    blocks = _blocks(net, by_class.block_classes)
    assert [n for n, _ in blocks] == [n for n, _ in _blocks(net, by_name.block_classes)] == \
        [f"layers.{i}" for i in range(4)]
    kept = keep_bf16.kept_parameters(net, ("first:1", "last:1", "embed"), blocks)
    names = {n for n, p in net.named_parameters() if id(p) in kept}
    assert names == {"embed.weight", "layers.0.lin.weight", "layers.0.lin.bias", "layers.3.lin.weight",
                     "layers.3.lin.bias"}
    assert by_class.to_config().block_classes == ("Block",)


def test_a_keep_bf16_entry_that_names_nothing_is_refused_with_the_nearest_names():
    """A typo, or first:N past the blocks, would pack a weight meant to stay bf16: ConfigError naming the entry
    and what the model has. The generic defaults (\"bias\" in a model without biases) may name nothing."""
    from fp4offload._config import KEEP_BF16
    from fp4offload.errors import ConfigError
    from fp4offload import _keep_bf16 as keep_bf16

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Linear(16, 16, bias=False)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(8, 16)
            self.layers = nn.ModuleList(Block() for _ in range(3))

    net = Net()
    blocks = keep_bf16.find_blocks(net, ("Block",))
    with pytest.raises(ConfigError, match=r"weights.keep_bf16='embd'.*nearest names: 'embed_tokens'"):
        keep_bf16.kept_parameters(net, ("embd",), blocks)
    with pytest.raises(ConfigError, match=r"weights.keep_bf16='first:99999999999'.*at most 3.*layers.0"):
        keep_bf16.kept_parameters(net, ("first:99999999999",), blocks)
    with pytest.raises(ConfigError, match=r"'last:4'"):
        keep_bf16.kept_parameters(net, ("last:4",), blocks)
    kept = keep_bf16.kept_parameters(net, KEEP_BF16, blocks)  # no bias, no lm_head, no norm: fine
    assert {n for n, p in net.named_parameters() if id(p) in kept} == {
        "embed_tokens.weight", "layers.0.mlp.weight", "layers.2.mlp.weight"}
    assert len(keep_bf16.kept_parameters(net, ("first:3", "embed"), blocks)) == 4


@pytest.mark.parametrize("kwargs, key", [
    ({"weights": {"format": "nvfp8"}}, "weights.format"),
    ({"weights": {"device": "nvme"}}, "weights.device"),
    ({"weights": {"keep_bf16": ["first:x"]}}, "weights.keep_bf16"),
    ({"weights": {"colour": "red"}}, "weights.colour"),
    ({"optimizer_states": {"device": "gpu"}}, "optimizer_states.device"),
    ({"optimizer_states": {"device": "nvme"}}, "optimizer_states.nvme_path"),
    ({"activations": {"format": "int8"}}, "activations.format"),
    ({"cpu_offload": "yes"}, "cpu_offload"),
    ({"reshard_after_forward": 2}, "reshard_after_forward"),
    ({"block_classes": [3]}, "block_classes"),
    ({"block_classes": [int]}, "block_classes"),  # a class, but not a module class
    ({"param_dtype": torch.int8}, "param_dtype"),
    ({"weights": 5}, "weights"),
])
def test_bad_policy_values_raise_config_error_naming_the_key(kwargs, key):
    with pytest.raises(ConfigError) as e:
        ff.Policy(**kwargs)
    assert e.value.key == key, str(e.value)
    assert "expected" in str(e.value)


def test_shipped_yaml_loads_into_a_policy_and_round_trips(tmp_path):
    """configs/fsdp_fp4.yaml, and every other FSDP policy shipped in configs/ (fsdp*.yaml)."""
    paths = sorted((ROOT / "configs").glob("fsdp*.yaml"))
    assert ROOT / "configs" / "fsdp_fp4.yaml" in paths
    for path in paths:
        p = ff.policy_from_yaml(path)
        assert isinstance(p, ff.Policy), path
        assert p.block_classes and all(isinstance(c, str) for c in p.block_classes)
        cfg = p.to_config()
        assert isinstance(cfg, FsdpPolicyConfig)
        assert ff.Policy.from_config(cfg) == p
    p = ff.policy_from_yaml(ROOT / "configs" / "fsdp_fp4.yaml", param_dtype=torch.float32)
    assert (p.packs_weights and p.param_dtype == torch.float32 and p.cpu_offload is True
            and p.activations is None)  # the weights file adds the gathers only


def test_bad_yaml_raises_config_error_with_key_path(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("cpu_offload: true\nweights: {format: nvfp4, device: cpu}\noptimizer_states: {rounding: up}\n")
    with pytest.raises(ConfigError) as e:
        ff.policy_from_yaml(f)
    assert e.value.key == "optimizer_states.rounding"
    f.write_text("block_clases: [A]\n")
    with pytest.raises(ConfigError) as e:
        ff.policy_from_yaml(f)
    assert "block_classes" in str(e.value)  # the did-you-mean hint


# ------------------------------------------------------------------------------------------------ apply fails early


class _Tiny(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return self.lin(x)


class _FakeMesh:
    """Stands in for a 1-D DeviceMesh of 2 ranks: apply must fail before it ever uses it."""

    ndim = 1

    def size(self, dim=None):
        return 2

    def __getattr__(self, name):
        raise AssertionError(f"the mesh was used ({name}) before validation finished")


def test_apply_rejects_bad_input_before_touching_the_model_or_any_collective():
    """No process group exists here: reaching fully_shard or a collective would raise a different error."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    m = _Tiny()
    before = {n: type(p) for n, p in m.named_parameters()}
    with pytest.raises(ConfigError) as e:
        ff.apply(m, ff.Policy(block_classes=["NoSuchBlock"]))
    assert e.value.key == "block_classes" and "Block" in str(e.value)
    with pytest.raises(ConfigError) as e:
        ff.apply(m, ff.Policy(block_classes=lambda mod: False))
    assert e.value.key == "block_classes"
    with pytest.raises(ConfigError) as e:
        ff.apply(m, ff.Policy())  # blocks found from _no_split_modules; then: no mesh, no process group
    assert e.value.key == "mesh" and "init_process_group" in str(e.value)
    with pytest.raises(ConfigError) as e:
        ff.apply(m, "nvfp4")
    assert e.value.key == "policy"
    with pytest.raises(ConfigError):
        ff.apply(nn.Sequential(nn.Linear(2, 2)), ff.Policy())  # no _no_split_modules, no block_classes
    with pytest.raises(ConfigError) as e:  # activation patterns that match no module: found before sharding
        ff.apply(m, ff.Policy(activations={"modules": ["*.mlp"]}), mesh=_FakeMesh())
    assert "modules" in e.value.key
    assert {n: type(p) for n, p in m.named_parameters()} == before
    assert all(type(p) is nn.Parameter for p in m.parameters())


# ------------------------------------------------------------------------------------------------ layouts


def test_weight_spec_layouts():
    s = fw.WeightSpec("w", (64, 48), 2)
    assert s.rows0 == 32 and s.local_shape == (32, 48) and s.tile == 16
    assert s.packed_sizes() == (32 * 48 // 2, 2 * 3)
    s = fw.WeightSpec("w", (33, 40), 2)  # rank 0: 17 rows, rank 1: 16 (+1 zero row) -> 1x16 blocks
    assert s.rows0 == 17 and s.tile == 1 and s.packed_sizes() == (43 * 8, 43)
    s = fw.WeightSpec("w", (4, 8, 16), 2)  # 2-D view of the local shard: 2*8 = 16 rows -> tiles
    assert s.local_rows == 16 and s.tile == 16
    s = fw.WeightSpec("b", (70,), 4)
    assert s.tile == 1 and s.local_shape == (18,) and s.packed_sizes() == (16, 2)
    # 16x16: 0.5 B/element + 1/256 B/element -> 3.97x fewer bytes than bf16
    s = fw.WeightSpec("w", (4096, 4096), 8)
    data, scales = s.packed_sizes()
    assert s.local_numel * 2 / (data + scales) > 3.9


def _fsdp_chunks(x: torch.Tensor, world: int) -> list[torch.Tensor]:
    """FSDP2's dim-0 sharding: torch.chunk (empty chunks for the last ranks if needed), zero-padded."""
    rows0 = -(-x.shape[0] // world)
    out = []
    for r in range(world):
        part = x[r * rows0:(r + 1) * rows0]
        pad = x.new_zeros((rows0, *x.shape[1:]))
        pad[: part.shape[0]] = part
        out.append(pad)
    return out


def _gather_as_fsdp(x: torch.Tensor, world: int, dtype=torch.float32) -> tuple[torch.Tensor, fw.WeightSpec]:
    spec = fw.WeightSpec("w", tuple(x.shape), world)
    amax = x.abs().amax()
    bufs, tss = [], []
    for chunk in _fsdp_chunks(x, world):
        slot = fw.Slot(spec)
        slot.global_amax = float(amax)
        buf, ts = slot.packed(chunk)
        assert buf.dtype == torch.uint8 and buf.numel() == sum(spec.packed_sizes())
        bufs.append(buf)
        tss.append(ts)
    assert all(torch.equal(t, tss[0]) for t in tss)  # one tensor scale everywhere, from the global amax
    return fw.decode_gathered(spec, torch.cat(bufs), tss[0], dtype), spec


@pytest.mark.parametrize("shape, world", [((64, 48), 2), ((128, 40), 4), ((8, 4, 16), 2)])
def test_tiled_gather_equals_quantizing_the_whole_tensor(shape, world):
    torch.manual_seed(1)
    x = torch.randn(shape) * torch.logspace(-2, 1, shape[-1])
    got, spec = _gather_as_fsdp(x, world)
    assert spec.tile == 16
    want = fp4offload.dequantize(fp4offload.quantize(x.reshape(-1, shape[-1]), "nvfp4", block="16x16"))
    assert torch.equal(got.reshape(-1, shape[-1]), want)


@pytest.mark.parametrize("shape, world", [((33, 40), 2), ((3, 5), 2), ((1, 24), 2), ((70,), 4), ((17,), 2)])
def test_odd_shards_decode_to_the_per_shard_encoding_with_the_global_scale(shape, world):
    torch.manual_seed(2)
    x = torch.randn(shape)
    got, spec = _gather_as_fsdp(x, world, torch.bfloat16)
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    amax = x.abs().amax()
    parts = [fp4offload.dequantize(fp4offload.quantize(c.reshape(-1), "nvfp4", block="1x16", amax=amax))
             for c in _fsdp_chunks(x, world)]
    want = torch.cat(parts).reshape(world * spec.rows0, *shape[1:])[: shape[0]]
    assert torch.equal(got, want.bfloat16())
    err = (got.float() - x).norm() / x.norm()
    assert err < 0.2  # it is a 4-bit copy of x, not noise


def test_wrapper_acts_like_its_fp32_master():
    """Everything but the all-gather hooks unwraps: math, in-place updates (marking the pack stale), views."""
    m = torch.randn(8, 16)
    slot = fw.Slot(fw.WeightSpec("w", (8, 16), 1))
    w = fw.FP4Weight(m.clone(), slot)
    assert type(w + 1) is torch.Tensor and torch.equal(w + 1, m + 1)
    gen = slot.gen
    w.mul_(2)
    assert slot.gen > gen and torch.equal(w._master, m * 2)
    v = w.view(-1)
    assert isinstance(v, fw.FP4Weight) and v._slot is slot and v.shape == (128,)
    assert isinstance(w.detach(), fw.FP4Weight) and isinstance(w.new_zeros((2, 16)), fw.FP4Weight)
    parts = torch.chunk(w, 2)
    assert all(isinstance(p, fw.FP4Weight) for p in parts)
    assert type(w.to(torch.bfloat16)) is torch.Tensor


def test_offload_fetch_carries_only_the_packed_bytes():
    """What CPU offload copies to the device: the [codes | scales] buffer, not the fp32 shard.

    On a GPU FSDP calls ``local.to(cuda)``; here the fetch is called directly with the CPU as target.
    """
    torch.manual_seed(4)
    master = torch.randn(32, 48)
    slot = fw.Slot(fw.WeightSpec("w", (64, 48), 2))
    fw.GatherGroup([slot], None, "cpu")  # no process group: the local amax is the amax
    w = fw.FP4Weight(master, slot)
    fw.STATS.reset()
    moved = w._fetch_packed(torch.device("cpu"), non_blocking=False)
    assert moved._master is None and moved.shape == w.shape
    nd, ns = slot.spec.packed_sizes()
    st = fw.STATS.snapshot()
    assert st["h2d_packed_bytes"] == nd + ns + 4 and st["h2d_fp32_bytes"] == 32 * 48 * 4
    assert st["h2d_fp32_bytes"] / st["h2d_packed_bytes"] > 7.8
    (buf,), (spec, ts) = moved.fsdp_pre_all_gather(None)
    assert buf.numel() == nd + ns and spec is slot.spec
    with pytest.raises(RuntimeError, match="packed bytes"):
        moved + 1
    # decoding what one rank would contribute gives its shard back, to 4-bit precision
    got = fw.decode_gathered(fw.WeightSpec("w", (32, 48), 1), buf, ts, torch.float32)
    assert torch.equal(got, fp4offload.dequantize(fp4offload.quantize(master, "nvfp4", block="16x16")))


def test_convert_wraps_the_packed_weights_and_shards_nothing():
    m = _Tiny()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    out = ff.convert(m, ff.Policy(weights={"keep_bf16": []}))
    assert out is m
    fp4 = {n for n, p in m.named_parameters() if isinstance(p.data, fw.FP4Weight) or isinstance(p, fw.FP4Weight)}
    assert fp4 == {n for n, p in before.items() if p.dim() >= 1}, fp4
    assert not any(hasattr(p, "device_mesh") for p in m.parameters())
    sd = m.state_dict()  # the fp32 values, never the wrapper
    assert all(type(v) is torch.Tensor and torch.equal(v, before[k]) for k, v in sd.items())
    x = torch.randn(3, before["layers.0.lin.weight"].shape[1])
    ref = _Tiny()
    ref.load_state_dict(before)
    assert torch.equal(m(x), ref(x))  # unsharded, a wrapper computes with its fp32 values


@pytest.mark.parametrize("policy, key", [
    (ff.Policy(optimizer_states={"master": "split"}), "optimizer_states.master"),
    (ff.Policy.auto(), "policy.auto"),
])
def test_convert_refuses_what_needs_the_sharding_itself_before_changing_anything(policy, key):
    m = _Tiny()
    with pytest.raises(ConfigError) as e:
        ff.convert(m, policy)
    assert key in str(e.value) and "apply" in str(e.value)
    assert not any(isinstance(p.data, fw.FP4Weight) for p in m.parameters())


def test_convert_twice_is_refused():
    m = ff.convert(_Tiny(), ff.Policy(weights={"keep_bf16": []}))
    with pytest.raises(ConfigError, match="converted already"):
        ff.convert(m)


def test_apply_takes_torchs_policy_objects_and_refuses_a_policy_that_disagrees():
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    from fp4offload._fsdp.apply import _torch_policies

    mp, off = _torch_policies(ff.Policy(), None, None)  # from the policy's fields
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32) and type(off) is OffloadPolicy
    mine = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    mp, off = _torch_policies(ff.Policy(cpu_offload=True), mine, None)
    assert mp is mine and isinstance(off, CPUOffloadPolicy)
    given = CPUOffloadPolicy(pin_memory=False)
    assert _torch_policies(ff.Policy(), None, given)[1] is given
    with pytest.raises(ConfigError) as e:  # a field set away from its default that disagrees: named, with the fix
        _torch_policies(ff.Policy(param_dtype=torch.float16), mine, None)
    assert "policy.param_dtype" in str(e.value) and "MixedPrecisionPolicy" in str(e.value)
    with pytest.raises(ConfigError, match="policy.cpu_offload"):
        _torch_policies(ff.Policy(cpu_offload=True), None, OffloadPolicy())
    with pytest.raises(ConfigError, match="mp_policy"):
        _torch_policies(ff.Policy(), "bf16", None)
