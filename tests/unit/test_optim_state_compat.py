"""FP4AdamW's state dict keeps its format: the keys, dtypes, shapes and bytes that saved files hold.

The layout below is written out by hand (each entry's keys in order, each tensor's dtype and size, the groups'
keys, the checksum rule), and the digests are those of the state dicts, parameters and next steps of the same
runs made by the optimizer before its code was split into rooms: a change of the format or of a single bit of
the step fails here. A state dict rebuilt in this form loads and continues bit for bit as the original optimizer
does.
"""

from __future__ import annotations

import hashlib
import json
import zlib

import pytest
import torch

from fp4offload._optim import FP4AdamW, StateFormat, StepOptions

SHAPES = [(70, 100), (5000,), (3, 5), (2500, 2)]

#: name -> (FP4AdamW keywords, parameter dtype)
CONFIGS = {
    "default": ({}, torch.float32),
    "split": ({"master": "split"}, torch.bfloat16),
    "bf16": ({"master": "bf16"}, torch.bfloat16),
    "fp32_master_bf16_param": ({}, torch.bfloat16),
    "ufp4": ({"state_format": StateFormat(v_format="ufp4")}, torch.float32),
    "nvfp4": ({"state_format": StateFormat(v_format="nvfp4")}, torch.float32),
    "nearest": ({"state_format": StateFormat(m_rounding="nearest", v_rounding="nearest")}, torch.float32),
    "cpu": ({"state_device": "cpu"}, torch.float32),
    "small_fp32": ({"state_format": StateFormat(min_numel=10**9)}, torch.float32),
    "split_small": ({"master": "split", "state_format": StateFormat(min_numel=10**9)}, torch.bfloat16),
    "reference": ({"state_format": StateFormat(seed=7), "step_options": StepOptions(backend="reference")},
                  torch.float32),
}

#: sha256 of (state dict, parameters, the next step's parameters and state dict), as the format was pinned
DIGESTS = {
    "bf16": "67fbb7dcb0f1623d30ab8292eddf9fab104b3bfebe8bf3b105ff4965606c1b90",
    "cpu": "796e964ee1b8b20939804c1b0a90524243cc81d3a1affb495b1d4a06e051edfe",
    "default": "796e964ee1b8b20939804c1b0a90524243cc81d3a1affb495b1d4a06e051edfe",
    "fp32_master_bf16_param": "64d026a654bc9f9cbfd8017a8d2fe867e1c95da5eff8cde2fe5e3d20b071fdd6",
    "nearest": "71418284e0a60ebe5498be9b9c572ec0734ca53537a8ae78d3726a42bda0aade",
    "nvfp4": "4b39c5d4951957b4548bc3198d392febe70b6655b346d4ef32ec6681110629e6",
    "reference": "c57be1cc7c1869664e2889741bb09c7fe14ac4b0f63858cce2fdb05b3e5774a4",
    "small_fp32": "00f13bc1b6f8604143b654d9abb2801e08f560b4fef49d2657479703f2f2727a",
    "split": "4fd4786ab24623a291ac9f5d01661a832721265da10def809905476051421a0c",
    "split_small": "733a9e673dfdbdbcc5e8e331bb9afefa1582ea97208a2ff43fca2b4a30d36c1c",
    "ufp4": "43062d8d762958fec783fab90f9f02cd4828a9422d5066f9caad1413ba459da1",
}

GROUP_KEYS = ["lr", "betas", "eps", "weight_decay", "maximize", "m_rounding", "v_rounding", "v_format", "min_numel",
              "seed", "params"]
PACKED = ["m_codes", "m_scales", "m_tscale", "v_codes", "v_scales", "v_tscale"]
#: numel -> the uint8 sizes of (codes, block scales, chunk scales): 8 bytes per block of 16, one E4M3 scale per
#: block, 4 bytes (one fp32) per chunk of 1024
PACKED_SIZES = {7000: (3504, 438, 28), 5000: (2504, 313, 20)}


def _params(dtype):
    g = torch.Generator().manual_seed(1)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.1).to(dtype)) for s in SHAPES]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]


def _optimizer(params, kw):
    return FP4AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}], lr=1e-2, **kw)


def _step(opt, params, step):
    for p, g in zip(params, _grads(params, step)):
        p.grad = g
    opt.step()


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _digest(sd, before, after, sd_after) -> str:
    h = hashlib.sha256()
    for d in (sd, sd_after):
        h.update(json.dumps(d["param_groups"], sort_keys=True, default=str).encode())
        for i in sorted(d["state"]):
            for k, v in d["state"][i].items():
                h.update(str(k).encode())
                h.update(_bytes(v) if torch.is_tensor(v) else json.dumps(v, sort_keys=True).encode())
    for t in (*before, *after):
        h.update(_bytes(t))
    return h.hexdigest()


