"""The fused decode-step kernels added for the engine path, against their torch references.

Under Triton's interpreter on CPU (tests/conftest.py). Each kernel is checked over the shapes the
decode step meets — zero tokens, one, a block and one over — in fp32 and bf16 (bf16 within one
ulp: the compiled kernels and torch may round a different intermediate), with NaN rows staying
in their row. Sizes are tiny: the interpreter runs every program in Python.
"""
from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.formats import get_format
from kernels.triton.compressor_step import compressor_step, compressor_step_reference
from kernels.triton.mhc_expand import mhc_expand, mhc_expand_reference
from kernels.triton.mhc_mix import mhc_mix, mhc_mix_reference
from kernels.triton.moe_ops import (gather_rows, gather_rows_reference, moe_combine, moe_combine_reference, swiglu,
                                    swiglu_reference)
from kernels.triton.norm_rope import norm_rope, norm_rope_reference
from kernels.triton.sparse_mla_decode import read_records

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

DTYPES = [torch.float32, torch.bfloat16]


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    return (a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
            and torch.allclose(a.float().nan_to_num(0.0), b.float().nan_to_num(0.0), atol=tol, rtol=tol))


def _rope(t: int, half: int, seed: int = 0):
    pos = torch.arange(t, dtype=torch.float32)[:, None] * 3 + 1
    freqs = pos / 100.0 ** (torch.arange(half) / half)
    return freqs.cos(), freqs.sin()


# ---- norm_rope ---------------------------------------------------------------------------------

@pytest.mark.parametrize("t", [0, 1, 5])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm,inverse", [(0, False), (1, False), (2, False), (0, True)])
def test_norm_rope_matches_engine_layers(t, dtype, norm, inverse):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 3, 32, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(32, generator=g)) if norm == 1 else None
    cos, sin = _rope(t, 4)
    got = norm_rope(x, norm, w, 1e-6, cos, sin, inverse=inverse)
    want = norm_rope_reference(x, norm, w, 1e-6, cos, sin, inverse=inverse)
    assert got.dtype == dtype and close(got, want, dtype)


