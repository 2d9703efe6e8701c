"""CUDA kernels against the torch reference (run on a GPU machine; skipped without one)."""
from __future__ import annotations

import pytest
import torch

from kernels.loader import cuda_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and cuda_available()),
                                                  reason="needs a CUDA GPU and CuPy")]

import kernels  # noqa: E402
from kernels import reference  # noqa: E402
from _kv_inputs import FORMAT_DIMS, adversarial_rows, random_rows  # noqa: E402

FORMATS = list(FORMAT_DIMS)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.float().cpu(), b.float().cpu()
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_bytes_match_reference(fmt, dtype):
    x = torch.cat([random_rows(100, FORMAT_DIMS[fmt]), adversarial_rows(FORMAT_DIMS[fmt])]).to(dtype)
    records = kernels.quantize(x.cuda(), fmt)
    assert torch.equal(records.cpu(), reference.quantize(x, fmt))
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert same(kernels.dequantize(records, fmt, out_dtype), reference.dequantize(records.cpu(), fmt, out_dtype))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", [1, 64, 256])
def test_paged_scatter_gather_match_reference(fmt, block_size):
    g = torch.Generator().manual_seed(block_size)
    nbytes = kernels.get_format(fmt, FORMAT_DIMS[fmt]).record_bytes
    pool = torch.randint(0, 256, (4, block_size, nbytes), generator=g).to(torch.uint8)
    x = random_rows(min(300, 4 * block_size), FORMAT_DIMS[fmt])
    slots = torch.randperm(4 * block_size, generator=g)[:x.shape[0]]
    slots[::5] = -1
    pool_gpu = pool.cuda()
    kernels.quantize_scatter(x.cuda(), pool_gpu, slots.cuda(), fmt)
    reference.quantize_scatter(x, pool, slots, fmt)
    assert torch.equal(pool_gpu.cpu(), pool)
    got = kernels.gather_dequantize(pool_gpu, slots.cuda(), fmt, torch.bfloat16)
    assert same(got, reference.gather_dequantize(pool, slots, fmt, torch.bfloat16))


@pytest.mark.parametrize("num_experts,k", [(256, 6), (384, 6), (64, 8)])
def test_route_matches_reference(num_experts, k):
    g = torch.Generator().manual_seed(num_experts)
    logits = torch.randn(4096, num_experts, generator=g) * 3
    bias = torch.randn(num_experts, generator=g) * 0.1
    w, ids = kernels.route(logits.cuda(), bias.cuda(), k, 1.5)
    w_ref, ids_ref = reference.route(logits, bias, k, 1.5)
    # CUDA expf/log1pf differ from torch's CPU softplus by ulps: ids may only differ on near-ties.
    assert (ids.cpu() != ids_ref).any(dim=1).float().mean() < 1e-3
    agree = (ids.cpu() == ids_ref).all(dim=1)
    torch.testing.assert_close(w.cpu()[agree], w_ref[agree], rtol=2e-6, atol=1e-7)


def test_route_ties_and_hash():
    logits = torch.zeros(2, 64)
    logits[1, [5, 40, 9]] = 2.0
    _, ids = kernels.route(logits.cuda(), None, 4, 1.0)
    assert ids.cpu().tolist() == [[0, 1, 2, 3], [5, 9, 40, 0]]
    tid2eid = torch.randint(0, 64, (100, 6), dtype=torch.int32)
    tokens = torch.randint(0, 100, (2,))
    w, ids = kernels.route(logits.cuda(), None, 6, 1.5, tokens.cuda(), tid2eid.cuda())
    w_ref, ids_ref = reference.route(logits, None, 6, 1.5, tokens, tid2eid)
    assert torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(w.cpu(), w_ref, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("t,k,e", [(4096, 6, 256), (1, 1, 1), (1000, 8, 384)])
def test_permute_matches_reference(t, k, e):
    ids = torch.randint(0, e, (t, k), dtype=torch.int32)
    for got, want in zip(kernels.permute(ids.cuda(), e), reference.permute(ids, e)):
        assert torch.equal(got.cpu(), want)
