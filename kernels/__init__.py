"""ringserve kernels: the only ops engine code imports.

Each op dispatches once on its tensors' device (rules in ``kernels.devices``: one device for all
arguments; CUDA tensors need the GPU toolkit, never falling back to the CPU path):
- KV cache and MoE routing: CUDA -> CuPy RawModule kernels (kernels/cuda/*.cu), CPU -> numba.
- Quantized GEMMs (FP8 block-scaled / packed FP4 weights) and activation fake-quantization:
  CUDA -> Triton (kernels/triton/quant_gemm.py), CPU -> numba tile decode + torch mm.
- Dense grouped GEMMs (MoE experts in bf16/fp16/fp32): CUDA -> torch's CUTLASS kernel where it
  has one (bf16, sm90/sm100), else Triton (kernels/triton/dense_grouped_mm.py); CPU -> torch.
- The fused decode step (mHC, norm + RoPE + KV store, compressor, indexer top-k, sparse MLA
  attention, MoE glue): CUDA -> Triton (kernels/triton/*.py), CPU -> kernels/cpu_decode.py;
  ``devices.triton_on_cpu()`` runs the Triton kernels on CPU tensors under the interpreter.
Semantics are defined by ``kernels.reference``; KV record layouts and numeric rules by
``kernels.formats``.
"""
from __future__ import annotations

import functools

from kernels import cpu_target

cpu_target.configure()  # the CPU kernels' vector width, before any of them compiles (kernels/cpu_target.py)

import torch  # noqa: E402

from kernels import cpu_gemv, cpu_kv, cpu_prepared_gemm, cpu_quant_gemm, cpu_routing
from kernels.devices import backend, decode_backend
from kernels.formats import FORMAT_NAMES, KVFormat, get_format
from kernels.reference import ACT_GROUP, FP4_GROUP, check_dense_grouped_mm

__all__ = ["FORMAT_NAMES", "KVFormat", "get_format", "quantize", "dequantize", "quantize_scatter",
           "gather_dequantize", "route", "permute", "act_quant_fp8", "dense_linear", "fp8_linear", "fp4_linear",
           "fp8_grouped_mm", "fp4_grouped_mm", "dense_grouped_mm", "prepare_quant_weight", "norm_rope", "mhc_mix",
           "mhc_expand", "compressor_step", "indexer_topk", "sparse_mla_decode", "gather_rows", "swiglu", "moe_combine"]


def _cupy(op: str, **tensors: torch.Tensor | None) -> bool:
    return backend(op, "cupy", **tensors) == "cuda"


def _triton(op: str, **tensors: torch.Tensor | None) -> bool:
    return backend(op, "triton", **tensors) == "cuda"


# ---- KV cache -------------------------------------------------------------------------------

def quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [N, D] float -> records uint8 [N, record_bytes] in format ``fmt``."""
    if _cupy("quantize", x=x):
        from kernels import cuda_kv
        return cuda_kv.quantize(x, fmt)
    return cpu_kv.quantize(x, fmt)


def dequantize(records: torch.Tensor, fmt: str, out_dtype: torch.dtype = torch.float32,
               dim: int | None = None) -> torch.Tensor:
    """records uint8 [N, record_bytes] -> [N, D] in ``out_dtype`` (D inferred unless given)."""
    if _cupy("dequantize", records=records):
        from kernels import cuda_kv
        return cuda_kv.dequantize(records, fmt, out_dtype, dim)
    return cpu_kv.dequantize(records, fmt, out_dtype, dim)


def quantize_scatter(x: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor, fmt: str) -> None:
    """Quantize x [N, D] into pool uint8 [num_blocks, block_size, record_bytes] in place.

    Row i goes to slot slot_mapping[i] = block * block_size + offset; -1 skips the row.
    """
    if _cupy("quantize_scatter", x=x, pool=pool, slot_mapping=slot_mapping):
        from kernels import cuda_kv
        return cuda_kv.quantize_scatter(x, pool, slot_mapping, fmt)
    return cpu_kv.quantize_scatter(x, pool, slot_mapping, fmt)


def gather_dequantize(pool: torch.Tensor, slots: torch.Tensor, fmt: str,
                      out_dtype: torch.dtype = torch.float32, dim: int | None = None) -> torch.Tensor:
    """Dequantize slots int64 [M] of the pool -> [M, D]; slot -1 reads as a zero row."""
    if _cupy("gather_dequantize", pool=pool, slots=slots):
        from kernels import cuda_kv
        return cuda_kv.gather_dequantize(pool, slots, fmt, out_dtype, dim)
    return cpu_kv.gather_dequantize(pool, slots, fmt, out_dtype, dim)


# ---- MoE routing ----------------------------------------------------------------------------

def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scaling_factor: float,
          token_ids: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE routing: (weights fp32 [T, k], expert_ids int32 [T, k]); see reference.route."""
    if _cupy("route", logits=logits, bias=bias, token_ids=token_ids, tid2eid=tid2eid):
        from kernels import cuda_routing
        return cuda_routing.route(logits, bias, top_k, routed_scaling_factor, token_ids, tid2eid)
    return cpu_routing.route(logits, bias, top_k, routed_scaling_factor, token_ids, tid2eid)


