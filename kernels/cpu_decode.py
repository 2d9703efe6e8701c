"""CPU implementations of the fused decode ops (kernels/__init__.py dispatches CPU tensors here).

Same signatures and semantics as the Triton modules. Ops without a dedicated CPU kernel yet run
their torch reference (correct, not fused).
"""
from __future__ import annotations

from kernels.triton.compressor_step import compressor_step_reference as compressor_step
from kernels.triton.indexer_topk import indexer_topk_reference as indexer_topk
from kernels.triton.mhc_expand import mhc_expand_reference as mhc_expand
from kernels.triton.mhc_mix import mhc_mix_reference as mhc_mix
from kernels.triton.moe_ops import gather_rows_reference as gather_rows
from kernels.triton.moe_ops import moe_combine_reference as moe_combine
from kernels.triton.moe_ops import swiglu_reference as swiglu
from kernels.triton.norm_rope import norm_rope_reference as norm_rope
from kernels.triton.sparse_mla_decode import sparse_mla_decode_reference as sparse_mla_decode

__all__ = ["compressor_step", "indexer_topk", "mhc_expand", "mhc_mix", "gather_rows", "moe_combine", "swiglu",
           "norm_rope", "sparse_mla_decode"]
