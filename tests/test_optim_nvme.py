"""The NVMe tier: states in files, identical training, damage detected, a full disk refused safely."""

import os
import shutil
import subprocess
import uuid

import pytest
import torch

from fp4offload import FP4AdamW
from fp4offload.errors import CapacityError, CorruptionError
from fp4offload.optim import SEGMENT


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


def test_nvme_tier_trains_like_ram(tmp_path):
    """A multi-segment parameter with states on disk ends bit-identical to the same run in RAM; files are 0600."""
    pa, pb = _params(), _params()
    ram = FP4AdamW(pa, lr=1e-2, m_rounding="stochastic")
    disk = FP4AdamW(pb, lr=1e-2, m_rounding="stochastic", state_device="nvme", nvme_path=tmp_path)
    _train(ram, pa, 3)
    _train(disk, pb, 3)
    for a, b in zip(pa, pb):
        assert torch.equal(a.detach(), b.detach())
    files = sorted(disk._nvme.dir.glob("*.fp4s"))
    assert len(files) == 4  # 3 segments of the big tensor + 1 of the 9000-element one; the small one is fp32
    assert all((f.stat().st_mode & 0o777) == 0o600 for f in files)
    assert (disk._nvme.dir.stat().st_mode & 0o777) == 0o700
    assert disk.state_bytes()["host"] < 9000 * 8  # the packed states are not in RAM
    sa, sb = ram.state_dict(), disk.state_dict()
    for k in sa["state"]:
        for key, t in sa["state"][k].items():
            if torch.is_tensor(t):
                assert torch.equal(t, sb["state"][k][key])
    disk.close()
    assert not files[0].parent.exists()


def _damaged_run(tmp_path, damage):
    params = _params()
    opt = FP4AdamW(params, lr=1e-2, state_device="nvme", nvme_path=tmp_path)
    _train(opt, params, 1)
    target = opt._nvme.path(0, 1)  # segment 1 of parameter 0
    damage(target)
    after_damage = target.read_bytes() if target.exists() else None
    with pytest.raises(CorruptionError) as e:
        _train(opt, params, 1, start=1)
    msg = str(e.value)
    assert target.name in msg and "segment 1 of parameter 0" in msg, msg
    # nothing was written over the damaged file
    assert (target.read_bytes() if target.exists() else None) == after_damage
    opt.close()
    return msg


def test_corrupt_byte_is_detected(tmp_path):
    def flip(path):
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x40
        path.write_bytes(bytes(raw))

    assert "checksum" in _damaged_run(tmp_path, flip)


def test_truncated_file_is_detected(tmp_path):
    def truncate(path):
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 100)

    assert "truncated" in _damaged_run(tmp_path, truncate)


def test_missing_file_is_detected(tmp_path):
    assert "missing" in _damaged_run(tmp_path, lambda p: p.unlink())


def test_reserve_makes_the_disk_full_before_anything_is_written(tmp_path):
    """With less free space than one step needs, the tier raises CapacityError and leaves the old files whole."""
    params = _params()
    opt = FP4AdamW(params, lr=1e-2, state_device="nvme", nvme_path=tmp_path)
    _train(opt, params, 1)
    before = {f.name: f.read_bytes() for f in opt._nvme.dir.glob("*.fp4s")}
    opt._nvme.reserve_bytes = shutil.disk_usage(tmp_path).free - 1000  # leave the tier 1000 bytes
    with pytest.raises(CapacityError) as e:
        _train(opt, params, 1, start=1)
    assert "NVMe optimizer states" in str(e.value)
    assert {f.name: f.read_bytes() for f in opt._nvme.dir.glob("*.fp4s")} == before
    opt.close()


def test_real_full_disk(tmp_path):
    """A real, small tmpfs: creating the states does not fit and raises CapacityError (needs mount rights)."""
    mnt = tmp_path / f"tiny-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        params = _params()  # ~2.4 MB of packed state: does not fit in 1 MiB
        opt = FP4AdamW(params, lr=1e-2, state_device="nvme", nvme_path=mnt)
        with pytest.raises(CapacityError):
            _train(opt, params, 1)
        # a tier that fits starts, then the disk fills behind its back: writes fail with ENOSPC -> CapacityError
        small = [torch.nn.Parameter(torch.randn(SEGMENT // 8))]
        opt2 = FP4AdamW(small, lr=1e-2, state_device="nvme", nvme_path=mnt)
        _train(opt2, small, 1)
        f = next(opt2._nvme.dir.glob("*.fp4s"))
        before = f.read_bytes()
        filler = mnt / "filler"
        with open(filler, "wb") as fh:
            try:
                while True:
                    fh.write(b"\0" * 65536)
            except OSError:
                pass
        opt2._nvme.reserve_bytes = -(1 << 30)  # pretend there is room: the write itself must fail safely
        with pytest.raises(CapacityError):
            _train(opt2, small, 1, start=1)
        assert f.read_bytes() == before
        assert not list(opt2._nvme.dir.glob(".*tmp*"))
        opt.close()
        opt2.close()
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
        os.rmdir(mnt)
