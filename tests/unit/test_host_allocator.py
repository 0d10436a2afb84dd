"""The host allocator cache: large CPU blocks reused without page faults, freed bytes bounded, values untouched."""

from __future__ import annotations

import resource
import sys
import threading

import pytest
import torch

from fp4offload import host_allocator
from fp4offload.errors import ConfigError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

MiB = 1 << 20


@pytest.fixture
def cache():
    """Install with the given settings for one test; leave the process as it was."""
    was = host_allocator.stats().get("installed", False)

    def install(**kw):
        got = host_allocator.install(**kw)
        assert got["installed"], got
        return got

    yield install
    host_allocator.empty_cache()
    if was:
        host_allocator.install()
    else:
        host_allocator.uninstall()


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def test_a_block_freed_and_asked_for_again_is_reused_without_page_faults(cache):
    cache(fraction=1.0, floor_bytes=64 * MiB, huge_bytes=0)  # 4 KiB pages: each fresh page is a fault
    n = 2 * MiB  # 8 MiB of fp32: 2048 pages of 4 KiB when faulted in fresh
    warm = torch.empty(n)
    warm.fill_(-1.0)
    del warm
    s0, f0 = host_allocator.stats(), _faults()
    for i in range(32):  # one layer after another: same size, freed before the next asks
        t = torch.empty(n)
        t.fill_(float(i))
        assert t[0].item() == i and t[-1].item() == i
        del t
    faults, s1 = _faults() - f0, host_allocator.stats()
    assert s1["allocs"] - s0["allocs"] == 32
    assert s1["hits"] - s0["hits"] == 32 and s1["maps"] == s0["maps"]
    assert faults < 512, faults  # fresh pages every time would be 32 x 2048


def test_values_alignment_and_odd_sizes(cache):
    cache(fraction=0.5, huge_bytes=4 * MiB)
    g = torch.Generator().manual_seed(0)
    keep = []
    for nbytes in (128 << 10, (128 << 10) + 1, 3 * MiB + 7, 4 * MiB, 9 * MiB + 4093):
        t = torch.empty(nbytes, dtype=torch.uint8)
        assert t.data_ptr() % 64 == 0
        if nbytes >= 4 * MiB:
            assert t.data_ptr() % (2 * MiB) == 0  # transparent-huge-page aligned
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        t.copy_(src)
        keep.append((t, src))
    for t, src in keep:
        assert torch.equal(t, src)
    s = host_allocator.stats()
    assert s["in_use_bytes"] >= sum(t.numel() for t, _ in keep)


def test_small_blocks_stay_with_the_previous_allocator(cache):
    cache()
    s0 = host_allocator.stats()
    small = [torch.empty(n, dtype=torch.uint8) for n in (1, 1024, (128 << 10) - 1)]
    assert host_allocator.stats()["allocs"] == s0["allocs"]
    big = torch.empty(128 << 10, dtype=torch.uint8)
    assert host_allocator.stats()["allocs"] == s0["allocs"] + 1
    del small, big


def test_freed_bytes_kept_stay_under_the_fraction_of_bytes_in_use(cache):
    cache(fraction=0.125, floor_bytes=0, ceiling_bytes=0)
    host_allocator.empty_cache()
    base = host_allocator.stats()["in_use_bytes"]
    live = [torch.empty(4 * MiB) for _ in range(8)]  # 128 MiB in use
    for t in live:
        t.zero_()
    del t
    while live:
        live.pop()
        s = host_allocator.stats()
        assert s["cached_bytes"] <= 0.125 * s["in_use_bytes"] + 1, s
        assert s["cached_bytes"] <= s["limit_bytes"]
    s = host_allocator.stats()
    assert s["in_use_bytes"] == base
    released = host_allocator.empty_cache()
    assert released == s["cached_bytes"] and host_allocator.stats()["cached_bytes"] == 0


