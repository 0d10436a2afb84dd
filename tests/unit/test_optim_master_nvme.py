"""FP4AdamW(master="split", state_device="nvme", nvme=NvmeOptions(master_device="nvme")): split's residual lives in
each segment file beside that segment's m and v (fp4offload/_optim/state.Residual, nvme.py), read ahead and written
behind with them.

It must train bit for bit as the fp32 master and as the residual in RAM, hold no full-size residual in RAM, keep a
failed step all or nothing, save and load the same state dict, and be refused where it does not apply. Both I/O
engines; the aio variants skip where DeepSpeed's async_io op does not load (and fail under CI)."""

import copy
import errno
import functools
import json

import pytest
import torch

from fp4offload import _metrics as metrics
from fp4offload.errors import CapacityError, ConfigError, CorruptionError
from fp4offload.formats.container import read_container, verify_container, write_container
from fp4offload._optim import SEGMENT, FP4AdamW, NvmeOptions, StepOptions, load_param_states
from fp4offload._optim import master as MW
from fp4offload._optim import nvme as nvme_mod
from fp4offload._store import engines as nvme_io
from fp4offload._store.aio import ALIGN, aio_layout
from fp4offload._optim.reference_step import packed_sizes
from fp4offload._optim.state import PACKED_KEYS, RESIDUAL_KEYS, residual_sizes
from fp4offload._optim.tiers import undo_bytes

BIG = SEGMENT + 4097  # a full segment and a partial one
ACTIVE = SEGMENT // 2  # the big tensor's elements with a gradient: the rest keep their (planted) ties, step after step


def _nvme(tmp_path, engine="threads", **kw):
    return dict(state_device="nvme", nvme_path=tmp_path, nvme=NvmeOptions(io=engine, master_device="nvme", **kw))


