"""One segment file of a store: its names, the disk space it may take, and its header's identity in words.

File layout: fp4offload's container (formats/container.py: ``MAGIC`` (8 bytes), header length (uint64 little
endian), CRC32 of the header (uint32 little endian), the header (UTF-8 JSON ``{"version", "meta", "tensors"}``,
each tensor with dtype, shape, offset, nbytes and crc32), then the raw bytes), written by either engine
(engines.py; the aio engine lays the same container out for direct I/O: aio.py). The header's ``meta`` names the
file's identity (a ``kind``, its key and segment number) and where it stands (its client's step, the store's
generation ``gen`` that wrote it, the store's ``run`` id); what else it holds, and which tensors, is the client's
(FP4AdamW's: fp4offload/_optim/nvme_states.py).

Names: the committed file of segment s of key k is ``<k>.s<s:05d>.fp4s``; the file a generation g writes before it
is committed is ``.<k>.s<s:05d>.g<g>.fp4s`` beside it (txn.py).
"""

from __future__ import annotations

import re
from pathlib import Path

from .aio import ALIGN, TENSOR_ALIGN, round_up

KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,120}")
HEADER_ALLOWANCE = 4096  # bytes of container header counted when checking free space


def file_disk_bytes(payload: int, tensors: int) -> int:
    """Disk space a container file of `payload` tensor bytes in `tensors` tensors may take, on either engine."""
    return round_up(payload + tensors * TENSOR_ALIGN, ALIGN) + HEADER_ALLOWANCE


# ---- names --------------------------------------------------------------------------------------------------

def segment_name(key: str, seg: int) -> str:
    return f"{key}.s{seg:05d}.fp4s"


def segment_path(folder: Path, key: str, seg: int) -> Path:
    """The committed file of segment `seg` of `key` in `folder` (ValueError for a key that is no file name)."""
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise ValueError(f"NVMe state key {key!r}: expected 1-120 characters of [A-Za-z0-9_-]")
    return folder / segment_name(key, seg)


def gen_path(folder: Path, key: str, seg: int, gen: int) -> Path:
    """The file of segment `seg` of `key` written by generation `gen`, until it is committed."""
    return segment_path(folder, key, seg).with_name(f".{key}.s{seg:05d}.g{gen}.fp4s")


def segment_files(folder: Path, key: str) -> list[Path]:
    """The committed segment files of `key`, by segment."""
    segment_path(folder, key, 0)
    return sorted(folder.glob(f"{key}.s[0-9]*.fp4s"))


def segment_of(path: Path, key: str) -> int:
    """The segment number of a committed file of `key`."""
    return int(path.name[len(key) + 2:-len(".fp4s")])


# ---- the header's identity ----------------------------------------------------------------------------------

def header_mismatch(found, want: dict, ident: tuple[str, ...]) -> str:
    """Why a segment's header `found` is not the one the store expects (`want`), in words; `ident`: the keys that
    name the file (kind, key, segment, ...), whose difference says only that the header does not match."""
    if not isinstance(found, dict):
        return "header does not match"
    if any(found.get(k) != want[k] for k in ident):
        return "header does not match"
    if found.get("run") != want["run"]:
        return (f"header does not match: the file was written by another store (run {found.get('run')!r}, this one "
                f"is {want['run']!r}), not by this optimizer")
    if found.get("step") != want["step"] or found.get("gen") != want["gen"]:
        return (f"header does not match: a stale segment (step {found.get('step')}, generation {found.get('gen')}; "
                f"the optimizer expects step {want['step']}, generation {want['gen']})")
    return "header does not match"
