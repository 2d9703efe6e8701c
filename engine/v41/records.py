"""Byte records of V4.1's QAT-quantized KV, for the paged pools (engine/v41/kv_cache.py).

A record stores one row exactly as the model quantizes it, so decoding a record gives the
model's fake-quantized values bit for bit:
  * `v41_fp8`        window KV: D e4m3 codes, then D/32 ue8m0 exponent bytes (512 → 528 B);
  * `v41_fp4_index`  index keys: D/2 bytes of e2m1 pairs (low nibble = even element), then D/32
                     ue8m0 bytes (128 → 68 B);
  * `fp4_kv`         compressed KV: the kernels' format (D/2 e2m1 bytes + D/16 e4m3 scales,
                     512 → 288 B), whose rules are V4.1's compressed-KV quantizer.
NaN scales are stored as the scale type's NaN byte (0xFF for ue8m0), so a poisoned block stays
all-NaN.
"""

from __future__ import annotations

import torch

from .quant import quantize_fp4_index, quantize_fp8

OWN_FORMATS = ("v41_fp8", "v41_fp4_index")


def record_bytes(fmt: str, dim: int) -> int:
    if fmt == "v41_fp8":
        return dim + dim // 32
    if fmt == "v41_fp4_index":
        return dim // 2 + dim // 32
    raise KeyError(fmt)


def _exponent_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales [..., nb, 1] → ue8m0 bytes [..., nb] (NaN → 0xFF)."""
    _, e = torch.frexp(scale[..., 0])
    byte = (e - 1 + 127).clamp(0, 254).to(torch.uint8)
    return byte.masked_fill(torch.isnan(scale[..., 0]), 255)


def _scales_of(byte: torch.Tensor) -> torch.Tensor:
    value = torch.ldexp(torch.ones(byte.shape, device=byte.device), byte.to(torch.int32) - 127)
    return torch.where(byte == 255, float("nan"), value)


def _e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """Exact e2m1 grid values (NaN read as 0) → 4-bit codes, sign in bit 3. Arithmetic on the
    grid (0, .5, 1, 1.5 → 0..3; 2, 3, 4 → 4..6; 6 → 7) rather than a lookup table: a table
    would be host data copied to the device inside a captured step."""
    mag = torch.nan_to_num(values.abs(), nan=0.0)
    code = torch.where(mag < 2, mag * 2, (mag + 2).clamp(max=7))
    return (code.to(torch.uint8) + 8 * torch.signbit(values).to(torch.uint8)).to(torch.uint8)


def _e2m1_values(nibbles: torch.Tensor) -> torch.Tensor:
    """4-bit codes (int64) → fp32 grid values, the inverse of `_e2m1_codes` (code 8 is −0)."""
    m = (nibbles & 7).float()
    mag = torch.where(m < 4, m * 0.5, torch.where(m == 7, 6.0, m - 2))
    return torch.where(nibbles >= 8, -mag, mag)


def encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Rows [N, D] (before quantization) → records uint8 [N, record_bytes]."""
    n, d = x.shape
    if fmt == "v41_fp8":
        codes, scale = quantize_fp8(x, 32)
        data = codes.flatten(-2).to(torch.float8_e4m3fn).view(torch.uint8)  # exact: already on the grid
        return torch.cat([data, _exponent_bytes(scale)], dim=1)
    if fmt == "v41_fp4_index":
        codes, scale = quantize_fp4_index(x, 32)
        nibbles = _e2m1_codes(codes.flatten(-2))
        packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
        return torch.cat([packed, _exponent_bytes(scale)], dim=1)
    raise KeyError(fmt)


def decode(records: torch.Tensor, fmt: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Records uint8 [N, record_bytes] → rows [N, dim] in `dtype` (exact)."""
    n = records.shape[0]
    if fmt == "v41_fp8":
        codes = records[:, :dim].contiguous().view(torch.float8_e4m3fn).float().view(n, -1, 32)
        scale = _scales_of(records[:, dim:])
    elif fmt == "v41_fp4_index":
        packed = records[:, :dim // 2].long()
        nibbles = torch.stack([packed & 15, packed >> 4], dim=-1).flatten(1)
        codes = _e2m1_values(nibbles).view(n, -1, 32)
        scale = _scales_of(records[:, dim // 2:])
    else:
        raise KeyError(fmt)
    return (codes * scale[..., None]).flatten(1).to(dtype)
