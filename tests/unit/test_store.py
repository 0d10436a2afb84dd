"""fp4offload/_store: the storage FP4AdamW's NVMe tier and the activations' NVMe files share.

- the optimizer's segment files are byte for byte what the code before _store wrote (a frozen description of the
  layout, checked against digests of files that code wrote), and the store reads them;
- _store is a lower layer: it imports nothing of _optim, _offload, _fsdp or _deepspeed, and its modules import
  each other without a cycle;
- the activations' folders are crash-safe (a dead process's folder is swept by the next store on that path) and
  their files go through the shared engines: aio where DeepSpeed's async_io loads, threads where it does not, and
  buffered I/O for a file when no more memory can be page-locked.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from benchmarks import harness
from fp4offload import offload_activations
from fp4offload._offload import HostSlabPool, SavedTensorReleasedError, nvme_store, shared_pool
from fp4offload._optim.nvme import NvmeStore, Record, tensor_disk_bytes
from fp4offload._optim.reference_step import Packed, packed_sizes
from fp4offload._optim.state import Residual
from fp4offload._store import engines, pinned
from fp4offload._store.aio import aio_op
from fp4offload._store.folder import KEEP_NAME, LOCK_NAME, lock_info
from fp4offload.formats.container import read_container
from helpers.activations import MIN_NUMEL, TOKENS, P, _one_thread, tiny_model  # noqa: F401
from helpers.extensions import LIBAIO_FIX, skip_or_fail

REPO = Path(__file__).resolve().parents[2]
STORE = REPO / "fp4offload" / "_store"


# ---- the optimizer's files, unchanged on disk ------------------------------------------------------------------

N, KEY, V_FORMAT, STEP, RUN = 1000, "kdemo", "ufp4", 3, "0123456789abcdef"
#: sha256 of the segment file the code before _store (commit ee1c0f4, fp4offload/_optim/nvme_*.py) wrote for the
#: description below: NvmeStore(io=..., residuals=...), run id RUN, generation 1, segment 0 of KEY.
FROZEN = {("threads", False): "a606f1f86ce64d3155c847a1ecd5f3a7803718db07231c01ae0d3e350945d0fa",
          ("threads", True): "cf06c253c643c0cb2bac59d3f0134386fc2ed81228c768730bd5dacf67fb9fcf",
          ("aio", False): "bc744d9735609135f325a1d38c3f27b99ba26acd570cf5c6e088f59a349b16a2",
          ("aio", True): "3ed9b1111e09fad852e37c5f20e81a064d033bca0db87b6cfea78e06e2044f1e"}


def _ramp(k: int, seed: int) -> torch.Tensor:
    return (torch.arange(k, dtype=torch.int64) * 7 + seed).remainder(256).to(torch.uint8)


def _states(seed: int) -> Packed:
    return Packed(*(_ramp(k, seed + i) for i, k in enumerate(packed_sizes(N))))


def _residual() -> Residual:
    return Residual((torch.arange(N, dtype=torch.int64) * 37 - 500).to(torch.int16), _ramp(N // 8, 3))


def _expected_file(aio: bool, residual: bool) -> bytes:
    """The segment file, built from the documented layout (formats/container.py, _store/aio.py): MAGIC (8 bytes) |
    header length (u64 LE) | CRC32 of the header (u32 LE) | JSON header {"version", "meta", "tensors"} | payload.
    The aio layout pads the header with spaces to a 4096-byte boundary, starts each tensor on 64 bytes (zero gaps)
    and ends with a zero tensor "_pad" that makes the file whole 4096-byte blocks."""
    m, v = _states(10), _states(20)
    tensors = {"m_codes": m.codes, "m_scales": m.scales, "m_tscale": m.tscale,
               "v_codes": v.codes, "v_scales": v.scales, "v_tscale": v.tscale}
    if residual:
        r = _residual()
        tensors.update(master_lo=r.lo.view(torch.uint8), master_odd_bits=r.bits)
    entries, blobs, off = {}, [], 0
    for name, t in tensors.items():
        raw = t.numpy().tobytes()
        if aio:
            off = -(-off // 64) * 64
        entries[name] = {"dtype": "uint8", "shape": [len(raw)], "offset": off, "nbytes": len(raw),
                         "crc32": zlib.crc32(raw)}
        blobs.append((off, raw))
        off += len(raw)
    payload = -(-off // 4096) * 4096 if aio else off
    if aio:
        npad = payload - off
        entries["_pad"] = {"dtype": "uint8", "shape": [npad], "offset": off, "nbytes": npad,
                           "crc32": zlib.crc32(bytes(npad))}
    meta = {"kind": "fp4offload._optim.segment", "key": KEY, "segment": 0, "numel": N, "v_format": V_FORMAT,
            "step": STEP, "gen": 1, "run": RUN}
    header = json.dumps({"version": 1, "meta": meta, "tensors": entries}).encode()
    if aio:
        header += b" " * (-(-(20 + len(header)) // 4096) * 4096 - 20 - len(header))
    body = bytearray(payload)
    for o, raw in blobs:
        body[o:o + len(raw)] = raw
    return b"FP4OFFL\x01" + struct.pack("<QI", len(header), zlib.crc32(header)) + header + bytes(body)


def _opt_store(root: Path, engine: str, residual: bool) -> NvmeStore:
    st = NvmeStore(root, io=engine, residuals=residual, threads=1)
    st.run_id = RUN
    return st


@pytest.mark.parametrize("residual", [False, True], ids=["states", "with_residual"])
def test_segment_files_are_the_bytes_the_code_before_store_wrote(tmp_path, engine, residual):
    """The hand-built file is the frozen one; the store writes exactly it, and reads it (and the other engine's)."""
    want = _expected_file(engine == "aio", residual)
    assert hashlib.sha256(want).hexdigest() == FROZEN[engine, residual]
    st = _opt_store(tmp_path, engine, residual)
    st.begin(tensor_disk_bytes(N, residual), "the test")
    st.write(KEY, 0, N, V_FORMAT, STEP, _states(10), _states(20), _residual() if residual else None)
    st.set_record(KEY, Record(st.generation, STEP, N, V_FORMAT))
    st.commit()
    path = st.path(KEY, 0)
    assert path.read_bytes() == want
    for layout in ("threads", "aio"):  # a file of either engine, as the old code left it, loads unchanged
        path.write_bytes(_expected_file(layout == "aio", residual))
        m, v, res = st.read(KEY, 0, N, V_FORMAT)
        assert all(torch.equal(a, b) for a, b in zip((*m, *v), (*_states(10), *_states(20))))
        if residual:
            assert torch.equal(res.lo, _residual().lo) and torch.equal(res.bits, _residual().bits)
        else:
            assert res is None
    st.close()


# ---- layering ----------------------------------------------------------------------------------------------

def _imports(path: Path) -> list[str]:
    """The fp4offload modules a _store module imports at module level (relative imports resolved)."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
            else:
                parts = ["fp4offload", "_store"][:3 - node.level]
                base = ".".join(parts + ([node.module] if node.module else []))
            out += [base] if node.module else [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return [m for m in out if m.startswith("fp4offload")]


def test_store_is_a_lower_layer_without_cycles():
    graph, forbidden = {}, ("fp4offload._optim", "fp4offload._offload", "fp4offload._fsdp", "fp4offload._deepspeed")
    for f in sorted(STORE.glob("*.py")):
        mods = _imports(f)
        bad = [m for m in mods if m.startswith(forbidden)]
        assert not bad, f"{f.name} imports {bad}"
        graph[f.stem] = {m.split(".")[2] for m in mods if m.startswith("fp4offload._store.")}
    seen, done = set(), set()

    def visit(n, path):
        assert n not in seen - done, f"import cycle in fp4offload/_store: {' -> '.join(path + [n])}"
        if n in done:
            return
        seen.add(n)
        for m in graph.get(n, ()):
            visit(m, path + [n])
        done.add(n)

    for n in graph:
        visit(n, [])
    code = ("import sys; import fp4offload._store.engines, fp4offload._store.folder, fp4offload._store.segment, "
            "fp4offload._store.txn, fp4offload._store.pinned; "
            "print([m for m in sys.modules if m.startswith(('fp4offload._optim', 'fp4offload._offload', "
            "'fp4offload._fsdp', 'fp4offload._deepspeed'))])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


# ---- one pinned pool ---------------------------------------------------------------------------------------

def test_the_activations_pool_is_the_store_pool():
    pool = shared_pool(1 << 20, 8192, pin=False)
    assert isinstance(pool, pinned.HostSlabPool) and shared_pool(1 << 20, 8192, pin=False) is pool
    assert pinned._SHARED[(HostSlabPool, 1 << 20, 8192, False)] is pool  # one registry, in _store
    b = pool.alloc(100)
    pool.free(b)
    with pytest.raises(SavedTensorReleasedError):  # the activations' error, as before
        b.view()
    plain = pinned.HostSlabPool(1 << 20, 8192, pin=False)
    c = plain.alloc(100)
    plain.free(c)
    with pytest.raises(pinned.ReleasedBlockError):
        c.view()


# ---- the activations' files ----------------------------------------------------------------------------------

def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def _round_trip(root: Path, fmt: str = "nvfp4"):
    """(grads, offloader, file sizes while stored) of one forward and backward with activations on `root`."""
    m = tiny_model()
    with offload_activations(P(format=fmt, device="nvme", nvme_path=str(root), min_numel=MIN_NUMEL)) as off:
        loss = harness.lm_loss(m, TOKENS)
    off.synchronize()
    sizes = [f.stat().st_size for f in off._nvme.files()]
    loss.backward()
    return _grads(m), off, sizes


def _reference(fmt: str = "nvfp4"):
    m = tiny_model()
    with offload_activations(P(format=fmt, min_numel=MIN_NUMEL)):
        loss = harness.lm_loss(m, TOKENS)
    loss.backward()
    return _grads(m)


@pytest.mark.parametrize("fmt", ["none", "nvfp4"])
def test_activation_files_go_through_aio_when_it_loads(tmp_path, fmt):
    """Where DeepSpeed's async_io op loads (as the optimizer's tests decide), the activations' files are written
    and read by the aio engine: whole 4 KiB blocks, still containers; backward gets the same bytes."""
    op, why = aio_op()
    if op is None:
        skip_or_fail(f"DeepSpeed's async_io op does not load here ({why}); install it: {LIBAIO_FIX}")
    g, off, sizes = _round_trip(tmp_path, fmt)
    assert off._nvme.io == "aio" and off._nvme.io_reason is None
    assert sizes and all(s % 4096 == 0 for s in sizes)
    ref = _reference(fmt)
    assert all(torch.equal(g[n], ref[n]) for n in ref)
    assert list(tmp_path.iterdir()) == []


def test_activation_files_use_threads_where_aio_does_not_load(tmp_path, monkeypatch):
    monkeypatch.setattr(engines, "aio_op", lambda: (None, "ImportError: no deepspeed"))
    monkeypatch.setattr(engines, "_warned", False)
    monkeypatch.setattr(nvme_store, "_engines", {})
    with pytest.warns(RuntimeWarning, match="activations' NVMe store uses its thread-pool I/O.*no deepspeed"):
        g, off, sizes = _round_trip(tmp_path)
    assert off._nvme.io == "threads" and off._nvme.io_reason == "ImportError: no deepspeed"
    assert sizes and not all(s % 4096 == 0 for s in sizes)  # buffered containers, no padding
    ref = _reference()
    assert all(torch.equal(g[n], ref[n]) for n in ref)


def test_activation_files_are_buffered_when_no_more_memory_can_be_locked(tmp_path, monkeypatch):
    """The aio engine's buffers for activations are bounded by what the process may lock: past it a file is written
    and read through the container module (DeepSpeed would abort the process on a failed mlock)."""
    if aio_op()[0] is None:
        skip_or_fail(f"DeepSpeed's async_io op does not load here ({aio_op()[1]}); install it: {LIBAIO_FIX}")
    monkeypatch.setattr(nvme_store, "_engines", {})
    root = tmp_path / "acts"
    root.mkdir()
    store = nvme_store.ActivationFileStore(root)  # starts the engine (its probe locks two blocks)
    assert store.io == "aio"
    store.close()
    before = pinned.locked_total()
    monkeypatch.setattr(pinned, "can_lock", lambda nbytes: "RLIMIT_MEMLOCK is 0 bytes")
    g, off, sizes = _round_trip(root)
    assert off._nvme.io == "aio" and pinned.locked_total() <= before  # nothing more was locked
    assert sizes and not all(s % 4096 == 0 for s in sizes)
    ref = _reference()
    assert all(torch.equal(g[n], ref[n]) for n in ref)


_KILLED = """
import os, signal, sys
from fp4offload._offload.nvme_store import ActivationFileStore
store = ActivationFileStore(sys.argv[1])
store.write(1, {"kind": "activation"}, lambda: {"raw": __import__("torch").ones(4096)}).result()
print(store.folder, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_an_activation_folder_left_by_a_dead_process_is_swept(tmp_path, caplog):
    """A process killed while it held activation files leaves its folder (with the lock naming it); the next store
    on that path removes it and says so. A live process's folder, a kept one and the optimizer's are left alone."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _KILLED, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=180)
    assert r.returncode == -9, r.stderr
    dead = Path(r.stdout.split()[-1])
    assert dead.parent == tmp_path and (dead / LOCK_NAME).is_file() and list(dead.glob("act-*.fp4c"))
    alive = tmp_path / "fp4offload-act-alive"
    kept = tmp_path / "fp4offload-act-kept"
    optim = tmp_path / "fp4adamw-dead"
    for d in (alive, kept, optim):
        d.mkdir(mode=0o700)
    (alive / LOCK_NAME).write_text(json.dumps(lock_info()))
    gone = json.dumps({"pid": json.loads((dead / LOCK_NAME).read_text())["pid"], "start": "1",
                       "host": socket.gethostname(), "uid": os.getuid()})
    for d in (kept, optim):
        (d / LOCK_NAME).write_text(gone)
    (kept / KEEP_NAME).write_text("kept\n")
    with caplog.at_level(logging.WARNING, logger="fp4offload._offload"):
        with offload_activations(P(device="nvme", nvme_path=str(tmp_path))) as off:
            assert off._nvme.swept == [dead]
    assert not dead.exists() and alive.exists() and kept.exists() and optim.exists()
    assert any(str(dead) in rec.getMessage() and "abandoned NVMe activation folder" in rec.getMessage()
               for rec in caplog.records)
    assert not off.nvme_folder.exists()


def test_an_activation_file_written_by_aio_reads_with_the_container_module(tmp_path):
    """A file the store wrote through either engine is fp4offload's container: read_container reads it."""
    store = nvme_store.ActivationFileStore(tmp_path)
    parts = {"data": torch.arange(300, dtype=torch.uint8), "scales": torch.ones(3, 5, dtype=torch.bfloat16),
             "tensor_scale": torch.tensor(0.5)}
    store.write(7, {"kind": "activation"}, lambda: parts).result()
    meta, t = read_container(store.path(7))
    assert meta == {"kind": "activation", "key": 7}
    got = store.read(7).result()
    assert sorted(got) == sorted(parts)
    for k, p in parts.items():
        assert torch.equal(t[k], p) and torch.equal(got[k], p) and got[k].dtype == p.dtype and got[k].shape == p.shape
    store.close()
    assert list(tmp_path.iterdir()) == []