def _layout(name: str, i: int, p) -> list[tuple[str, object]]:
    """Entry `i`'s keys in order, each with (dtype, shape) for a tensor, the type for other values."""
    kw, dtype = CONFIGS[name]
    fmt = kw.get("state_format", StateFormat())
    master = kw.get("master", "fp32")
    n = p.numel()
    out: list[tuple[str, object]] = [("step", (torch.float32, ()))]
    if master == "fp32" and dtype != torch.float32:
        out.append(("master", (torch.float32, (n,))))
    if master == "split":
        # the int16 residual and the int64 odd positions, as bytes (this run's one odd position: entry 3, packed)
        odd = 8 if (i == 3 and n >= fmt.min_numel) else 0
        out += [("master_lo", (torch.uint8, (2 * n,))), ("master_odd", (torch.uint8, (odd,)))]
    if n >= fmt.min_numel:
        out.append(("v_format", str))
        out += [(k, (torch.uint8, (size,))) for k, size in zip(PACKED, PACKED_SIZES[n] * 2)]
    else:
        out += [("exp_avg", (torch.float32, tuple(p.shape))), ("exp_avg_sq", (torch.float32, tuple(p.shape)))]
    return out + [("fingerprint", dict), ("checksum", int)]


def _checksum(entry) -> int:
    """The entry's CRC-32 by the saved rule: every key but the checksum, sorted, each followed by its value (byte
    tensors as bytes, other tensors as fp32, the step as its integer, the fingerprint as sorted JSON)."""
    crc = 0
    for k in sorted(k for k in entry if k != "checksum"):
        v = entry[k]
        crc = zlib.crc32(k.encode(), crc)
        if k == "step":
            data = str(int(float(v))).encode()
        elif torch.is_tensor(v):
            data = _bytes(v if v.dtype == torch.uint8 else v.reshape(-1).to(torch.float32))
        elif isinstance(v, dict):
            data = json.dumps(v, sort_keys=True).encode()
        else:
            data = repr(v).encode()
        crc = zlib.crc32(data, crc)
    return crc


def _saved_form(sd) -> dict:
    """The state dict rebuilt from the pinned layout alone: the groups' keys, each entry's keys, fresh tensors."""
    groups = [{k: list(g[k]) if k == "params" else g[k] for k in GROUP_KEYS} for g in sd["param_groups"]]
    state = {}
    for i, e in sd["state"].items():
        state[i] = {k: (v.clone() if torch.is_tensor(v) else json.loads(json.dumps(v))) for k, v in e.items()}
    return {"state": state, "param_groups": groups}


def _same(a, b, where=""):
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape, where
        assert _bytes(a) == _bytes(b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_state_dict_keeps_the_saved_format_and_bits(name):
    kw, dtype = CONFIGS[name]
    params = _params(dtype)
    opt = _optimizer(params, kw)
    for s in range(3):
        _step(opt, params, s)
    sd = opt.state_dict()
    before = [p.detach().clone() for p in params]

    # the layout, key by key
    assert [list(g) for g in sd["param_groups"]] == [GROUP_KEYS, GROUP_KEYS]
    assert [g["params"] for g in sd["param_groups"]] == [[0, 1], [2, 3]]
    assert list(sd) == ["state", "param_groups"] and list(sd["state"]) == [0, 1, 2, 3]
    for i, p in enumerate(params):
        entry = sd["state"][i]
        want = _layout(name, i, p)
        assert list(entry) == [k for k, _ in want], (i, list(entry))
        for k, spec in want:
            v = entry[k]
            if isinstance(spec, tuple):
                assert torch.is_tensor(v) and (v.dtype, tuple(v.shape)) == spec, (i, k, v.dtype, tuple(v.shape))
            else:
                assert isinstance(v, spec) and not isinstance(v, bool), (i, k, type(v))
        assert entry["fingerprint"] == {"index": i, "shape": list(p.shape), "numel": p.numel(),
                                        "master": "fp32" if "master" in entry else "split" if "master_lo" in entry
                                        else "none"}
        assert entry["checksum"] == _checksum(entry), i
        assert float(entry["step"]) == 3.0

    # the next step, from the live optimizer and from the state dict rebuilt in the saved form
    saved = _saved_form(sd)
    _step(opt, params, 3)
    after, sd_after = [p.detach().clone() for p in params], opt.state_dict()
    qs = [torch.nn.Parameter(t.clone()) for t in before]
    loaded = _optimizer(qs, kw)
    loaded.load_state_dict(saved)
    _step(loaded, qs, 3)
    _same(after, [q.detach() for q in qs], "params")
    _same(sd_after, loaded.state_dict(), "state_dict")
    assert _digest(sd, before, after, sd_after) == DIGESTS[name]
