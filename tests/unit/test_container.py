"""PackedTensor.save / load and the checksummed container under them (fp4offload/formats/container.py).

Real files in a temporary folder: round trips are bit for bit; every kind of damage (a flipped
byte anywhere, a truncation at any length, a missing file, another file format) raises
CorruptionError naming the file; files are private (0600) and written atomically (no temp file
left behind, the old file intact when a write fails).
"""

from __future__ import annotations

import os
import stat
import struct
import zlib

import pytest
import torch

import fp4offload
from fp4offload import CorruptionError, PackedTensor
from fp4offload.formats import container

CASES = [("nvfp4", {}, (37, 50), torch.float32), ("nvfp4", {"block": "16x16"}, (20, 33), torch.bfloat16),
         ("nvfp4", {"scale_scope": 64}, (300,), torch.float16), ("ufp4", {}, (3, 5, 7), torch.float32),
         ("mxfp4", {"rounding": "stochastic", "seed": 3}, (65,), torch.bfloat16), ("mxfp8", {}, (4, 32), torch.float32),
         ("nvfp4", {}, (), torch.float32), ("mxfp4", {}, (0, 5), torch.float32)]


def _packed(fmt, kw, shape, dtype, seed=0) -> PackedTensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    return fp4offload.quantize((x.abs() if fmt == "ufp4" else x).to(dtype), fmt, **kw)


def _same(a: PackedTensor, b: PackedTensor) -> None:
    assert a.header() == b.header()
    assert (a.shape, a.dtype, a.format, a.block, a.scale_scope) == (b.shape, b.dtype, b.format, b.block, b.scale_scope)
    ta, tb = a.tensors(), b.tensors()
    assert list(ta) == list(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape, k
        assert ta[k].contiguous().view(torch.uint8).tolist() == tb[k].contiguous().view(torch.uint8).tolist(), k


def _saved(tmp_path, name="t.fp4"):
    p = _packed("nvfp4", {}, (5, 7), torch.float32)
    path = tmp_path / name
    p.save(path)
    return p, path, path.read_bytes()


def _expect_corruption(path, *, match_path=True) -> CorruptionError:
    with pytest.raises(CorruptionError) as ei:
        PackedTensor.load(path)
    if match_path:
        assert str(path) in str(ei.value) and str(ei.value.path) == str(path)
    return ei.value


def _header_span(raw: bytes) -> tuple[int, int]:
    (hlen,) = struct.unpack("<Q", raw[8:16])
    return 20, 20 + hlen  # magic, length, header crc32, header


@pytest.mark.parametrize("fmt,kw,shape,dtype", CASES)
def test_round_trip_bit_for_bit(tmp_path, fmt, kw, shape, dtype):
    p = _packed(fmt, kw, shape, dtype)
    path = tmp_path / "state.fp4"
    p.save(path)
    q = PackedTensor.load(path)
    _same(p, q)
    d, e = p.dequantize(), q.dequantize()
    assert d.dtype == e.dtype == dtype and d.shape == e.shape
    assert torch.equal(d.reshape(-1).view(torch.uint8), e.reshape(-1).view(torch.uint8))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.listdir(tmp_path) == ["state.fp4"]


def test_overwrite_is_atomic_and_private(tmp_path):
    path = tmp_path / "w.fp4"
    path.write_bytes(b"old")
    os.chmod(path, 0o644)
    p1 = _packed("nvfp4", {}, (64,), torch.float32, seed=1)
    p1.save(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    p2 = _packed("mxfp4", {}, (96,), torch.float32, seed=2)
    p2.save(path)
    _same(p2, PackedTensor.load(path))
    assert os.listdir(tmp_path) == ["w.fp4"]


def test_failed_write_keeps_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    """A write that fails midway (here: fsync raises, as on a full or failing disk) leaves the old file."""
    p_old = _packed("nvfp4", {}, (64,), torch.float32, seed=1)
    path = tmp_path / "m.fp4"
    p_old.save(path)

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(container.os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        _packed("nvfp4", {}, (640,), torch.float32, seed=2).save(path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["m.fp4"]
    _same(p_old, PackedTensor.load(path))


def test_flipped_byte_in_magic_length_or_payload(tmp_path):
    """Every byte outside the JSON header (magic, header length, tensor bytes), flipped three ways."""
    _, path, raw = _saved(tmp_path)
    h0, h1 = _header_span(raw)
    positions = list(range(0, h0)) + list(range(h1, len(raw)))
    assert len(raw) - h1 > 16  # the payload is really there
    for i in positions:
        for flip in (0x01, 0x80, 0xFF):
            b = bytearray(raw)
            b[i] ^= flip
            path.write_bytes(bytes(b))
            e = _expect_corruption(path)
            if i >= h1:
                assert "checksum" in str(e) and e.offset is not None


def test_flipped_byte_in_header(tmp_path):
    _, path, raw = _saved(tmp_path)
    h0, h1 = _header_span(raw)
    wrong = []
    for i in range(h0, h1):
        b = bytearray(raw)
        b[i] ^= 0x01
        path.write_bytes(bytes(b))
        try:
            PackedTensor.load(path)
            wrong.append((i, "loaded"))
        except CorruptionError:
            pass
        except Exception as e:
            wrong.append((i, type(e).__name__))
    assert not wrong, wrong[:10]


def test_trailing_bytes(tmp_path):
    _, path, raw = _saved(tmp_path)
    path.write_bytes(raw + b"\x00")
    _expect_corruption(path)


def test_truncated_at_every_length(tmp_path):
    _, path, raw = _saved(tmp_path)
    for n in range(len(raw)):
        path.write_bytes(raw[:n])
        _expect_corruption(path)


def test_missing_file(tmp_path):
    e = _expect_corruption(tmp_path / "nowhere.fp4")
    assert "missing" in str(e)


def test_wrong_magic_and_other_formats(tmp_path):
    _, path, raw = _saved(tmp_path)
    path.write_bytes(b"FP4OFFL\x02" + raw[8:])  # a future container version
    assert "magic" in str(_expect_corruption(path))
    other = tmp_path / "pickle.pt"
    torch.save({"data": torch.zeros(4)}, other)
    assert "magic" in str(_expect_corruption(other))
    text = tmp_path / "text.fp4"
    text.write_text("hello, this is not an fp4offload file\n")
    _expect_corruption(text)


def test_unsupported_version(tmp_path):
    """A well-formed file from another container version is refused, not misread."""
    p, path, _ = _saved(tmp_path)
    container.write_container(path, p.header(), p.tensors())
    raw = path.read_bytes()
    h0, h1 = _header_span(raw)
    header = raw[h0:h1].replace(b'"version": 1', b'"version": 9')
    assert header != raw[h0:h1]
    path.write_bytes(raw[:8] + struct.pack("<QI", len(header), zlib.crc32(header)) + header + raw[h1:])
    assert "version" in str(_expect_corruption(path))
