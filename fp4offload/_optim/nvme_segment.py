"""One segment file of the NVMe store: its names, the disk space it takes, its header and the checks a read makes.

File layout: fp4offload's container (fp4offload/formats/container.py: magic, format version, a checksummed
JSON header with the shape, dtype, offset and CRC32 of every tensor, then the raw bytes) holding the six
tensors of one segment (``m_codes``, ``m_scales``, ``m_tscale``, ``v_codes``, ``v_scales``, ``v_tscale``;
in a store made with ``residuals=True``, ``FP4AdamW(master="split", nvme=NvmeOptions(master_device="nvme"))``,
also split's residual of the segment: ``master_lo``, ``master_odd_bits``, see state.Residual) and in the header the
segment's identity (key, segment number, element count, v format) and where it stands: the tensor's ``step``
count the states belong to, the store's generation ``gen`` that wrote it and the store's ``run`` id (random,
one per store). The aio engine lays the same container out for direct I/O (nvme_aio.py).

Names: the committed file of segment s of key k is ``<k>.s<s:05d>.fp4s``; the file a generation g writes
before it is committed is ``.<k>.s<s:05d>.g<g>.fp4s`` beside it (nvme_txn.py).

Reads check magic, version, identity, step, generation, run id, sizes and checksums against the record
(:func:`check_segment`) and raise CorruptionError naming the file and the segment: a damaged file, or an older
(or another run's) valid copy put in its place, is never used.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import CorruptionError
from .nvme_aio import ALIGN, TENSOR_ALIGN, round_up
from .reference_step import SEGMENT, Packed, packed_sizes
from .state import PACKED_KEYS, RESIDUAL_KEYS, Residual, residual_sizes

KIND = "fp4offload._optim.segment"
KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,120}")
_HEADER_ALLOWANCE = 4096  # bytes of container header counted when checking free space


class Record(NamedTuple):
    """What the store expects of a key's files: the generation that wrote them (0: none yet, the states
    are zeros), the tensor's step count they belong to, its element count and v format."""

    gen: int
    step: int
    numel: int
    v_format: str


# ---- sizes ----------------------------------------------------------------------------------------------------

def segment_file_bytes(n: int, residual: bool = False) -> int:
    """Payload bytes of one segment file of n elements, with split's residual or without (the header adds well
    under 1 KiB)."""
    c, s, t = packed_sizes(n)
    return 2 * (c + s + t) + (sum(residual_sizes(n)) if residual else 0)


def segment_disk_bytes(n: int, residual: bool = False) -> int:
    """Disk space one segment file of n elements may take, on either engine (what a transaction reserves)."""
    tensors = len(PACKED_KEYS) + (len(RESIDUAL_KEYS) if residual else 0)
    return round_up(segment_file_bytes(n, residual) + tensors * TENSOR_ALIGN, ALIGN) + _HEADER_ALLOWANCE


def tensor_disk_bytes(n: int, residual: bool = False) -> int:
    """Disk space of the files of a tensor of n elements."""
    return sum(segment_disk_bytes(min(n, s0 + SEGMENT) - s0, residual) for s0 in range(0, n, SEGMENT))