def test_norm_rope_reads_a_column_slice_and_rounds_fp32_input():
    """x a slice of a wider fp32 GEMM output, result in bf16: the pre-cast the engine does."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 100, generator=g)
    x = wide[:, 36:100].view(4, 1, 64)
    cos, sin = _rope(4, 8)
    got = norm_rope(x, 0, None, 1e-6, cos, sin, inverse=True, dtype=torch.bfloat16)
    want = norm_rope_reference(x, 0, None, 1e-6, cos, sin, inverse=True, dtype=torch.bfloat16)
    assert close(got, want, torch.bfloat16)


@pytest.mark.parametrize("fmt,dim", [("fp32", 64), ("fp8_ds_mla", 128), ("fp4_kv", 64)])
def test_norm_rope_stores_the_record_it_returns(fmt, dim):
    """The pool write is reference.quantize of the returned vector, at slot[t]; −1 writes nothing."""
    g = torch.Generator().manual_seed(2)
    t = 4
    x = torch.randn(t, 1, dim, generator=g)
    w = 1 + 0.1 * torch.randn(dim, generator=g)
    cos, sin = _rope(t, 32 if fmt == "fp8_ds_mla" else 8)
    slots = torch.tensor([5, -1, 2, 9])
    if fmt == "fp32":
        pool = torch.zeros(3, 4, dim)
    else:
        pool = torch.zeros(3, 4, get_format(fmt, dim).record_bytes, dtype=torch.uint8)
    out = norm_rope(x, 1, w, 1e-6, cos, sin, pool=pool, pool_fmt=fmt, slots=slots)
    expected = torch.zeros_like(pool)
    keep = slots >= 0
    if fmt == "fp32":
        expected.view(-1, dim)[slots[keep]] = out[keep, 0]
    else:
        reference.quantize_scatter(out[keep, 0], expected, slots[keep], fmt)
    assert torch.equal(pool, expected)
    assert close(out, norm_rope_reference(x, 1, w, 1e-6, cos, sin), torch.float32)
    assert read_records(pool, fmt, torch.tensor([1]), dim).abs().sum() == 0     # slot 1 untouched


def test_norm_rope_nan_stays_in_its_vector():
    x = torch.randn(3, 2, 32)
    x[1, 0, 3] = float("nan")
    out = norm_rope(x, 2, None, 1e-6, *_rope(3, 4))
    assert out[1, 0].isnan().all() and not out[1, 1].isnan().any() and not out[[0, 2]].isnan().any()


# ---- mHC: the fused norm and the expand ------------------------------------------------------------

def _mhc_case(t: int, dtype: torch.dtype, n: int = 4, d: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, n, d, generator=g).to(dtype), torch.randn((2 + n) * n, n * d, generator=g) / (n * d) ** 0.5,
            0.5 * torch.randn((2 + n) * n, generator=g), 1 + 0.2 * torch.randn(3, generator=g))


@pytest.mark.parametrize("t", [0, 1, 16, 17])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mhc_mix_with_the_block_norm(t, dtype):
    args = (*_mhc_case(t, dtype), 20, 1e-6, 1e-6)
    w = 1 + 0.1 * torch.randn(64, generator=torch.Generator().manual_seed(5))
    got = mhc_mix(*args, collapse=True, norm_weight=w)
    want = mhc_mix_reference(*args, collapse=True, norm_weight=w)
    assert got[3].dtype == dtype
    assert all(close(a, b, dtype) for a, b in zip(got, want))


@pytest.mark.parametrize("t", [0, 1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mhc_expand_matches_hc_expand(t, dtype):
    g = torch.Generator().manual_seed(t)
    streams = torch.randn(t, 4, 48, generator=g).to(dtype)        # D not a power of two: a masked tail
    y = torch.randn(t, 48, generator=g).to(dtype)
    post = 2 * torch.rand(t, 4, generator=g)
    comb = torch.rand(t, 4, 4, generator=g)
    assert close(mhc_expand(streams, y, post, comb), mhc_expand_reference(streams, y, post, comb), dtype)


# ---- MoE glue ------------------------------------------------------------------------------------

@pytest.mark.parametrize("t", [0, 1, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_ops_match_engine_moe(t, dtype):
    g = torch.Generator().manual_seed(t)
    k, h, i = 3, 40, 24
    x = torch.randn(t, h, generator=g).to(dtype)
    order = torch.randperm(t * k, generator=g).int()
    inverse = torch.argsort(order).int()
    assert torch.equal(gather_rows(x, order, k), gather_rows_reference(x, order, k))
    hh = (4 * torch.randn(t * k, 2 * i, generator=g)).to(dtype)   # |values| past the clamp limit
    rw = torch.rand(t * k, generator=g)
    assert close(swiglu(hh, 3.0), swiglu_reference(hh, 3.0), dtype)
    assert close(swiglu(hh, 3.0, rw), swiglu_reference(hh, 3.0, rw), dtype)
    y = torch.randn(t * k, h, generator=g).to(dtype)
    w = torch.rand(t, k, generator=g)
    shared = torch.randn(t, h, generator=g).to(dtype)
    for sh in (None, shared):
        assert close(moe_combine(y, w, inverse, sh, dtype), moe_combine_reference(y, w, inverse, sh, dtype), dtype)


# ---- compressor_step on raw projections (ape added in the kernel) --------------------------------------

@pytest.mark.parametrize("overlap,ratio", [(True, 4), (False, 4)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_compressor_step_adds_ape_to_raw_strided_rows(overlap, ratio, dtype):
    from test_triton_decode import _compressor_case, _run

    case = _compressor_case(overlap, ratio, "fp32")
    b, q, two_w = case["rows"].shape
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(b, q, two_w + 24, generator=g).to(dtype)     # the projection inside a packed GEMM output
    raw = wide[..., 8 : 8 + two_w]
    ape = torch.randn(ratio, two_w // 2, generator=g)
    positions = case["row_slots"].new_zeros(b, q) + torch.tensor([2, 6, 5, 0, 0])[:, None] + torch.arange(q)
    case = dict(case, rows=raw, ape=ape, positions=positions)
    state, entries = _run(compressor_step, case, dtype=dtype)
    ref_state, ref_entries = _run(compressor_step_reference, case, dtype=dtype)
    assert torch.equal(state, ref_state)
    assert close(entries, ref_entries, dtype)
    assert (case["entry_slots"] >= 0).sum() >= 2
