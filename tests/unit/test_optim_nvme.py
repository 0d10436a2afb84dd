"""The NVMe tier: states in files, identical training, damage detected, a full disk refused safely.

Every behaviour is checked with both I/O engines: the thread pool (buffered I/O through the container module)
and DeepSpeed's async_io handle (O_DIRECT); the aio variants skip, saying why, where that op does not load.
"""

import errno
import os
import shutil
import subprocess
import uuid

import pytest
import torch

from fp4offload import FP4AdamW
from fp4offload._optim import NvmeOptions, StateFormat, StepOptions
from fp4offload.errors import CapacityError, ConfigError, CorruptionError
from fp4offload.formats.container import read_container
from fp4offload._optim import SEGMENT
from helpers.extensions import LIBAIO_FIX, skip_or_fail
from fp4offload._optim import nvme as nvme_mod
from fp4offload._store import engines as nvme_io

ENGINES = ("threads", "aio")


def _params(seed=0):
    torch.manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(2 * SEGMENT + 3000) * 0.1), torch.nn.Parameter(torch.randn(9000)),
            torch.nn.Parameter(torch.randn(100))]


def _grad(step, p, i):
    g = torch.Generator().manual_seed(1000 * step + i)
    return torch.randn(p.shape, generator=g)


def _train(opt, params, steps, start=0):
    for s in range(start, start + steps):
        for i, p in enumerate(params):
            p.grad = _grad(s, p, i) + 0.1 * p.detach()
        opt.step()


def _disk(params, tmp_path, engine, threads=4, **kw):
    opt = FP4AdamW(params, lr=1e-2, state_device="nvme", nvme_path=tmp_path,
                   nvme=NvmeOptions(io=engine, threads=threads), **kw)
    assert opt.nvme_io == engine
    return opt


def _assert_same_state_dicts(sa, sb):
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        for key, t in sa["state"][k].items():
            if torch.is_tensor(t):
                assert torch.equal(t, sb["state"][k][key]), (k, key)


def test_nvme_tier_trains_like_ram(tmp_path, engine):
    """A multi-segment parameter with states on disk ends bit-identical to the same run in RAM; files are 0600."""
    pa, pb = _params(), _params()
    ram = FP4AdamW(pa, lr=1e-2, state_format=StateFormat(m_rounding="stochastic"))
    disk = _disk(pb, tmp_path, engine, threads=2, state_format=StateFormat(m_rounding="stochastic"))
    _train(ram, pa, 4)
    _train(disk, pb, 4)
    for a, b in zip(pa, pb):
        assert torch.equal(a.detach(), b.detach())
    files = sorted(disk.placement.store.dir.glob("*.fp4s"))
    assert len(files) == 4  # 3 segments of the big tensor + 1 of the 9000-element one; the small one is fp32
    assert [f.name for f in disk.placement.store.files(disk.placement.key(pb[0]))] == [f.name for f in files[:3]]
    assert all((f.stat().st_mode & 0o777) == 0o600 for f in files)
    assert (disk.placement.store.dir.stat().st_mode & 0o777) == 0o700
    assert not list(disk.placement.store.dir.glob(".*"))  # no temporary or probe files left
    assert disk.state_bytes()["host"] < 9000 * 8  # the packed states are not in RAM
    for f in files:  # either engine writes a container the container module reads
        meta, t = read_container(f)
        assert meta["kind"] == nvme_mod.KIND and t["m_codes"].dtype == torch.uint8
    if engine == "aio":
        assert all(f.stat().st_size % nvme_mod.ALIGN == 0 for f in files)  # whole direct-I/O blocks
        assert not disk.placement.store._pool_bufs._busy  # every buffer read went back with its write
    _assert_same_state_dicts(ram.state_dict(), disk.state_dict())
    disk.close()
    assert not files[0].parent.exists()


def test_state_dict_round_trip_across_engines(tmp_path, engine):
    """A state dict saved from one engine loads into the other and training continues bit-identically."""
    other = "threads" if engine == "aio" else "aio"
    if other == "aio" and nvme_mod.aio_op()[0] is None:
        skip_or_fail(f"DeepSpeed's async_io op does not load here; install it: {LIBAIO_FIX}")
    pa, pb = _params(), _params()
    a = _disk(pa, tmp_path / "a", engine)
    _train(a, pa, 2)
    sd = a.state_dict()
    with torch.no_grad():
        for x, y in zip(pa, pb):
            y.copy_(x)
    b = _disk(pb, tmp_path / "b", other)
    b.load_state_dict(sd)
    _train(a, pa, 2, start=2)
    _train(b, pb, 2, start=2)
    for x, y in zip(pa, pb):
        assert torch.equal(x.detach(), y.detach())
    a.close()
    b.close()