def test_ceiling_and_floor(cache):
    cache(fraction=1.0, floor_bytes=0, ceiling_bytes=8 * MiB)
    for _ in range(4):
        t = torch.empty(3 * MiB, dtype=torch.uint8)
        u = torch.empty(3 * MiB, dtype=torch.uint8)
        v = torch.empty(3 * MiB, dtype=torch.uint8)
        del t, u, v
        assert host_allocator.stats()["cached_bytes"] <= 8 * MiB
    cache(fraction=0.001, floor_bytes=32 * MiB)
    host_allocator.empty_cache()
    t = torch.empty(16 * MiB, dtype=torch.uint8)
    del t  # 0.1% of what is in use is far below 16 MiB: the floor keeps it
    assert host_allocator.stats()["cached_bytes"] >= 16 * MiB


def test_uninstall_hands_torch_its_allocator_back(cache):
    cache()
    t = torch.full((2 * MiB,), 3.0)
    assert host_allocator.uninstall() and not host_allocator.installed()
    s0 = host_allocator.stats()
    u = torch.full((2 * MiB,), 4.0)  # served by torch's own allocator now
    assert host_allocator.stats()["allocs"] == s0["allocs"]
    assert t.sum().item() == 3.0 * 2 * MiB  # what the cache handed out stays valid
    del t  # ... and is unmapped when freed, not cached
    s1 = host_allocator.stats()
    assert s1["unmaps"] == s0["unmaps"] + 1 and s1["cached_bytes"] == 0
    assert u.sum().item() == 4.0 * 2 * MiB


def test_training_math_is_unchanged(cache):
    def run():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
        x = torch.randn(256, 512)
        for _ in range(2):
            model.zero_grad()
            model(x).square().mean().backward()
        return [p.grad.clone() for p in model.parameters()]

    host_allocator.uninstall()
    plain = run()
    cache()
    s0 = host_allocator.stats()
    cached = run()
    assert host_allocator.stats()["allocs"] > s0["allocs"]  # the run did go through the cache
    for a, b in zip(plain, cached):
        assert torch.equal(a, b)


def test_threads_allocating_and_freeing_at_once(cache):
    cache(fraction=0.25)
    base = host_allocator.stats()["in_use_bytes"]
    errors = []

    def work(k):
        try:
            for i in range(50):
                t = torch.full(((k + 1) * 64 * 1024,), float(i))
                if t[-1].item() != i:
                    errors.append((k, i))
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert host_allocator.stats()["in_use_bytes"] == base


@pytest.mark.parametrize("value", ["2", "-0.5", "lots"])
def test_bad_env_value_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(host_allocator.ENV, value)
    with pytest.raises(ConfigError, match=host_allocator.ENV):
        host_allocator.install()


def test_env_off_and_bad_arguments(monkeypatch):
    monkeypatch.setenv(host_allocator.ENV, "off")
    got = host_allocator.install()
    assert got == {"installed": False, "reason": f"{host_allocator.ENV}=off"}
    with pytest.raises(ConfigError, match="fraction"):
        host_allocator.install(fraction=0.0)
    with pytest.raises(ConfigError, match="floor_bytes"):
        host_allocator.install(fraction=0.5, floor_bytes=-1)


def test_a_forked_child_can_allocate_while_another_thread_was_allocating(cache):
    """The cache's lock is held across fork (pthread_atfork), so a child never inherits it locked."""
    import os
    import signal
    import time

    cache()
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            t = torch.empty(1 << 18)
            del t

    th = threading.Thread(target=churn)
    th.start()
    try:
        for _ in range(20):
            pid = os.fork()
            if pid == 0:  # element writes only: no OpenMP in a forked child
                t = torch.empty(1 << 20)
                t[0], t[-1] = 1.0, 2.0
                os._exit(0 if (t[0].item(), t[-1].item()) == (1.0, 2.0) else 1)
            deadline = time.monotonic() + 30
            while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    pytest.fail("the forked child hung allocating")
                time.sleep(0.01)
            assert os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == 0
    finally:
        stop.set()
        th.join()