def permute(expert_ids: torch.Tensor, num_experts: int,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(counts [E], offsets [E+1], order [T*k], inverse [T*k]), int32; see reference.permute."""
    if _cupy("permute", expert_ids=expert_ids):
        from kernels import cuda_routing
        return cuda_routing.permute(expert_ids, num_experts)
    return cpu_routing.permute(expert_ids, num_experts)


# ---- quantized GEMMs ------------------------------------------------------------------------

def act_quant_fp8(x: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """Fake-quantize x [..., K] to e4m3 with a ue8m0 scale per ``group`` along K (quant ->
    dequant, in x.dtype); NaN/Inf rules in reference.act_quant_fp8."""
    if _triton("act_quant_fp8", x=x):
        from kernels.triton import quant_gemm
        return quant_gemm.act_quant_fp8(x, group)
    return cpu_quant_gemm.act_quant_fp8(x, group)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, allow_bf16: bool = True) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N] (F.linear without bias). On CPU, decode-sized
    fp32 products take a row kernel that streams the weight once (kernels/cpu_gemv.py); the
    rest, and every CUDA product, is torch's (on CPU with bf16 operands where
    kernels/cpu_precision.py allows them, unless allow_bf16 is False)."""
    if x.is_cpu and weight.is_cpu:
        return cpu_gemv.dense_linear(x, weight, allow_bf16)
    return torch.nn.functional.linear(x, weight)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
               act_quant: bool = False, out_dtype: torch.dtype | None = None,
               act_group: int = ACT_GROUP) -> torch.Tensor:
    """x [M, K] @ dequant(weight e4m3 [N, K], scale [ceil(N/bN), ceil(K/bK)])^T -> [M, N].

    act_quant fake-quantizes x first (per ``act_group``); fp32 accumulation; out_dtype defaults
    to x.dtype. See the quantized-GEMM section of kernels/reference.py.
    """
    if _triton("fp8_linear", x=x, weight=weight, scale=scale):
        from kernels.triton import quant_gemm
        return quant_gemm.fp8_linear(x, weight, scale, block, act_quant, out_dtype, act_group)
    return cpu_quant_gemm.fp8_linear(x, weight, scale, block, act_quant, out_dtype, act_group)


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, act_quant: bool = False,
               out_dtype: torch.dtype | None = None, group: int = FP4_GROUP,
               act_group: int = ACT_GROUP) -> torch.Tensor:
    """x [M, K] @ dequant(packed e2m1 int8 [N, K/2], scale [N, ceil(K/group)])^T -> [M, N]."""
    if _triton("fp4_linear", x=x, packed=packed, scale=scale):
        from kernels.triton import quant_gemm
        return quant_gemm.fp4_linear(x, packed, scale, act_quant, out_dtype, group, act_group)
    return cpu_quant_gemm.fp4_linear(x, packed, scale, act_quant, out_dtype, group, act_group)


def fp8_grouped_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                   block: tuple[int, int] = (128, 128), act_quant: bool = False,
                   out_dtype: torch.dtype | None = None, act_group: int = ACT_GROUP) -> torch.Tensor:
    """MoE: rows [offsets[e-1], offsets[e]) of x [S, K] times dequant(weight[e])^T, weight e4m3
    [E, N, K], scale [E, ceil(N/bN), ceil(K/bK)], offsets int32 [E] cumulative ends (as
    F.grouped_mm's offs) -> [S, N]; rows at or past offsets[-1] are zero."""
    if _triton("fp8_grouped_mm", x=x, weight=weight, scale=scale, offsets=offsets):
        from kernels.triton import quant_gemm
        return quant_gemm.fp8_grouped_mm(x, weight, scale, offsets, block, act_quant, out_dtype, act_group)
    return cpu_quant_gemm.fp8_grouped_mm(x, weight, scale, offsets, block, act_quant, out_dtype, act_group)


