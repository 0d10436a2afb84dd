"""What FP4AdamW keeps in a store of fp4offload/_store: the tensors and header of a segment file, their sizes and
the checks of a read, and a kept folder's manifest, read back as state-dict entries.

A segment file (fp4offload/_store/segment.py: a checksummed container named ``<key>.s<segment:05d>.fp4s``) holds
the six tensors of one segment of a parameter's states (``m_codes``, ``m_scales``, ``m_tscale``, ``v_codes``,
``v_scales``, ``v_tscale``; in a store made with ``residuals=True``,
``FP4AdamW(master="split", nvme=NvmeOptions(master_device="nvme"))``, also split's residual of the segment:
``master_lo``, ``master_odd_bits``, see state.Residual) and in the header the segment's identity (kind, key,
segment number, element count, v format) and where it stands: the tensor's ``step`` count the states belong to,
the store's generation ``gen`` that wrote it and the store's ``run`` id (random, one per store).

Reads check magic, version, identity, step, generation, run id, sizes and checksums against the key's
:class:`Record` (:func:`check_segment`) and raise CorruptionError naming the file and the segment: a damaged file,
or an older (or another run's) valid copy put in its place, is never used.

A kept folder (``keep=True``) gets, once its store closed, a ``manifest.json`` listing each key's step, size and
v format (:class:`StateFolder`); :func:`read_kept` reads it back as state-dict entries.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch

from ..errors import CorruptionError
from ..formats.container import read_container
from .._store.aio import ALIGN, aio_layout
from .._store.folder import Folder, write_json
from .._store.segment import KEY_RE, file_disk_bytes, header_mismatch, segment_name
from .reference_step import SEGMENT, Packed, packed_sizes, v_bits
from .state import PACKED_KEYS, RESIDUAL_KEYS, Residual, residual_sizes

KIND = "fp4offload._optim.segment"
FOLDER_PREFIX = "fp4adamw-"
MANIFEST_NAME = "manifest.json"
MANIFEST_KIND = "fp4offload._optim.nvme_folder"
_IDENT = ("kind", "key", "segment", "numel", "v_format")


class Record(NamedTuple):
    """What the store expects of a key's files: the generation that wrote them (0: none yet, the states
    are zeros), the tensor's step count they belong to, its element count and v format."""

    gen: int
    step: int
    numel: int
    v_format: str


# ---- sizes ----------------------------------------------------------------------------------------------------

def segment_file_bytes(n: int, residual: bool = False, v_bits: int = 4) -> int:
    """Payload bytes of one segment file of n elements, with split's residual or without, v's codes of `v_bits`
    bits (the default, 4, bounds every v format; the header adds well under 1 KiB)."""
    c, s, t = packed_sizes(n)
    return 2 * (c + s + t) - (c - packed_sizes(n, v_bits)[0]) + (sum(residual_sizes(n)) if residual else 0)


def segment_disk_bytes(n: int, residual: bool = False, v_bits: int = 4) -> int:
    """Disk space one segment file of n elements may take, on either engine (what a transaction reserves), with v's
    codes of `v_bits` bits."""
    return file_disk_bytes(segment_file_bytes(n, residual, v_bits),
                           len(PACKED_KEYS) + (len(RESIDUAL_KEYS) if residual else 0))


def tensor_disk_bytes(n: int, residual: bool = False, v_bits: int = 4) -> int:
    """Disk space of the files of a tensor of n elements."""
    return sum(segment_disk_bytes(min(n, s0 + SEGMENT) - s0, residual, v_bits) for s0 in range(0, n, SEGMENT))


