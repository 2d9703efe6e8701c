"""CPU implementations of the fused decode ops (kernels/__init__.py dispatches CPU tensors here).

Same signatures and semantics as the Triton modules. Ops without a dedicated CPU kernel yet run
their torch reference (correct, not fused).
"""
from __future__ import annotations

from kernels.cpu_attention import sparse_mla_decode
from kernels.cpu_mhc import mhc_expand, mhc_mix
from kernels.cpu_norm_compress import compressor_step, norm_rope
from kernels.triton.indexer_topk import indexer_topk_reference as indexer_topk
from kernels.triton.moe_ops import gather_rows_reference as gather_rows
from kernels.triton.moe_ops import moe_combine_reference as moe_combine
from kernels.triton.moe_ops import swiglu_reference as swiglu

__all__ = ["compressor_step", "indexer_topk", "mhc_expand", "mhc_mix", "gather_rows", "moe_combine", "swiglu",
           "norm_rope", "sparse_mla_decode"]
