"""Spawn N ranks of a function with an initialized process group, with hard timeouts and cleanup.

Used by tests that need real ``torch.distributed`` (gloo on CPU by default)::

    from helpers.dist import run_ranks

    def worker(rank, world_size, tmp, scale):      # top-level, so the spawned process can import it
        ...                                        # the process group is up; return something picklable
        return {"loss": 1.0 * scale}

    results = run_ranks(worker, world_size=2, args=(3.0,))   # one result per rank, in rank order

What it guarantees:
- a free TCP port per call (MASTER_ADDR=127.0.0.1), the ``spawn`` start method (no forked torch state);
- ``init_process_group(backend, timeout=pg_timeout)`` before ``fn`` and ``destroy_process_group`` after,
  whether ``fn`` returns or raises;
- a temporary directory per call (passed as ``tmp``, removed afterwards unless ``keep_tmp``);
- no hang: the parent waits at most ``timeout`` seconds in all; once a rank has failed, the others get
  ``grace`` seconds to finish (a collective they are stuck in fails after ``pg_timeout``), then every
  process still alive is killed (by its own pid) and :class:`RanksFailed` is raised with each rank's
  traceback or state;
- ``torch.set_num_threads(threads)`` in every rank, so N ranks do not oversubscribe a small machine.

``fn(rank, world_size, tmp, *args)`` runs with the environment variables RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT set. Pass ``init_pg=False`` to let ``fn`` create the group
itself (e.g. to test what happens before one exists).
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import shutil
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["run_ranks", "free_port", "RanksFailed"]


class RanksFailed(RuntimeError):
    """One or more ranks raised, or the run did not finish in time.

    Attributes:
        errors: rank -> formatted traceback (or a line saying it timed out / died).
        results: rank -> return value, for the ranks that did return.
    """

    def __init__(self, errors: dict[int, str], results: dict[int, Any]):
        self.errors, self.results = errors, results
        parts = [f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())]
        super().__init__(f"{len(errors)} rank(s) failed:\n" + "\n".join(parts))


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, world_size: int, port: int, tmp: str, args: tuple, out,
           backend: str, pg_timeout: float, threads: int, init_pg: bool, env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if init_pg:
            dist.init_process_group(backend, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(rank, world_size, tmp, *args)
        # plain pickle bytes: torch's queue reductions would share tensors through file descriptors that
        # vanish when this process exits before the parent reads them
        out.put((rank, "ok", pickle.dumps(result)))
    except BaseException as e:  # report everything, including KeyboardInterrupt / SystemExit
        out.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(fn: Callable, world_size: int = 2, *, args: Sequence[Any] = (), timeout: float = 120.0,
              grace: float | None = None, backend: str = "gloo", pg_timeout: float = 30.0, threads: int = 1,
              init_pg: bool = True, env: dict[str, str] | None = None, keep_tmp: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, tmp, *args)`` on ``world_size`` spawned ranks; return their results.

    Args:
        fn: a top-level (importable) function; its return value must be picklable (tensors may be returned).
        world_size: number of ranks.
        args: extra positional arguments (picklable).
        timeout: seconds the whole run may take before every rank is killed. Default 120.
        grace: seconds the other ranks get after one failed; default ``pg_timeout + 15``.
        backend: process-group backend. Default ``"gloo"``.
        pg_timeout: the process group's collective timeout in seconds. Default 30.
        threads: torch intra-op threads per rank. Default 1.
        init_pg: create the process group before calling ``fn``. Default True.
        env: extra environment variables for the ranks.
        keep_tmp: leave the temporary directory in place (its path is ``tmp``).

    Raises:
        RanksFailed: a rank raised or died, or the run ran out of time; carries every rank's traceback.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="fp4offload_dist_")
    port = free_port()
    grace = pg_timeout + 15.0 if grace is None else grace
    procs = []
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_entry, name=f"rank{rank}", daemon=True,
                            args=(fn, rank, world_size, port, tmp, tuple(args), out, backend, pg_timeout, threads,
                                  init_pg, dict(env or {})))
            p.start()
            procs.append(p)
        deadline = time.monotonic() + timeout
        first_error_at: float | None = None
        while len(results) + len(errors) < world_size:
            now = time.monotonic()
            limit = deadline if first_error_at is None else min(deadline, first_error_at + grace)
            if now >= limit:
                break
            try:
                rank, status, payload = out.get(timeout=min(0.5, limit - now))
            except queue.Empty:
                for r, p in enumerate(procs):  # a rank that died without reporting (segfault, OOM kill)
                    if not p.is_alive() and r not in results and r not in errors and p.exitcode not in (0, None):
                        time.sleep(0.2)  # its report may still be in flight
                        if out.empty():
                            errors[r] = f"process died with exit code {p.exitcode} before reporting"
                            first_error_at = first_error_at or time.monotonic()
                continue
            if status == "ok":
                results[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
                first_error_at = first_error_at or time.monotonic()
        for r in range(world_size):
            if r not in results and r not in errors:
                why = "the run timed out" if first_error_at is None else "another rank failed"
                errors[r] = f"no result after {timeout if first_error_at is None else grace:.0f} s ({why}); killed"
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()  # our own child, by its pid
                p.join(timeout=5)
        out.close()
        if not keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    if errors:
        raise RanksFailed(errors, results)
    return [results[r] for r in range(world_size)]


def run_group(cmd: list[str], log: Path, timeout: float, *, cwd: Path | None = None, **env_extra: str) -> int | None:
    """Run a launcher command line (torchrun, ``accelerate launch``, ``deepspeed``) in its own process group with
    the CPU-rank environment, its output to ``log``; kill the whole group when it ends or times out. The exit
    status, None on a timeout."""
    import signal
    import subprocess

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])), **env_extra}
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=cwd or root, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:  # the launcher and its ranks: our own process group
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return rc


def launch(cmd: list[str], log: Path, out: Path, timeout: float, what: str) -> dict:
    """:func:`run_group`, then the JSON the command wrote to ``out``; fails the test with the log's tail
    otherwise."""
    import json

    import pytest

    rc = run_group(cmd, log, timeout)
    tail = log.read_text()[-4000:]
    if rc is None:
        pytest.fail(f"{what} did not finish in {timeout} s; killed. Log tail:\n{tail}")
    assert rc == 0 and out.exists(), f"{what} exited with {rc}. Log tail:\n{tail}"
    return json.loads(out.read_text())