def _damaged_run(tmp_path, engine, damage, seg=1):
    params = _params()
    opt = _disk(params, tmp_path, engine)
    _train(opt, params, 1)
    key = opt.placement.key(params[0])
    target = opt.placement.store.path(key, seg)  # a segment of parameter 0
    damage(target)
    after_damage = target.read_bytes() if target.exists() else None
    with pytest.raises(CorruptionError) as e:
        _train(opt, params, 1, start=1)
    msg = str(e.value)
    assert target.name in msg and f"segment {seg} of tensor {key}" in msg, msg
    assert str(e.value.path) == str(target)
    # nothing was written over the damaged file
    assert (target.read_bytes() if target.exists() else None) == after_damage
    opt.close()
    return msg


def _flip(at):
    def flip(path):
        raw = bytearray(path.read_bytes())
        raw[at(len(raw))] ^= 0x40
        path.write_bytes(bytes(raw))

    return flip


def test_corrupt_byte_is_detected(tmp_path, engine):
    assert "checksum mismatch in tensor" in _damaged_run(tmp_path, engine, _flip(lambda n: n // 2))


def test_corrupt_header_is_detected(tmp_path, engine):
    assert "header checksum" in _damaged_run(tmp_path, engine, _flip(lambda n: 30))  # inside the JSON header


@pytest.mark.parametrize("where, what", [(lambda n: 4096 + 1510, "non-zero bytes between tensors"),
                                         (lambda n: n - 1, "checksum mismatch in tensor '_pad'")])
def test_aio_gaps_and_tail_are_checked(tmp_path, where, what):
    """An aio file has zero gaps between its tensors and a zero tail tensor: a byte changed there is caught too.

    The last segment of parameter 0 holds 3000 elements: m_codes is 1500 bytes, m_scales starts at 1536.
    """
    op, why = nvme_mod.aio_op()
    if op is None:
        skip_or_fail(f"DeepSpeed's async_io op does not load here ({why}); install it: {LIBAIO_FIX}")
    assert what in _damaged_run(tmp_path, "aio", _flip(where), seg=2)


def test_truncated_file_is_detected(tmp_path, engine):
    def truncate(path):
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 100)

    assert "truncated" in _damaged_run(tmp_path, engine, truncate)


def test_block_truncated_file_is_detected(tmp_path, engine):
    """Cut by a whole 4 KiB block: the aio engine reads it directly and must still see the loss."""
    def truncate(path):
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 4096)

    assert "truncated" in _damaged_run(tmp_path, engine, truncate)


def test_missing_file_is_detected(tmp_path, engine):
    assert "missing" in _damaged_run(tmp_path, engine, lambda p: p.unlink())


def test_reserve_makes_the_disk_full_before_anything_is_written(tmp_path, engine):
    """With less free space than one step needs, the tier raises CapacityError and leaves the old files whole."""
    params = _params()
    opt = _disk(params, tmp_path, engine)
    _train(opt, params, 1)
    before = {f.name: f.read_bytes() for f in opt.placement.store.dir.glob("*.fp4s")}
    # reserve the whole disk (not "free minus a little": other processes change the free space meanwhile)
    opt.placement.store.reserve_bytes = shutil.disk_usage(tmp_path).total
    with pytest.raises(CapacityError) as e:
        _train(opt, params, 1, start=1)
    assert "NVMe optimizer states" in str(e.value)
    assert {f.name: f.read_bytes() for f in opt.placement.store.dir.glob("*.fp4s")} == before
    opt.close()


