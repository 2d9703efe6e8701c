"""CPU (numba) KV formats against the torch reference: packed bytes and dequantized values."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import kernels
from kernels import cpu_kv, reference
from _kv_inputs import FORMAT_DIMS, adversarial_rows, random_rows

FORMATS = list(FORMAT_DIMS)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN, -0 distinct from +0 (compared as fp32 bit patterns)."""
    a, b = a.float(), b.float()
    if a.shape != b.shape:
        return False
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(
        a.masked_fill(nan, 0).view(torch.int32), b.masked_fill(nan, 0).view(torch.int32))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_bytes_and_values_match_reference(fmt, dtype):
    x = random_rows(67, FORMAT_DIMS[fmt], seed=1).to(dtype)
    records = cpu_kv.quantize(x, fmt)
    assert torch.equal(records, reference.quantize(x, fmt))
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert same(cpu_kv.dequantize(records, fmt, out_dtype), reference.dequantize(records, fmt, out_dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_adversarial_bytes_match_reference(fmt):
    x = adversarial_rows(FORMAT_DIMS[fmt])
    records = kernels.quantize(x, fmt)
    assert torch.equal(records, reference.quantize(x, fmt))
    assert same(kernels.dequantize(records, fmt), reference.dequantize(records, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_arbitrary_bytes_dequantize_like_reference(fmt):
    nbytes = kernels.get_format(fmt, FORMAT_DIMS[fmt]).record_bytes
    records = torch.randint(0, 256, (50, nbytes), generator=torch.Generator().manual_seed(3)).to(torch.uint8)
    assert same(cpu_kv.dequantize(records, fmt), reference.dequantize(records, fmt))


_FLOAT_ROWS = hnp.arrays(
    "float32", (3, 128),
    elements=st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True),
                       st.floats(-8, 8, width=32), st.sampled_from([0.25, 0.75, 2.5, 5.0, 448.0, 1e-4])))


@settings(max_examples=60, deadline=None)
@given(rows=_FLOAT_ROWS, fmt=st.sampled_from(["bf16", "fp8_ds_mla", "fp4_kv", "fp4_index"]))
def test_hypothesis_bytes_match_reference(rows, fmt):
    x = torch.from_numpy(rows.copy())
    if fmt == "fp8_ds_mla":
        x = torch.cat([x, x.flip(1), x, x], dim=1)       # D = 512
    assert torch.equal(cpu_kv.quantize(x, fmt), reference.quantize(x, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_error_bounds(fmt):
    x = random_rows(64, FORMAT_DIMS[fmt], seed=2)
    y = kernels.dequantize(kernels.quantize(x, fmt), fmt)
    f = kernels.get_format(fmt, x.shape[1])
    err = (y - x).abs()
    if fmt == "bf16":
        assert (err <= x.abs() * 2.0 ** -8).all()
        return
    blocks = x[:, :f.quant_dim].unflatten(1, (-1, f.group))
    amax = blocks.abs().amax(-1, keepdim=True)
    if fmt == "fp4_kv":                    # e4m3-rounded amax / 6, floored at 2^-9
        scale = amax / 6 * (1 + 2.0 ** -4) + 2.0 ** -9
    else:                                  # ue8m0: scale < 2 * amax / qmax
        scale = 2 * amax / (448.0 if fmt == "fp8_ds_mla" else 6.0)
    if fmt == "fp8_ds_mla":                # half an e4m3 step: 2^-4 relative, 2^-10 * scale subnormal
        bound = blocks.abs() * 2.0 ** -4 + scale * 2.0 ** -10
        assert torch.equal(y[:, f.quant_dim:], x[:, f.quant_dim:].bfloat16().float())
    else:                                  # half an e2m1 step: max(0.25, |y| / 4) code units
        bound = blocks.abs() / 4 + scale / 4
    if fmt == "fp4_kv":                    # beyond 6 * 448 the e4m3 scale saturates (tested apart)
        bound = torch.where(amax <= 6 * 448.0, bound, torch.inf)
    assert (err[:, :f.quant_dim].unflatten(1, (-1, f.group)) <= bound * (1 + 1e-6)).all()
