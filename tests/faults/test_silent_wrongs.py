"""Things that used to go wrong without a sign: a damaged or re-keyed optimizer state dict, gradients whose square
overflows fp32, one Inf in a saved activation, MX values rounded up past the dtype's maximum. Each now ends in a
documented error or in the right result."""

import copy
import random

import pytest
import torch

from fp4offload import FP4AdamW, dequantize, quantize
from fp4offload._optim import StateFormat, StepOptions
from fp4offload.errors import ConfigError, CorruptionError, NonFiniteError
from fp4offload._offload import offload_activations
from fp4offload._offload.policy import ActivationPolicy
from fp4offload._optim.adamw import GRAD_LIMIT
from fp4offload._optim.convert import CHECKSUM, FINGERPRINT


def _params(shapes=((40, 32), (40,), (32, 40), (5, 3)), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


def _trained(master="fp32", dtype=torch.float32, min_numel=1):
    ps = [torch.nn.Parameter(p.detach().to(dtype)) for p in _params()]
    opt = FP4AdamW(ps, master=master, state_format=StateFormat(min_numel=min_numel))
    for i in range(2):
        g = torch.Generator().manual_seed(i)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        opt.step()
    return ps, opt


def _fresh(ps, min_numel: int, master: str = "fp32"):
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    return qs, FP4AdamW(qs, master=master, state_format=StateFormat(min_numel=min_numel))


def _snapshot(opt):
    return copy.deepcopy({id(p): {k: v for k, v in st.items()} for p, st in opt.state.items()})


# ---- the optimizer's state dict: checksums and keys -------------------------------------------------------


def test_one_flipped_byte_in_a_saved_file_is_a_corruption_error(tmp_path):
    ps, opt = _trained()
    path = tmp_path / "opt.pt"
    torch.save(opt.state_dict(), path)
    raw = bytearray(path.read_bytes())
    codes = opt.state_dict()["state"][0]["m_codes"].numpy().tobytes()
    at = raw.find(codes[:64])
    assert at > 0
    raw[at + 17] ^= 0x04
    path.write_bytes(bytes(raw))
    sd = torch.load(path, weights_only=True)  # torch.load itself reads it without complaint
    qs, fresh = _fresh(ps, min_numel=1)
    with pytest.raises(CorruptionError, match=r"state_dict\['state'\]\[0\]: checksum mismatch"):
        fresh.load_state_dict(sd)
    assert len(fresh.state) == 0  # nothing was loaded


@pytest.mark.parametrize("master,dtype,min_numel", [("fp32", torch.float32, 1), ("fp32", torch.bfloat16, 4096),
                                                    ("split", torch.bfloat16, 1)])
def test_state_dict_damage_fuzz(master, dtype, min_numel):
    """Seeded damage to every value of every entry (a flipped bit, a changed step, a changed v_format, a removed
    key): each ends in CorruptionError (or a ConfigError naming the key) and leaves the optimizer as it was."""
    ps, opt = _trained(master, dtype, min_numel)
    sd = opt.state_dict()
    rng = random.Random(16)
    qs, fresh = _fresh(ps, min_numel=min_numel, master=master)
    fresh.load_state_dict(copy.deepcopy(sd))
    before = _snapshot(fresh)
    n = 0
    for key, entry in sd["state"].items():
        for name, value in entry.items():
            if name == CHECKSUM:
                continue
            for trial in range(3):
                bad = copy.deepcopy(sd)
                e = bad["state"][key]
                if torch.is_tensor(value) and value.numel() and name != "step":
                    t = e[name].reshape(-1)
                    i = rng.randrange(t.numel())
                    if t.dtype == torch.uint8:
                        t[i] ^= 1 << rng.randrange(8)
                    else:
                        t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)[i] ^= 1 << rng.randrange(15)
                elif name == "step":
                    e[name] = e[name] + 1 + trial
                elif name == FINGERPRINT:
                    e[name] = dict(e[name], numel=e[name]["numel"] + 16 * (trial + 1))
                elif isinstance(value, str):
                    e[name] = "nvfp4" if value == "ufp4" else "ufp4"
                else:
                    continue
                if trial == 2 and name != FINGERPRINT:
                    del e[name]
                n += 1
                with pytest.raises((CorruptionError, ConfigError)) as err:
                    fresh.load_state_dict(bad)
                assert f"state_dict['state'][{key!r}]" in str(err.value)
                assert _snapshot(fresh).keys() == before.keys()
    print(f"fuzz: {n} damaged state dicts ({master}, {dtype}, min_numel={min_numel}), every one refused")
    assert n >= 30


