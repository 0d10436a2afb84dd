"""Reading a small input file (JSON, YAML, text) whose every failure is a ConfigError naming the key, the value and
the fix.

Used by the DeepSpeed config reader, the planner's readings, its Hugging Face config.json reader and the strategy
catalogue. Every file is opened without blocking and checked to be a regular file before a byte is read (a FIFO,
a device such as /dev/zero, a socket or a directory is refused), and is read only up to ``MAX_INPUT_BYTES``: a
config file is kilobytes, so a larger one is a mistake, not something to load into memory. The bytes must be
UTF-8; a JSON object may name each key once (a repeated key is refused with its key path, since JSON readers
disagree on which value wins), and JSON nested too deeply is refused rather than raising RecursionError.

Output files (the planner's emitted configs and readings) go through :func:`write_text`: the path is checked
up front (:func:`check_output`: not empty, no NUL byte, not an existing directory, FIFO or device, not under a
regular file or in /proc or /sys), the text is written to a new temporary file of random name beside it
(created exclusively, mode 0600) and renamed onto it, so a symlink at the path is replaced, never followed.
Every OSError is a ConfigError naming the flag.
Imports nothing of fp4offload but the errors, so any module may use it.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from fp4offload.errors import ConfigError

__all__ = ["MAX_INPUT_BYTES", "DuplicateKeyError", "read_bytes", "read_text", "read_json", "parse_json", "file_kind",
           "key_path", "check_output", "write_text"]

#: the largest input file read (16 MiB); a Hugging Face config.json, a DeepSpeed JSON, a readings file or a
#: strategy YAML is a few kilobytes
MAX_INPUT_BYTES = 16 << 20


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words, from its ``st_mode``."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc) if isinstance(exc, OSError) else str(exc)


def read_bytes(path: str | os.PathLike, key: str, value: Any, *, readable: str,
               limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them.

    The file is opened with O_NONBLOCK (so a FIFO does not block the open) and checked with fstat before it is
    read: a directory, a FIFO, a device or a socket, a file larger than ``limit`` and any OSError (missing,
    unreadable, a NUL byte in the path) raise ConfigError(key, value, readable, <why>).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise ConfigError(key, value, readable, _why(exc)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(key, value, readable, f"it is {file_kind(st.st_mode)}, not a regular file")
        if st.st_size > limit:
            raise ConfigError(key, value, readable, f"it holds {st.st_size:,} bytes, more than the {limit:,} an "
                              "input file of fp4offload may have")
        chunks, got = [], 0
        while got <= limit:
            b = os.read(fd, min(1 << 20, limit + 1 - got))
            if not b:
                break
            chunks.append(b)
            got += len(b)
        if got > limit:
            raise ConfigError(key, value, readable, f"it grew past {limit:,} bytes while being read")
        return b"".join(chunks)
    except OSError as exc:
        raise ConfigError(key, value, readable, _why(exc)) from None
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, key: str, value: Any, *, readable: str,
              limit: int = MAX_INPUT_BYTES) -> str:
    """:func:`read_bytes` decoded as UTF-8; other bytes raise ConfigError naming the offset of the first bad one."""
    raw = read_bytes(path, key, value, readable=readable, limit=limit)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(key, value, "a UTF-8 text file",
                          f"byte {raw[exc.start]:#04x} at offset {exc.start} is not UTF-8 ({exc.reason})") from None


def key_path(parts) -> str:
    """``a.b[2].c`` from ("a", "b", 2, "c")."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


class _Obj(dict):
    """A JSON object as parsed, remembering the first key it was given more than once."""

    __slots__ = ("dup",)


def _pairs(pairs: list[tuple[str, Any]]) -> _Obj:
    d = _Obj()
    d.dup = None
    for k, v in pairs:
        if k in d and d.dup is None:
            d.dup = (k, [w for j, w in pairs if j == k])
        d[k] = v
    return d


class DuplicateKeyError(ValueError):
    """A JSON object names one key more than once: ``key_path`` (``optimizer.params.lr``) and the ``values``."""

    def __init__(self, parts: tuple, values: list):
        self.parts, self.key_path, self.values = parts, key_path(parts), values
        super().__init__(f"{self.key_path!r} is given {len(values)} times: {values!r}")


