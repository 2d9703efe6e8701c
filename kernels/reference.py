"""Readable torch definitions of every kernel op; the numba and CUDA versions must match these.

KV formats and their numeric rules are specified in ``kernels/formats.py``. Routing and the
expert permutation are specified on ``route`` and ``permute`` below; the quantized GEMMs (FP8
block-scaled and packed-FP4 weights, dense and grouped) and activation fake-quantization in the
last section.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import checks
from kernels.formats import E2M1_MAX, E4M3_MAX, E4M3_MIN_SUBNORMAL, UE8M0_AMAX_FLOOR, KVFormat, slot_offsets

FLT_MAX = torch.finfo(torch.float32).max
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
BF16_NAN_BITS = 0x7FC0
E4M3_NAN_CODE = 0x7F
UE8M0_NAN_CODE = 0xFF


# ---- element and scale codes -------------------------------------------------------------

def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 (RNE) as int16 bits; every NaN becomes 0x7FC0."""
    bits = x.to(torch.bfloat16).view(torch.int16)
    return torch.where(torch.isnan(x), torch.tensor(BF16_NAN_BITS, dtype=torch.int16), bits)


def e4m3_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3fn codes (RNE, saturating at +-448, sign kept); NaN -> 0x7F."""
    codes = y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(y), torch.tensor(E4M3_NAN_CODE, dtype=torch.uint8), codes)


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float()


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """fp32 -> e2m1 codes (RNE: a tie goes to the even code; saturating at 6; sign kept)."""
    a = y.abs()
    # One step per representable value; ">=" where the lower neighbour's code is odd.
    magnitude = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
                 + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    return (magnitude + 8 * torch.signbit(y).int()).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    magnitude = E2M1_VALUES.to(codes.device)[(codes & 7).long()]
    return torch.where(codes >= 8, -magnitude, magnitude)


def ue8m0_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """ceil(log2(max(amax, 1e-4) / qmax)), exact: read off the fp32 quotient's frexp."""
    ratio = amax.clamp(min=UE8M0_AMAX_FLOOR) / qmax
    mantissa, exponent = torch.frexp(ratio)          # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent as fp32 (exact for exponent in [-149, 127])."""
    return torch.ldexp(torch.ones(exponent.shape, device=exponent.device), exponent)


def ue8m0_values(codes: torch.Tensor) -> torch.Tensor:
    scale = pow2(codes.int() - 127)
    return torch.where(codes == UE8M0_NAN_CODE, torch.nan, scale)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def _blocks(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, G*group] -> (values [N, G, group] with Inf clamped, amax [N, G] ignoring NaN, has_nan)."""
    xb = x.clamp(-FLT_MAX, FLT_MAX).unflatten(-1, (-1, group))
    mag = xb.abs()
    has_nan = torch.isnan(mag)
    amax = torch.where(has_nan, 0.0, mag).amax(dim=-1)
    return xb, amax, has_nan.any(dim=-1)


def _pad(scales: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    return F.pad(scales, (0, fmt.scale_bytes - fmt.num_scales))


# ---- quantize / dequantize records --------------------------------------------------------

def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [N, D] float -> records uint8 [N, record_bytes]."""
    f = checks.check_values(x, fmt)
    x = x.float()
    if f.name == "bf16":
        return bf16_bits(x).view(torch.uint8)                       # [N, 2D]
    xb, amax, has_nan = _blocks(x[:, :f.quant_dim], f.group)         # [N, G, group], [N, G]
    if f.name == "fp8_ds_mla":
        exponent = ue8m0_exponent(amax, E4M3_MAX)
        codes = e4m3_codes(xb / pow2(exponent)[..., None]).flatten(1)
        rope = bf16_bits(x[:, f.quant_dim:]).view(torch.uint8)       # [N, 2 * 64]
        scales = _pad((exponent + 127).to(torch.uint8), f)
        return torch.cat([codes, rope, scales], dim=1)
    if f.name == "fp4_kv":
        scale_codes = e4m3_codes((amax / E2M1_MAX).clamp(min=E4M3_MIN_SUBNORMAL))
        scale = e4m3_values(scale_codes)
        scale_codes = torch.where(has_nan, E4M3_NAN_CODE, scale_codes)
    else:                                                            # fp4_index
        exponent = ue8m0_exponent(amax, E2M1_MAX)
        scale = pow2(exponent)
        scale_codes = torch.where(has_nan, UE8M0_NAN_CODE, exponent + 127).to(torch.uint8)
    y = torch.nan_to_num(xb, nan=0.0) / scale[..., None]
    packed = pack_nibbles(e2m1_codes(y).flatten(1))                  # [N, D/2]
    return torch.cat([packed, _pad(scale_codes, f)], dim=1)