def test_keys_are_checked_against_the_parameter_list():
    ps, opt = _trained()
    sd = opt.state_dict()
    qs, fresh = _fresh(ps, min_numel=1)
    cases = {-1: "no parameter id", 4: "no parameter id", "-1": "no parameter id"}
    for key, why in cases.items():
        bad = copy.deepcopy(sd)
        bad["state"][key] = bad["state"].pop(3)
        with pytest.raises(ConfigError, match=why) as err:
            fresh.load_state_dict(bad)
        assert repr(key) in str(err.value)
    swapped = copy.deepcopy(sd)  # parameters 0 and 2 have the same size, (40, 32) and (32, 40)
    swapped["state"][0], swapped["state"][2] = swapped["state"][2], swapped["state"][0]
    with pytest.raises(ConfigError, match=r"\[0\].*saved for parameter 2.*swapped"):
        fresh.load_state_dict(swapped)
    same_shape = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(2)]
    o2 = FP4AdamW(same_shape, state_format=StateFormat(min_numel=1))
    for p in same_shape:
        p.grad = torch.randn(8, 8)
    o2.step()
    s2 = o2.state_dict()
    s2["state"][0], s2["state"][1] = s2["state"][1], s2["state"][0]
    with pytest.raises(ConfigError, match="swapped"):
        FP4AdamW([torch.nn.Parameter(p.detach().clone()) for p in same_shape],
                 state_format=StateFormat(min_numel=1)).load_state_dict(s2)
    other = [torch.nn.Parameter(torch.randn(32, 40)), *qs[1:]]  # same numel, other shape
    with pytest.raises(ConfigError, match="another model"):
        FP4AdamW(other, state_format=StateFormat(min_numel=1)).load_state_dict(copy.deepcopy(sd))
    as_strings = copy.deepcopy(sd)  # integer keys written as strings still name their parameter
    as_strings["state"] = {str(k): v for k, v in as_strings["state"].items()}
    fresh.load_state_dict(as_strings)
    assert int(fresh.state[qs[0]]["step"]) == 2


def test_state_dicts_without_checksums_still_load_and_continue_bit_for_bit():
    ps, opt = _trained()
    sd = opt.state_dict()
    for e in sd["state"].values():
        e.pop(CHECKSUM)
        e.pop(FINGERPRINT)
    qs, fresh = _fresh(ps, min_numel=1)
    fresh.load_state_dict(sd)
    for p, q in zip(ps, qs):
        p.grad = torch.ones_like(p)
        q.grad = torch.ones_like(q)
    opt.step()
    fresh.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))


# ---- gradients whose square overflows fp32 ----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("min_numel", [1, 4096])
def test_huge_gradients_skip_the_step_like_nan(backend, min_numel):
    """|g| >= 2**64 squares past fp32's maximum: the step is skipped and counted (it used to give NaN weights on
    the reference step and silently different numbers on the fused one); just below it the step runs, finite."""
    below = torch.nextafter(torch.tensor(GRAD_LIMIT), torch.tensor(0.0)).item()
    rng = random.Random(9)
    n = 0
    for value in (GRAD_LIMIT, 1e20, 1e38, 3.4e38, -1e38, -GRAD_LIMIT, below, -below, 1e18):
        ps = _params()
        opt = FP4AdamW(ps, state_format=StateFormat(min_numel=min_numel), step_options=StepOptions(backend=backend))
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
        before = [p.detach().clone() for p in ps]
        state = _snapshot(opt)
        for p in ps:
            p.grad = torch.randn_like(p)
        p = ps[rng.randrange(len(ps))]
        p.grad.view(-1)[rng.randrange(p.numel())] = value
        opt.step()
        n += 1
        if abs(value) >= GRAD_LIMIT:
            assert opt.skipped_steps == 1, value
            assert all(torch.equal(a, b) for a, b in zip(before, ps))
            assert _snapshot(opt).keys() == state.keys()
            assert all(int(opt.state[q]["step"]) == 1 for q in ps)
        else:
            assert opt.skipped_steps == 0 and all(bool(torch.isfinite(q).all()) for q in ps), value
    print(f"fuzz: {n} gradient magnitudes at and around 2**64 ({backend}, min_numel={min_numel})")


