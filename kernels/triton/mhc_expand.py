"""The mHC residual update of one site in one kernel: H'_k = post_k · y + Σ_j comb[j, k] · H_j.

engine/v4/layers.py `hc_expand` is a batched matmul, a product and a sum (three launches, two
[T, n, D] temporaries); here one program owns BLOCK_D channels of one token and writes the n new
streams, rounding as the torch maths does in the streams' dtype: comb and post are cast to it
first, the matmul accumulates in fp32 and rounds once, the product and the sum each round.
Layouts: streams [T, n, D]; y [T, D] (the block's output); post [T, n], comb [T, n, n] fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton import kv_codec
from kernels.decode_reference import mhc_expand_reference  # noqa: F401 (re-exported)


@triton.jit
def _r(x, BF16: tl.constexpr):
    if BF16:
        x = kv_codec.round_bf16(x)
    return x


@triton.jit
def _mhc_expand_kernel(streams_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, N: tl.constexpr, D: tl.constexpr,
                       BLOCK_D: tl.constexpr, BF16: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    y = tl.load(y_ptr + t * D + d, mask=dmask, other=0.0).to(tl.float32)
    for k in range(0, N):
        mixed = tl.zeros([BLOCK_D], tl.float32)
        for j in range(0, N):
            c = _r(tl.load(comb_ptr + t * N * N + j * N + k), BF16)
            h = tl.load(streams_ptr + (t * N + j) * D + d, mask=dmask, other=0.0).to(tl.float32)
            mixed += c * h
        p = _r(tl.load(post_ptr + t * N + k), BF16)
        out = _r(p * y, BF16) + _r(mixed, BF16)
        tl.store(out_ptr + (t * N + k) * D + d, kv_codec.cast(out, out_ptr.dtype.element_ty), mask=dmask)


def mhc_expand(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """engine.v4.layers.hc_expand(streams, y, post, comb) -> [T, n, D] in streams.dtype."""
    t, n, d = streams.shape
    if y.shape != (t, d) or post.shape != (t, n) or comb.shape != (t, n, n):
        raise ValueError(f"y must be [{t}, {d}], post [{t}, {n}], comb [{t}, {n}, {n}]; got {tuple(y.shape)}, "
                         f"{tuple(post.shape)}, {tuple(comb.shape)}")
    out = torch.empty_like(streams, memory_format=torch.contiguous_format)
    if t == 0:
        return out
    block_d = min(1024, triton.next_power_of_2(d))
    _mhc_expand_kernel[(t, triton.cdiv(d, block_d))](
        streams.contiguous(), y.contiguous(), post.float().contiguous(), comb.float().contiguous(), out, N=n, D=d,
        BLOCK_D=block_d, BF16=streams.dtype == torch.bfloat16)
    return out


