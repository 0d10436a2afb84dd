"""The torch reference backend: docs/design.md section 3 with tensor ops, on any device.

It is the oracle the CPU and CUDA kernels are tested against, and the fallback when neither builds.
Every backend exposes the same six functions with the same signatures (see fp4offload/_ops).

Layouts (shared by all backends):
- ``tile == 1``: blocks of ``block`` consecutive elements of the flattened tensor, zero-padded at the
  end; codes in that order. ``scope`` elements share one fp32 tensor scale (0: the whole tensor).
- ``tile == 16``: 16x16 tiles of the (rows, cols) view, zero-padded to (rows_p, cols_p); codes are
  stored row-major over the padded view, block scales row-major over the tile grid; one tensor scale.
Packed nibbles: element 2i in bits 0-3 of byte i, element 2i+1 in bits 4-7, an odd tail padded with code
0; :func:`pack_nibbles` and :func:`unpack_nibbles` are the only place this module writes that rule (the C++
and CUDA kernels have theirs in csrc/fp4_codec.h). A 2-bit grid (FP4AdamW's ue2m0 v state) packs four codes a
byte, element 4i + k in bits 2k..2k+1 of byte i (:func:`pack_codes` with 2 bits). Sizes and the rows/cols view are
``layout``'s.
"""

from __future__ import annotations

import torch

from . import bits as B

NVFP4_BLOCK = 16
MX_BLOCK = 32


def _div(a, b) -> torch.Tensor:
    """Correctly rounded fp32 a / b with both operands as full tensors.

    Dividing by a Python scalar may be lowered to a multiply by its reciprocal (torch does this on
    CUDA), which rounds differently from the kernels; full-size operands keep it a true division.
    """
    if not torch.is_tensor(a):
        a = torch.full_like(b, a)
    if not torch.is_tensor(b):
        b = torch.full_like(a, b)
    return torch.div(a, b)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (0..15, any shape, taken flat) -> uint8, two a byte: element 2i low, 2i+1 high."""
    c = codes.to(torch.uint8).reshape(-1)
    if c.numel() % 2:
        c = torch.cat((c, c.new_zeros(1)))
    c = c.view(-1, 2)
    return c[:, 0] | (c[:, 1] << 4)


def unpack_nibbles(data: torch.Tensor) -> torch.Tensor:
    """uint8 -> the codes, flat, two per byte (a padded odd tail comes back as a last code 0)."""
    d = data.reshape(-1)
    return torch.stack((d & 0xF, d >> 4), dim=1).reshape(-1)


def pack_codes(codes: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Codes of `bits` bits (4: :func:`pack_nibbles`; 2: four a byte, element 4i + k in bits 2k..2k+1 of byte i,
    a tail padded with code 0)."""
    if bits == 4:
        return pack_nibbles(codes)
    c = codes.to(torch.uint8).reshape(-1)
    if c.numel() % 4:
        c = torch.cat((c, c.new_zeros(4 - c.numel() % 4)))
    c = c.view(-1, 4)
    return c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)


