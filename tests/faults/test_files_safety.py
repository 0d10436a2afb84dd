"""Files that cannot be redirected, opened to other users, or misread.

Real files, real symlinks and FIFOs, and a real tmpfs that fills up:

- writes (PackedTensor.save and every container, the planner's emitted configs and readings) go to a new
  temporary file of random name, created exclusively with mode 0600: a symlink planted at the old predictable
  name (or at the target) is not written through, a pre-existing 0666 file does not make the result 0666, a
  full disk leaves the old file and no temporary;
- reads refuse a FIFO, a directory or a device without blocking, check the header before the payload, refuse a
  header that names a key twice, and cross-check a PackedTensor header against itself and its payload (a
  relabelled format, dtype, block, scope or shape is a CorruptionError naming the field);
- JSON input files name the key path of a repeated key.
"""

from __future__ import annotations

import itertools
import json
import os
import stat
import struct
import subprocess
import time
import zlib
from pathlib import Path

import pytest
import torch

import fp4offload
from fp4offload import CorruptionError, PackedTensor
from fp4offload.errors import ConfigError
from fp4offload.formats import container
from fp4offload._jsonfile import check_output, read_json, write_text


def _packed(fmt="nvfp4", shape=(5, 70), **kw) -> PackedTensor:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    return fp4offload.quantize(x.abs() if fmt == "ufp4" else x, fmt, **kw)


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


# ---------------------------------------------------------------------------------------------
# writes


def test_planted_symlink_at_the_old_temporary_name_is_not_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    path = tmp_path / "x.fp4"
    # the names the old writer used (".<name>.tmp<pid>"), for this process and its neighbours
    for pid in (os.getpid(), os.getpid() + 1, 1):
        os.symlink(victim, tmp_path / f".x.fp4.tmp{pid}")
    os.symlink(victim, tmp_path / ".x.fp4.tmp")
    p = _packed()
    p.save(path)
    assert victim.read_text() == "precious\n"
    assert not path.is_symlink() and path.is_file() and _mode(path) == 0o600
    q = PackedTensor.load(path)
    assert torch.equal(q.data, p.data) and torch.equal(q.scales, p.scales)
    links = sorted(n.name for n in tmp_path.iterdir() if n.is_symlink())
    assert len(links) == 4  # the planted links are left alone, and no temporary is left behind
    assert sorted(n.name for n in tmp_path.iterdir()) == sorted(links + ["victim.txt", "x.fp4"])


def test_symlink_at_the_target_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    path = tmp_path / "x.fp4"
    os.symlink(victim, path)
    _packed().save(path)
    assert victim.read_text() == "precious\n" and not path.is_symlink()
    PackedTensor.load(path)


def test_preexisting_0666_files_do_not_lend_their_mode(tmp_path):
    path = tmp_path / "x.fp4"
    for name in (f".x.fp4.tmp{os.getpid()}", "x.fp4"):
        (tmp_path / name).write_bytes(b"old")
        os.chmod(tmp_path / name, 0o666)
    old = os.umask(0)
    try:
        _packed().save(path)
        fd, tmp = container.create_temp(tmp_path / "y.fp4")
        os.close(fd)
    finally:
        os.umask(old)
    assert _mode(path) == 0o600 and _mode(tmp) == 0o600
    assert (tmp_path / f".x.fp4.tmp{os.getpid()}").read_bytes() == b"old"  # not reused


def test_temporary_names_are_random_and_exclusive(tmp_path):
    names = set()
    for _ in range(20):
        fd, tmp = container.create_temp(tmp_path / "s.fp4")
        os.close(fd)
        assert tmp.parent == tmp_path and tmp.name.startswith(".s.fp4.") and tmp.name.endswith(".tmp")
        names.add(tmp.name)
    assert len(names) == 20 and not any(str(os.getpid()) in n for n in names)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 256 KiB tmpfs (root only; skipped elsewhere)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_keeps_the_old_file_and_no_temporary(small_tmpfs):
    path = small_tmpfs / "w.fp4"
    small = _packed(shape=(64,))
    small.save(path)
    before = path.read_bytes()
    with pytest.raises(OSError) as e:
        _packed(shape=(1024, 1024)).save(path)  # ~576 KiB: does not fit
    assert e.value.errno == 28
    assert path.read_bytes() == before and os.listdir(small_tmpfs) == ["w.fp4"]
    with pytest.raises(ConfigError) as e:  # the planner's writer says it as a ConfigError naming the flag
        write_text(small_tmpfs / "big.json", "x" * (512 << 10), "--emit")
    assert e.value.key == "--emit" and "space" in str(e.value)
    assert os.listdir(small_tmpfs) == ["w.fp4"]


