"""The engine's V4.1 quantizers (engine/v41/quant.py) and KV records (engine/v41/records.py,
the `fp4_kv` pool) bit-exact against their definitions on edge values.

Two independent checks: hand-derived codes and scales for zero blocks, the largest values,
subnormal inputs and NaN / ±Inf blocks; and equality (bits, NaN where NaN) with the plain
reference quantizers of tests/v41/quant.py over random and edge rows. A pool must hand back
exactly the fake-quantized values the model computes with.
"""

from __future__ import annotations

import pytest
import torch

from engine.kv_layout import PoolSpec
from engine.v41 import quant as eq
from engine.v41 import records
from engine.v41.kv_cache import V41Pool
from tests.v41 import quant as rq

NAN, INF = float("nan"), float("inf")


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values and signs (−0 ≠ +0), NaN where NaN."""
    a, b = a.float(), b.float()
    if not torch.equal(torch.isnan(a), torch.isnan(b)):
        return False
    keep = ~torch.isnan(a)
    return torch.equal(a[keep], b[keep]) and torch.equal(torch.signbit(a[keep]), torch.signbit(b[keep]))


def edge_rows(width: int) -> torch.Tensor:
    """Rows of 64 values (two 32-blocks, four 16-blocks) covering the edge cases, then random."""
    g = torch.Generator().manual_seed(0)
    rows = [
        torch.zeros(width),
        -torch.zeros(width),
        torch.full((width,), 448.0),  # e4m3's largest value at scale 1
        torch.full((width,), 6.0),  # e2m1's largest value at scale 1
        torch.full((width,), 2.0**-140),  # subnormal fp32 inputs, under every floor
        torch.full((width,), 2.0**-9) * torch.arange(width).remainder(5),  # at the fp4-kv scale floor
        torch.randn(width, generator=g) * 1e-30,
        torch.randn(width, generator=g) * 1e6,
    ]
    nan_row = torch.randn(width, generator=g)
    nan_row[3] = NAN
    inf_row = torch.randn(width, generator=g)
    inf_row[40] = -INF
    rows += [nan_row, inf_row, torch.randn(width, generator=g) * 3]
    return torch.stack(rows)


def test_zero_block_uses_the_amax_floor():
    # act: 2^ceil(log2(1e-4 / 448)) = 2^-22; index fp4: 2^ceil(log2(2^-126)) = 2^-126;
    # kv fp4: e4m3(2^-9) = 2^-9, the least e4m3 subnormal. Codes all zero, signs kept.
    z = -torch.zeros(1, 32)
    for fn, block, scale in ((eq.quantize_fp8, 32, 2.0**-22), (eq.quantize_fp4_index, 32, 2.0**-126),
                             (eq.quantize_fp4_kv, 16, 2.0**-9)):
        codes, s = fn(z, block)
        assert torch.equal(s, torch.full_like(s, scale)), fn.__name__
        assert torch.equal(codes, torch.zeros_like(codes)) and torch.signbit(codes).all()


def test_largest_values_are_kept():
    x = torch.tensor([[448.0, -448.0] + [1.0] * 30])
    codes, s = eq.quantize_fp8(x)
    assert float(s) == 1.0 and torch.equal(codes.flatten(), x.flatten())
    y = torch.tensor([[6.0, -6.0, 3.0, 0.5] + [0.0] * 28])
    for fn in (eq.fake_fp4_index, lambda t: eq.fake_fp4_kv(t, 16)):
        assert torch.equal(fn(y), y)


def test_kv_fp4_scale_rounding_saturates_codes():
    # amax 6.2 → scale e4m3(6.2 / 6 = 1.0333) = 1 (quantum 1/8): 6.2 / 1 saturates to 6
    x = torch.tensor([[6.2, 0.76] + [0.0] * 14])
    codes, s = eq.quantize_fp4_kv(x, 16)
    assert float(s) == 1.0 and codes.flatten()[:2].tolist() == [6.0, 1.0]  # 0.76 → nearest 1.0


def test_subnormal_inputs():
    # 2^-140 under the index floor 6·2^-126: scale 2^-126, codes round(2^-14) = 0
    x = torch.full((1, 32), 2.0**-140)
    codes, s = eq.quantize_fp4_index(x)
    assert float(s) == 2.0**-126 and not codes.any()
    # kv: 2^-9 · k at the floor scale 2^-9 → codes k (0..4 are on the e2m1 grid)
    k = torch.arange(16).remainder(5).float()
    codes, s = eq.quantize_fp4_kv((k * 2.0**-9)[None], 16)
    assert float(s) == 2.0**-9 and torch.equal(codes.flatten(), k)


def test_nonfinite_blocks_poison_only_their_block():
    x = torch.ones(1, 64)
    x[0, 5] = NAN
    x[0, 40] = INF
    for fn, block in ((eq.fake_fp8, 32), (eq.fake_fp4_index, 32), (eq.fake_fp4_kv, 16)):
        out = fn(x, block)[0]
        bad = torch.zeros(64, dtype=torch.bool)
        bad[(5 // block) * block:(5 // block + 1) * block] = True
        bad[(40 // block) * block:(40 // block + 1) * block] = True
        finite = fn(torch.ones(1, block), block)[0].repeat(int((~bad).sum()) // block)  # the clean blocks alone
        assert torch.isnan(out[bad]).all() and torch.equal(out[~bad], finite)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equal_to_the_reference_quantizers(dtype):
    x = edge_rows(64).to(dtype)
    pairs = ((eq.quantize_fp8, rq.quantize_fp8, 32), (eq.quantize_fp4_index, rq.quantize_fp4_e8m0, 32),
             (eq.quantize_fp4_kv, rq.quantize_fp4_e4m3, 16))
    for mine, ref, block in pairs:
        for a, b in zip(mine(x, block), ref(x, block)):
            assert same(a, b), mine.__name__
    for mine, ref, block in ((eq.fake_fp8, rq.fake_fp8, 32), (eq.fake_fp4_index, rq.fake_fp4_e8m0, 32),
                             (eq.fake_fp4_kv, rq.fake_fp4_e4m3, 16)):
        a, b = mine(x, block), ref(x, block)
        assert a.dtype == dtype and same(a, b), mine.__name__


@pytest.mark.parametrize("fmt,fake,block", [("v41_fp8", rq.fake_fp8, 32), ("v41_fp4_index", rq.fake_fp4_e8m0, 32)])
def test_records_decode_to_the_fake_values(fmt, fake, block):
    x = edge_rows(64).to(torch.bfloat16)
    rec = records.encode(x, fmt)
    assert rec.dtype == torch.uint8 and rec.shape == (x.shape[0], records.record_bytes(fmt, 64))
    assert same(records.decode(rec, fmt, 64, torch.bfloat16), fake(x, block))


@pytest.mark.parametrize("fmt,kind,fake", [("v41_fp8", "swa", rq.fake_fp8), ("v41_fp4_index", "idx4", rq.fake_fp4_e8m0),
                                           ("fp4_kv", "c4", lambda t: rq.fake_fp4_e4m3(t, 16)),
                                           ("bf16", "c4", lambda t: rq.fake_fp4_e4m3(t, 16))])
def test_pool_reads_back_the_fake_values(fmt, kind, fake):
    """Written before quantization, read as the model's fake-quantized rows (finite rows: the
    kernels' fp4_kv format has no NaN scale)."""
    x = edge_rows(64)[[0, 2, 3, 4, 5, 6, 7, 10]].to(torch.bfloat16)
    pool = V41Pool(PoolSpec(kind, "full", fmt, 64, 1, 0, (0,)), 4, 8, "cpu")
    slots = torch.tensor([9, 10, 11, 12, 13, 14, 15, 17])
    pool.write(0, slots, x)
    assert same(pool.read(0, slots, torch.bfloat16), fake(x))