def unpack_codes(data: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the codes, flat."""
    if bits == 4:
        return unpack_nibbles(data)
    d = data.reshape(-1)
    return torch.stack((d & 3, (d >> 2) & 3, (d >> 4) & 3, d >> 6), dim=1).reshape(-1)


def grid_of(ufp4) -> tuple[bool, int, int]:
    """(unsigned grid, mantissa bits, code bits) of nvfp4_encode's `ufp4` argument: False (E2M1), True or the
    mantissa bits of a 4-bit unsigned grid, or a grids.VGrid row."""
    if hasattr(ufp4, "bits"):
        return not ufp4.signed, ufp4.mbits, ufp4.bits
    return bool(int(ufp4)), int(ufp4), 4


def _tile_layout(x: torch.Tensor, rows: int, cols: int):
    """(blocks, index) for 16x16 tiles: blocks is (ntiles, 256) fp32, index the padded row-major position."""
    rp, cp = _ceil_div(rows, 16) * 16, _ceil_div(cols, 16) * 16
    x2 = torch.zeros((rp, cp), dtype=torch.float32, device=x.device)
    x2[:rows, :cols] = x.reshape(rows, cols)
    R, C = rp // 16, cp // 16
    blocks = x2.view(R, 16, C, 16).permute(0, 2, 1, 3).reshape(R * C, 256)
    index = torch.arange(rp * cp, device=x.device).view(R, 16, C, 16).permute(0, 2, 1, 3).reshape(R * C, 256)
    return blocks, index, (R, C)


def _untile(codes: torch.Tensor, R: int, C: int) -> torch.Tensor:
    return codes.view(R, C, 16, 16).permute(0, 2, 1, 3).reshape(-1)


def _flat_layout(x: torch.Tensor, block: int):
    n = x.numel()
    nb = _ceil_div(n, block)
    flat = torch.zeros(nb * block, dtype=torch.float32, device=x.device)
    flat[:n] = x.reshape(-1)
    return flat.view(nb, block), torch.arange(nb * block, device=x.device).view(nb, block)


def _finite_magnitudes(blocks: torch.Tensor):
    finite = torch.isfinite(blocks)
    bad = ~finite.all(dim=1)
    count = int((~finite).sum())
    a = torch.where(finite, blocks.abs(), torch.zeros_like(blocks))
    return a, bad, count


def _e2m1_codes(y: torch.Tensor, stochastic: bool, seed: int, stream: int, index: torch.Tensor) -> torch.Tensor:
    """Signed E2M1 codes of the scaled elements y: magnitude clamped to 6, nearest-even or stochastic rounding
    (random bits keyed on each element's `index`), sign from the sign bit (so -0 -> 8)."""
    ya = y.abs().clamp(max=B.E2M1_MAX)
    if stochastic:
        mag = B.e2m1_encode_magnitude_sr(ya, B.random_bits(seed, stream, index))
    else:
        mag = B.e2m1_encode_magnitude(ya)
    return mag | (B.signbit(y).to(torch.int32) << 3)


def nvfp4_encode(x: torch.Tensor, rows: int, cols: int, tile: int, scope: int, ufp4: bool,
                 stochastic: bool, seed: int, stream: int, propagate: bool, amax: torch.Tensor | None = None):
    """NVFP4 (or ufp4 when `ufp4`) encode. Returns (data u8, scales u8, tensor_scale f32[nscopes], nonfinite).
    `ufp4` may also be the mantissa bits of an unsigned 4-bit grid (grids.py's rows: 1 is ufp4, 2 is FP4AdamW's
    ue2m2 state) or a grids.VGrid row (the 2-bit ue2m0 is only reachable so); only this reference encodes grids
    other than ufp4.

    `amax` (fp32, one per scope) replaces the measured scope amax: sharded weights use the amax
    max-reduced across ranks so every rank encodes with the same tensor scale (docs/design.md 3.8).
    """
    ug, mb, cb = grid_of(ufp4)
    elem_max = B.ugrid_max(mb) if ug else B.E2M1_MAX
    if tile == 16:
        blocks, index, (R, C) = _tile_layout(x, rows, cols)
        scope_of_block = torch.zeros(blocks.shape[0], dtype=torch.long, device=x.device)
        nscopes = 1
    else:
        blocks, index = _flat_layout(x, NVFP4_BLOCK)
        per = (scope // NVFP4_BLOCK) if scope else max(blocks.shape[0], 1)
        nscopes = max(_ceil_div(blocks.shape[0], per), 1)
        scope_of_block = torch.arange(blocks.shape[0], device=x.device) // per
    a, bad, count = _finite_magnitudes(blocks)
    amax_b = a.amax(dim=1) if blocks.shape[0] else a.new_zeros(0)
    amax_s = torch.zeros(nscopes, dtype=torch.float32, device=x.device)
    amax_s.scatter_reduce_(0, scope_of_block, amax_b, reduce="amax")
    if amax is not None:
        amax_s = amax.to(device=x.device, dtype=torch.float32).reshape(-1).expand(nscopes).clone()
    nz = amax_s > 0
    s_enc = torch.where(nz, _div(elem_max * B.E4M3_MAX, torch.where(nz, amax_s, 1.0)), 0.0).clamp(max=B.F32_MAX)
    s_dec = torch.where(nz, _div(1.0, s_enc), 0.0)

    t = torch.clamp(_div(amax_b, elem_max) * s_enc[scope_of_block], max=B.E4M3_MAX)
    scale_code = B.e4m3_encode(t)
    scale_val = B.e4m3_table(x.device)[scale_code.long()]
    live = (scale_code != 0) & ~bad
    s_enc_b = torch.where(live, _div(1.0, torch.where(live, scale_val * s_dec[scope_of_block], 1.0)), 0.0)
    s_enc_b = s_enc_b.clamp(max=B.F32_MAX)  # the reciprocal may overflow when the tensor scale was clamped
    y = blocks * s_enc_b[:, None]
    if ug and stochastic:
        codes = B.ugrid_encode_sr(y.abs(), B.random_bits(seed, stream, index), mb, cb)
    elif ug:
        codes = B.ugrid_encode(y.abs(), mb, cb)
    else:
        codes = _e2m1_codes(y, stochastic, seed, stream, index)
    codes = torch.where(live[:, None], codes, torch.zeros_like(codes))
    if propagate:
        scale_code = torch.where(bad, torch.full_like(scale_code, B.E4M3_NAN), scale_code)
    if tile == 16:
        codes = _untile(codes, R, C)
    data = pack_codes(codes.reshape(-1), cb)
    return data, scale_code.to(torch.uint8).reshape(-1), s_dec.to(torch.float32), count


def nvfp4_decode(data: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor, rows: int, cols: int,
                 tile: int, scope: int, ufp4: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of nvfp4_encode: (value(code) * fp32(scale_b)) * s_dec, returned flat with rows*cols elements."""
    ug, mb, cb = grid_of(ufp4)
    codes = unpack_codes(data, cb).long()
    table = (B.ugrid_values(mb, data.device, cb) if ug
             else B.e2m1_decode_magnitude(torch.arange(16, device=data.device)))
    vals = table[codes]
    scale_val = B.e4m3_table(data.device)[scales.long()]
    if tile == 16:
        rp, cp = _ceil_div(rows, 16) * 16, _ceil_div(cols, 16) * 16
        R, C = rp // 16, cp // 16
        v = vals.view(R, 16, C, 16) * scale_val.view(R, 1, C, 1)
        v = v * tensor_scale.reshape(-1)[0]
        return v.reshape(rp, cp)[:rows, :cols].reshape(-1).to(out_dtype)
    nb = scales.numel()
    per = (scope // NVFP4_BLOCK) if scope else max(nb, 1)
    s_dec = tensor_scale.reshape(-1)[torch.arange(nb, device=data.device) // per]
    v = (vals.view(nb, NVFP4_BLOCK) * scale_val[:, None]) * s_dec[:, None]
    return v.reshape(-1)[: rows * cols].to(out_dtype)


def mx_encode(x: torch.Tensor, fp8: bool, floor_mode: bool, stochastic: bool, seed: int, stream: int,
              propagate: bool):
    """MXFP4 (E2M1) or MXFP8 (E4M3) elements with an E8M0 scale per 32. Returns (data, scales, nonfinite)."""
    blocks, index = _flat_layout(x, MX_BLOCK)
    a, bad, count = _finite_magnitudes(blocks)
    amax_b = a.amax(dim=1) if blocks.shape[0] else a.new_zeros(0)
    if fp8:
        e = B.e8m0_exponent(amax_b, 0x600000, 8, "floor" if floor_mode else "rceil")
    else:
        e = B.e8m0_exponent(amax_b, 0x400000, 2, "floor" if floor_mode else "rceil")
    y = blocks * B.pow2_f32(-e)[:, None]
    if fp8:
        codes = B.e4m3_encode(y)
    else:
        codes = _e2m1_codes(y, stochastic, seed, stream, index)
    codes = torch.where(bad[:, None], torch.zeros_like(codes), codes)
    scale_code = e + 127
    if propagate:
        scale_code = torch.where(bad, torch.full_like(scale_code, B.E8M0_NAN), scale_code)
    data = codes.to(torch.uint8).reshape(-1) if fp8 else pack_nibbles(codes.reshape(-1))
    return data, scale_code.to(torch.uint8), count


def mx_decode(data: torch.Tensor, scales: torch.Tensor, numel: int, fp8: bool, out_dtype: torch.dtype):
    if fp8:
        vals = B.e4m3_table(data.device)[data.long()]
    else:
        vals = B.e2m1_decode_magnitude(unpack_nibbles(data))
    nb = scales.numel()
    scale_val = B.e8m0_table(data.device)[scales.long()]
    v = vals.view(nb, MX_BLOCK) * scale_val[:, None]
    return v.reshape(-1)[:numel].to(out_dtype)


def int2_scale_code(amax_b: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """The int2 block scale: the smallest E4M3 code whose value is at least (amax_b / 3) * s_enc (0 only where that
    product underflows fp32 to 0)."""
    want = torch.clamp(_div(amax_b, torch.full_like(amax_b, B.INT2_MAX)) * s_enc, max=B.E4M3_MAX)
    code = B.e4m3_encode(want)
    below = (B.e4m3_table(amax_b.device)[code.long()] < want) & (code < 0x7E)
    return code + below.to(code.dtype)


def int2_encode(x: torch.Tensor, stochastic: bool, seed: int, stream: int, propagate: bool):
    """int2 (csrc/fp4_codec.h): code c of element x is the odd level 2c - 3 times its 16-element block's scale, an
    E4M3 value rounded up from amax_b / 3 under the fp32 tensor scale s_dec = amax / (3 * 448). Returns (data u8,
    scales u8, tensor_scale f32[1], nonfinite)."""
    blocks, index = _flat_layout(x, NVFP4_BLOCK)
    a, bad, count = _finite_magnitudes(blocks)
    amax_b = a.amax(dim=1) if blocks.shape[0] else a.new_zeros(0)
    amax = amax_b.amax() if amax_b.numel() else torch.zeros((), device=x.device)
    amax = amax.reshape(1)
    nz = amax > 0
    s_enc = torch.where(nz, _div(B.INT2_MAX * B.E4M3_MAX, torch.where(nz, amax, 1.0)), 0.0).clamp(max=B.F32_MAX)
    s_dec = torch.where(nz, _div(1.0, s_enc), 0.0)
    scale_code = torch.where((amax_b > 0) & nz & ~bad, int2_scale_code(amax_b, s_enc.expand_as(amax_b)), 0)
    live = scale_code != 0  # 0 also where (amax_b / 3) * s_enc underflows: the block is stored as zeros
    scale_val = B.e4m3_table(x.device)[scale_code.long()]
    k = torch.where(live, _div(1.0, torch.where(live, scale_val * s_dec, 1.0)), 0.0).clamp(max=B.F32_MAX)
    y = blocks * k[:, None]
    u = ((y + B.INT2_MAX) * 0.5).clamp(0.0, B.INT2_MAX)
    lo = u.to(torch.int32)
    frac = u - lo.to(torch.float32)
    if stochastic:
        r = (B.random_bits(seed, stream, index) >> 8).to(torch.float32) * 2.0 ** -24
        up = r < frac
    else:
        up = (frac > 0.5) | ((frac == 0.5) & (lo & 1).bool())
    codes = torch.where(live[:, None], lo + up.to(torch.int32), 2)  # a dead block: level 1 (its scale is 0 or NaN)
    if propagate:
        scale_code = torch.where(bad, torch.full_like(scale_code, B.E4M3_NAN), scale_code)
    return pack_codes(codes.reshape(-1), 2), scale_code.to(torch.uint8), s_dec.to(torch.float32), count


def int2_decode(data: torch.Tensor, scales: torch.Tensor, tensor_scale: torch.Tensor, numel: int,
                out_dtype: torch.dtype) -> torch.Tensor:
    """Inverse of int2_encode: (2c - 3) * (fp32(scale_b) * s_dec), flat, `numel` elements."""
    levels = (2 * unpack_codes(data, 2).to(torch.int32) - 3).to(torch.float32)
    d = B.e4m3_table(data.device)[scales.long()] * tensor_scale.reshape(-1)[0]
    v = levels.view(scales.numel(), NVFP4_BLOCK) * d[:, None]
    return v.reshape(-1)[:numel].to(out_dtype)