def test_text_writer_refuses_what_is_not_a_file_and_keeps_0600(tmp_path):
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    victim = tmp_path / "victim.json"
    victim.write_text("{}")
    link = tmp_path / "link.json"
    os.symlink(victim, link)
    for bad, why in ((tmp_path, "directory"), (fifo, "FIFO"), (tmp_path / "victim.json" / "x", "Not a directory"),
                     ("/proc/self/x.json", "/proc"), ("", "file path"), (str(tmp_path / "a\0b"), "NUL")):
        with pytest.raises(ConfigError) as e:
            write_text(bad, "{}", "--out")
        assert e.value.key == "--out" and why in str(e.value), str(e.value)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    write_text(link, '{"new": 1}', "--out")
    assert victim.read_text() == "{}" and not link.is_symlink() and _mode(link) == 0o600
    assert check_output(tmp_path / "new" / "deeper" / "x.json", "--out") == tmp_path / "new" / "deeper" / "x.json"


# ---------------------------------------------------------------------------------------------
# reads


def test_reads_refuse_fifos_directories_and_devices_without_blocking(tmp_path):
    fifo = tmp_path / "fifo.fp4"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.fp4"
    os.symlink("/dev/zero", zero)
    t0 = time.perf_counter()
    for p, what in ((fifo, "FIFO"), (tmp_path, "directory"), (zero, "character device")):
        for read in (PackedTensor.load, container.read_container, container.verify_container):
            with pytest.raises(CorruptionError) as e:
                read(p)
            assert what in str(e.value) and str(p) in str(e.value)
        with pytest.raises(ConfigError) as e:
            read_json(p, "--model", str(p), readable="a readable config.json", valid="JSON")
        assert e.value.key == "--model" and what in str(e.value)
    assert time.perf_counter() - t0 < 5


def test_header_is_checked_before_the_payload_is_read(tmp_path):
    """A file that claims a huge header, or is not a container at all, fails on its first 20 bytes."""
    path = tmp_path / "big.fp4"
    with open(path, "wb") as f:
        f.write(container.MAGIC + struct.pack("<QI", 1 << 20, 0))
        f.truncate(1 << 19)
    with pytest.raises(CorruptionError, match="truncated header"):
        container.read_container(path)
    with open(path, "r+b") as f:
        f.write(container.MAGIC + struct.pack("<QI", (container.MAX_HEADER_BYTES + 1), 0))
    with pytest.raises(CorruptionError, match="header too large"):
        container.verify_container(path)


def test_verify_streams_and_agrees_with_read(tmp_path):
    path = tmp_path / "v.fp4"
    p = _packed(shape=(700, 1500))  # ~ 600 KiB of codes: several chunks
    p.save(path)
    meta, entries = container.verify_container(path)
    meta2, tensors = container.read_container(path)
    assert meta == meta2 and list(entries) == list(tensors)
    for k, t in tensors.items():
        assert entries[k]["shape"] == list(t.shape) and entries[k]["nbytes"] == t.numel() * t.element_size()
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError, match="checksum mismatch"):
        container.verify_container(path)


def _rewrite_header(path: Path, edit) -> None:
    """Apply ``edit(header_dict)`` to a container's header and fix the header checksum (a careful forger)."""
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[20:20 + hlen])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(raw[:8] + struct.pack("<QI", len(new), zlib.crc32(new)) + new + raw[20 + hlen:])


def test_repeated_header_key_is_refused(tmp_path):
    path = tmp_path / "d.fp4"
    _packed().save(path)
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[8:16])
    header = raw[20:20 + hlen]
    new = header.replace(b'"dtype": "float32"', b'"dtype": "float16", "dtype": "float32"', 1)
    assert new != header
    path.write_bytes(raw[:8] + struct.pack("<QI", len(new), zlib.crc32(new)) + new + raw[20 + hlen:])
    with pytest.raises(CorruptionError) as e:
        PackedTensor.load(path)
    assert "meta.dtype" in str(e.value) and "2 times" in str(e.value)


@pytest.mark.parametrize("field, value", [("format", "ufp4"), ("dtype", "int64"), ("dtype", "bfloat16"),
                                          ("block", "16x16"), ("scale_scope", 8), ("scale_scope", 64)])