def dequantize(records: torch.Tensor, fmt: str, out_dtype: torch.dtype = torch.float32,
               dim: int | None = None) -> torch.Tensor:
    """records uint8 [N, record_bytes] -> values [N, D] in ``out_dtype``."""
    f = checks.format_for_records(records, fmt, dim)
    checks.check_records(records, f)
    checks.check_out_dtype(out_dtype)
    return _dequantize_f32(records, f).to(out_dtype)


def _dequantize_f32(records: torch.Tensor, f: KVFormat) -> torch.Tensor:
    n = records.shape[0]
    if f.name == "bf16":
        return records.contiguous().view(torch.bfloat16).float()
    data, scale_codes = records[:, :f.data_bytes], records[:, f.data_bytes:][:, :f.num_scales]
    if f.name == "fp8_ds_mla":
        codes = data[:, :f.quant_dim].reshape(n, -1, f.group)
        nope = e4m3_values(codes) * ue8m0_values(scale_codes)[..., None]
        rope = data[:, f.quant_dim:].contiguous().view(torch.bfloat16).float()  # [N, 64]
        return torch.cat([nope.flatten(1), rope], dim=1)
    codes = unpack_nibbles(data).reshape(n, -1, f.group)
    if f.name == "fp4_kv":
        scale = e4m3_values(scale_codes)
    else:
        scale = ue8m0_values(scale_codes)
    return (e2m1_values(codes) * scale[..., None]).flatten(1)


# ---- paged pool ---------------------------------------------------------------------------

