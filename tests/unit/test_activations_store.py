"""Where offloaded activations live: the bounded host slab pool and the NVMe files."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from benchmarks import harness
from fp4offload import ActivationPolicy, ConfigError, CorruptionError, offload_activations
from fp4offload._offload import HostSlabPool, SavedTensorReleasedError
from fp4offload._offload.pinned_pool import ALIGN
from fp4offload._store.folder import LOCK_NAME

from helpers.activations import MIN_NUMEL, TOKENS, P, _one_thread, tiny_model  # noqa: F401


def grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def run(policy, pool=None):
    m = tiny_model()
    with offload_activations(policy, pool=pool) as off:
        loss = harness.lm_loss(m, TOKENS)
    loss.backward()
    return grads(m), off


# -- the pool -----------------------------------------------------------------------------------

def test_pool_reuses_slabs_and_is_bounded():
    pool = HostSlabPool(max_bytes=4 * 8192, slab_bytes=8192, pin=False)
    blocks = [pool.alloc(3000) for _ in range(4)]  # 3000 -> 3072 aligned: two per slab
    assert all(b is not None for b in blocks)
    assert pool.snapshot()["slabs_created"] == 2
    for b in blocks:
        pool.free(b)
    for _ in range(5):  # alloc/free cycles reuse the same slabs
        bs = [pool.alloc(3000) for _ in range(4)]
        for b in bs:
            pool.free(b)
    snap = pool.snapshot()
    assert snap["slabs_created"] == 2 and snap["in_use_bytes"] == 0 and snap["reserved_bytes"] == 2 * 8192
    big = pool.alloc(9000)  # bigger than a slab: a slab of the next power of two
    assert big is not None and big.slab.size == 16384
    assert pool.snapshot()["reserved_bytes"] == 4 * 8192
    held = [pool.alloc(6000) for _ in range(2)]  # one in each small slab: nothing idle to trim now
    assert held[0].slab is not held[1].slab and held[0].slab.size == 8192
    assert pool.alloc(9000) is None  # past max_bytes: refused, not failing
    assert pool.snapshot()["failed_allocs"] == 1 and pool.snapshot()["reserved_bytes"] <= pool.max_bytes
    pool.free(big)
    again = pool.alloc(9000)
    assert again is not None and again.slab is big.slab  # the big slab is reused
    assert pool.snapshot()["peak_reserved_bytes"] <= pool.max_bytes


def test_pool_trims_idle_slabs_to_make_room_for_a_bigger_one():
    pool = HostSlabPool(max_bytes=4 * 8192, slab_bytes=8192, pin=False)
    small = [pool.alloc(8000) for _ in range(4)]
    for b in small:
        pool.free(b)
    big = pool.alloc(20000)  # needs 32 KiB: the four idle 8 KiB slabs are released first
    assert big is not None and pool.snapshot()["slabs_released"] == 4
    assert pool.snapshot()["reserved_bytes"] == 32768


def test_pool_block_views_refuse_reuse_after_free():
    pool = HostSlabPool(max_bytes=1 << 20, slab_bytes=8192, pin=False)
    a = pool.alloc(100)
    a.view().fill_(7)
    assert a.view().numel() == 100 and a.offset % ALIGN == 0
    pool.free(a)
    b = pool.alloc(100)  # same slab, reset: b takes a's bytes
    assert b.offset == a.offset and b.slab is a.slab
    with pytest.raises(SavedTensorReleasedError):
        a.view()
    b.view().fill_(1)
    assert int(b.view().sum()) == 100


def test_pool_is_plain_host_memory_without_cuda():
    pool = HostSlabPool(max_bytes=1 << 20, slab_bytes=8192)
    assert pool.pin == torch.cuda.is_available()
    b = pool.alloc(10)
    assert b.view().device.type == "cpu" and b.view().is_pinned() == pool.pin


def test_past_max_host_bytes_tensors_stay_compressed_where_they_are():
    unbounded, _ = run(P(format="nvfp4", min_numel=MIN_NUMEL),
                       pool=HostSlabPool(1 << 30, 1 << 16, pin=False))
    pool = HostSlabPool(max_bytes=1 << 17, slab_bytes=1 << 16, pin=False)  # 128 KiB: most do not fit
    g, off = run(P(format="nvfp4", min_numel=MIN_NUMEL), pool=pool)
    snap = off.snapshot()
    assert snap["overflow_tensors"] > 0 and snap["bytes_to_host"] > 0  # some fit, the rest stayed
    assert snap["overflow_bytes"] + snap["bytes_to_host"] == snap["bytes_out"]
    assert pool.snapshot()["peak_reserved_bytes"] <= 1 << 17
    assert all(torch.equal(g[n], unbounded[n]) for n in g)  # same bytes wherever they were kept
    assert pool.snapshot()["in_use_bytes"] == 0


def test_pool_is_reused_from_step_to_step():
    pool = HostSlabPool(max_bytes=1 << 26, slab_bytes=1 << 18, pin=False)
    m = tiny_model()
    created = []
    for _ in range(3):
        with offload_activations(P(format="mxfp8", min_numel=MIN_NUMEL), pool=pool):
            loss = harness.lm_loss(m, TOKENS)
        loss.backward()
        created.append(pool.snapshot()["slabs_created"])
    assert created[0] > 0 and created[0] == created[1] == created[2]


# -- NVMe ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["none", "nvfp4"])
def test_nvme_round_trip_and_cleanup_after_backward(tmp_path, fmt):
    ref, _ = run(P(format=fmt, min_numel=MIN_NUMEL))  # device cpu
    m = tiny_model()
    policy = P(format=fmt, device="nvme", nvme_path=str(tmp_path), min_numel=MIN_NUMEL)
    with offload_activations(policy) as off:
        loss = harness.lm_loss(m, TOKENS)
    off.synchronize()
    folder = off.nvme_folder
    files = sorted(folder.glob("act-*.fp4c"))
    assert folder.parent == tmp_path and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert sorted(folder.iterdir()) == sorted([*files, folder / LOCK_NAME])  # the lock names this process
    assert len(files) == off.snapshot()["tensors_stored"] > 0
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in folder.iterdir())
    assert sum(f.stat().st_size for f in files) > off.snapshot()["bytes_out"]
    loss.backward()
    g = grads(m)
    assert all(torch.equal(g[n], ref[n]) for n in ref)  # same bytes as the host store
    assert not folder.exists() and list(tmp_path.iterdir()) == []
    snap = off.snapshot()
    assert snap["bytes_to_nvme"] == snap["bytes_from_nvme"] == snap["bytes_out"]
    assert snap["prefetch_hits"] > 0


def test_nvme_folder_removed_on_exception(tmp_path):
    m = tiny_model()
    policy = P(device="nvme", nvme_path=str(tmp_path), min_numel=MIN_NUMEL)
    with pytest.raises(KeyError):
        with offload_activations(policy) as off:
            loss = harness.lm_loss(m, TOKENS)
            raise KeyError("boom")
    assert not off.nvme_folder.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(SavedTensorReleasedError):
        loss.backward()


def test_nvme_corrupted_file_raises_corruption_error_in_backward(tmp_path):
    m = tiny_model()
    policy = P(device="nvme", nvme_path=str(tmp_path), min_numel=MIN_NUMEL, prefetch=0)
    with offload_activations(policy) as off:
        loss = harness.lm_loss(m, TOKENS)
    off.synchronize()
    stored = sorted(off.nvme_folder.glob("act-*.fp4c"))  # (not the folder's lock file)
    victim = stored[len(stored) // 2]
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0x5A  # a payload byte
    os.chmod(victim, 0o600)
    victim.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError) as e:
        loss.backward()
    assert str(victim) in str(e.value) and "checksum" in str(e.value)
    del loss, e
    import gc

    gc.collect()
    assert not off.nvme_folder.exists()  # the graph went, and with it every file and the folder


def test_nvme_failure_raises_only_once_its_folder_is_gone(tmp_path, monkeypatch):
    """A write on another I/O thread can make a file between the failure's listing of the folder and its rmdir (the
    removal then leaves the folder). Every CapacityError is handed out only once the folder is gone, so a caller that
    catches it finds the disk as it was."""
    import shutil

    from fp4offload._offload import nvme_store

    store = nvme_store.ActivationFileStore(tmp_path)
    store.write(1, {}, lambda: {"x": torch.ones(64)}).result()
    real = shutil.rmtree
    raced = []

    def rmtree_raced_by_a_write(path, ignore_errors=False):
        real(path, ignore_errors=ignore_errors)
        if not raced:  # the first removal: a concurrent write's temporary file lands before the rmdir
            raced.append(path)
            os.makedirs(path)
            (path / "act-00000002.fp4c.tmp").write_bytes(b"half a file")

    monkeypatch.setattr(nvme_store.shutil, "rmtree", rmtree_raced_by_a_write)
    err = store._fail(1 << 30, 0, "the disk is full")
    assert raced and "removed" in str(err)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(type(err)):
        store.read(1).result()
    store.close()


def test_nvme_path_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="nvme_path"):
        with offload_activations(ActivationPolicy(device="nvme", nvme_path=str(tmp_path / "missing"))):
            pass