def segments_of(n: int) -> int:
    return -(-n // SEGMENT)


def segment_numel(numel: int, seg: int) -> int:
    """Elements of segment `seg` of a tensor of `numel` elements."""
    return min(numel, (seg + 1) * SEGMENT) - seg * SEGMENT


def locked_bytes(buffers: int, residual: bool = False) -> int:
    """Page-locked bytes of `buffers` aio buffers, each the file of a whole segment (with split's residual)."""
    c, s, t = packed_sizes(SEGMENT)
    sizes = dict(zip(PACKED_KEYS, (c, s, t) * 2))
    if residual:
        sizes.update(zip(RESIDUAL_KEYS, residual_sizes(SEGMENT)))
    return buffers * (ALIGN + aio_layout(sizes)[1])


# ---- header and tensors -------------------------------------------------------------------------------------

def header(key: str, seg: int, n: int, v_format: str, step: int, gen: int, run: str) -> dict:
    """The identity and standing of a segment file, as its container header's meta holds them."""
    return {"kind": KIND, "key": key, "segment": seg, "numel": n, "v_format": v_format, "step": int(step),
            "gen": int(gen), "run": run}


def expected_header(key: str, seg: int, rec: Record, run: str) -> dict:
    """The header a segment of `key` must have to be the one `rec` names."""
    return header(key, seg, segment_numel(rec.numel, seg), rec.v_format, rec.step, rec.gen, run)


def segment_tensors(m: Packed, v: Packed, res: Residual | None) -> dict[str, torch.Tensor]:
    """The tensors of a segment file, by name (flat uint8)."""
    tensors = dict(zip(PACKED_KEYS, (t.reshape(-1) for t in (*m, *v))))
    if res is not None:
        tensors.update(zip(RESIDUAL_KEYS, (res.lo.view(torch.uint8).reshape(-1), res.bits.reshape(-1))))
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
        raise CorruptionError(path, f"{where}: {header_mismatch(meta, want, _IDENT)}", expected=want, found=meta)
    c, s, ts = packed_sizes(n)
    sizes = dict(zip(PACKED_KEYS, (c, s, ts, packed_sizes(n, v_bits(v_format))[0], s, ts)))
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


# ---- a kept folder --------------------------------------------------------------------------------------------

class StateFolder(Folder):
    """The store's folder (``<nvme_path>/fp4adamw-XXXXXXXX/``, fp4offload/_store/folder.py); kept, it gets the
    manifest of `records` (each key's step: `steps`, the optimizer's step counts given at close, else the
    record's)."""

    def __init__(self, root: Path, keep: bool, run: str, records: dict[str, Record], residuals: bool = False):
        super().__init__(root, FOLDER_PREFIX, keep, "kept: FP4AdamW(nvme=NvmeOptions(keep=True)); remove the folder "
                         "when done\n")
        self.run, self.records, self.residuals = run, records, residuals
        self.steps: dict[str, int] = {}

    def on_keep(self) -> None:
        keys = {k: {"step": int(self.steps.get(k, r.step)), "numel": r.numel, "v_format": r.v_format,
                    "segments": segments_of(r.numel)} for k, r in sorted(self.records.items()) if r.gen > 0}
        write_json(self.path / MANIFEST_NAME, {"kind": MANIFEST_KIND, "run": self.run, "keys": keys,
                                               "residuals": self.residuals})


def read_kept(folder) -> dict[str, dict]:
    """The states of a folder kept with ``keep=True`` (``FP4AdamW(nvme=NvmeOptions(keep=True))``), after its store
    closed.

    Returns ``{key: entry}``, each entry an FP4AdamW state-dict entry (``step``, ``v_format`` and the six packed
    uint8 tensors; split's ``master_lo`` and ``master_odd`` too when the files hold the residual) that
    ``fp4offload._optim.load_param_states(opt, {tensor: entry})`` loads (with the bf16 parameters of that moment).
    Every file is checked (checksums, identity, run id); anything missing or not matching raises
    CorruptionError."""
    folder = Path(folder)
    mpath = folder / MANIFEST_NAME
    try:
        manifest = json.loads(mpath.read_text())
    except FileNotFoundError:
        raise CorruptionError(mpath, "manifest is missing (the folder was not kept, or its store did not close)") \
            from None
    except (OSError, ValueError) as e:
        raise CorruptionError(mpath, f"unreadable manifest ({type(e).__name__}: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("kind") != MANIFEST_KIND:
        raise CorruptionError(mpath, "not a kept NVMe state folder's manifest", expected=MANIFEST_KIND,
                              found=manifest.get("kind") if isinstance(manifest, dict) else type(manifest).__name__)
    residuals = bool(manifest.get("residuals", False))
    out = {}
    for key, info in manifest.get("keys", {}).items():
        if not KEY_RE.fullmatch(str(key)):
            raise CorruptionError(mpath, f"bad key {key!r}")
        n, vf = int(info["numel"]), info["v_format"]
        parts = []
        for seg in range(segments_of(n)):
            path = folder / segment_name(key, seg)
            meta, t = read_container(path)
            m = segment_numel(n, seg)
            want = {"kind": KIND, "key": key, "segment": seg, "numel": m, "v_format": vf, "run": manifest.get("run")}
            got = {k: meta.get(k) for k in want}
            if got != want:
                raise CorruptionError(path, f"segment {seg} of tensor {key}: header does not match the manifest",
                                      expected=want, found=got)
            if residuals:
                check_residual(path, f"segment {seg} of tensor {key}", t, m)
            parts.append(t)
        entry = {"step": torch.tensor(float(info["step"])), "v_format": vf}
        if residuals:  # the state dict's form: int16 residual and int64 positions, as bytes
            entry["master_lo"] = torch.cat([pt["master_lo"].reshape(-1) for pt in parts])
            odd = [Residual(pt["master_lo"].view(torch.int16), pt["master_odd_bits"]).odd() + s * SEGMENT
                   for s, pt in enumerate(parts)]
            entry["master_odd"] = torch.cat(odd).view(torch.uint8)
        for k in PACKED_KEYS:
            entry[k] = torch.cat([pt[k].reshape(-1) for pt in parts])
        out[key] = entry
    return out
