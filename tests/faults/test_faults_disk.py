"""Faults on real file systems: a disk that fills in the middle of an FP4AdamW step on the NVMe tier,
damaged and stale segment files, activations on a full disk, and state folders left behind by exits and kills.

The disks are real: tmpfs mounts of a few MiB with few inodes (a file system out of inodes fails file creation
with ENOSPC however many bytes are free, so the disk fills between two segment writes of one step: after the
step's space was reserved and after weights were updated). They need mount rights (root); without them the
tests skip. tmpfs has no O_DIRECT, so these runs use the thread engine; tests/unit/test_optim_nvme.py covers both
engines on the space checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from fp4offload import ActivationPolicy, FP4AdamW, offload_activations
from fp4offload.errors import CapacityError, ConfigError, CorruptionError
from fp4offload._optim import SEGMENT, NvmeOptions, StateFormat, StepOptions, load_param_states
from fp4offload._optim import nvme as nvme_mod
from fp4offload._optim import reference_step as R


REPO = Path(__file__).resolve().parents[2]
MASTERS = ("fp32", "split", "bf16")


@contextlib.contextmanager
def tmpfs(where: Path, size: str = "32m", inodes: int | None = None):
    """A real tmpfs of `size` (and `inodes`) mounted at `where`, unmounted afterwards."""
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (f",nr_inodes={inodes}" if inodes else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
        with contextlib.suppress(OSError):
            where.rmdir()


@contextlib.contextmanager
def ext4(where: Path, size_mb: int = 24, inodes: int = 64):
    """A real ext4 file system on a loop device (O_DIRECT works there: the aio engine), unmounted afterwards."""
    where.mkdir(parents=True, exist_ok=True)
    img = where.with_name(where.name + ".img")
    with open(img, "wb") as f:
        f.truncate(size_mb << 20)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-N", str(inodes), "-O", "^has_journal", str(img)],
                       capture_output=True, text=True)
    if r.returncode == 0:
        r = subprocess.run(["mount", "-o", "loop", str(img), str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        img.unlink()
        pytest.skip(f"cannot mount an ext4 loop device here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], capture_output=True)
        img.unlink()
        with contextlib.suppress(OSError):
            where.rmdir()


def leave_inodes(mnt: Path, k: int) -> list[Path]:
    """Fill the file system's inodes with empty files until exactly `k` are free; returns the fillers."""
    d = mnt / f"fill-{uuid.uuid4().hex[:6]}"
    d.mkdir()
    out = [d]
    for i in range(max(0, os.statvfs(mnt).f_favail - k)):
        f = d / f"{i}"
        f.touch()
        out.append(f)
    assert os.statvfs(mnt).f_favail == k
    return out


def free_fillers(fillers: list[Path]) -> None:
    for f in reversed(fillers):
        f.rmdir() if f.is_dir() else f.unlink()


# ---- the optimizer's NVMe tier -----------------------------------------------------------------------------


def _params(master: str):
    torch.manual_seed(0)
    dt = torch.float32 if master == "fp32" else torch.bfloat16
    # two segment files, one, and fp32 states in RAM (under min_numel): three kinds of undo in one step
    return [torch.nn.Parameter((torch.randn(SEGMENT + 5000) * 0.1).to(dt)),
            torch.nn.Parameter(torch.randn(9000).to(dt)), torch.nn.Parameter(torch.randn(100).to(dt))]


def _grads(step: int, params) -> None:
    for i, p in enumerate(params):
        g = torch.Generator().manual_seed(1000 * step + i)
        p.grad = (torch.randn(p.shape, generator=g) + 0.1 * p.detach().float()).to(p.dtype)


def _opt(params, master: str, **kw):
    return FP4AdamW(params, lr=1e-2, master=master, **kw)


def _snapshot(opt, params):
    return [p.detach().clone() for p in params], opt.state_dict()