@pytest.mark.parametrize("row_independent", [False, True])
def test_sparse_attention_in_query_blocks_equals_one_block(monkeypatch, row_independent):
    """A long prefill chunk gathers its keys a block of queries at a time; each row depends on its
    own keys alone, so the blocks give what one gather of every row gives, bit for bit — and
    both match the test suite's own reference."""
    from engine.v41 import numerics as nx
    from tests.v41.ref_ops import sparse_attention as ref_sparse_attention

    g = torch.Generator().manual_seed(7)
    t, h, d, n, k = 37, 4, 64, 90, 70
    q = torch.randn(t, h, d, generator=g).bfloat16()
    kv = torch.randn(n, d, generator=g).bfloat16()
    idx = torch.randint(0, n, (t, k), generator=g)
    idx[:, -5:] = -1  # masked tails
    sink = torch.randn(h, generator=g)
    with nx.numerics(nx.Numerics(row_independent=row_independent)):
        whole = nx.sparse_attention(q, kv, idx, sink, d**-0.5)
        monkeypatch.setattr(nx, "ATTN_GATHER_BYTES", 5 * k * d * 4)  # 5 queries per block: 8 blocks
        blocked = nx.sparse_attention(q, kv, idx, sink, d**-0.5)
    assert torch.equal(blocked, whole)
    torch.testing.assert_close(whole.float(), ref_sparse_attention(q, kv, idx, sink, d**-0.5).float(),
                               atol=2e-2, rtol=2e-2)
