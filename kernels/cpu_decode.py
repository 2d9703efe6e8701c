"""CPU implementations of the fused decode ops (kernels/__init__.py dispatches CPU tensors here).

Same signatures and semantics as the Triton modules (kernels/decode_reference.py defines them;
each kernel module's tests compare against it). Numba kernels for all but SwiGLU, whose torch
reference (two vectorised ops) measured faster than a numba loop at decode sizes. Nothing here
imports Triton: a CPU install without it runs the static decode path.
"""
from __future__ import annotations

from kernels.cpu_attention import sparse_mla_decode
from kernels.cpu_indexer import indexer_topk
from kernels.cpu_mhc import mhc_expand, mhc_mix
from kernels.cpu_moe_glue import gather_rows, moe_combine
from kernels.cpu_norm_compress import compressor_step, norm_rope
from kernels.decode_reference import swiglu_reference as swiglu

__all__ = ["compressor_step", "indexer_topk", "mhc_expand", "mhc_mix", "gather_rows", "moe_combine", "swiglu",
           "norm_rope", "sparse_mla_decode"]