def _assert_same(a, b, what: str) -> None:
    (pa, sa), (pb, sb) = a, b
    for i, (x, y) in enumerate(zip(pa, pb)):
        assert torch.equal(x, y), f"{what}: parameter {i} differs"
    assert sa["state"].keys() == sb["state"].keys(), what
    for k, entry in sa["state"].items():
        assert entry.keys() == sb["state"][k].keys(), (what, k)
        for key, t in entry.items():
            u = sb["state"][k][key]
            assert (torch.equal(t, u) if torch.is_tensor(t) else t == u), f"{what}: state {k}.{key} differs"


def _committed(opt) -> dict[str, bytes]:
    d = opt.placement.store.dir
    return {f.name: f.read_bytes() for f in sorted(d.glob("*.fp4s"))}


def _hidden(opt) -> list[str]:
    return sorted(f.name for f in opt.placement.store.dir.glob(".*"))


def _reference(master: str, steps: list[int]):
    """The same run in RAM, taking only `steps` (the failed ones skipped)."""
    params = _params(master)
    opt = _opt(params, master)
    for s in steps:
        _grads(s, params)
        opt.step()
    return _snapshot(opt, params)


def _fault_plan(seed: int, n: int) -> list[tuple[str, int]]:
    """A generated sequence of steps: each ok, or failing in one way (the kinds below), with a parameter."""
    rng = random.Random(seed)
    kinds = [("inodes", k) for k in range(0, 4)] + [("corrupt", s) for s in range(3)] + [("stale", s) for s in
                                                                                         range(3)] + [("bytes", 0)]
    plan = [("ok", 0)]
    for _ in range(n):
        plan.append(rng.choice(kinds) if rng.random() < 0.75 else ("ok", 0))
    return plan


def _segment_file(opt, params, seg: int) -> Path:
    """Segment `seg` of the step's files in order: 0, 1 of parameter 0, then 0 of parameter 1."""
    p, s = (params[0], seg) if seg < 2 else (params[1], 0)
    return opt.placement.store.path(opt.placement.key(p), s)