def test_huge_gradient_norm_skips_the_step():
    ps = _params()
    opt = FP4AdamW(ps, state_format=StateFormat(min_numel=1))
    for p in ps:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in ps]
    for norm in (float("inf"), float("nan"), -1.0, GRAD_LIMIT, torch.tensor(1e30, dtype=torch.float64)):
        opt.step(grad_norm=norm)
    assert opt.skipped_steps == 5 and all(torch.equal(a, b) for a, b in zip(before, ps))
    opt.step(grad_norm=1e10)
    assert opt.skipped_steps == 5 and not torch.equal(before[0], ps[0])


# ---- one Inf in a saved activation ------------------------------------------------------------------------


def _clamped(x, spots):
    y = (x * 1.5).clone()
    with torch.no_grad():
        for i, v in spots:
            y.view(-1)[i] = v
    return torch.nn.functional.hardtanh(y, -2.0, 2.0)  # saves y; its backward masks by -2 < y < 2


@pytest.mark.parametrize("device", ["cpu", "same"])
def test_nonfinite_activation_is_kept_exact_fuzz(device):
    """Random tensors with a few +-Inf or NaN at random places: on the CPU the saved tensor is kept as is
    (counted as passed through for 'nonfinite'), so every gradient equals the uncompressed run's; tensors
    without any are still compressed."""
    rng = random.Random(5)
    n = 0
    for fmt in ("nvfp4", "mxfp4", "mxfp8"):
        for _ in range(4):
            shape = (rng.randrange(2, 9), 16 * rng.randrange(4, 40))
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(n), requires_grad=True)
            k = rng.randrange(0, 3)
            spots = [(rng.randrange(x.numel()), rng.choice([float("inf"), float("-inf"), float("nan")]))
                     for _ in range(k)]
            ref = x.detach().clone().requires_grad_()
            _clamped(ref, spots).nan_to_num().sum().backward()
            with offload_activations(ActivationPolicy(format=fmt, device=device, min_numel=16, seed=1)) as off:
                out = _clamped(x, spots)
            out.nan_to_num().sum().backward()
            snap = off.snapshot()
            n += 1
            if spots:
                assert snap["passthrough"].get("nonfinite", 0) >= 1
                assert torch.equal(x.grad, ref.grad), (fmt, shape, spots)  # no neighbour's gradient zeroed
            else:
                assert snap["tensors_stored"] >= 1 and "nonfinite" not in snap["passthrough"]
                assert not torch.equal(x.grad, ref.grad)  # compressed: the mask comes from 4/8-bit values
    print(f"fuzz: {n} activations with and without Inf/NaN ({device})")


# ---- MX values rounded up past the dtype's maximum --------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8"])
def test_mx_overflow_on_decode_raises_under_raise_fuzz(backend, fmt):
    """Finite inputs near the dtype's maximum: quantize(nonfinite='raise') raises NonFiniteError when some
    would decode to Inf, else every decoded value is finite; 'propagate' keeps the bytes (and the Inf)."""
    rng = random.Random(3)
    n = raised = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        top = torch.finfo(dtype).max
        for _ in range(12):
            scale = rng.choice([1.0, 0.999, 0.97, 0.9, 0.75, 0.5, 1e-3])
            x = (torch.rand(rng.randrange(1, 200), generator=torch.Generator().manual_seed(n)) * 2 - 1)
            x = (x * top * scale).clamp(-top, top).to(dtype)
            n += 1
            try:
                q = quantize(x, fmt)
            except NonFiniteError as e:
                raised += 1
                assert "rounds up to Inf" in str(e) and e.count > 0
                d = dequantize(quantize(x, fmt, nonfinite="propagate"))
                assert int((~torch.isfinite(d)).sum()) == e.count  # the same bytes, decoded
                continue
            assert bool(torch.isfinite(dequantize(q)).all()), (dtype, scale)
    print(f"fuzz: {n} near-maximum MX inputs ({fmt}), {raised} raised NonFiniteError, the rest decoded finite")
    assert raised > 0