def _byte_index(f: KVFormat, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat pool byte positions [M, record_bytes] of each slot's record (data, then scales)."""
    data_off, scale_off = slot_offsets(f, slots, block_size)
    return torch.cat([data_off[:, None] + torch.arange(f.data_bytes),
                      scale_off[:, None] + torch.arange(f.scale_bytes)], dim=1)


def quantize_scatter(x: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor, fmt: str) -> None:
    """Quantize x [N, D] and write row i to slot slot_mapping[i] of pool [blocks, B, R] in place.

    slot = block * B + offset; slot -1 skips the row. Duplicate slots are a caller error.
    """
    f = checks.check_values(x, fmt)
    checks.check_pool(pool, f)
    checks.check_slots(slot_mapping, x.shape[0], pool.shape[0] * pool.shape[1], check_range=True)
    keep = slot_mapping >= 0
    records = quantize(x[keep], fmt)
    pool.view(-1)[_byte_index(f, slot_mapping[keep], pool.shape[1])] = records


def gather_dequantize(pool: torch.Tensor, slots: torch.Tensor, fmt: str,
                      out_dtype: torch.dtype = torch.float32, dim: int | None = None) -> torch.Tensor:
    """Read slots [M] from pool and dequantize -> [M, D]; slot -1 gives a zero row."""
    f = checks.format_for_records(pool, fmt, dim)
    checks.check_pool(pool, f)
    checks.check_out_dtype(out_dtype)
    checks.check_slots(slots, None, pool.shape[0] * pool.shape[1], check_range=True)
    records = pool.view(-1)[_byte_index(f, slots.clamp(min=0), pool.shape[1])]
    values = _dequantize_f32(records, f)
    return torch.where((slots >= 0)[:, None], values, 0.0).to(out_dtype)


# ---- MoE routing ----------------------------------------------------------------------------

def router_scores(logits: torch.Tensor) -> torch.Tensor:
    """s = sqrt(softplus(logits)), softplus as torch's (beta 1, threshold 20), fp32."""
    return F.softplus(logits.float()).sqrt()


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scaling_factor: float,
          token_ids: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits fp32 [T, E] -> (weights fp32 [T, k], expert_ids int32 [T, k]).

    Selection: hash routing ids = tid2eid[token_ids] (bias ignored) when tid2eid is given, else
    the top-k of key = s + bias in descending key order, ties to the lower expert id, a NaN key
    ranking below every number (as -inf). Weights: w = s[ids]; w / (w_0 + ... + w_{k-1} + 1e-20)
    * routed_scaling_factor, summed left to right in fp32. A selected NaN score makes the token's
    weights NaN; a selected +Inf score gets weight NaN (inf/inf) and the others 0.
    """
    checks.check_route(logits, bias, top_k, token_ids, tid2eid)
    s = router_scores(logits)                                        # [T, E]
    if tid2eid is not None:
        ids = tid2eid[token_ids.long()].long()                       # [T, k]
    else:
        key = s if bias is None else s + bias
        key = torch.where(torch.isnan(key), -torch.inf, key)
        ids = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = s.gather(1, ids)                                             # [T, k]
    denom = w[:, 0]
    for j in range(1, top_k):
        denom = denom + w[:, j]
    weights = w / (denom + 1e-20)[:, None] * routed_scaling_factor
    return weights, ids.to(torch.int32)


def permute(expert_ids: torch.Tensor, num_experts: int,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the T*k routed slots by expert for an expert-parallel all-to-all.

    expert_ids [T, k] -> counts int32 [E], offsets int32 [E+1] (offsets[0] = 0, exclusive
    prefix sum of counts), order int32 [T*k] (flat slots t*k+j sorted by expert, ascending slot
    within an expert), inverse int32 [T*k] with order[inverse[f]] == f.
    """
    checks.check_expert_ids(expert_ids, num_experts, check_range=True)
    flat = expert_ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    order = torch.sort(flat, stable=True).indices
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return counts.int(), offsets.int(), order.int(), inverse.int()


# ---- quantized GEMMs: weights kept in stored form ---------------------------------------------
#
# Dense weights: e4m3 codes W [N, K] with one scale per bN x bK block, scale [ceil(N/bN),
# ceil(K/bK)]. Routed experts: e2m1 codes packed two per byte along K (low nibble = even k),
# [N, K/2], one scale per ``group`` (32) along K, scale [N, ceil(K/group)]. Scales are E8M0 bytes
# (float8_e8m0fnu or uint8: 2^(b-127), 0xFF is NaN) or plain fp32. Grouped (MoE) versions stack
# E experts in front: [E, N, ...]. A GEMM computes, in fp32 with fp32 accumulation,
#     out[m, n] = sum_k a[m, k] * W[n, k] * scale[n // bN, k // bK]       (FP4: scale[n, k // group])
# where a = x, or act_quant_fp8(x) computed in fp32 when act_quant, then casts to out_dtype
# (default x.dtype). Every special value follows IEEE: a NaN weight code (e4m3 0x7F/0xFF), a NaN
# scale or a NaN activation makes every output it is multiplied into NaN (0 * NaN is NaN).

ACT_GROUP = 32      # V4.1: activations are fake-quantized per 32 channels along K
FP4_GROUP = 32      # values per scale along K in FP4 expert weights


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Scale tensor -> fp32: E8M0 bytes (float8_e8m0fnu or uint8) decode to 2^(b-127), NaN for
    0xFF; fp32 scales are taken as they are."""
    if scale.dtype == torch.float32:
        return scale
    return ue8m0_values(scale.view(torch.uint8))


def act_quant_fp8(x: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """Fake-quantize x [..., K] per ``group`` channels along K: quantize to e4m3 and back.

    s = 2^ceil(log2(max(amax, 1e-4) / 448)) per group (the last group may be shorter when K is
    not a multiple of ``group``); value = e4m3_rne(x / s) * s, saturating at +-448 * s; the result
    is cast to x.dtype (RNE; exact for bf16 and fp32). Special values, as in kernels/formats.py:
    NaN never counts towards amax and stays NaN; +-Inf counts as +-FLT_MAX, so its group gets
    s = 2^120 and the Inf comes back as +-Inf (256 * 2^120 overflows fp32) while the group's
    finite values flush to +-0 or tiny multiples of 2^111.
    """
    return _act_quant_f32(x, group).to(x.dtype)


def _act_quant_f32(x: torch.Tensor, group: int) -> torch.Tensor:
    k = x.shape[-1]
    padded = F.pad(x.float(), (0, -k % group))             # zeros never raise a group's amax
    xb, amax, _ = _blocks(padded, group)                   # [..., G, group], [..., G]
    scale = pow2(ue8m0_exponent(amax, E4M3_MAX))[..., None]
    y = e4m3_values(e4m3_codes(xb / scale)) * scale
    return y.flatten(-2)[..., :k]


def dequantize_fp8_weight(weight: torch.Tensor, scale: torch.Tensor,
                          block: tuple[int, int]) -> torch.Tensor:
    """e4m3 [..., N, K] (float8_e4m3fn or uint8 codes) with block scales -> fp32 [..., N, K]."""
    n, k = weight.shape[-2:]
    s = scale_values(scale)                                # [..., NB, KB]
    s = s.repeat_interleave(block[0], dim=-2)[..., :n, :].repeat_interleave(block[1], dim=-1)[..., :k]
    return e4m3_values(weight.view(torch.uint8)) * s


def dequantize_fp4_weight(packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP) -> torch.Tensor:
    """Packed e2m1 [..., N, K/2] (int8 or uint8) with scales [..., N, ceil(K/group)] -> fp32 [..., N, K]."""
    codes = unpack_nibbles(packed.view(torch.uint8))      # [..., N, K]
    s = scale_values(scale).repeat_interleave(group, dim=-1)[..., :codes.shape[-1]]
    return e2m1_values(codes) * s


def _activation(x: torch.Tensor, act_quant: bool, act_group: int) -> torch.Tensor:
    return _act_quant_f32(x, act_group) if act_quant else x.float()


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
               act_quant: bool = False, out_dtype: torch.dtype | None = None,
               act_group: int = ACT_GROUP) -> torch.Tensor:
    """x [M, K] @ dequant(weight [N, K])^T -> [M, N] (see the section comment)."""
    checks.check_fp8_gemm("fp8_linear", x, weight, scale, block, None, out_dtype, act_group)
    w = dequantize_fp8_weight(weight, scale, block)       # [N, K]
    return (_activation(x, act_quant, act_group) @ w.T).to(out_dtype or x.dtype)


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, act_quant: bool = False,
               out_dtype: torch.dtype | None = None, group: int = FP4_GROUP,
               act_group: int = ACT_GROUP) -> torch.Tensor:
    """x [M, K] @ dequant(packed [N, K/2])^T -> [M, N] (see the section comment)."""
    checks.check_fp4_gemm("fp4_linear", x, packed, scale, group, None, out_dtype, act_group)
    w = dequantize_fp4_weight(packed, scale, group)       # [N, K]
    return (_activation(x, act_quant, act_group) @ w.T).to(out_dtype or x.dtype)


def _grouped(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows [offsets[e-1], offsets[e]) of a [S, K] times w[e]^T ([E, N, K]); rows at or past
    offsets[-1] belong to no expert and are zero."""
    out = torch.zeros(a.shape[0], w.shape[1])             # [S, N]
    start = 0
    for e, end in enumerate(offsets.tolist()):
        out[start:end] = a[start:end] @ w[e].T
        start = end
    return out


def fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                   block: tuple[int, int] = (128, 128), act_quant: bool = False,
                   out_dtype: torch.dtype | None = None, act_group: int = ACT_GROUP) -> torch.Tensor:
    """Per expert e: x rows [offsets[e-1], offsets[e]) @ dequant(weight[e])^T; x [S, K],
    weight [E, N, K], scale [E, NB, KB], offsets [E] cumulative ends (as F.grouped_mm's offs)."""
    checks.check_fp8_gemm("fp8_grouped_mm", x, weight, scale, block, offsets, out_dtype, act_group)
    w = dequantize_fp8_weight(weight, scale, block)       # [E, N, K]
    return _grouped(_activation(x, act_quant, act_group), w, offsets).to(out_dtype or x.dtype)