@pytest.mark.parametrize("master, fs, engine", [(m, "tmpfs", "threads") for m in MASTERS] + [("fp32", "ext4", "aio")])
def test_fault_sequence_is_all_or_nothing(tmp_path, master, fs, engine):
    """A generated run of steps, most failing on a real tmpfs: out of inodes (the disk fills after the step's
    reservation, between segment writes, once weights were updated; or before anything, at the reservation),
    short of bytes, a damaged or a stale segment file. After each failure the optimizer (parameters, step
    counts, m and v, the committed files) equals its state before the step; once the cause is gone training
    continues, and the whole run equals the same run in RAM with the failed steps skipped, bit for bit. (The
    aio engine needs O_DIRECT, which tmpfs lacks: it runs on ext4 on a loop device.)"""
    if engine == "aio" and nvme_mod.aio_op()[0] is None:
        pytest.skip(f"DeepSpeed's async_io op does not load here ({nvme_mod.aio_op()[1]})")
    plan = _fault_plan(seed=MASTERS.index(master) + (10 if fs == "ext4" else 0), n=7)
    kinds_seen = {k for k, _ in plan}
    disk = tmpfs(tmp_path / "mnt", size="24m", inodes=64) if fs == "tmpfs" else ext4(tmp_path / "mnt")
    with disk as mnt:
        params = _params(master)
        opt = _opt(params, master, state_device="nvme", nvme_path=mnt, nvme=NvmeOptions(io=engine))
        assert opt.nvme_io == engine
        opt.placement.tier.undo_ram_bytes = (1 << 20) if master == "fp32" else 1 << 30  # fp32: most of the undo on disk
        taken, old = [], {}
        for step, (kind, arg) in enumerate(plan):
            _grads(step, params)
            if kind == "ok":
                if taken:
                    old = _committed(opt)  # copies of valid files one step older, for the stale faults
                opt.step()
                taken.append(step)
                continue
            if not taken or (kind == "stale" and not old):
                continue
            before, files = _snapshot(opt, params), _committed(opt)
            if kind == "inodes":
                fillers = leave_inodes(mnt, arg)
                undo = lambda f=fillers: free_fillers(f)  # noqa: E731
            elif kind == "bytes":  # every free byte taken by another file: refused at the space check
                filler = mnt / "bytes"
                _fill_bytes(filler)
                undo = filler.unlink
            else:
                target = _segment_file(opt, params, arg)
                good = target.read_bytes()
                if kind == "corrupt":
                    raw = bytearray(good)
                    raw[len(raw) // 2] ^= 0x10
                    target.write_bytes(bytes(raw))
                else:
                    target.write_bytes(old[target.name])  # an older valid copy of the same segment
                undo = lambda t=target, b=good: t.write_bytes(b)  # noqa: E731
            with pytest.raises((CapacityError, CorruptionError)) as e:
                opt.step()
            expected = CapacityError if kind in ("inodes", "bytes") else CorruptionError
            assert isinstance(e.value, expected), (kind, arg, e.value)
            if kind == "stale":
                assert "stale segment" in str(e.value), str(e.value)
            if kind == "bytes" or (kind == "inodes" and arg == 0):  # refused before anything was written
                assert "nothing was written" in str(e.value), str(e.value)
            elif kind == "inodes":  # the disk filled between writes, after weights of this step were updated
                assert "the step is undone" in str(e.value), str(e.value)
            undo()
            assert _committed(opt) == files, (kind, arg)
            assert _hidden(opt) == [], (kind, arg, _hidden(opt))  # no generation, reservation or undo file left
            if engine == "aio":
                assert not opt.placement.store._pool_bufs._busy  # every page-locked buffer read went back
            _assert_same(before, _snapshot(opt, params), f"after {kind}:{arg}")
        final = _snapshot(opt, params)
        opt.close()
    _assert_same(final, _reference(master, taken), "the run against the run with the failed steps skipped")
    failed = len(plan) - len(taken)
    print(f"fuzz: {len(plan)} steps ({failed} failing: {sorted(kinds_seen - {'ok'})}), master={master}")
    assert failed >= 3


@pytest.mark.parametrize("fs, engine", [("tmpfs", "threads"), ("ext4", "aio")])
def test_fault_sequence_with_the_residual_in_the_state_files(tmp_path, monkeypatch, fs, engine):
    """The same generated run with split's residual in the segment files (``master_device="nvme"``): it goes to
    the step's generation with m and v, so a disk that fills between segment writes, a damaged or a stale file
    leave it as before the step too; the reference run keeps it in RAM."""
    real, made = _opt, []

    def opt_with_residual_on_disk(params, master, **kw):
        if kw.get("state_device") == "nvme":
            kw["nvme"] = dataclasses.replace(kw.get("nvme", NvmeOptions()), master_device="nvme")
        made.append(real(params, master, **kw))
        return made[-1]

    monkeypatch.setitem(globals(), "_opt", opt_with_residual_on_disk)
    test_fault_sequence_is_all_or_nothing(tmp_path, "split", fs, engine)
    assert [o.master_device for o in made] == ["nvme", "same"]  # the run on disk, then its reference in RAM


def _fill_bytes(path: Path) -> None:
    """Take every free byte of the file system with one file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with contextlib.suppress(OSError):
            while os.write(fd, bytes(1 << 16)) > 0:
                pass
    finally:
        os.close(fd)


def test_capacity_error_on_the_first_step_then_retry(tmp_path):
    """The first step does not fit: CapacityError, no state and no file made; with room, the retry is the
    run's first step (no 'file is missing')."""
    with tmpfs(tmp_path / "mnt", size="1m") as mnt:
        params = _params("fp32")
        opt = _opt(params, "fp32", state_device="nvme", nvme_path=mnt, nvme=NvmeOptions(io="threads"))
        before = [p.detach().clone() for p in params]
        _grads(0, params)
        with pytest.raises(CapacityError, match="nothing was written"):
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(before, params))
        assert len(opt.state) == 0 or all("step" not in st for st in opt.state.values())
        assert _committed(opt) == {} and _hidden(opt) == []
        subprocess.run(["mount", "-o", "remount,size=24m", str(mnt)], check=True)
        for s in (1, 2):
            _grads(s, params)
            opt.step()
        final = _snapshot(opt, params)
        opt.close()
    _assert_same(final, _reference("fp32", [1, 2]), "the retried run against the run without its first step")