def _plain(x: Any, path: tuple) -> Any:
    """``x`` with every _Obj a plain dict; raises DuplicateKeyError at the first repeated key (outermost first)."""
    if isinstance(x, _Obj):
        if x.dup is not None:
            raise DuplicateKeyError(path + (x.dup[0],), x.dup[1])
        return {k: _plain(v, path + (k,)) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain(v, path + (i,)) for i, v in enumerate(x)]
    return x


def parse_json(text: str) -> Any:
    """``json.loads(text)`` refusing a key given twice in one object (DuplicateKeyError, a ValueError).

    Also raises json.JSONDecodeError, RecursionError (nested too deeply) and ValueError (an integer of more
    digits than Python converts)."""
    return _plain(json.loads(text, object_pairs_hook=_pairs), ())


def read_json(path: Path, key: str, value: str, *, readable: str, valid: str,
              detail: str = "not valid JSON: {exc}", top: str | None = None) -> Any:
    """The parsed JSON document at ``path``.

    Raises ConfigError(key, value, ...) expecting ``readable`` when the file cannot be read (:func:`read_bytes`:
    missing, not a regular file, too large), a UTF-8 text file when it is not UTF-8, ``valid`` when it is not JSON
    (the hint is ``detail`` formatted with the JSONDecodeError as ``exc``) or is nested too deeply; and, when
    ``top`` is given, ``top`` when the document is not a JSON object. A key given twice in one object raises
    ConfigError naming its key path (``optimizer.params.lr``) and the values given.
    """
    text = read_text(path, key, value, readable=readable)
    try:
        doc = parse_json(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(key, value, valid, detail.format(exc=exc)) from None
    except RecursionError:
        raise ConfigError(key, value, valid, "it is nested too deeply to be a configuration") from None
    except DuplicateKeyError as dup:
        raise ConfigError(dup.key_path, dup.values, "one value: each key once in its object",
                          f"{key} {value} gives it {len(dup.values)} times and JSON readers disagree on which one "
                          "wins; keep one") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise ConfigError(key, value, valid, str(exc)) from None
    if top is not None and not isinstance(doc, dict):
        raise ConfigError(key, value, top)
    return doc


_PSEUDO = ("/proc", "/sys")


def check_output(path: str | os.PathLike, key: str) -> Path:
    """``path`` as a Path, once it is known that a regular file can be written there; else ConfigError(key, ...).

    Refused: an empty path or one with a NUL byte; an existing directory, FIFO, device or socket (a symlink is
    fine: it is replaced, not followed); a path under something that is not a directory; a path in /proc or
    /sys. Missing parent folders are fine (:func:`write_text` creates them)."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigError(key, path, "a file path")
    text = os.fspath(path)
    if "\0" in str(text):
        raise ConfigError(key, text, "a path without NUL bytes")
    p = Path(text)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    except OSError as exc:  # ENOTDIR: under a regular file; ELOOP, ENAMETOOLONG, EACCES
        raise ConfigError(key, text, "a path where a file can be written", _why(exc)) from None
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        raise ConfigError(key, text, "a path to a regular file", f"it is {file_kind(st.st_mode)}; nothing was written")
    q = p.absolute().parent
    while not os.path.lexists(q) and q != q.parent:
        q = q.parent
    if not q.is_dir():
        raise ConfigError(key, text, "a path under a directory", f"{q} is not a directory")
    real = os.path.realpath(q)
    for d in _PSEUDO:
        if real == d or real.startswith(d + "/"):
            raise ConfigError(key, text, "a path on a real filesystem", f"{real} is in {d}, a filesystem of the "
                              "kernel's, not a disk")
    return p


def write_text(path: str | os.PathLike, text: str, key: str) -> Path:
    """Write ``text`` to ``path`` atomically (:func:`check_output`; missing parent folders created; a new
    temporary file of random name beside it, created exclusively with mode 0600, fsynced, then renamed onto
    ``path``). Any failure is a ConfigError(key, path, ...) naming the reason, and leaves no temporary file."""
    p = check_output(path, key)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as exc:
        raise ConfigError(key, os.fspath(path), "a path where a file can be written", _why(exc)) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise ConfigError(key, os.fspath(path), "a path where a file can be written", _why(exc)) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p