def _tied(p: torch.Tensor, seed: int) -> torch.Tensor:
    """fp32 values around p's bf16 ones, an eighth of them exact ties (low 17 bits 0x8000: about half of those
    round down to an even bf16 value, the odd positions)."""
    g = torch.Generator().manual_seed(seed)
    b = p.detach().reshape(-1).view(torch.int16).to(torch.int64) & 0xFFFF
    bits = (b << 16) | torch.randint(0, 1 << 16, b.shape, generator=g)
    k = torch.randint(0, b.numel(), (b.numel() // 8,), generator=g)
    bits[k] = (b[k] << 16) | 0x8000
    return MW._f32(bits)


def _groups(params):
    """The big tensor without weight decay: where its gradient is 0 its master does not move, so its ties stay."""
    return [{"params": params[-1:], "weight_decay": 0.0}, {"params": params[:-1]}]


def _residual(opt, p):
    """split's (lo, odd) of p, from RAM or read back from the files."""
    st = opt.state[p]
    if "master_lo" in st:
        return st["master_lo"], st["master_odd"]
    return opt.placement.states_and_residual(st, p)[2]


def _masters(opt, params):
    out = []
    for p in params:
        st = opt.state[p]
        out.append(st["master"].clone() if "master" in st else MW.join(p.detach().reshape(-1), *_residual(opt, p)))
    return out


def _assert_same_state_dicts(sa, sb, what=""):
    assert sa["state"].keys() == sb["state"].keys(), what
    for k, e in sa["state"].items():
        assert e.keys() == sb["state"][k].keys(), (what, k)
        for key, t in e.items():
            u = sb["state"][k][key]
            assert torch.equal(t, u) if torch.is_tensor(t) else t == u, (what, k, key)


# ---- trains bit for bit -------------------------------------------------------------------------------------

STEPS = 30


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.GELU(), torch.nn.Linear(160, 8)).to(torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _big_grads():
    """The big tensor's gradients, step by step (given, not backpropagated: cheaper); 0 past ACTIVE."""
    g = torch.zeros(STEPS, BIG, dtype=torch.bfloat16)
    g[:, :ACTIVE] = torch.randn(STEPS, ACTIVE, generator=torch.Generator().manual_seed(3)).mul_(0.01)
    return g


def _train(master: str, **kw):
    """STEPS steps of a small model plus the big tensor, from fp32 masters full of planted ties (loaded through a
    state dict: fp32 -> split writes the residual into the files); returns (losses, params, optimizer)."""
    model = _model()
    g = torch.Generator().manual_seed(1)
    params = list(model.parameters()) + [torch.nn.Parameter((torch.randn(BIG, generator=g) * 0.02).to(torch.bfloat16))]
    src = FP4AdamW(_groups(params), lr=0.0, master="fp32")
    for p in params:
        p.grad = torch.zeros_like(p)
    src.step()  # every parameter gets its state and an fp32 master
    with torch.no_grad():
        for i, p in enumerate(params):
            src.state[p]["master"].copy_(_tied(p, i))
            p.copy_(src.state[p]["master"].view(p.shape).to(torch.bfloat16))  # the parameters: the masters' rne
    sd = src.state_dict()
    for group in sd["param_groups"]:
        group["lr"] = 3e-3
    opt = FP4AdamW(_groups(params), lr=3e-3, weight_decay=0.1, master=master, **kw)
    opt.load_state_dict(sd)
    xs = torch.randn(STEPS, 16, 96, generator=g).to(torch.bfloat16)
    losses = []
    for i in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(xs[i]).float().pow(2).mean()
        loss.backward()
        params[-1].grad = _big_grads()[i]
        opt.step()
        losses.append(loss.item())
    return losses, params, opt


@functools.lru_cache(maxsize=None)
def _references():
    """The fp32-master run and split's with the residual in RAM (computed once for both engines)."""
    out = {}
    for name, master in (("fp32", "fp32"), ("split", "split")):
        losses, params, opt = _train(master)
        out[name] = losses, [p.detach().clone() for p in params], _masters(opt, params)
    return out


def test_residual_on_nvme_trains_as_the_fp32_master(tmp_path, engine):
    """30 steps, both segments of the big tensor holding odd positions all along: the same losses, bf16 weights
    and rebuilt fp32 masters as the fp32 master and as split's residual in RAM; between steps host RAM holds no
    residual of a tensor with packed states, and the files hold them."""
    ref = _references()
    losses, params, opt = _train("split", **_nvme(tmp_path, engine))
    assert opt.nvme_io == engine
    for name in ("fp32", "split"):
        want_losses, want_params, want_masters = ref[name]
        assert losses == want_losses, name
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(params, want_params)), name
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                   for a, b in zip(_masters(opt, params), want_masters)), name
    big = params[-1]
    key, vf = opt.placement.key(big), opt.state[big]["v_format"]
    per_segment = [opt.placement.store.read(key, s, n, vf)[2].odd().numel() for s, n in enumerate((SEGMENT, 4097))]
    assert min(per_segment) > 100, per_segment  # the ties kept on both sides of the segment boundary
    # RAM: only step and v_format for the tensors in files; the residuals of the small ones (fp32 states) stay
    packed = [p for p in params if "v_format" in opt.state[p]]
    assert len(packed) == 2
    for p in packed:
        held = sum(t.numel() * t.element_size() for t in opt.state[p].values() if torch.is_tensor(t))
        assert held <= 8 and "master_lo" not in opt.state[p]
    small = [p for p in params if "v_format" not in opt.state[p]]
    mb = opt.master_bytes()
    assert mb["host"] == sum(2 * p.numel() + 8 * opt.state[p]["master_odd"].numel() for p in small)
    assert mb["nvme"] == sum(2 * p.numel() + sum(-(-n // 8) for n in _segments(p.numel())) for p in packed)
    if engine == "aio":
        assert not opt.placement.store._pool_bufs._busy
    opt.close()


def _segments(n):
    return [min(n, s0 + SEGMENT) - s0 for s0 in range(0, n, SEGMENT)]


def test_reference_step_equals_the_fused_step(tmp_path):
    """The torch reference step (join, step, split per segment) reads and writes the residual in the files as the
    fused C++ step does."""
    out = []
    for backend in ("reference", "auto"):
        params = _fault_params()
        opt = _split_opt(params, step_options=StepOptions(backend=backend), **_nvme(tmp_path / backend))
        for s in range(2):
            _grads(s, params)
            opt.step()
        out.append(([p.detach().clone() for p in params], opt.state_dict()))
        opt.close()
    (pa, sa), (pb, sb) = out
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(pa, pb))
    _assert_same_state_dicts(sa, sb)


# ---- all or nothing -----------------------------------------------------------------------------------------

def _fault_params():
    g = torch.Generator().manual_seed(5)
    return [torch.nn.Parameter((torch.randn(n, generator=g) * 0.05).to(torch.bfloat16)) for n in (9000, 100, BIG)]


def _grads(step, params):
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
        if p.numel() == BIG:
            g[ACTIVE:] = 0
        p.grad = g.to(torch.bfloat16)


def _split_opt(params, **kw):
    """split over params started from tied fp32 masters with start_master (on the NVMe tier: into the files)."""
    opt = FP4AdamW(_groups(params), lr=1e-2, weight_decay=0.1, master="split", **kw)
    with torch.no_grad():
        for i, p in enumerate(params):
            h, lo, odd = MW.split(_tied(p, 10 + i))
            p.copy_(h.view(p.shape))
            opt.hooks.start_master(p, lo, odd)
    return opt


def _snapshot(opt, params):
    return [p.detach().clone() for p in params], opt.state_dict()


def _assert_same(a, b, what):
    assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a[0], b[0])), what
    _assert_same_state_dicts(a[1], b[1], what)