def test_stale_segment_is_refused(tmp_path, capsys):
    """An older valid copy of a segment file, or one from another optimizer's folder, put in its place: a
    CorruptionError naming the file, the step and the run, and nothing used or overwritten. `fp4offload inspect`
    prints the header's step, generation and run."""
    params = _params("fp32")
    opt = _opt(params, "fp32", state_device="nvme", nvme_path=tmp_path, nvme=NvmeOptions(io="threads"))
    _grads(0, params)
    opt.step()
    target = _segment_file(opt, params, 1)
    older = target.read_bytes()
    _grads(1, params)
    opt.step()
    current = target.read_bytes()
    target.write_bytes(older)
    with pytest.raises(CorruptionError) as e:
        opt.state_dict()
    msg = str(e.value)
    assert target.name in msg and "stale segment (step 1" in msg and "expects step 2" in msg, msg
    before = [p.detach().clone() for p in params]
    _grads(2, params)
    with pytest.raises(CorruptionError, match="stale segment"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params)) and target.read_bytes() == older

    other_params = _params("fp32")
    other = _opt(other_params, "fp32", state_device="nvme", nvme_path=tmp_path, nvme=NvmeOptions(io="threads"))
    for s in (0, 1):
        _grads(s, other_params)
        other.step()
    twin = other.placement.store.path(other.placement.key(other_params[0]), 1)
    assert twin.name == target.name and twin.read_bytes() != current  # same step, same key: another run id
    target.write_bytes(twin.read_bytes())
    with pytest.raises(CorruptionError, match="written by another store"):
        opt.step()
    target.write_bytes(current)
    opt.step()  # the right file back: training goes on
    other.close()

    from fp4offload.cli import main

    capsys.readouterr()
    assert main(["inspect", str(target)]) == 0
    meta = json.loads(capsys.readouterr().out)["meta"]
    assert meta["step"] == 3 and meta["run"] == opt.placement.store.run_id and meta["segment"] == 1 and meta["gen"] > 0
    opt.close()


# ---- activations on a full disk --------------------------------------------------------------------------


def _mlp_loss(x):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(),
                            torch.nn.Linear(256, 1))
    return m(x).sum()  # five saved tensors of 32768 elements: five files of about 19 KB


@pytest.mark.slow  # five tmpfs mounts, a forward and a backward on each: ~30 s
def test_activations_on_a_full_disk(tmp_path):
    """Activation files on tmpfs mounts too small for one forward (generated sizes: full before the first file,
    or after a few): backward raises CapacityError (not a raw OSError), and the failed store's files and
    folder are gone at once, before the offloader closes. (Enough room: tests/unit/test_activations_store.py.)"""
    x = torch.randn(128, 256)
    sizes = sorted(random.Random(7).sample(range(8, 100, 4), 5))
    n = 0
    for kib in sizes:
        with tmpfs(tmp_path / f"mnt{kib}", size=f"{kib}k") as mnt:
            with offload_activations(ActivationPolicy(device="nvme", nvme_path=str(mnt), min_numel=1024)) as off:
                loss = _mlp_loss(x)
            try:
                loss.backward()
            except CapacityError as err:
                e = err
            else:  # say what the store saw, so that a pass-through is told apart from a write that fitted
                pytest.fail(f"backward did not raise CapacityError on a {kib} KiB tmpfs: {off.snapshot()}; "
                            f"files {sorted((str(f), f.stat().st_size) for f in mnt.rglob('*') if f.is_file())}")
            assert "activation files" in str(e) and "removed" in str(e), str(e)
            assert list(mnt.iterdir()) == [] and not off.nvme_folder.exists(), (kib, list(mnt.iterdir()))
            del loss, e
            n += 1
    print(f"fuzz: {n} cases: activation stores on tmpfs of {sizes} KiB, each CapacityError, files removed")