def test_write_failing_for_space_keeps_the_old_file(tmp_path, engine, monkeypatch):
    """The disk fills between the space check and the write: CapacityError, old files whole, no temporaries."""
    params = _params()
    opt = _disk(params, tmp_path, engine)
    _train(opt, params, 1)
    before = {f.name: f.read_bytes() for f in opt.placement.store.dir.glob("*.fp4s")}

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    if engine == "aio":
        monkeypatch.setattr(os, "posix_fallocate", full)  # the aio write preallocates its temporary
    else:
        monkeypatch.setattr(nvme_io, "write_container", full)  # (a real ENOSPC mid-write: test_real_full_disk)
    with pytest.raises(CapacityError) as e:
        _train(opt, params, 1, start=1)
    assert "ENOSPC" in str(e.value) and "previous state file is intact" in str(e.value)
    assert {f.name: f.read_bytes() for f in opt.placement.store.dir.glob("*.fp4s")} == before
    assert not list(opt.placement.store.dir.glob(".*tmp*"))
    monkeypatch.undo()
    opt.close()


def test_real_full_disk(tmp_path, engine):
    """A real, small tmpfs: creating the states does not fit and raises CapacityError (needs mount rights)."""
    mnt = tmp_path / f"tiny-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        params = _params()  # ~2.4 MB of packed state: does not fit in 1 MiB
        opt = _disk(params, mnt, engine)
        with pytest.raises(CapacityError):
            _train(opt, params, 1)
        # a tier that fits starts, then the disk fills behind its back: writes fail with ENOSPC -> CapacityError
        small = [torch.nn.Parameter(torch.randn(SEGMENT // 8))]
        opt2 = _disk(small, mnt, engine)
        _train(opt2, small, 1)
        f = next(opt2.placement.store.dir.glob("*.fp4s"))
        before = f.read_bytes()
        filler = mnt / "filler"
        with open(filler, "wb") as fh:
            try:
                while True:
                    fh.write(b"\0" * 65536)
            except OSError:
                pass
        opt2.placement.store.reserve_bytes = -(1 << 30)  # pretend there is room: the write itself must fail safely
        with pytest.raises(CapacityError):
            _train(opt2, small, 1, start=1)
        assert f.read_bytes() == before
        assert not list(opt2.placement.store.dir.glob(".*tmp*"))
        opt.close()
        opt2.close()
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
        os.rmdir(mnt)


# ---- keys: files follow tensors, not positions ---------------------------------------------------------------


def _subgroup_run(opt, flats, steps):
    """What DeepSpeed ZeRO-3 does: one param group, each sub-group's flat tensor put in alone for its step."""
    group = opt.param_groups[0]
    for s in range(steps):
        for i in (1, 0, 2) if s % 2 else (0, 1, 2):  # any order: the files follow the tensors
            flats[i].grad = _grad(s, flats[i], i)
            group["params"] = [flats[i]]
            opt.step()
        group["params"] = []


def test_sub_groups_stepped_one_at_a_time_keep_their_own_files(tmp_path, engine):
    def flats():
        torch.manual_seed(1)
        return [torch.randn(n) * 0.1 for n in (SEGMENT + 5000, 70_000, 9000)]

    fa, fb = flats(), flats()
    for i, (ta, tb) in enumerate(zip(fa, fb)):
        ta.ds_id = tb.ds_id = f"{10 * i}_{10 * i + 3}"  # as DeepSpeed names its fp32 sub-group partitions
    key = lambda t: getattr(t, "ds_id", None)  # noqa: E731 - also picks each tensor's random stream
    ram = FP4AdamW([{"params": []}], lr=1e-2, step_options=StepOptions(tensor_key=key))
    disk = FP4AdamW([{"params": []}], lr=1e-2, state_device="nvme", nvme_path=tmp_path, nvme=NvmeOptions(io=engine),
                    step_options=StepOptions(tensor_key=key))
    _subgroup_run(ram, fa, 3)
    _subgroup_run(disk, fb, 3)
    for a, b in zip(fa, fb):
        assert torch.equal(a, b)
    assert sorted(f.name for f in disk.placement.store.dir.glob("*.fp4s")) == [
        "k0_3.s00000.fp4s", "k0_3.s00001.fp4s", "k10_13.s00000.fp4s", "k20_23.s00000.fp4s"]
    # DeepSpeed saves with every flat in the group: the state dict reads each tensor's own files
    ram.param_groups[0]["params"], disk.param_groups[0]["params"] = fa, fb
    _assert_same_state_dicts(ram.state_dict(), disk.state_dict())
    # a re-created tensor with the same ds_id finds the same files after load_state_dict
    sd = disk.state_dict()
    fresh = [t.clone() for t in fb]
    for i, t in enumerate(fresh):
        t.ds_id = fb[i].ds_id
    disk.param_groups[0]["params"] = fresh
    disk.load_state_dict(sd)
    assert len(list(disk.placement.store.dir.glob("*.fp4s"))) == 4
    disk.param_groups[0]["params"] = []
    ram.param_groups[0]["params"] = []
    _subgroup_run(ram, fa, 1)
    _subgroup_run(disk, fresh, 1)
    for a, b in zip(fa, fresh):
        assert torch.equal(a, b)
    disk.close()


def test_two_live_tensors_cannot_share_a_key(tmp_path):
    a, b = torch.nn.Parameter(torch.randn(5000)), torch.nn.Parameter(torch.randn(5000))
    opt = FP4AdamW([a, b], state_device="nvme", nvme_path=tmp_path, nvme=NvmeOptions(io="threads"),
                   step_options=StepOptions(tensor_key=lambda t: "same"))
    a.grad, b.grad = torch.randn(5000), torch.randn(5000)
    with pytest.raises(ConfigError) as e:
        opt.step()
    assert e.value.key == "step_options.tensor_key"
    opt.close()


def test_odd_keys_are_made_safe_file_names(tmp_path):
    a = torch.nn.Parameter(torch.randn(5000))
    a.grad = torch.randn(5000)
    opt = FP4AdamW([a], state_device="nvme", nvme_path=tmp_path, nvme=NvmeOptions(io="threads"),
                   step_options=StepOptions(tensor_key=lambda t: "../x y"))
    opt.step()
    (f,) = opt.placement.store.dir.glob("*.fp4s")
    assert f.parent == opt.placement.store.dir and "/" not in opt.placement.key(a) and " " not in f.name
    opt.close()


# ---- engine choice -------------------------------------------------------------------------------------------


def test_engine_choice(tmp_path, monkeypatch):
    with pytest.raises(ConfigError) as e:
        FP4AdamW([torch.nn.Parameter(torch.randn(8))], state_device="nvme", nvme_path=tmp_path,
                 nvme=NvmeOptions(io="spdk"))
    assert e.value.key == "nvme.io"
    monkeypatch.setattr(nvme_io, "aio_op", lambda: (None, "ImportError: no deepspeed"))
    monkeypatch.setattr(nvme_io, "_warned", False)
    p = torch.nn.Parameter(torch.randn(8))
    with pytest.warns(RuntimeWarning, match="no deepspeed"):
        opt = FP4AdamW([p], state_device="nvme", nvme_path=tmp_path, nvme=NvmeOptions(io="auto"))
    assert opt.nvme_io == "threads" and opt.placement.store.io_reason == "ImportError: no deepspeed"
    opt.close()
    with pytest.raises(ConfigError, match="no deepspeed") as e:
        FP4AdamW([p], state_device="nvme", nvme_path=tmp_path, nvme=NvmeOptions(io="aio"))
    assert e.value.key == "nvme_io"
    assert sorted(os.listdir(tmp_path)) == []  # the refused store left no folder behind


def test_auto_picks_aio_when_it_loads(tmp_path):
    if nvme_mod.aio_op()[0] is None:
        skip_or_fail(f"DeepSpeed's async_io op does not load here ({nvme_mod.aio_op()[1]}); install it: {LIBAIO_FIX}")
    opt = FP4AdamW([torch.nn.Parameter(torch.randn(8))], state_device="nvme", nvme_path=tmp_path)
    assert opt.nvme_io == "aio" and opt.placement.store.io_reason is None
    opt.close()


def test_write_behind_is_bounded(tmp_path, engine):
    """However many segments a parameter has, at most max_pending_writes writes wait at once."""
    p = torch.nn.Parameter(torch.randn(6 * SEGMENT) * 0.1)
    opt = _disk([p], tmp_path, engine, threads=1)
    store = opt.placement.store
    seen = []
    orig = store._write

    def slow_write(*a):
        seen.append(sum(1 for f in store._pending if not f.done()))
        return orig(*a)

    store._write = slow_write
    p.grad = torch.randn_like(p)
    opt.step()
    opt.step()
    assert max(seen) <= store.max_pending_writes == 2
    if engine == "aio":
        assert len(store._pool_bufs._all) <= store.max_pending_writes + 4 + 2  # + the probe's two blocks
    opt.close()