def fp4_grouped_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                   act_quant: bool = False, out_dtype: torch.dtype | None = None, group: int = FP4_GROUP,
                   act_group: int = ACT_GROUP) -> torch.Tensor:
    """MoE: rows [offsets[e-1], offsets[e]) of x [S, K] times dequant(packed[e])^T, packed int8
    [E, N, K/2], scale [E, N, ceil(K/group)], offsets int32 [E] -> [S, N]; rows at or past
    offsets[-1] are zero."""
    if _triton("fp4_grouped_mm", x=x, packed=packed, scale=scale, offsets=offsets):
        from kernels.triton import quant_gemm
        return quant_gemm.fp4_grouped_mm(x, packed, scale, offsets, act_quant, out_dtype, group, act_group)
    return cpu_quant_gemm.fp4_grouped_mm(x, packed, scale, offsets, act_quant, out_dtype, group, act_group)


def dense_grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """MoE over dense experts: rows [offsets[e-1], offsets[e]) of x [S, K] times weight[e]^T,
    weight [E, N, K] in x's dtype (any strides), offsets int32 [E] cumulative ends (as
    F.grouped_mm's offs) -> [S, N] in x's dtype. Rows at or past offsets[-1] are unspecified
    (the Triton kernel writes zeros; torch leaves them unwritten): no caller reads them (the MoE
    combine gathers expert rows only; the padded all-to-all ignores its padding rows), and
    zeroing them would cost launches in every captured step.

    CUDA: torch's CUTLASS grouped GEMM where it has one (bf16 on sm90/sm100, 16-byte aligned
    operands), else Triton (kernels/triton/dense_grouped_mm.py): torch's fallback for the rest
    copies the offsets to the host, which CUDA-graph capture forbids. CPU: F.grouped_mm, or the
    Triton kernel interpreted inside ``devices.triton_on_cpu()`` (as the fused decode ops).
    """
    if (decode_backend("dense_grouped_mm", x=x, weight=weight, offsets=offsets) == "triton"
            and not _cutlass_grouped_mm(x, weight)):
        from kernels.triton import dense_grouped_mm as triton_grouped
        return triton_grouped.dense_grouped_mm(x, weight, offsets)
    check_dense_grouped_mm(x, weight, offsets)
    out = torch.nn.functional.grouped_mm(x, weight.transpose(1, 2), offs=offsets)  # [S, N]
    return out.zero_() if not offsets.numel() else out


@functools.cache
def _sm90_or_sm100(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] in (9, 10)


def _tma_aligned(t: torch.Tensor) -> bool:
    """Unit stride in one of the last two dims, the other a 16-byte multiple covering its rows,
    and a 16-byte aligned start (the caching allocator aligns allocations to 512 bytes)."""
    (rows, cols), (a, b), size = t.shape[-2:], t.stride()[-2:], t.element_size()
    return (t.storage_offset() * size % 16 == 0
            and ((b == 1 and a >= max(1, cols) and a * size % 16 == 0)
                 or (a == 1 and b >= max(1, rows) and b * size % 16 == 0)))


def _cutlass_grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's CUDA grouped GEMM takes its CUTLASS kernel (no host sync) for x [S, K] and
    the weight's transpose [E, K, N]; torch checks the current device, which the engine sets."""
    if x.dtype != torch.bfloat16 or not x.is_cuda:
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    return _sm90_or_sm100(index) and _tma_aligned(x) and _tma_aligned(weight.transpose(1, 2))


def prepare_quant_weight(weight: torch.Tensor, scale: torch.Tensor, kind: str,
                         block: tuple[int, int]) -> cpu_prepared_gemm.PreparedQuantWeight | None:
    """An FP8 ('fp8', block (bN, bK)) or packed FP4 ('fp4', block (1, group)) weight [N, K] or
    expert stack [E, N, K] checked once for decode-sized CPU products whose per-call cost is the
    kernel's (kernels/cpu_prepared_gemm.py); None for CUDA weights, whose products stay the
    entry points above."""
    if not (weight.is_cpu and scale.is_cpu):
        return None
    return cpu_prepared_gemm.PreparedQuantWeight(weight, scale, kind, block)


# ---- the fused decode step ------------------------------------------------------------------
# Signatures and semantics: the Triton modules (each pairs its kernel with a torch reference).

def _decode_impl(op: str, module: str, **tensors: torch.Tensor | None):
    """The module implementing a fused decode op for these tensors."""
    if decode_backend(op, **tensors) == "triton":
        import importlib

        return importlib.import_module(f"kernels.triton.{module}")
    from kernels import cpu_decode

    return cpu_decode