def segments_of(n: int) -> int:
    return -(-n // SEGMENT)


def segment_numel(numel: int, seg: int) -> int:
    """Elements of segment `seg` of a tensor of `numel` elements."""
    return min(numel, (seg + 1) * SEGMENT) - seg * SEGMENT


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


# ---- header and tensors -------------------------------------------------------------------------------------

def header(key: str, seg: int, n: int, v_format: str, step: int, gen: int, run: str) -> dict:
    """The identity and standing of a segment file, as its container header's meta holds them."""
    return {"kind": KIND, "key": key, "segment": seg, "numel": n, "v_format": v_format, "step": int(step),
            "gen": int(gen), "run": run}


def expected_header(key: str, seg: int, rec: Record, run: str) -> dict:
    """The header a segment of `key` must have to be the one `rec` names."""
    return header(key, seg, segment_numel(rec.numel, seg), rec.v_format, rec.step, rec.gen, run)


def segment_tensors(m: Packed, v: Packed, res: Residual | None) -> dict[str, torch.Tensor]:
    """The tensors of a segment file, by name."""
    tensors = dict(zip(PACKED_KEYS, (*m, *v)))
    if res is not None:
        tensors.update(zip(RESIDUAL_KEYS, (res.lo.view(torch.uint8), res.bits)))
    return tensors


def unpack(t: dict[str, torch.Tensor], residuals: bool) -> tuple[Packed, Packed, Residual | None]:
    """(m, v, residual) of a segment file's checked tensors (residual: None in a store without residuals)."""
    res = Residual(t["master_lo"].view(torch.int16), t["master_odd_bits"]) if residuals else None
    return (Packed(t["m_codes"], t["m_scales"], t["m_tscale"]), Packed(t["v_codes"], t["v_scales"], t["v_tscale"]),
            res)


# ---- checks -------------------------------------------------------------------------------------------------

def check_residual(path: Path, where: str, t: dict, n: int) -> None:
    """The residual tensors of a segment file of n elements: present, of their sizes, no odd bit past the end."""
    for name, size in zip(RESIDUAL_KEYS, residual_sizes(n)):
        if name not in t:
            raise CorruptionError(path, f"{where}: the file holds no split residual (tensor {name!r} is missing), "
                                  "which this store keeps beside the states", expected=size, found=None)
        if t[name].numel() != size or t[name].dtype != torch.uint8:
            raise CorruptionError(path, f"{where}: tensor {name!r} has the wrong size", expected=size,
                                  found=t[name].numel())
    if n % 8 and int(t["master_odd_bits"][-1]) >> (n % 8):
        raise CorruptionError(path, f"{where}: odd positions past the segment's {n} elements")


def check_segment(path: Path, where: str, meta, t: dict, want: dict, n: int, v_format: str, rec: Record,
                  residuals: bool) -> None:
    """A segment file read for `where`: the layout the optimizer asked for (n elements in v_format) is the one
    `rec` names, the header is `want`, and the tensors are those of a segment of n elements (with the residual
    exactly when the store keeps residuals). CorruptionError otherwise."""
    if n != want["numel"] or v_format != rec.v_format:
        raise CorruptionError(path, f"{where}: the optimizer asked for {n} elements in {v_format}, the "
                              "store holds another layout", expected=(want["numel"], rec.v_format),
                              found=(n, v_format))
    if not isinstance(meta, dict) or meta != want:
        raise CorruptionError(path, f"{where}: {_mismatch(meta, want)}", expected=want, found=meta)
    c, s, ts = packed_sizes(n)
    sizes = dict(zip(PACKED_KEYS, (c, s, ts, c, s, ts)))
    for name, size in sizes.items():
        if name not in t or t[name].numel() != size or t[name].dtype != torch.uint8:
            raise CorruptionError(path, f"{where}: tensor {name!r} has the wrong size", expected=size,
                                  found=None if name not in t else t[name].numel())
    if residuals:
        check_residual(path, where, t, n)
    extra = sorted(set(t) - set(sizes) - {"_pad", *(RESIDUAL_KEYS if residuals else ())})
    if extra:
        raise CorruptionError(path, f"{where}: unexpected tensors {extra}" + (
            " (a split residual, which this store does not keep)" if set(extra) & set(RESIDUAL_KEYS) else ""))


def _mismatch(found, want: dict) -> str:
    """Why a segment's header does not match what the store expects, in words."""
    if not isinstance(found, dict):
        return "header does not match"
    ident = ("kind", "key", "segment", "numel", "v_format")
    if any(found.get(k) != want[k] for k in ident):
        return "header does not match"
    if found.get("run") != want["run"]:
        return (f"header does not match: the file was written by another store (run {found.get('run')!r}, this one "
                f"is {want['run']!r}), not by this optimizer")
    if found.get("step") != want["step"] or found.get("gen") != want["gen"]:
        return (f"header does not match: a stale segment (step {found.get('step')}, generation {found.get('gen')}; "
                f"the optimizer expects step {want['step']}, generation {want['gen']})")
    return "header does not match"