def test_relabelled_header_names_the_field(tmp_path, field, value):
    path = tmp_path / "r.fp4"
    p = _packed()  # nvfp4, 1x16, (5, 70), float32, one tensor scale
    p.save(path)
    _rewrite_header(path, lambda h: h["meta"].update({field: value}))
    with pytest.raises(CorruptionError) as e:
        PackedTensor.load(path)
    assert f"'{field}'" in str(e.value), str(e.value)


def test_header_cross_check_fuzz(tmp_path):
    """Every single-field change of a saved header (with its checksum fixed) is refused; the count is printed."""
    values = {"format": ["nvfp4", "ufp4", "mxfp4", "mxfp8", "fp4", "", None, 3],
              "block": ["1x16", "16x16", "1x32", "32x1", None],
              "dtype": ["float32", "bfloat16", "float16", "int64", "uint8", "float64", None],
              "scale_scope": [0, 16, 64, 1024, 8, -16, True, "16", None],
              "shape": [[5, 70], [70, 5], [350], [5, 71], [5, 69], [], [-5, -70], None, "5x70"],
              "binding": [0, 1, -1, None, "x", 2 ** 40]}
    sources = [("nvfp4", (5, 70), {}), ("ufp4", (5, 70), {}), ("nvfp4", (5, 70), {"block": "16x16"}),
               ("mxfp4", (5, 70), {}), ("nvfp4", (5, 70), {"scale_scope": 64})]
    n = refused = 0
    wrong = []
    for (fmt, shape, kw), (field, vals) in itertools.product(sources, values.items()):
        path = tmp_path / "c.fp4"
        _packed(fmt, shape, **kw).save(path)
        orig, raw = PackedTensor.load(path).header(), path.read_bytes()
        for v in vals:
            if field != "binding" and orig.get(field) == v:
                continue
            path.write_bytes(raw)
            _rewrite_header(path, lambda h: h["meta"].update({field: v}) if v is not None else h["meta"].pop(field))
            n += 1
            try:
                PackedTensor.load(path)
            except CorruptionError as e:
                refused += 1
                if f"'{field}'" not in str(e) and not (field in ("shape", "binding") and field in str(e)):
                    wrong.append((fmt, field, v, str(e)[:160]))
            except Exception as e:  # anything else is a bug
                wrong.append((fmt, field, v, f"{type(e).__name__}: {e}"))
            else:
                if not (field == "scale_scope" and v in (None,) and orig["scale_scope"] == 0):  # absent means 0
                    wrong.append((fmt, field, v, "loaded"))
    print(f"fuzz: {n} relabelled headers, {refused} refused as CorruptionError")
    assert not wrong, wrong[:10]
    assert n > 150


def test_json_repeated_keys_name_the_key_path(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"a": {"b": [1, {"c": 1, "d": 2, "c": 3}]}, "e": 1}')
    with pytest.raises(ConfigError) as e:
        read_json(p, "--config", str(p), readable="readable", valid="JSON")
    assert e.value.key == "a.b[1].c" and e.value.value == [1, 3] and "--config" in str(e.value)
    p.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_json(p, "--config", str(p), readable="readable", valid="JSON")
    p.write_text("[" * 100_000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        read_json(p, "--config", str(p), readable="readable", valid="JSON")


def test_file_saved_before_the_binding_loads_only_when_asked(tmp_path):
    """A file without `binding` (an older save) is refused by default, naming the way to load it; with
    unbound_ok=True it loads (the other cross-checks still apply) and saving it again binds it."""
    path = tmp_path / "old.fp4"
    pt = _packed("nvfp4", (5, 70))
    pt.save(path)
    _rewrite_header(path, lambda h: h["meta"].pop("binding"))
    with pytest.raises(CorruptionError, match="unbound_ok=True"):
        PackedTensor.load(path)
    old = PackedTensor.load(path, unbound_ok=True)
    assert torch.equal(old.dequantize(torch.float32), pt.dequantize(torch.float32))
    old.save(tmp_path / "new.fp4")
    again = PackedTensor.load(tmp_path / "new.fp4")
    assert torch.equal(again.dequantize(torch.float32), pt.dequantize(torch.float32))
    _rewrite_header(path, lambda h: h["meta"].update(dtype="int64"))  # unbound, but the cross-checks still hold
    with pytest.raises(CorruptionError, match="dtype"):
        PackedTensor.load(path, unbound_ok=True)