def norm_rope(x: torch.Tensor, norm: int = 0, weight: torch.Tensor | None = None, eps: float = 1e-6,
              cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, inverse: bool = False,
              dtype: torch.dtype | None = None, pre_round: bool = False, pool: torch.Tensor | None = None,
              pool_fmt: str = "fp32", slots: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head RMSNorm (none / weighted / head) + interleaved RoPE (+ a KV record store)."""
    return _decode_impl("norm_rope", "norm_rope", x=x, pool=pool).norm_rope(
        x, norm, weight, eps, cos, sin, inverse, dtype, pre_round, pool, pool_fmt, slots)


def mhc_mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
            hc_eps: float, norm_eps: float, collapse: bool = False, norm_weight: torch.Tensor | None = None,
            out_eps: float = 1e-6) -> tuple[torch.Tensor, ...]:
    """mHC (pre, post, comb) with every Sinkhorn iteration, + the collapse (+ the block's RMSNorm)."""
    return _decode_impl("mhc_mix", "mhc_mix", streams=streams).mhc_mix(
        streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, collapse, norm_weight=norm_weight,
        out_eps=out_eps)


def mhc_expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """H'_k = post_k · y + Σ_j comb[j, k] · H_j -> [T, n, D]."""
    return _decode_impl("mhc_expand", "mhc_expand", streams=streams, y=y).mhc_expand(streams, y, post, comb)


def compressor_step(rows: torch.Tensor, state_pool: torch.Tensor, row_slots: torch.Tensor, entry_pool: torch.Tensor,
                    entry_fmt: str, entry_slots: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    cos: torch.Tensor, sin: torch.Tensor, ratio: int, overlap: bool,
                    dtype: torch.dtype = torch.float32, ape: torch.Tensor | None = None,
                    positions: torch.Tensor | None = None) -> None:
    """Append the step's compressor rows and write the entries they complete."""
    return _decode_impl("compressor_step", "compressor_step", rows=rows, state_pool=state_pool).compressor_step(
        rows, state_pool, row_slots, entry_pool, entry_fmt, entry_slots, norm_weight, eps, cos, sin, ratio, overlap,
        dtype, ape, positions)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, fmt: str, block_table: torch.Tensor,
                 lengths: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int,
                 max_entries: int | None = None, weight_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each decode query's top-k index entries over its real length -> (entries, slots) [B, q, k]."""
    return _decode_impl("indexer_topk", "indexer_topk", q=q, pool=pool).indexer_topk(
        q, weights, pool, fmt, block_table, lengths, positions, ratio, topk, max_entries, weight_scale=weight_scale)


def sparse_mla_decode(q: torch.Tensor, sink: torch.Tensor, window_pool: torch.Tensor, window_fmt: str,
                      window_slots: torch.Tensor, entry_pool: torch.Tensor | None = None, entry_fmt: str = "fp32",
                      entry_slots: torch.Tensor | None = None, new_kv: torch.Tensor | None = None,
                      scale: float | None = None, window_shared: bool = False,
                      entries_shared: bool = False) -> torch.Tensor:
    """Sink attention over window + picked entries (+ the step's keys) read from the pools; a
    `*_shared` table holds one slot per column for all of a sequence's rows (read once per
    sequence: kernels/triton/sparse_mla_decode.py)."""
    return _decode_impl("sparse_mla_decode", "sparse_mla_decode", q=q, window_pool=window_pool).sparse_mla_decode(
        q, sink, window_pool, window_fmt, window_slots, entry_pool, entry_fmt, entry_slots, new_kv, scale,
        window_shared=window_shared, entries_shared=entries_shared)


def gather_rows(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """x [T, H] -> [T·k, H]: row i is x[order[i] // k]."""
    return _decode_impl("gather_rows", "moe_ops", x=x, order=order).gather_rows(x, order, k)


def swiglu(h: torch.Tensor, limit: float, row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Clamped SwiGLU of h [S, 2I] = [gate | up] -> [S, I]."""
    return _decode_impl("swiglu", "moe_ops", h=h).swiglu(h, limit, row_weight)


def moe_combine(y: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor, shared: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """Weight, unpermute and sum the k expert outputs per token (+ the shared expert) -> [T, H]."""
    return _decode_impl("moe_combine", "moe_ops", y=y, inverse=inverse).moe_combine(y, weights, inverse, shared, dtype)
