"""KV record formats: byte layouts, numeric rules and paged-pool addressing.

Every format stores one D-wide vector per token as a fixed-size byte record. All multi-byte
values are little-endian. Element codes are packed in element order; for FP4 two codes share a
byte, the even element in the low nibble.

- ``bf16``        D x bf16 (2*D bytes). Round-to-nearest-even; Inf kept; NaN -> 0x7FC0.
- ``fp8_ds_mla``  vLLM's DeepSeek-V4 ``fp8_ds_mla`` entry (584 bytes for D=512):
                  [ (D-64) e4m3 "nope" codes | 64 bf16 "rope" values | ue8m0 scales + pad ].
                  One ue8m0 scale per 64 nope values; the scale area is padded with zero bytes
                  to a multiple of 4 (7 scales + 1 pad for D=512). In a paged pool vLLM does not
                  keep the record contiguous: a block of B tokens holds all B data parts
                  (576 bytes each, token order) followed by all B scale parts (8 bytes each);
                  see vllm/models/deepseek_v4/common/ops/cache_utils.py. A standalone record
                  (``quantize``) is the same layout with B = 1, i.e. data then scales.
- ``fp4_kv``      V4.1 compressed KV: D/2 bytes of e2m1 codes, then D/16 e4m3 scales
                  (one per 16 values): 512 -> 256 + 32 = 288 bytes. Record contiguous.
- ``fp4_index``   indexer keys: D/2 bytes of e2m1 codes, then D/32 ue8m0 scales
                  (one per 32 values): 128 -> 64 + 4 = 68 bytes. Record contiguous.

Numeric rules shared by every implementation (reference, numba, CUDA), bit for bit:
- Inputs are converted to fp32 first (exact for bf16/fp16). NaN never counts towards a block's
  amax; +-Inf counts as +-FLT_MAX, so Inf saturates to the largest code of its block.
- ue8m0 scale: s = 2^ceil(log2(max(amax, 1e-4) / qmax)), with qmax 448 (e4m3) or 6 (e2m1),
  the ceil taken exactly from the fp32 quotient's bits. Stored as the byte exponent + 127.
  The 1e-4 floor follows vLLM, so an all-zero block stores 2^-22 (byte 105) and zero codes.
- e4m3 block scale (fp4_kv): s = e4m3_rne(max(amax / 6, 2^-9)), saturating at 448; an all-zero
  block stores 2^-9 (byte 0x01) and zero codes. Values beyond 6 * 448 saturate to +-6 * 448.
- Element code = RNE(x / s) in the element type, saturating to its largest finite value
  (448 for e4m3, 6 for e2m1). The sign is kept, so tiny negatives become -0.
- NaN: e4m3 elements encode NaN as 0x7F. e2m1 has no NaN, so a NaN poisons its block instead:
  its codes are computed with NaN read as 0 and its scale byte is the scale type's NaN
  (0x7F for e4m3, 0xFF for ue8m0), so the whole block dequantizes to NaN.
- Dequantization is code * scale in fp32 (exact), then cast to the output dtype (RNE).
"""
from __future__ import annotations

from dataclasses import dataclass

FORMAT_NAMES = ("bf16", "fp8_ds_mla", "fp4_kv", "fp4_index")

ROPE_DIM = 64           # fp8_ds_mla: trailing values kept as bf16
FP8_DS_MLA_GROUP = 64   # nope values per ue8m0 scale
FP4_KV_GROUP = 16       # values per e4m3 scale
FP4_INDEX_GROUP = 32    # values per ue8m0 scale
UE8M0_AMAX_FLOOR = 1e-4
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E4M3_MIN_SUBNORMAL = 2.0 ** -9


@dataclass(frozen=True, slots=True)
class KVFormat:
    """Byte layout of one record; ``data`` precedes ``scales`` inside a record."""

    name: str
    dim: int            # values per record
    quant_dim: int      # leading values that are block-quantized (the rest are bf16)
    group: int          # values per scale (0: no scales)
    data_bytes: int     # codes (+ bf16 tail) per record
    num_scales: int     # real scale bytes per record
    scale_bytes: int    # scale bytes per record, padding included
    split_block: bool   # pool block = all data parts, then all scale parts (vLLM fp8_ds_mla)

    @property
    def record_bytes(self) -> int:
        return self.data_bytes + self.scale_bytes


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def get_format(name: str, dim: int) -> KVFormat:
    """The layout of ``name`` for D = ``dim``; raises ValueError for unsupported dims."""
    if name not in FORMAT_NAMES:
        raise ValueError(f"unknown KV format {name!r}; expected one of {FORMAT_NAMES}")
    if dim <= 0:
        raise ValueError(f"{name}: dim must be positive, got {dim}")
    if name == "bf16":
        return KVFormat(name, dim, 0, 0, 2 * dim, 0, 0, False)
    if name == "fp8_ds_mla":
        nope = dim - ROPE_DIM
        if nope <= 0 or nope % FP8_DS_MLA_GROUP:
            raise ValueError(
                f"fp8_ds_mla: dim - {ROPE_DIM} must be a positive multiple of "
                f"{FP8_DS_MLA_GROUP}, got dim={dim}")
        n = nope // FP8_DS_MLA_GROUP
        return KVFormat(name, dim, nope, FP8_DS_MLA_GROUP, nope + 2 * ROPE_DIM, n,
                        _round_up(n, 4), True)
    group = FP4_KV_GROUP if name == "fp4_kv" else FP4_INDEX_GROUP
    if dim % group:
        raise ValueError(f"{name}: dim must be a multiple of {group}, got {dim}")
    return KVFormat(name, dim, dim, group, dim // 2, dim // group, dim // group, False)


def slot_offsets(fmt: KVFormat, slot, block_size: int):
    """Byte offsets (data, scales) of ``slot`` in a flat pool of ``block_size``-token blocks."""
    block, pos = slot // block_size, slot % block_size   # works for ints and int64 tensors
    base = block * block_size * fmt.record_bytes
    if fmt.split_block:
        return base + pos * fmt.data_bytes, base + block_size * fmt.data_bytes + pos * fmt.scale_bytes
    data = base + pos * fmt.record_bytes
    return data, data + fmt.data_bytes