def _committed(opt):
    return {f.name: f.read_bytes() for f in sorted(opt.placement.store.dir.glob("*.fp4s"))}


class _RaisingHandle:
    def __init__(self, exc):
        self.exc = exc

    def sync_pwrite(self, *a):
        raise self.exc


def _failing_write(mp, engine, opt, p, seg: int, exc: BaseException):
    """The write of segment `seg` of p's new generation raises `exc` (aio: inside the transfer, after the buffer and
    the temporary file were taken, as a failing disk would)."""
    prefix = f".{opt.placement.key(p)}.s{seg:05d}.g"
    if engine == "aio":
        real = nvme_io.write_file

        def write(handle, pool, path, *a, **k):
            return real(_RaisingHandle(exc) if path.name.startswith(prefix) else handle, pool, path, *a, **k)

        mp.setattr(nvme_io, "write_file", write)
    else:
        real = nvme_io.write_container

        def write(path, *a, **k):
            if path.name.startswith(prefix):
                raise exc
            return real(path, *a, **k)

        mp.setattr(nvme_io, "write_container", write)


def test_a_failed_step_leaves_the_residual_as_before(tmp_path, engine, monkeypatch):
    """Faults in the middle of a step (a write failing for space after the big tensor's first segment went to the
    new generation, a damaged file of the tensor stepped after it, any other error from a write, no space at the
    reservation) leave parameters, residuals (read back from the files), states and committed files as before the
    step; the whole run equals the run in RAM with the failed steps skipped."""
    params = _fault_params()
    opt = _split_opt(params, **_nvme(tmp_path, engine))
    plan = ["ok", "enospc", "ok", "corrupt", "error", "reserve", "ok"]
    taken = []
    for step, kind in enumerate(plan):
        _grads(step, params)
        if kind == "ok":
            opt.step()
            taken.append(step)
            continue
        before, files = _snapshot(opt, params), _committed(opt)
        with monkeypatch.context() as mp:
            if kind == "enospc":  # the big tensor's segment 1, after its segment 0 went to the new generation
                _failing_write(mp, engine, opt, params[2], 1, OSError(errno.ENOSPC, "No space left on device"))
            elif kind == "error":  # the tensor stepped after the big one
                _failing_write(mp, engine, opt, params[0], 0, RuntimeError("injected"))
            elif kind == "reserve":
                mp.setattr(opt.placement.store, "reserve_bytes", 1 << 62)
            else:  # the big tensor is stepped first: its segments were written when this file is found damaged
                target = opt.placement.store.path(opt.placement.key(params[0]), 0)
                raw = bytearray(target.read_bytes())
                raw[len(raw) // 2] ^= 0x10
                target.write_bytes(bytes(raw))
            expected = {"enospc": CapacityError, "reserve": CapacityError, "corrupt": CorruptionError}
            with pytest.raises(expected.get(kind, RuntimeError)):
                opt.step()
        if kind == "corrupt":
            target.write_bytes(files[target.name])
        assert _committed(opt) == files, kind
        assert not list(opt.placement.store.dir.glob(".*")), kind  # no generation, reservation or temporary left
        if engine == "aio":
            assert not opt.placement.store._pool_bufs._busy
        _assert_same(before, _snapshot(opt, params), kind)
    final = _snapshot(opt, params)
    opt.close()
    _assert_same(final, _ram_run(tuple(taken)), "against the run with the failed steps skipped")


@functools.lru_cache(maxsize=None)
def _ram_run(steps):
    """The run of _split_opt in RAM taking `steps` (computed once for both engines)."""
    params = _fault_params()
    opt = _split_opt(params)
    for step in steps:
        _grads(step, params)
        opt.step()
    return _snapshot(opt, params)


# ---- state dicts, copies, conversions -----------------------------------------------------------------------

def test_state_dicts_copies_and_conversions_between_master_devices(tmp_path):
    """The state dict is the same bytes with the residual in RAM or in the files, so one saved with either loads
    into the other and gives the same run; deepcopy, a v_format change, torch AdamW's state and a kept folder
    (read_kept) work with the residual in the files."""
    pa, pb = _fault_params(), _fault_params()
    ram, disk = _split_opt(pa), _split_opt(pb, **_nvme(tmp_path / "disk"))
    for s in range(2):
        _grads(s, pa)
        _grads(s, pb)
        ram.step()
        disk.step()
    _assert_same(_snapshot(ram, pa), _snapshot(disk, pb), "after 2 steps")
    runs = []  # (optimizer, params): the originals, a copy of each, and each state dict loaded into the other form
    for opt, params, other in ((ram, pa, _nvme(tmp_path / "to-disk")), (disk, pb, {})):
        clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
        moved = FP4AdamW(_groups(clone), lr=1e-2, weight_decay=0.1, master="split", **other)
        moved.load_state_dict(opt.state_dict())
        runs += [(opt, params), (moved, clone)]
    copied = copy.deepcopy(disk)
    runs.append((copied, copied.param_groups[1]["params"] + copied.param_groups[0]["params"]))
    assert copied.placement.store.dir != disk.placement.store.dir and "master_lo" not in copied.state[runs[-1][1][2]]
    for opt, params in runs:
        opt.param_groups[1]["v_format"] = "nvfp4"  # the 9000-element tensor's states are converted once
        _grads(2, params)
        opt.step()
    first = _snapshot(*runs[0])
    for i, (opt, params) in enumerate(runs[1:]):
        _assert_same(first, _snapshot(opt, params), f"run {i + 1}")
    # torch AdamW's states, quantized once; the residual starts at zero
    out = []
    for kw in ({}, _nvme(tmp_path / "adamw")):
        params = [torch.nn.Parameter(p.detach().clone()) for p in pa[:2]]
        ta = torch.optim.AdamW(params, lr=1e-2)
        _grads(0, params)
        ta.step()
        opt = FP4AdamW(params, lr=1e-2, master="split", **kw)
        opt.load_state_dict(ta.state_dict())
        opt.step()
        out.append(_snapshot(opt, params))
    _assert_same(out[0], out[1], "from torch AdamW")
    # a kept folder lists the residuals: read_kept gives state-dict entries that load_param_states takes
    keep = FP4AdamW(_groups(pb), lr=1e-2, weight_decay=0.1, master="split", **_nvme(tmp_path / "k", keep=True))
    keep.load_state_dict(disk.state_dict())
    want = keep.state_dict()["state"]
    keys = {keep.placement.key(p): i
            for i, p in enumerate(keep.param_groups[0]["params"] + keep.param_groups[1]["params"])
            if "v_format" in keep.state[p]}
    folder = keep.placement.store.dir
    keep.close()
    kept = nvme_mod.read_kept(folder)
    assert kept.keys() == keys.keys()
    for key, entry in kept.items():
        for k in ("master_lo", "master_odd", "m_codes", "v_codes"):
            assert torch.equal(entry[k], want[keys[key]][k]), (key, k)
    again = FP4AdamW(_groups(pb), lr=1e-2, master="split")
    order = pb[2:] + pb[:2]
    assert load_param_states(again, {order[i]: kept[k] for k, i in keys.items()}) == 2
    assert all(torch.equal(_residual(again, order[i])[0], _residual(disk, order[i])[0]) for i in keys.values())
    for opt in (disk, copied):
        opt.close()


def test_grad_scale_with_the_residual_on_nvme(tmp_path):
    """hooks.scale_grad (fp32 multiply per segment) steps the same with the residual in the files as in RAM."""
    out = []
    for kw in ({}, _nvme(tmp_path)):
        params = _fault_params()[:2]
        opt = _split_opt(params, **kw)
        for s in range(3):
            _grads(s, params)
            for p in params:
                opt.hooks.scale_grad(p, torch.tensor(0.3 + 0.2 * s))
            opt.step()
        out.append(_snapshot(opt, params))
    _assert_same(out[0], out[1], "with a gradient scale")


# ---- the files ----------------------------------------------------------------------------------------------

def _header(path):
    raw = path.read_bytes()
    hlen = int.from_bytes(raw[8:16], "little")
    return 20 + hlen, json.loads(raw[20:20 + hlen])["tensors"]


def _rewrite(path, change):
    meta, t = read_container(path)
    t.pop("_pad", None)
    change(t)
    path.unlink()
    write_container(path, meta, t, fsync=False)


def test_damaged_or_missing_residual_is_refused(tmp_path, engine):
    """A changed residual byte (checksum), a segment file without the residual, one of the wrong size, odd bits past
    the segment's end: CorruptionError naming the file and the segment, the step undone; the file put back, the
    run goes on. A residual in a store that keeps none is refused too."""
    params = [torch.nn.Parameter((torch.randn(BIG) * 0.05).to(torch.bfloat16))]
    opt = FP4AdamW(params, lr=1e-2, master="split", **_nvme(tmp_path, engine))
    params[0].grad = torch.randn(BIG).to(torch.bfloat16)
    opt.step()
    key = opt.placement.key(params[0])
    target = opt.placement.store.path(key, 1)
    good = target.read_bytes()

    def flip(path):
        base, entries = _header(path)
        raw = bytearray(path.read_bytes())
        raw[base + entries["master_lo"]["offset"] + 7] ^= 0x01
        path.write_bytes(bytes(raw))

    def bits_past_end(t):
        t["master_odd_bits"] = t["master_odd_bits"].clone()
        t["master_odd_bits"][-1] |= 0x80  # 4097 elements: only bit 0 of the last byte is inside

    damages = {"checksum mismatch in tensor 'master_lo'": flip,
               "holds no split residual": lambda p: _rewrite(p, lambda t: [t.pop(k) for k in ("master_lo",
                                                                                            "master_odd_bits")]),
               "tensor 'master_lo' has the wrong size": lambda p: _rewrite(p, lambda t: t.update(
                   master_lo=t["master_lo"][:-2])),
               "odd positions past": lambda p: _rewrite(p, bits_past_end)}
    for what, damage in damages.items():
        damage(target)
        before = params[0].detach().clone()
        with pytest.raises(CorruptionError) as e:
            opt.step()
        assert what in str(e.value) and f"segment 1 of tensor {key}" in str(e.value), str(e.value)
        assert torch.equal(before, params[0].detach())
        target.write_bytes(good)
    opt.step()
    opt.close()
    plain = FP4AdamW(params, lr=1e-2, master="split", state_device="nvme", nvme_path=tmp_path,
                     nvme=NvmeOptions(io=engine))
    plain.step()
    f = plain.placement.store.path(plain.placement.key(params[0]), 1)
    _rewrite(f, lambda t: t.update(master_lo=torch.zeros(2 * 4097, dtype=torch.uint8),
                                   master_odd_bits=torch.zeros(513, dtype=torch.uint8)))
    with pytest.raises(CorruptionError, match="a split residual, which this store does not keep"):
        plain.step()
    plain.close()


def test_disk_grows_by_exactly_the_residual(tmp_path, engine):
    """Per segment of n elements the files hold 2n + ceil(n / 8) bytes more (the residual and the odd-position
    bitmap), plus the header's two entries (threads) or the padding to 4 KiB blocks (aio); the step writes and reads
    that much more, reserves at least what it writes, and its undo log no longer counts the residual."""
    sizes, moved = {}, {}
    for md in ("same", "nvme"):
        params = [torch.nn.Parameter(torch.zeros(BIG, dtype=torch.bfloat16))]
        opt = FP4AdamW(params, lr=1e-2, master="split", state_device="nvme", nvme_path=tmp_path / md,
                       nvme=NvmeOptions(io=engine, master_device=md))
        params[0].grad = torch.ones(BIG, dtype=torch.bfloat16)
        opt.step()
        counters = [metrics.counter(f"optim.nvme.bytes_{k}") for k in ("written", "read")]
        was = [c.value for c in counters]
        reserved, undo = opt.placement.step_bytes([(opt.param_groups[0], params[0], 0)], opt.state, opt.is_packed)
        assert undo == undo_bytes(params[0], *([opt.state[params[0]]["master_lo"]] if md == "same" else []))
        opt.step()
        moved[md] = [c.value - w for c, w in zip(counters, was)]
        files = opt.placement.store.files(opt.placement.key(params[0]))
        sizes[md] = [(f.stat().st_size, sum(e["nbytes"] for k, e in verify_container(f)[1].items() if k != "_pad"))
                     for f in files]
        assert reserved >= sum(s for s, _ in sizes[md])
        assert reserved == nvme_mod.tensor_disk_bytes(BIG, md == "nvme")
        opt.close()
    for n, (same, new) in zip(_segments(BIG), zip(sizes["same"], sizes["nvme"])):
        assert new[1] - same[1] == 2 * n + -(-n // 8)
        if engine == "aio":  # a 4 KiB header block, each tensor on 64 bytes, the file in whole 4 KiB blocks
            c, sc, t = packed_sizes(n)
            states = dict(zip(PACKED_KEYS, (c, sc, t) * 2))
            assert same[0] == ALIGN + aio_layout(states)[1]
            assert new[0] == ALIGN + aio_layout({**states, **dict(zip(RESIDUAL_KEYS, residual_sizes(n)))})[1]
        else:
            assert 0 < new[0] - same[0] - (2 * n + -(-n // 8)) < 400  # the two header entries
    grew = sum(new[0] - same[0] for same, new in zip(sizes["same"], sizes["nvme"]))
    assert moved["nvme"][0] - moved["same"][0] == grew and moved["nvme"][1] - moved["same"][1] == grew


# ---- refused where it does not apply ------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(master="fp32"), dict(master="bf16"), dict(state_device="cpu"),
                                dict(state_device="same"), dict(master_device="gpu")])
def test_master_device_nvme_needs_split_on_the_nvme_tier(tmp_path, kw):
    p = torch.nn.Parameter(torch.zeros(5000, dtype=torch.bfloat16))
    args = dict(master="split", state_device="nvme", nvme_path=tmp_path / "states", master_device="nvme")
    args.update(kw)
    with pytest.raises(ConfigError, match="master_device") as e:
        FP4AdamW([p], **{k: v for k, v in args.items() if k != "master_device"},
                 nvme=NvmeOptions(master_device=args["master_device"]))
    assert repr(args["master_device"]) in str(e.value)
    if args["master_device"] == "nvme":
        assert "master='split' and state_device='nvme'" in str(e.value)
    assert not (tmp_path / "states").exists()  # refused before anything was made