def fp4_grouped_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                   act_quant: bool = False, out_dtype: torch.dtype | None = None, group: int = FP4_GROUP,
                   act_group: int = ACT_GROUP) -> torch.Tensor:
    """Per expert e: x rows [offsets[e-1], offsets[e]) @ dequant(packed[e])^T; x [S, K],
    packed [E, N, K/2], scale [E, N, ceil(K/group)], offsets [E] cumulative ends."""
    checks.check_fp4_gemm("fp4_grouped_mm", x, packed, scale, group, offsets, out_dtype, act_group)
    w = dequantize_fp4_weight(packed, scale, group)       # [E, N, K]
    return _grouped(_activation(x, act_quant, act_group), w, offsets).to(out_dtype or x.dtype)


# ---- dense expert GEMMs ---------------------------------------------------------------------

def check_dense_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                           op: str = "dense_grouped_mm") -> None:
    """x [S, K] float, weight [E, N, K] of x's dtype (any strides), offsets int32 [E] on x's
    device; offset values are checked on the host only (reading CUDA offsets would sync)."""
    if x.dim() != 2 or x.dtype not in checks.FLOAT_DTYPES:
        raise ValueError(f"{op}: x must be [S, K] of {checks.FLOAT_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    if weight.dim() != 3 or weight.dtype != x.dtype:
        raise ValueError(f"{op}: weight must be [E, N, K] of x's dtype {x.dtype}, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if weight.shape[2] != x.shape[1]:
        raise ValueError(f"{op}: x has K={x.shape[1]} but the weight has K={weight.shape[2]}")
    if offsets.dtype != torch.int32:
        raise ValueError(f"{op}: offsets must be int32 cumulative row ends (F.grouped_mm's offs), got {offsets.dtype}")
    if not x.device == weight.device == offsets.device:
        raise ValueError(f"{op}: x ({x.device}), weight ({weight.device}) and offsets ({offsets.device}) "
                         f"must be on one device")
    checks.check_offsets(op, offsets, weight.shape[0], x.shape[0])


def dense_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per expert e: x rows [offsets[e-1], offsets[e]) @ weight[e]^T in fp32, cast to x.dtype;
    x [S, K], weight [E, N, K], offsets [E] cumulative ends, i.e. F.grouped_mm(x,
    weight.transpose(1, 2), offs=offsets), except that rows at or past offsets[-1] are zero
    (torch leaves them unwritten)."""
    check_dense_grouped_mm(x, weight, offsets)
    return _grouped(x.float(), weight.float(), offsets).to(x.dtype)
