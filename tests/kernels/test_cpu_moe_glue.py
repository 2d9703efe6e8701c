"""kernels/cpu_moe_glue.py (numba gather_rows / moe_combine) against the torch references, bit for bit.

Random weights make every weighted row round in bf16; rows of NaN, Inf and values near bf16's
overflow check that the roundings happen where the reference's do (an extra or missing rounding
changes bits, an fp32 sum in another order changes the last bit of many outputs).
"""
from __future__ import annotations

import pytest
import torch

from kernels.cpu_moe_glue import gather_rows, moe_combine
from kernels.triton.moe_ops import gather_rows_reference, moe_combine_reference


def _routing(t: int, k: int, index_dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(t * k, generator=g).to(index_dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that NaN payloads may differ (torch's vectorised bf16 casts keep them)."""
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.isnan(), b.isnan()):
        return False
    keep = ~a.isnan()
    return torch.equal(a[keep].view(torch.uint8), b[keep].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,k,h", [(0, 6, 8), (1, 6, 256), (5, 1, 24), (16, 6, 72)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_gather_rows_matches_reference(dtype, t, k, h, index_dtype):
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(1)).to(dtype)
    order = _routing(t, k, index_dtype)
    assert _same_bits(gather_rows(x, order, k), gather_rows_reference(x, order, k))
    if h > 1:                                                         # a column slice: not contiguous
        assert _same_bits(gather_rows(x[:, 1:], order, k), gather_rows_reference(x[:, 1:], order, k))


def _combine_case(t: int, k: int, h: int, dtype: torch.dtype, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    y = (torch.randn(t * k, h, generator=g) * 3).to(dtype)
    if t * k >= 3:
        y[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
        y[1, :2] = torch.tensor([3.3e38, -3.3e38])                   # times w ~1: near fp32 / bf16 overflow
        y[2, :2] = torch.tensor([1e-38, 2.0**-130])                  # subnormal products
    weights = torch.rand(t, k, generator=g) * 1.5
    shared = torch.randn(t, h, generator=g).to(dtype)
    return y, weights, shared


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,k,h", [(0, 6, 8), (1, 6, 256), (3, 1, 40), (16, 6, 72), (16, 6, 64), (4, 8, 4096)])
@pytest.mark.parametrize("with_shared", [True, False])
def test_moe_combine_matches_reference_bit_for_bit(dtype, t, k, h, with_shared):
    y, weights, shared = _combine_case(t, k, h, dtype)
    inverse = _routing(t, k, torch.int32, seed=3)
    sh = shared if with_shared else None
    out = moe_combine(y, weights, inverse, sh, dtype)
    ref = moe_combine_reference(y, weights, inverse, sh, dtype)
    if dtype == torch.float32 and h % 32:
        # torch sums fp32 columns past the last full 32 (4 x 8 lanes) in another order: an ulp
        finite = ref.isfinite()
        assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out[ref.isinf()], ref[ref.isinf()])
        bound = (y[inverse.long()].abs() * weights.reshape(-1, 1)).view(t, k, h).sum(1)  # Σ_j |w·y|
        if sh is not None:
            bound = bound + sh.abs()
        assert ((out - ref)[finite].abs() <= 1e-6 * bound[finite]).all()
        assert _same_bits(out[:, :h // 32 * 32], ref[:, :h // 32 * 32])
    else:
        assert _same_bits(out, ref)
    if t * k >= 3 and with_shared:                                    # the special rows did reach the output
        assert out.isnan().any() and out.isinf().any()


def test_moe_combine_mixed_dtypes_follow_the_reference():
    """fp32 expert outputs combined into bf16 (not the kernel's case: the reference's promotion)."""
    y, weights, shared = _combine_case(4, 6, 32, torch.float32)
    inverse = _routing(4, 6, torch.int64)
    out = moe_combine(y, weights, inverse, shared.bfloat16(), torch.bfloat16)
    assert _same_bits(out, moe_combine_reference(y, weights, inverse, shared.bfloat16(), torch.bfloat16))


def test_moe_combine_checks_shapes():
    y, weights, shared = _combine_case(2, 6, 8, torch.float32)
    with pytest.raises(ValueError):
        moe_combine(y[:-1], weights, _routing(2, 6, torch.int32), shared, torch.float32)