# ---- state folders left behind -----------------------------------------------------------------------------


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("FP4OFFLOAD_NVME_KEEP", None)
    return env


_CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    import torch._dynamo  # what torch.optim imports on first use, once for both processes
    from fp4offload import FP4AdamW
    from fp4offload._optim import NvmeOptions, StateFormat, StepOptions

    def optimizer(root, keep=False):
        p = torch.nn.Parameter(torch.randn(3000))
        opt = FP4AdamW([p], state_device="nvme", nvme_path=root, nvme=NvmeOptions(io="threads", keep=keep),
                       state_format=StateFormat(min_numel=1), step_options=StepOptions(backend="reference"))
        p.grad = torch.ones(3000)
        opt.step()
        print(opt.placement.store.dir, flush=True)
        return opt

    pid = os.fork()  # before any torch op: the child steps an optimizer of its own, then is SIGKILLed
    if pid == 0:
        opt = optimizer(sys.argv[3])
        os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(pid, 0)
    a, b = optimizer(sys.argv[1]), optimizer(sys.argv[2], keep=True)  # removed at exit, kept: neither closed
""")


@pytest.mark.slow  # one child process: torch and torch._dynamo (torch.optim imports it) load in ~7 s of CPU
def test_nothing_is_left_behind(tmp_path, caplog):
    """Normal exit without close(): the folder is gone (atexit). A SIGKILLed process's folder stays, and the
    next optimizer on that path removes it and says so in the log. A kept folder (nvme_keep=True) survives
    exit and sweeps, and read_kept gives back its states; closing removes the folder otherwise."""
    exit_root, keep_root, kill_root = tmp_path / "exit", tmp_path / "keep", tmp_path / "kill"
    for d in (exit_root, keep_root, kill_root):
        d.mkdir()
    r = subprocess.run([sys.executable, "-c", _CHILD, str(exit_root), str(keep_root), str(kill_root)],
                       capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    killed_dir, exit_dir, kept_dir = map(Path, r.stdout.split())
    assert exit_dir.parent == exit_root and list(exit_root.iterdir()) == []  # removed at exit
    assert kept_dir.parent == keep_root and killed_dir.parent == kill_root
    assert killed_dir.exists() and (killed_dir / nvme_mod.LOCK_NAME).exists()
    p = torch.nn.Parameter(torch.randn(10))
    with caplog.at_level(logging.WARNING, logger="fp4offload._optim.nvme"):
        opt = FP4AdamW([p], state_device="nvme", nvme_path=kill_root, nvme=NvmeOptions(io="threads"))
    assert opt.placement.store.swept == [killed_dir] and not killed_dir.exists()
    assert any(str(killed_dir) in r.getMessage() and "abandoned" in r.getMessage() for r in caplog.records)
    mine = opt.placement.store.dir
    assert sorted(kill_root.iterdir()) == [mine]
    other = FP4AdamW([torch.nn.Parameter(torch.randn(10))], state_device="nvme", nvme_path=kill_root,
                     nvme=NvmeOptions(io="threads"))
    assert other.placement.store.swept == [] and mine.exists()  # a live store's folder is never swept
    other.close()
    opt.close()
    assert list(kill_root.iterdir()) == []

    assert (kept_dir / nvme_mod.KEEP_NAME).exists() and not (kept_dir / nvme_mod.LOCK_NAME).exists()
    sweeper = FP4AdamW([torch.nn.Parameter(torch.randn(10))], state_device="nvme", nvme_path=keep_root,
                       nvme=NvmeOptions(io="threads"))
    assert sweeper.placement.store.swept == [] and kept_dir.exists()
    sweeper.close()
    entries = nvme_mod.read_kept(kept_dir)
    (entry,) = entries.values()
    assert float(entry["step"]) == 1.0 and entry["m_codes"].numel() == R.packed_sizes(3000)[0]
    q = torch.nn.Parameter(torch.randn(3000))
    fresh = FP4AdamW([q], state_format=StateFormat(min_numel=1), step_options=StepOptions(backend="reference"))
    assert load_param_states(fresh, {q: entry}) == 1
    assert fresh.state_dict()["state"][0]["step"] == 1.0


def test_keep_folder_in_process(tmp_path, monkeypatch):
    """nvme_keep=True keeps the folder at close with a manifest of the optimizer's steps (also states loaded
    and not stepped since); FP4OFFLOAD_NVME_KEEP=1 does the same for engines that build the optimizer."""
    params = _params("fp32")[:2]
    opt = FP4AdamW(params, lr=1e-2, state_device="nvme", nvme_path=tmp_path, nvme=NvmeOptions(io="threads", keep=True))
    for s in range(2):
        _grads(s, params)
        opt.step()
    sd = opt.state_dict()
    folder = opt.placement.store.dir
    opt.close()
    manifest = json.loads((folder / nvme_mod.MANIFEST_NAME).read_text())
    assert {k: v["step"] for k, v in manifest["keys"].items()} == {"t00000": 2, "t00001": 2}
    kept = nvme_mod.read_kept(folder)
    for i, key in enumerate(("t00000", "t00001")):
        for k, t in kept[key].items():
            assert torch.equal(t, sd["state"][i][k]) if torch.is_tensor(t) else t == sd["state"][i][k]
    monkeypatch.setenv("FP4OFFLOAD_NVME_KEEP", "1")
    loaded = FP4AdamW(_params("fp32")[:2], lr=1e-2, state_device="nvme", nvme_path=tmp_path / "b",
                      nvme=NvmeOptions(io="threads"))
    loaded.load_state_dict(sd)
    folder = loaded.placement.store.dir
    loaded.close()
    assert {k: v["step"] for k, v in json.loads((folder / "manifest.json").read_text())["keys"].items()} == {
        "t00000": 2, "t00001": 2}
    monkeypatch.setenv("FP4OFFLOAD_NVME_KEEP", "maybe")
    with pytest.raises(ConfigError) as e:
        FP4AdamW(_params("fp32")[:1], state_device="nvme", nvme_path=tmp_path / "c")
    assert e.value.key == "FP4OFFLOAD_NVME_KEEP" and not list(tmp_path.glob("c/fp4adamw-*"))


def test_engine_destroy_closes_the_optimizer(tmp_path):
    """Under the DeepSpeed block, engine.destroy() (DeepSpeed's teardown) also closes FP4AdamW: its folder goes.
    (The engine here is a stand-in with DeepSpeed's two names; tests/integration/test_deepspeed_nvme_subgroups.py
    runs the real one.)"""
    import types

    from fp4offload._deepspeed.engine import _close_on_destroy

    params = _params("fp32")[1:2]
    opt = FP4AdamW(params, state_device="nvme", nvme_path=tmp_path, nvme=NvmeOptions(io="threads"))
    _grads(0, params)
    opt.step()
    folder, destroyed = opt.placement.store.dir, []
    engine = types.SimpleNamespace(optimizer=opt, destroy=lambda: destroyed.append(True))
    assert _close_on_destroy(engine)
    engine.destroy()
    assert destroyed == [True] and not folder.exists() and opt.placement.store is None
    assert list(tmp_path.iterdir()) == []
