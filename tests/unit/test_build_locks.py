"""A build killed while it holds torch's build lock does not hang the next one (fp4offload._ops.build)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from fp4offload._ops import build as b

NAME = "fp4offload_locktest"
# a module that needs Python only: it compiles in about a second with torch's flags
SOURCE = """#include <Python.h>
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "%s", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit_%s(void) { return PyModule_Create(&mod); }
""" % (NAME, NAME)

CHILD = textwrap.dedent("""
    import os, signal, sys
    from torch.utils import cpp_extension
    from fp4offload._ops.build import build
    if sys.argv[2] == "die":  # killed in the middle of its build, while torch's lock file exists
        def die(*a, **k):
            assert os.path.exists(os.path.join(sys.argv[3], "lock"))
            os.kill(os.getpid(), signal.SIGKILL)
        cpp_extension._write_ninja_file_and_build_library = die
    mod = build("%s", ["locktest.cpp"], root=sys.argv[1])
    print("loaded", mod.__name__)
""" % NAME)


@pytest.fixture
def ext_env(tmp_path, monkeypatch):
    root = tmp_path / "src"
    root.mkdir()
    (root / "locktest.cpp").write_text(SOURCE)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "RANK": "0"}
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    return root, tmp_path / "ext" / NAME, env


def _child(root, build_dir, env, mode, timeout=180):
    return subprocess.run([sys.executable, "-c", CHILD, str(root), mode, str(build_dir)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_killed_build_is_detected_and_the_next_build_clears_its_lock(ext_env):
    root, build_dir, env = ext_env
    dead = _child(root, build_dir, env, "die")
    assert dead.returncode == -9, dead.stderr[-2000:]
    lock = build_dir / "lock"
    assert lock.exists(), "the killed build should have left torch's lock behind"
    # doctor's check names it at once (fp4offload's owner lock is free: its holder died)
    assert b.stale_locks() == [lock]
    t0 = time.monotonic()
    again = _child(root, build_dir, env, "build")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"loaded {NAME}" in again.stdout
    assert f"removed {lock}, left by a build of {NAME} that was killed" in again.stderr
    assert f"building the {NAME} kernel for this machine (first use" in again.stderr
    assert time.monotonic() - t0 < 170
    assert not lock.exists() and b.stale_locks() == []
    # cached now: a third process loads it without building or clearing anything
    third = _child(root, build_dir, env, "build")
    assert third.returncode == 0 and "building" not in third.stderr and "removed" not in third.stderr


def test_a_live_build_is_waited_for_not_cleared(ext_env, tmp_path):
    """The owner lock held by a live process: its torch lock is not stale, and doctor does not report it."""
    import fcntl

    root, build_dir, env = ext_env
    build_dir.mkdir(parents=True)
    (build_dir / "lock").write_text("")
    fd = os.open(build_dir / "fp4offload.owner", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert b.stale_locks() == []
    finally:
        os.close(fd)
    assert b.stale_locks() == [build_dir / "lock"]


def test_another_packages_lock_is_stale_only_when_old_and_nobody_builds_there(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    young, old, busy = (tmp_path / n for n in ("young", "old", "busy"))
    for d in (young, old, busy):
        d.mkdir()
        (d / "lock").write_text("")
    for d in (old, busy):
        os.utime(d / "lock", (time.time() - 600, time.time() - 600))
    worker = subprocess.Popen(["sleep", "60"], cwd=busy)  # a compiler working in that folder
    try:
        assert b.stale_locks() == [old / "lock"]
    finally:
        worker.kill()
        worker.wait()


KEYED = "fp4offload_keytest"
KEYED_SOURCE = """#include <Python.h>
#include "answer.h"
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "%s", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit_%s(void) { PyObject* m = PyModule_Create(&mod); PyModule_AddIntConstant(m, "answer", ANSWER);
                                 return m; }
""" % (KEYED, KEYED)


def test_a_build_is_reused_from_any_checkout_with_the_same_files_and_flags(tmp_path, monkeypatch):
    """The key is the files and flags, not where they are: a second checkout imports the first one's library
    without compiling; another header or other flags build again."""
    import shutil

    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.cpp").write_text(KEYED_SOURCE)
    (one / "answer.h").write_text("#define ANSWER 42\n")
    assert b.build(KEYED, ["m.cpp"], root=one).answer == 42
    two = tmp_path / "two"
    shutil.copytree(one, two)
    assert b.build_key(KEYED, one, ["-O3"], []) == b.build_key(KEYED, two, ["-O3"], [])
    built = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: built.append(kw))
    assert b.build(KEYED, ["m.cpp"], root=two).answer == 42 and not built  # imported, nothing compiled

    assert b.build_key(KEYED, two, ["-O3"], []) != b.build_key(KEYED, two, ["-O2"], [])
    assert b.build_key(KEYED, two, [], ["--fmad=false"]) != b.build_key(KEYED, two, [], [])
    (two / "answer.h").write_text("#define ANSWER 43\n")  # a header no source list names
    assert b.build_key(KEYED, two, ["-O3"], []) != b.build_key(KEYED, one, ["-O3"], [])
    b.build(KEYED, ["m.cpp"], root=two)
    assert len(built) == 1 and built[0]["sources"] == [str(two / "m.cpp")]  # built again
    assert not (tmp_path / "ext" / KEYED / b.KEY_FILE).exists()  # the old library's key is gone: no stale import
